"""The model-checkpoint round trip (`resume` check) through ColossalAI's Booster, run for real on 2 ranks: one
plugin saved as one file (TorchDDP, `shard=False`), one as a sharded folder (LowLevelZero, `shard=True`), each
resumed on a freshly built, frozen and boosted model, and a broken load the check must catch."""

from __future__ import annotations

import dataclasses

import pytest
import torch

# "colossalai.booster", not "colossalai": see test_colossalai_adapter.py (prepend import mode).
pytest.importorskip("colossalai.booster")

import odd_sized
import slices

from pytest_freezecompat.adapters.colossalai import DECLARATION
from pytest_freezecompat.controller import pool
from pytest_freezecompat.core.cell import Cell, UserModel

CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="the cells' plan (emulation) is the CPU one")
PLUGINS = {"torch-ddp": "shard=False", "low-level-zero-1": "shard=True"}
FROZEN = {"tok_emb.weight", "pos_emb.weight"}
#: What the session's ColossalAI ranks preload: the adapter, and the probe that reads ZeRO grads a second way.
POOL_MODULES = (DECLARATION.implementation_module, "colossalai_probe")
#: A trainable param the broken load leaves at its freshly built value.
BROKEN = "blocks.1.fc1.weight"


@pytest.fixture(scope="module")
def rank_pool(shared_pools: slices.SharedPools) -> pool.RankPool:
    return shared_pools.get(*POOL_MODULES)


def _cell(plugin: str) -> Cell:
    return slices.matrix_cell("colossalai", plugin=plugin, init="eager", checkpoint="none", freeze="embedding",
                              clip="clip")


@CPU_ONLY
@pytest.mark.parametrize("plugin", list(PLUGINS))
def test_round_trip_through_the_booster_passes(rank_pool: pool.RankPool, plugin: str) -> None:
    verdict, ranks = slices.judged(rank_pool, _cell(plugin))
    assert verdict.status == "pass", verdict.message
    resume = ranks[0].record.resume
    assert resume is not None and resume.error is None
    assert "booster.save_model" in resume.api and "booster.load_optimizer" in resume.api
    assert PLUGINS[plugin] in resume.api
    names = set(resume.requires_grad or ())
    assert FROZEN < names and set(resume.saved_params or ()) == names  # every param, frozen ones too, is saved
    assert set(resume.saved_state or ()) == names - FROZEN  # Adam state for exactly the params it stepped
    assert not any(resume.requires_grad[n] for n in FROZEN)  # the rebuild froze them again


@CPU_ONLY
@pytest.mark.parametrize("plugin", list(PLUGINS))
def test_a_load_that_leaves_a_param_behind_fails_the_resume_check(rank_pool: pool.RankPool, plugin: str) -> None:
    verdict, _ = slices.judged(rank_pool, dataclasses.replace(_cell(plugin), break_load=BROKEN))
    assert verdict.status == "fail", verdict.message
    resume = [f for f in verdict.failures if f.check == "resume"]
    assert resume and BROKEN in resume[0].message, verdict.message


@pytest.fixture(scope="module")
def probe_pool(shared_pools: slices.SharedPools) -> pool.RankPool:
    return shared_pools.get(*POOL_MODULES)


@CPU_ONLY
@pytest.mark.parametrize("plugin", ["low-level-zero-1", "low-level-zero-2", "hybrid-parallel-zero-1"])
def test_zero_grads_read_in_one_all_gather_equal_those_read_one_param_at_a_time(probe_pool: pool.RankPool,
                                                                                plugin: str) -> None:
    """Bit for bit, at every step (the probe adapter raises otherwise): with frozen params (no ZeRO grad), a
    trainable branch that gets none, and a model none of whose params splits evenly over the ranks."""
    adapter = "colossalai_probe:ComparesZeroGradsAdapter"
    cells = [dataclasses.replace(_cell(plugin), adapter=adapter),
             dataclasses.replace(slices.matrix_cell("colossalai", plugin=plugin, init="eager", checkpoint="none",
                                                    freeze="unused-branch", clip="clip"), adapter=adapter)]
    control = slices.matrix_cell("colossalai", plugin=plugin, init="eager", checkpoint="none", freeze="none",
                                 clip="clip")
    cells.append(dataclasses.replace(control, adapter=adapter, user_model=UserModel(odd_sized.FACTORY,
                                                                                     odd_sized.BATCH, odd_sized.LOSS)))
    for cell in cells:
        verdict, _ = slices.judged(probe_pool, cell)
        assert verdict.status in ("pass", "fail") and "AssertionError" not in verdict.message, verdict.message
