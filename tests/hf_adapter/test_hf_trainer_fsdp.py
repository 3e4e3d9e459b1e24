"""Real 2-rank cells of the Trainer's FSDP checkpoint plugins, the examples' peft model and the staged unfreeze.

trainer-fsdp2-full-state-dict is accelerate PR#4206's cross-release case (the adapter comes back whole from 1.15.0
only); trainer-fsdp1 around a peft model saves an empty adapter on peft 0.21.2 (the finding
peft-fsdp1-nested-units-adapter-state-dict-empty); last-block-after-optimizer leaves the block out of the optimizer
under the user's loop and the Trainer alike.
"""

from __future__ import annotations

import importlib.util

import pytest

pytest.importorskip("accelerate.state")  # a module of the real package, not a namespace folder
pytest.importorskip("peft")

import accelerate
import slices
from hf_cells import cell, examples_pool, run
from packaging.version import Version

from pytest_freezecompat import user
from pytest_freezecompat.adapters.emulation import fsdp1_cpu_offload_patches
from pytest_freezecompat.controller.pool import RankPool
from pytest_freezecompat.core.cell import Cell
from pytest_freezecompat.spec import matrix as spec
from pytest_freezecompat.spec import plan

ACCELERATE = Version(accelerate.__version__)
LORA_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"


pool = pytest.fixture(scope="module", name="pool")(examples_pool)


def lora_cell(plugin: str) -> Cell:
    """examples/test_peft_lora.py's tiny-llama-lora `lora` cell of this plugin, as the matrix plans it."""
    import test_peft_lora

    case = user.build_case(getattr(test_peft_lora.tiny_llama_lora, user.CASE_ATTRIBUTE))
    cells = plan.user_cells(spec.load(), case, world_size=slices.WORLD_SIZE, device="cpu")
    (found,) = [c for c in cells if (c.key.framework, c.key.plugin, c.key.checkpoint, c.key.freeze) ==
                ("hf", plugin, "none", "lora")]
    return found


def test_the_trainers_fsdp2_full_save_restores_the_peft_adapter_from_accelerate_1_15_only(pool: RankPool) -> None:
    verdict, _ = run(pool, lora_cell("trainer-fsdp2-full-state-dict"))
    if ACCELERATE >= Version("1.15.0"):
        assert verdict.status == "pass", verdict.message
    else:  # only rank 0's shard of each adapter tensor was written (PR#4206)
        assert [f.check for f in verdict.failures] == ["resume"], verdict.message
        assert f"after load, values differ from what was saved: {LORA_A}" in verdict.message


def test_the_trainers_fsdp1_saves_the_peft_adapter_on_peft_0_17_and_nothing_on_0_21(pool: RankPool) -> None:
    import peft

    verdict, records = run(pool, lora_cell("trainer-fsdp1"))
    assert "FSDP.summon_full_params" in records[0].grad_access  # use_orig_params: the Trainer's FSDP1 default
    if Version(peft.__version__) >= Version("0.21"):
        assert [f.check for f in verdict.failures] == ["resume"], verdict.message
        assert f"not in the saved files: {LORA_A}" in verdict.message
    else:
        assert verdict.status == "pass", verdict.message


def test_the_trainers_fsdp1_full_state_dict_runs_behind_the_offload_patches(pool: RankPool) -> None:
    c = cell("trainer-fsdp1", "all-but-last")
    assert c.emulation
    verdict, records = run(pool, c)
    assert verdict.status == "pass", verdict.message
    offload = {patch.what for patch in fsdp1_cpu_offload_patches("Accelerate's full state dict")}
    assert offload & set(records[0].emulated)


@pytest.mark.parametrize("plugin", ["accelerate-ddp", "trainer-fsdp2", pytest.param(
    "accelerate-zero2", marks=pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                                 reason="DeepSpeed is not installed here"))])
def test_a_block_unfrozen_after_the_optimizer_never_moves_under_either_driver(pool: RankPool, plugin: str) -> None:
    verdict, records = run(pool, cell(plugin, "last-block-after-optimizer"))
    assert verdict.status == "fail" and verdict.check == "optimizer", verdict.message
    block = [n for n in records[0].plan.names if n.startswith("blocks.2.")]
    assert block and not set(block) & set(records[0].tracked)
    initial, last = records[0].initial, records[0].steps[-1].params
    assert all((initial[n] == last[n]).all() for n in block)
    assert records[0].steps[0].grads["blocks.2.fc1.weight"] is not None  # unfrozen: it gets a grad, reaching no weight
