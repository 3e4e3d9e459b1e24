"""The model-checkpoint round trip (`resume` check) through ColossalAI's Booster, run for real on 2 ranks: one
plugin saved as one file (TorchDDP, `shard=False`), one as a sharded folder (LowLevelZero, `shard=True`), each
resumed on a freshly built, frozen and boosted model, and a broken load the check must catch."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch

# "colossalai.booster", not "colossalai": see test_colossalai_adapter.py (prepend import mode).
pytest.importorskip("colossalai.booster")

import slices

from pytest_freezecompat.adapters.colossalai import DECLARATION
from pytest_freezecompat.controller import pool
from pytest_freezecompat.core.cell import Cell

CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="the cells' plan (emulation) is the CPU one")
PLUGINS = {"torch-ddp": "shard=False", "low-level-zero-1": "shard=True"}
FROZEN = {"tok_emb.weight", "pos_emb.weight"}
#: A trainable param the broken load leaves at its freshly built value.
BROKEN = "blocks.1.fc1.weight"


@pytest.fixture(scope="module")
def rank_pool() -> Iterator[pool.RankPool]:
    yield from slices.rank_pool(DECLARATION.implementation_module)


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
