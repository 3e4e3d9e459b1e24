"""Real 2-rank cells of TRL's SFTTrainer (`trl-*`) and of QLoRA (examples/test_qlora.py) on the hf row.

SFTTrainer is a Trainer: its cells are judged like the Trainer's, and the stack that ran must say SFTTrainer. The
`peft_config` path hands SFTTrainer the base and the LoraConfig; its adapter starts from the cell's values, so the
reference judges it. A QLoRA base is frozen in every pattern, the control too, and its 4-bit weights never move.
"""

from __future__ import annotations

import importlib.util

import pytest

pytest.importorskip("accelerate.state")
pytest.importorskip("transformers")
pytest.importorskip("peft")

import slices
from hf_cells import examples_pool, run
from packaging.version import Version

from pytest_freezecompat import user
from pytest_freezecompat.controller.pool import RankPool
from pytest_freezecompat.core.cell import Cell
from pytest_freezecompat.spec import matrix as spec
from pytest_freezecompat.spec import plan

LORA_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"
Q_PROJ = "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"


pool = pytest.fixture(scope="module", name="pool")(examples_pool)


def example_cell(module: str, factory: str, plugin: str, freeze: str, checkpoint: str = "non-reentrant") -> Cell:
    """An examples/ case's cell of this plugin, as the matrix plans it."""
    case = user.build_case(getattr(getattr(__import__(module), factory), user.CASE_ATTRIBUTE))
    cells = plan.user_cells(spec.load(), case, world_size=slices.WORLD_SIZE, device="cpu")
    (found,) = [c for c in cells if (c.key.framework, c.key.plugin, c.key.checkpoint, c.key.freeze) ==
                ("hf", plugin, checkpoint, freeze)]
    return found


def _accelerate() -> Version:
    import accelerate

    return Version(accelerate.__version__)


@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="TRL is not installed here")
@pytest.mark.parametrize("plugin", ["trl-sft-ddp", "trl-sft-ddp-peft-config"])
def test_sft_trainer_trains_the_adapter_like_the_reference_both_ways_it_gets_one(pool: RankPool, plugin: str) -> None:
    verdict, records = run(pool, example_cell("test_peft_lora", "tiny_llama_lora", plugin, "lora"))
    assert records[0].observed["trainer"] == "SFTTrainer" and records[0].observed["driver"] == "trainer"
    if _accelerate() < Version("1.15.0"):  # transformers 4.57.1 cannot resume a CPU DDP run (its finding)
        assert [f.check for f in verdict.failures] == ["resume"], verdict.message
    else:
        assert verdict.status == "pass", verdict.message
    assert records[0].steps[0].grads[LORA_A] is not None


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="bitsandbytes is not installed here")
def test_a_qlora_base_stays_frozen_in_the_control_and_its_packed_bytes_never_move(pool: RankPool) -> None:
    verdict, records = run(pool, example_cell("test_qlora", "tiny_llama_qlora_bf16_storage", "trainer-fsdp2", "none"))
    trainable = set(records[0].plan.trainable)  # the control: nothing frozen but the 4-bit weights
    assert Q_PROJ not in trainable and LORA_A in trainable and "base_model.model.lm_head.weight" in trainable
    assert records[0].observed["precision"] == "fp32", records[0].observed
    first, last = records[0].initial[Q_PROJ], records[0].steps[-1].params[Q_PROJ]
    assert (first == last).sum() + (first != first).sum() == first.size  # equal, or NaN in both (packed bf16)
    assert verdict.check in (None, "resume"), verdict.message  # the Trainer saves a PeftModel's adapter alone
