"""The `trl-*` driver: TRL's `SFTTrainer`, a Trainer subclass whose `__init__` prepares the model itself (a
`peft_config` wrapped by its `get_peft_model`, a quantized model's adapters cast, gradient checkpointing's input
grads), over the same stacks as the `trainer-*` driver.

What a TRL user writes: `SFTTrainer(model, args=SFTConfig(...), train_dataset=..., processing_class=tokenizer,
peft_config=LoraConfig(...) or None)`, then `train()`. The model reaches it two ways, both in TRL's docs:
- `model`: the model as the user built and froze it (a `PeftModel` from `get_peft_model`: trl#3926's path);
- `peft_config`: the base model and the `LoraConfig`, which SFTTrainer applies. The base is the cell's `PeftModel`
  unloaded, and the adapter SFTTrainer builds gets the cell's initial adapter values back, so that the reference
  starts where the cell does.
Gradient checkpointing is SFTConfig's (`gradient_checkpointing`, `gradient_checkpointing_kwargs`), as the cell's
checkpoint axis says: TRL's default turns it on, so `none` turns it off. SFTTrainer computes its loss from its own
collated columns; the cell keeps its own batches and loss (`CellLoop`): what TRL does to the model is in `__init__`.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

from torch import nn
from transformers import PreTrainedTokenizerFast, Trainer, TrainingArguments

from ..base import RunContext
from . import TRL_PLUGINS
from .trainer_loop import CellLoop, TrainerRun

#: The plugins that hand SFTTrainer the base and a `peft_config`; the others hand it the model as built. Each plugin's
#: stack is its Trainer twin's (the package's `TRL_PLUGINS`).
PEFT_CONFIG_PLUGINS = frozenset({"trl-sft-ddp-peft-config"})
#: The rows SFTTrainer's `__init__` reads from its train dataset; the cell's own batches replace them in training.
DATASET_ROWS = 4
#: TRL sends usage telemetry unless told not to (trl's base_trainer): no network here, and none wanted in a test.
QUIET = {"HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_OFFLINE": "1"}


def tokenizer(model: nn.Module) -> PreTrainedTokenizerFast:
    """The tokenizer a user passes as `processing_class` (without one SFTTrainer loads the model's from the hub): a
    word-level vocabulary with the model's own pad, eos and bos ids."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    config = getattr(model, "config", None)
    special = {"<pad>": getattr(config, "pad_token_id", None), "</s>": getattr(config, "eos_token_id", None),
               "<s>": getattr(config, "bos_token_id", None)}
    ids = iter(range(max((i for i in special.values() if isinstance(i, int)), default=-1) + 1, 1 << 30))
    vocab = {token: i if isinstance(i, int) else next(ids) for token, i in special.items()}
    vocab["<unk>"] = next(ids)
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<unk>")),
                                   pad_token="<pad>", eos_token="</s>", bos_token="<s>", unk_token="<unk>")


@functools.cache
def _sft_trainer_class() -> type[Trainer]:
    """The cell's SFTTrainer, made where a `trl-*` cell runs: TRL is imported only there."""
    from trl import SFTTrainer

    return type("CellSFTTrainer", (CellLoop, SFTTrainer), {"__doc__": "SFTTrainer with the cell's loss and batches."})


class SFTRun(TrainerRun):
    """One SFTTrainer script over the stack of its `trainer-*` twin."""

    def __init__(self, ctx: RunContext, plugin: str, folder: Path, first_step: int = 0, saves: bool = False) -> None:
        from trl import SFTConfig

        if plugin not in TRL_PLUGINS:
            raise ValueError(f"hf adapter has no plugin {plugin!r}; valid: {', '.join(TRL_PLUGINS)}")
        os.environ.update(QUIET)
        self.arguments_class = SFTConfig
        self.passes_peft_config = plugin in PEFT_CONFIG_PLUGINS
        super().__init__(ctx, plugin, folder, first_step, saves, stack=TRL_PLUGINS[plugin])

    def arguments(self) -> dict[str, Any]:
        mode = self.ctx.cell.key.checkpoint
        checkpointing: dict[str, Any] = {"gradient_checkpointing": mode != "none"}
        if mode != "none":
            checkpointing["gradient_checkpointing_kwargs"] = {"use_reentrant": mode == "reentrant"}
        # bf16=False: SFTConfig's default computes in bf16 where the device has it; the cell is fp32
        return {**checkpointing, "bf16": False}

    def build_trainer(self, model: nn.Module, args: TrainingArguments) -> Trainer:
        from datasets import Dataset

        dataset = Dataset.from_dict({"input_ids": [[0, 1]] * DATASET_ROWS})
        kwargs: dict[str, Any] = {"args": args, "train_dataset": dataset, "processing_class": tokenizer(model),
                                  "callbacks": [self.callback], "cell_run": self}
        if not (self.passes_peft_config and _is_peft_model(model)):
            return _sft_trainer_class()(model=model, **kwargs)
        from peft import get_peft_model_state_dict, set_peft_model_state_dict

        adapter = model.active_adapter
        config, initial = model.peft_config[adapter], get_peft_model_state_dict(model, adapter_name=adapter)
        trainer = _sft_trainer_class()(model=model.unload(), peft_config=config, **kwargs)
        set_peft_model_state_dict(trainer.model, initial, adapter_name=adapter)
        self.bare = trainer.model  # the PeftModel SFTTrainer built: what the probes and the staged unfreeze see
        return trainer


def _is_peft_model(model: nn.Module) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)
