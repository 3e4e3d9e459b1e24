"""Real 2-rank Megatron cells on gloo through the engine's warm RankPool, judged by the engine's checks."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("megatron.core")

import megatron.core
import slices
from packaging.version import Version

from pytest_freezecompat.adapters.megatron import DECLARATION
from pytest_freezecompat.adapters.megatron.emulation import FUSED_ADAM
from pytest_freezecompat.controller.pool import RankPool
from pytest_freezecompat.core.cell import Cell
from pytest_freezecompat.core.freeze import FreezePattern
from pytest_freezecompat.verdict import checks

ADAPTER = DECLARATION.implementation_module
PROBE = "megatron_shard_probe"
#: Before 0.11, get_megatron_optimizer builds its Adam over an empty list on a pipeline stage with nothing
#: to train and torch refuses it (Megatron-LM#1166, fixed by commit 1468ab01): the stack's error, not ours.
EMPTY_STAGE_OPTIMIZER = Version(megatron.core.__version__) >= Version("0.11")
#: Before 0.10 the distributed optimizer demands Apex's or TE's FusedAdam; on CPU the shim lets torch's AdamW stand in.
DISTOPT_WANTS_FUSED_ADAM = Version(megatron.core.__version__) < Version("0.10")


@pytest.fixture(scope="module")
def pool(shared_pools: slices.SharedPools) -> RankPool:
    return shared_pools.get(ADAPTER, PROBE)


def cell(plugin: str, freeze: str, init: str = "eager", checkpoint: str = "none") -> Cell:
    return slices.matrix_cell("megatron", plugin=plugin, init=init, checkpoint=checkpoint, freeze=freeze, clip="clip")


def assert_trains(verdict: checks.Verdict) -> None:
    """Every training check held; the model-checkpoint round trip is judged apart (test_megatron_resume.py: the
    distributed optimizer's and partly trained layers' checkpoints are Megatron's own refusals)."""
    training = [f for f in verdict.failures if f.check != "resume"]
    assert verdict.status in ("pass", "fail") and not training, verdict.message


run = slices.judged


@pytest.mark.parametrize(("plugin", "freeze", "init"), [
    ("megatron-ddp-tp2", "embedding", "eager"),
    ("megatron-ddp-distopt-pp2", "output", "eager"),
    ("torch-ddp-tp1", "optimizer-subset", "eager"),
])
def test_freeze_patterns_train_like_the_reference(pool: RankPool, plugin: str, freeze: str, init: str) -> None:
    verdict, ranks = run(pool, cell(plugin, freeze, init))
    assert_trains(verdict)
    assert ranks[0].record.emulated  # on CPU the cell is labelled as emulated


def test_a_pipeline_stage_with_nothing_to_train(pool: RankPool) -> None:
    verdict, _ = run(pool, cell("megatron-ddp-pp2", "all-but-last", "meta"))  # stage 0 trains nothing at all
    if EMPTY_STAGE_OPTIMIZER:
        assert_trains(verdict)
    else:
        assert verdict.status == "error" and "optimizer got an empty parameter list" in verdict.message


def test_distributed_optimizer_shards_are_united_and_grads_gathered(pool: RankPool) -> None:
    c = dataclasses.replace(cell("megatron-ddp-distopt-tp1", "none"), adapter=f"{PROBE}:ShardNotingAdapter")
    verdict, ranks = run(pool, c)
    assert_trains(verdict)  # grads read from the reduce-scattered shards match
    local = [set(next(n for n in r.record.notes if "locally tracked" in n).split(": ")[1].split(","))
             for r in ranks]
    assert local[0] and local[1] and local[0] != local[1]  # each rank's optimizer holds its own shard
    assert set(ranks[0].record.tracked) == local[0] | local[1] == set(ranks[0].record.plan.optimized)
    assert "all-gather" in ranks[0].record.grad_access
    assert (FUSED_ADAM in ranks[0].record.emulated) == DISTOPT_WANTS_FUSED_ADAM


def test_megatron_findings_show_as_real_failures(pool: RankPool) -> None:
    verdict, _ = run(pool, cell("megatron-ddp-tp1", "bias-only"))  # LinearWithFrozenWeight drops the bias grad
    assert (verdict.status, verdict.check) == ("fail", "grads")
    assert "linear_qkv.bias" in verdict.message
    verdict, _ = run(pool, cell("megatron-ddp-tp1", "embedding", checkpoint="full"))  # reentrant recompute
    assert (verdict.status, verdict.check) == ("fail", "grads")


def test_freeze_after_wrap_breaks_the_distributed_optimizer(pool: RankPool) -> None:
    base = cell("megatron-ddp-distopt-tp1", "decoder")
    after = dataclasses.replace(base, key=dataclasses.replace(base.key, freeze="decoder-after-wrap"),
                                pattern=FreezePattern("decoder-after-wrap", frozen=("decoder",)),
                                options={"freeze_after_wrap": True})
    verdict, _ = run(pool, after)
    assert verdict.status == "error" and "KeyError" in verdict.message


def test_one_rank_error_ends_with_both_stories_and_the_next_cell_runs(pool: RankPool) -> None:
    verdict, ranks = run(pool, cell("torch-ddp-pp2", "all-but-last"))  # stage 0: torch DDP refuses, no trainables
    assert verdict.status == "error" and "DistributedDataParallel is not needed" in verdict.message
    assert all(r.record is not None or r.stack for r in ranks)  # every rank told its story
    verdict, _ = run(pool, cell("torch-ddp-pp2", "none"))
    assert verdict.status == "pass", verdict.message


def test_without_the_shim_megatron_fails_loudly_on_cpu(pool: RankPool) -> None:
    verdict, _ = run(pool, dataclasses.replace(cell("megatron-ddp-tp1", "none"), emulation=False, shim=None))
    assert verdict.status == "error" and "CUDA" in verdict.message, verdict.message
