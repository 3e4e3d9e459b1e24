"""The `resume` round trip through Megatron-core's distributed checkpointing, real 2-rank cells on gloo."""

from __future__ import annotations

import dataclasses
import importlib.util
import queue

import pytest

pytest.importorskip("megatron.core")

import megatron.core
import slices
from packaging.version import Version

from pytest_freezecompat.adapters.megatron import DECLARATION, compat
from pytest_freezecompat.controller.pool import RankPool
from pytest_freezecompat.core.cell import Cell

ADAPTER = DECLARATION.implementation_module
MCORE = Version(megatron.core.__version__)
#: megatron-core's torch_dist writer needs psutil, which megatron-core does not declare: 0.8 refuses to pick
#: the strategy, 0.16 would hang in its forked writer (the adapter refuses before the save instead).
HAS_PSUTIL = importlib.util.find_spec("psutil") is not None
#: 0.8's MCoreSavePlanner has every rank write its BytesIO items, which torch 2.13's DCP global plan refuses
#: ("item.index.fqn not in md", default_planner.py): the adapter does not run the round trip there.
SAVES_ON_THIS_TORCH = compat.round_trip_problem() is None
needs_a_save = pytest.mark.skipif(not (HAS_PSUTIL and SAVES_ON_THIS_TORCH),
                                  reason="this environment's megatron-core cannot save a torch_dist checkpoint")


@pytest.fixture(scope="module")
def pool(shared_pools: slices.SharedPools) -> RankPool:
    return shared_pools.get(ADAPTER, "megatron_shard_probe")  # test_megatron_slice's pool: one start for both


def cell(plugin: str, freeze: str) -> Cell:
    return slices.matrix_cell("megatron", plugin=plugin, init="eager", checkpoint="none", freeze=freeze, clip="clip")


run = slices.judged


@needs_a_save
@pytest.mark.parametrize(("plugin", "freeze", "api"), [
    ("torch-ddp-tp2", "embedding", "optim_state_to_sharding_state"),
    ("megatron-ddp-pp2", "output", "FP32Optimizer.sharded_state_dict"),
])
def test_round_trip_through_dist_checkpointing(pool: RankPool, plugin: str, freeze: str, api: str) -> None:
    c = cell(plugin, freeze)
    verdict, ranks = run(pool, c)
    assert verdict.status == "pass", verdict.message
    resume = ranks[0].record.resume
    assert "dist_checkpointing.save" in resume.api and api in resume.api
    # every param of the full model, under its own name (stacked layers and renamed layernorms mapped back)
    assert set(resume.saved_params) == set(ranks[0].record.plan.names)
    assert "decoder.layers.3.input_layernorm.weight" in resume.saved_params
    assert set(resume.saved_state) == set(ranks[0].record.plan.optimized)  # only what the optimizer stepped


@needs_a_save
def test_a_broken_load_is_caught_as_resume(pool: RankPool) -> None:
    broken = "decoder.layers.1.mlp.linear_fc1.weight"  # trainable under `embedding`, on stage 0 at pp2
    c = dataclasses.replace(cell("megatron-ddp-pp2", "embedding"), break_load=broken)
    verdict, _ = run(pool, c)
    assert verdict.status == "fail"
    resume = next(f for f in verdict.failures if f.check == "resume")
    assert broken in resume.message


@pytest.mark.skipif(HAS_PSUTIL, reason="psutil is installed: the torch_dist writer works")
def test_without_psutil_the_save_fails_the_round_trip_instead_of_hanging(pool: RankPool) -> None:
    verdict, _ = run(pool, cell("megatron-ddp-tp1", "none"))
    assert verdict.status == "fail", verdict.message
    resume = next(f for f in verdict.failures if f.check == "resume")
    assert "psutil" in resume.message


@pytest.mark.skipif(SAVES_ON_THIS_TORCH, reason="the round trip runs on this release")
def test_a_release_that_cannot_save_here_says_so_and_is_judged_without_a_round_trip(pool: RankPool) -> None:
    verdict, ranks = run(pool, cell("megatron-ddp-tp1", "embedding"))
    assert verdict.status == "pass", verdict.message
    assert ranks[0].record.resume is None
    assert any(note.startswith("resume not checked: megatron-core") for note in verdict.notes)


def test_a_save_keeps_its_write_results_in_the_rank() -> None:
    """The torch_dist writer's results queue is a spawned Manager's unless the adapter gave it a plain one first: a
    new interpreter importing torch on the first put, ~2 s in every fresh rank's first round trip."""
    filesystem_async = pytest.importorskip("megatron.core.dist_checkpointing.strategies.filesystem_async")
    if not hasattr(filesystem_async, "_get_write_results_queue"):
        pytest.skip("this release hands write results back without a Manager queue")
    filesystem_async._results_queue = None
    compat.keep_write_results_in_process()
    assert isinstance(filesystem_async._get_write_results_queue(), queue.Queue)
    filesystem_async._results_queue = None
