"""The stack that ran, recorded and held against the cell's name: a wrapper other than the one the cell names is a
harness state with what was seen, never a verdict; every row carries what the ranks observed and imported."""

from __future__ import annotations

import dataclasses

import pytest
import slices

from pytest_freezecompat.core.cell import Cell, CellKey
from pytest_freezecompat.core.declaration import AdapterDeclaration
from pytest_freezecompat.core.freeze import FreezePattern
from pytest_freezecompat.core.records import RankRecord
from pytest_freezecompat.spec import matrix as spec
from pytest_freezecompat.verdict import stack

ZERO = AdapterDeclaration(plugins=("zero2", "zero3"), init=("eager",), checkpoint=("none",), implementation="x:Y",
                          observes=("wrapper", "precision"),
                          promises={"zero2": {"zero_stage": "2"}, "zero3": {"zero_stage": "3"}})


def cell(plugin: str = "zero2", precision: str = "fp32") -> Cell:
    return Cell(key=CellKey("tiny-gpt", "ds", plugin, "eager", "none", "none"), environment="ds", adapter="x:Y",
                world_size=2, device="cpu", pattern=FreezePattern("none"), groups={}, precision=precision,
                promised_stack=ZERO.promised((plugin, "eager", "none"), precision), observes=ZERO.observes)


def record(rank: int, wrapped: bool = True, **observed: str) -> RankRecord:
    return RankRecord(rank=rank, requires_grad={"w": True} if wrapped else None, observed=observed)


def test_a_cell_promises_its_values_facts_and_its_precision():
    assert ZERO.promised(("zero3", "eager", "none"), "bf16") == {"precision": "bf16", "zero_stage": "3"}


def test_the_stack_the_name_promises_is_no_mismatch():
    ranks = [record(r, wrapper="Engine", precision="fp32", zero_stage="2") for r in (0, 1)]
    assert stack.mismatch(cell(), ranks) is None


def test_a_wrong_stage_on_one_rank_is_named_with_what_was_seen():
    ranks = [record(0, wrapper="Engine", precision="fp32", zero_stage="2"),
             record(1, wrapper="Engine", precision="fp32", zero_stage="3")]
    assert stack.mismatch(cell(), ranks) == ("the stack that ran is not the cell's: zero_stage is 3 on rank 1, the "
                                             "cell's name promises 2")


def test_a_fact_not_reported_after_wrapping_is_a_mismatch_but_not_before():
    assert "rank 0 did not observe zero_stage" in stack.mismatch(cell(), [record(0, wrapper="E", precision="fp32")])
    assert stack.mismatch(cell(), [record(0, wrapped=False)]) is None  # refused before the wrapper existed


def test_the_row_shows_rank_0s_facts_and_each_ranks_where_they_differ():
    ranks = [record(0, wrapper="Engine", zero_stage="2"), record(1, wrapper="Engine", zero_stage="3")]
    assert stack.observed_stack(ranks) == {"wrapper": "Engine", "zero_stage": "rank 0: 2; rank 1: 3"}


def test_every_framework_observes_what_its_names_promise():
    """Each shipped adapter declares what it reads back and what each of its values promises."""
    for framework in spec.load().frameworks.values():
        declaration = framework.declaration
        assert "wrapper" in declaration.observes and "precision" in declaration.observes, framework.name
        promised = {fact for facts in declaration.promises.values() for fact in facts}
        assert promised, f"{framework.name} promises nothing of its plugins"


@pytest.fixture(scope="module")
def pool(shared_pools: slices.SharedPools):
    return shared_pools.get("pytest_freezecompat.adapters.torch_native.adapter")


def test_a_real_ddp_run_under_an_fsdp1_promise_is_a_harness_state_not_a_verdict(pool):
    ddp = slices.matrix_cell("torch", model="tiny-gpt", plugin="ddp", init="eager", checkpoint="none",
                             freeze="embedding", clip="clip")
    verdict, ranks = slices.judged(pool, ddp)
    assert verdict.status == "pass", verdict.message
    assert all(state.record.observed["wrapper"] == "DistributedDataParallel" for state in ranks)
    assert ranks[0].record.versions["torch"].startswith(pool_torch_version())

    misnamed = dataclasses.replace(ddp, promised_stack={"wrapper": "FullyShardedDataParallel", "precision": "fp32"})
    verdict, _ = slices.judged(pool, misnamed)
    assert (verdict.status, verdict.harness) == ("error", True)
    assert ("wrapper is DistributedDataParallel on rank 0, the cell's name promises FullyShardedDataParallel"
            in verdict.message)


def pool_torch_version() -> str:
    import torch

    return torch.__version__.split("+")[0]
