"""Real 2-rank `trainer-*` cells: `Trainer.train()` owns the loop; the probes run in its subclass and callback.

The checks are the engine's: the Trainer's own optimizer (`create_optimizer` over the params that require grad),
its clipping (`max_grad_norm`) through `accelerator.clip_grad_norm_`, and its own checkpoint round trip
(`resume_from_checkpoint`), against the single-process reference.
"""

from __future__ import annotations

import pytest

pytest.importorskip("accelerate.state")  # a module of the real package, not a namespace folder
pytest.importorskip("transformers")

import accelerate
import slices
from hf_cells import ADAPTER, cell, run
from packaging.version import Version

from pytest_freezecompat.adapters.hf import emulation
from pytest_freezecompat.controller.pool import RankPool

ACCELERATE = Version(accelerate.__version__)


@pytest.fixture(scope="module")
def pool(shared_pools: slices.SharedPools) -> RankPool:
    return shared_pools.get(ADAPTER)


def test_trainer_ddp_trains_like_the_reference_and_resumes_from_its_own_checkpoint(pool: RankPool) -> None:
    if ACCELERATE < Version("1.15.0"):
        pytest.skip("transformers 4.57.1 cannot resume a CPU DDP run (the finding transformers-trainer-cpu-ddp-resume-"
                    "map-location): its round trip fails there")
    verdict, records = run(pool, cell("trainer-ddp", "embedding"))
    assert verdict.status == "pass", verdict.message
    first = records[0]
    assert first.steps[0].grads["tok_emb.weight"] is None and first.steps[0].grads["head.weight"] is not None
    assert first.steps[0].norm_source.startswith("returned by accelerator.clip_grad_norm_ inside Trainer.train")
    assert first.resume is not None and first.resume.error is None
    assert "Trainer checkpointing" in first.resume.api
    assert not first.emulated


def test_trainer_ddp_no_clip_makes_no_clipping_record(pool: RankPool) -> None:
    if ACCELERATE < Version("1.15.0"):
        pytest.skip("transformers 4.57.1 cannot resume a CPU DDP run (the finding transformers-trainer-cpu-ddp-resume-"
                    "map-location): its round trip fails there")
    verdict, records = run(pool, cell("trainer-ddp", "none", clip="no-clip"))
    assert verdict.status == "pass", verdict.message
    assert all(step.norm is None for step in records[0].steps)


def test_trainer_fsdp2_runs_behind_the_labelled_shim_and_resumes_where_accelerate_loads_its_optimizer(
        pool: RankPool) -> None:
    """FSDP2 through `TrainingArguments(fsdp=...)` on CPU, behind the shim; the Trainer's checkpoints take the
    plugin's FSDP2 default (sharded), whose optimizer load fills a fresh optimizer from accelerate 1.13.0 (PR #3904;
    1.10.1 loads nothing: the registry's accelerate-fsdp2-sharded-optimizer-load-fresh-template)."""
    c = cell("trainer-fsdp2", "all-but-last")
    assert c.emulation
    verdict, records = run(pool, c)
    assert "DTensor" in records[0].grad_access, records[0].grad_access
    assert emulation.BACKEND in records[0].emulated
    if ACCELERATE >= Version("1.13.0"):
        assert verdict.status == "pass", verdict.message
    else:
        assert [f.check for f in verdict.failures] == ["resume"], verdict.message


def test_trainer_ddp_turns_on_find_unused_parameters_for_a_model_that_is_not_a_pretrained_model(
        pool: RankPool) -> None:
    """tiny-gpt is a plain nn.Module: the Trainer's DDP finds unused params, so an idle branch does not raise
    (accelerate-ddp raises there), and reentrant checkpointing marks params ready twice."""
    if ACCELERATE < Version("1.15.0"):
        pytest.skip("transformers 4.57.1 cannot resume a CPU DDP run (the finding transformers-trainer-cpu-ddp-resume-"
                    "map-location): its round trip fails there")
    verdict, _ = run(pool, cell("trainer-ddp", "unused-branch"))
    assert verdict.status == "pass", verdict.message
    verdict, _ = run(pool, cell("trainer-ddp", "none", checkpoint="reentrant"))
    assert verdict.status == "error" and "Expected to mark a variable ready only once" in verdict.message


def test_trainer_ddp_resume_on_transformers_4_fails_on_the_indexed_cpu_device(pool: RankPool) -> None:
    """The finding transformers-trainer-cpu-ddp-resume-map-location, seen by a cell: the steps before the save pass,
    the resume's optimizer load raises on the `cpu:0` map_location (and every rank reports that, not a missing file)."""
    if ACCELERATE >= Version("1.15.0"):
        pytest.skip("transformers 5.23.0 (beside accelerate 1.15.0) loads with plain 'cpu'")
    verdict, records = run(pool, cell("trainer-ddp", "embedding"))
    assert [f.check for f in verdict.failures] == ["resume"], verdict.message
    assert all("tagged with cpu:0" in r.resume.error.message for r in records), [r.resume.error for r in records]
