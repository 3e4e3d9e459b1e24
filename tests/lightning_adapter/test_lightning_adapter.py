"""The Lightning row on real 2-rank cells: the Trainer's and Fabric's DDP, FSDP and DeepSpeed (the last two behind
the CPU shim) judged like any wrapper, the round trip through Lightning's own checkpointing, the two silent failures
of its finetuning callback under DDP, and the DeepSpeed checkpoint without its frozen params that it cannot resume."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("lightning.pytorch")  # a module of the real package, not a namespace folder

import slices

from pytest_freezecompat.adapters.lightning import DECLARATION
from pytest_freezecompat.controller.pool import RankPool
from pytest_freezecompat.core.cell import Cell
from pytest_freezecompat.verdict import checks

ADAPTER = DECLARATION.implementation_module


@pytest.fixture(scope="module")
def pool(shared_pools: slices.SharedPools) -> RankPool:
    return shared_pools.get(ADAPTER)


def cell(plugin: str, freeze: str, checkpoint: str = "none") -> Cell:
    return slices.matrix_cell("lightning", plugin=plugin, init="eager", checkpoint=checkpoint, freeze=freeze,
                              clip="clip")


def messages(verdict: checks.Verdict, check: str) -> str:
    return " ".join(f.message for f in verdict.failures if f.check == check)


@pytest.mark.parametrize("plugin", ["trainer-ddp", "trainer-fsdp", "fabric-ddp", "fabric-fsdp"])
@pytest.mark.parametrize("freeze", ["embedding", "all-but-last"])
def test_a_frozen_part_holds_and_survives_the_round_trip(pool: RankPool, plugin: str, freeze: str) -> None:
    verdict, ranks = slices.judged(pool, cell(plugin, freeze))
    assert verdict.status == "pass", verdict.message
    lead = ranks[0].record
    driver = "Trainer" if plugin.startswith("trainer") else "Fabric"
    wrapper = "FullyShardedDataParallel" if plugin.endswith("fsdp") else "DistributedDataParallel"
    assert lead.observed["driver"] == driver and lead.observed["wrapper"] == wrapper
    resume = lead.resume
    assert resume is not None and resume.error is None
    assert ("save_checkpoint" if driver == "Trainer" else "fabric.save") in resume.api
    if plugin.endswith("fsdp"):  # behind the shim, which said so
        assert lead.emulated
    assert sorted(resume.saved_params) == sorted(lead.plan.names)  # every param, frozen ones too, by bare name
    assert set(resume.saved_state) <= set(lead.plan.trainable)  # Adam's moments of what trains, nothing frozen
    assert resume.steps[1].params is not None  # the resumed run trained exactly step 1


@pytest.mark.parametrize("plugin", ["trainer-ddp", "fabric-ddp"])
def test_a_load_that_leaves_one_param_fresh_is_caught(pool: RankPool, plugin: str) -> None:
    broken = dataclasses.replace(cell(plugin, "embedding"), break_load="blocks.0.fc1.weight")
    verdict, _ = slices.judged(pool, broken)
    assert verdict.status == "fail", verdict.message
    message = messages(verdict, "resume")
    assert "blocks.0.fc1.weight" in message and "after load" in message, message


def test_the_finetuning_callback_under_ddp_leaves_the_unfrozen_blocks_unsynced_and_refrozen_on_resume(
        pool: RankPool) -> None:
    """Lightning#20340: unfrozen after DDP was built, the blocks' grads are never averaged (each rank steps its
    own); Lightning#21901: resumed after the unfreeze epoch, BaseFinetuning.setup freezes them again for good."""
    verdict, ranks = slices.judged(pool, cell("trainer-ddp", "decoder-finetuning"))
    assert verdict.status == "fail", verdict.message
    assert "rank 1's grads differ from rank 0's: blocks." in messages(verdict, "grads")
    resume = messages(verdict, "resume")
    assert "requires_grad after load differs from the freeze pattern: blocks." in resume, resume
    assert "no grad on trainable: blocks." in resume, resume
    # the first run did unfreeze them: every rank trained them at step 0
    assert all(ranks[0].record.steps[0].grads.get(n) is not None for n in ranks[0].record.plan.names
               if n.startswith("blocks."))


def test_an_idle_branch_the_callback_unfroze_is_frozen_again_after_a_resume(pool: RankPool) -> None:
    """Lightning#21901 alone: the branch gets no grad on these batches (DDP's sync is moot), and the resumed run's
    BaseFinetuning.setup freezes it again; within the cell no weight changes, so it is costly, not silent."""
    verdict, _ = slices.judged(pool, cell("trainer-ddp", "unused-branch-finetuning"))
    assert verdict.status == "fail" and {f.check for f in verdict.failures} == {"resume"}, verdict.message
    assert "requires_grad after load differs from the freeze pattern: vision." in messages(verdict, "resume")


@pytest.mark.parametrize("plugin", ["trainer-deepspeed", "trainer-deepspeed-stage-3", "fabric-deepspeed",
                                    "fabric-deepspeed-stage-3"])
def test_deepspeed_holds_a_frozen_embedding_and_its_round_trip(pool: RankPool, plugin: str) -> None:
    """Lightning's DeepSpeed strategy behind the shim, read through DeepSpeed's own API: the clip norm compared (the
    engine's, or under Fabric its ZeRO optimizer's), the round trip through DeepSpeed's folders holding every param."""
    pytest.importorskip("deepspeed")
    verdict, ranks = slices.judged(pool, cell(plugin, "embedding"))
    assert verdict.status == "pass" and not verdict.unchecked, (verdict.message, verdict.unchecked)
    lead = ranks[0].record
    assert lead.observed["wrapper"] == "DeepSpeedEngine" and lead.observed["strategy"] == "DeepSpeedStrategy"
    assert lead.observed["zero_stage"] == ("3" if plugin.endswith("-stage-3") else "2")
    assert lead.emulated  # behind the shim, which said so
    resume = lead.resume
    assert resume is not None and resume.error is None and "engine.save_checkpoint" in resume.api
    assert sorted(resume.saved_params) == sorted(lead.plan.names)  # frozen params too, by bare name


@pytest.mark.parametrize("plugin", ["trainer-deepspeed-exclude-frozen", "fabric-deepspeed-exclude-frozen"])
def test_a_checkpoint_without_the_frozen_params_is_refused_on_resume(pool: RankPool, plugin: str) -> None:
    """Lightning 2.5.5+: exclude_frozen_parameters=True writes only what trains, and the resume loads it strictly
    (findings/lightning-deepspeed-exclude-frozen-resume-strict-load.py); before 2.5.5 the switch does not exist."""
    pytest.importorskip("deepspeed")
    found = cell(plugin, "embedding")
    if found.skip is not None:
        assert "2.5.5" in found.skip, found.skip
        return
    verdict, ranks = slices.judged(pool, found)
    assert verdict.status == "fail", verdict.message
    assert "Missing key(s) in state_dict" in messages(verdict, "resume")
    lead = ranks[0].record
    assert lead.observed["exclude_frozen_parameters"] == "True"
    assert sorted(lead.resume.saved_params) == sorted(lead.plan.trainable)  # the base left out, as asked
