"""Real 2-rank DeepSpeed cells on gloo through the engine's warm RankPool, judged by the engine's checks."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("deepspeed")

import odd_sized
import slices
from slices import TIMEOUT_S

from pytest_freezecompat.adapters.deepspeed import DECLARATION
from pytest_freezecompat.controller.pool import RankPool
from pytest_freezecompat.core.cell import Cell, UserModel
from pytest_freezecompat.core.records import Outcome
from pytest_freezecompat.verdict import checks

ADAPTER = DECLARATION.implementation_module
PROBE = "deepspeed_probe"
EMBEDDING = {"tok_emb.weight", "pos_emb.weight"}


@pytest.fixture(scope="module")
def pool(shared_pools: slices.SharedPools) -> RankPool:
    return shared_pools.get(ADAPTER, PROBE)


def cell(plugin: str, freeze: str, init: str = "eager", checkpoint: str = "none", clip: str = "clip") -> Cell:
    return slices.matrix_cell("deepspeed", plugin=plugin, init=init, checkpoint=checkpoint, freeze=freeze, clip=clip)


run = slices.judged


@pytest.mark.parametrize(("plugin", "init"), [("zero0", "eager"), ("zero1", "eager"), ("zero2", "eager"),
                                              ("zero3", "eager"),
                                              ("zero2-offload", "eager"),
                                              ("zero3", "zero-init"),
                                              ("zero2-offload-config-optim", "eager")])
def test_each_stage_reads_grads_and_maps_the_tracked_set_to_bare_names(pool: RankPool, plugin: str,
                                                                       init: str) -> None:
    verdict, ranks = run(pool, cell(plugin, "embedding", init))
    assert verdict.status == "pass", verdict.message
    lead = ranks[0].record
    names = set(lead.requires_grad)
    assert set(lead.tracked) == names - EMBEDDING  # bare names, every rank's optimizer params united
    grads = lead.steps[0].grads
    assert all(grads[n] is None for n in EMBEDDING) and all(grads[n] is not None for n in names - EMBEDDING)
    assert "safe_get_full_grad" in lead.grad_access


@pytest.mark.parametrize(("plugin", "init"), [("zero2", "eager"), ("zero3", "zero-init")])
def test_rows_held_by_a_gradient_mask_stay_held_under_zero(pool: RankPool, plugin: str, init: str) -> None:
    """DeepSpeed#5041's workaround: the hook on the bare param reaches the grads ZeRO reduces and partitions."""
    verdict, ranks = run(pool, cell(plugin, "embedding-rows", init))
    assert verdict.status == "pass", verdict.message
    grad = ranks[0].record.steps[0].grads["tok_emb.weight"]
    assert not grad[:-16].any() and grad[-16:].any()


def test_stage_0_reads_the_norm_where_the_engine_computes_it(pool: RankPool) -> None:
    verdict, ranks = run(pool, cell("zero0", "none"))
    assert verdict.status == "pass", verdict.message
    assert "clip_grad_norm_" in ranks[0].record.steps[0].norm_source


def test_exclude_frozen_parameters_saves_what_trains(pool: RankPool) -> None:
    verdict, ranks = run(pool, cell("zero3", "lora", "zero-init"))
    assert verdict.status == "pass", verdict.message
    resume = ranks[0].record.resume
    assert resume.saved_trainable_only and "exclude_frozen_parameters=True" in resume.api
    assert all(".lora_" in name for name in resume.saved_params)


@pytest.mark.parametrize("plugin", ["zero0", "zero2", "zero3"])
def test_a_broken_load_is_caught_as_resume(pool: RankPool, plugin: str) -> None:
    c = dataclasses.replace(cell(plugin, "embedding"), break_load="blocks.2.fc1.weight")
    verdict, _ = run(pool, c)
    assert verdict.status == "fail" and verdict.check == "resume", verdict.message
    assert "blocks.2.fc1.weight" in verdict.message


@pytest.mark.parametrize(("plugin", "init"), [("zero3", "eager"), ("zero3", "zero-init"), ("zero3-bf16", "eager")])
def test_stage_3_reads_every_param_in_one_collective_as_gathered_parameters_reads_it(pool: RankPool, plugin: str,
                                                                                      init: str) -> None:
    """After wrapping, after each step and after the load: the same values, bit for bit, both ways (the probe
    adapter raises otherwise), for tiny-gpt with LoRA and for a model none of whose params splits evenly."""
    compared = dataclasses.replace(cell(plugin, "lora", init), adapter=f"{PROBE}:ComparesStage3ReadsAdapter")
    uneven = dataclasses.replace(cell(plugin, "none", init), adapter=compared.adapter, user_model=UserModel(
        odd_sized.FACTORY, odd_sized.BATCH, odd_sized.LOSS))
    for c in (compared, uneven):
        verdict, ranks = run(pool, c)
        assert verdict.status == "pass", verdict.message
        assert ranks[0].record.resume is not None and ranks[0].record.resume.loaded is not None


def test_a_rank_aborting_after_its_results_still_records_the_cell(pool: RankPool) -> None:
    c = dataclasses.replace(cell("zero2", "embedding"), adapter=f"{PROBE}:AbortsAtTeardownAdapter")
    result = pool.run(c, TIMEOUT_S)
    verdict = checks.judge(result, c, TIMEOUT_S)
    assert result.outcome is Outcome.DONE and verdict.status == "pass", verdict.message
    assert any("rank 1" in note and "tidying" in note for note in result.notes), result.notes
    after, _ = run(pool, cell("zero2", "embedding"))  # fresh ranks serve the next cell
    assert after.status == "pass", after.message


def test_a_bf16_engine_gets_its_float_inputs_in_bf16_as_its_users_feed_it(pool: RankPool) -> None:
    """A user's loss that does not cast its float inputs: the fp32 input met bf16 weights and every cell raised
    ("expected m1 and m2 to have the same dtype"), the control included."""
    uncast = dataclasses.replace(cell("zero2-bf16", "none"), user_model=UserModel(
        odd_sized.FACTORY, odd_sized.BATCH, "odd_sized:odd_sized_uncast_loss"))
    verdict, _ = run(pool, uncast)
    assert verdict.status == "pass", verdict.message
