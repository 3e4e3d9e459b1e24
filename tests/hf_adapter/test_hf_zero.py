"""The `*-zero*` plugins: Accelerate's DeepSpeed path from the user's loop and from the Trainer, real on 2 ranks
behind the labelled shim, and the stack check that refuses a DeepSpeed request Accelerate silently dropped."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("accelerate.state")  # a module of the real package, not a namespace folder
pytest.importorskip("deepspeed")

import accelerate
import slices
import torch
from accelerate import Accelerator, DeepSpeedPlugin
from hf_cells import ADAPTER, cell, run
from hf_fixtures import one_process_group  # noqa: F401 (a fixture)
from packaging.version import Version
from torch import nn

from pytest_freezecompat.adapters.hf import ZERO_PLUGINS, emulation, state
from pytest_freezecompat.controller.pool import RankPool

ACCELERATE = Version(accelerate.__version__)


@pytest.fixture(scope="module")
def pool(shared_pools: slices.SharedPools) -> RankPool:
    return shared_pools.get(ADAPTER)


def test_accelerate_zero3_trains_like_the_reference_and_round_trips_through_save_state(pool: RankPool) -> None:
    """The user's loop: grads read as the engine's step begins (inside accelerator.backward), the norm that
    accelerator.clip_grad_norm_ returns, save_state/load_state of the engine checkpoint."""
    c = cell("accelerate-zero3", "embedding")
    assert c.emulation
    verdict, records = run(pool, c)
    assert verdict.status == "pass", verdict.message
    first = records[0]
    assert emulation.BACKEND in first.emulated
    assert "engine.step() begins" in first.grad_access and "stage 3" in first.grad_access
    assert first.steps[0].grads["tok_emb.weight"] is None and first.steps[0].grads["head.weight"] is not None
    assert first.steps[0].norm_source == "returned by accelerator.clip_grad_norm_"
    assert first.resume is not None and first.resume.error is None and "save_state" in first.resume.api
    assert first.resume.saved_state is not None and "head.weight" in first.resume.saved_state


def test_trainer_zero3_trains_like_the_reference_and_resumes_from_its_engine_checkpoint(pool: RankPool) -> None:
    verdict, records = run(pool, cell("trainer-zero3", "all-but-last"))
    assert verdict.status == "pass", verdict.message
    first = records[0]
    assert emulation.BACKEND in first.emulated and "engine.step() begins" in first.grad_access
    assert first.steps[0].norm_source.startswith("returned by accelerator.clip_grad_norm_ inside Trainer.train")
    assert first.resume is not None and first.resume.error is None and "Trainer checkpointing" in first.resume.api


@pytest.mark.usefixtures("one_process_group")
def test_the_check_refuses_a_deepspeed_request_accelerate_silently_ran_without_deepspeed() -> None:
    """`Accelerator(cpu=True, deepspeed_plugin=...)` takes the plugin without a word and prepares no engine
    (`cpu=True` turns DeepSpeed off): the cell's check names what was asked and what came."""
    accelerator = Accelerator(cpu=True, deepspeed_plugin=DeepSpeedPlugin(zero_stage=3))
    model = nn.Linear(2, 2)
    prepared, _ = accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
    assert state.wrapper_kind(prepared) != "deepspeed"
    with pytest.raises(state.StackMismatch, match=r"asked for distributed_type=DEEPSPEED, num_processes=1, wrapper "
                                                  r"deepspeed; Accelerate gave distributed_type=(?!DEEPSPEED)"):
        state.check(ZERO_PLUGINS[1], "DEEPSPEED", "deepspeed", accelerator, prepared, 1)


def test_without_the_shim_accelerate_1_15_counts_one_process_and_the_check_refuses_it(pool: RankPool) -> None:
    """Asked for DeepSpeed on CPU without the shim, Accelerate 1.15.0 inits DeepSpeed's 2-rank group yet counts one
    process per rank (its own backend stays None) and the engine trains regardless (the config's batch sizes are
    explicit): silent but for the stack check. Accelerate 1.10.1 counts both ranks there and needs no shim."""
    marked = cell("accelerate-zero3", "none")
    verdict, records = run(pool, dataclasses.replace(marked, emulation=False, shim=None))
    assert not records[0].emulated
    if ACCELERATE < Version("1.15.0"):
        assert verdict.status == "pass", verdict.message
        return
    assert verdict.status == "error" and records[0].error.type == "StackMismatch", verdict.message
    assert ("asked for distributed_type=DEEPSPEED, num_processes=2, wrapper deepspeed; Accelerate gave "
            "distributed_type=DEEPSPEED, num_processes=1" in records[0].error.message), records[0].error.message
