"""The `trainer-*` driver: the Transformers `Trainer` owns the loop, the wrapping, the optimizer and the checkpoints.

What a Trainer user writes: build and freeze the model, `Trainer(model, args=TrainingArguments(...),
train_dataset=...)`, `trainer.train()`; to resume, a fresh script with the same model and
`trainer.train(resume_from_checkpoint=<output_dir>/checkpoint-N)`. The Trainer builds its optimizer itself
(`create_optimizer`: AdamW over the params that require grad when `train()` starts) and clips with its default
`max_grad_norm=1.0` through `accelerator.clip_grad_norm_`. The cell's hyperparameters go in through
`TrainingArguments` (lr, betas, eps, weight decay, a constant schedule); the one change to the Trainer's defaults is
its weight-decay split (`get_decay_parameter_names`: every param, not all but biases and norms), so that its
AdamW is the reference's and the update check compares like with like.

The probes run where `train()` lets them: the loss and the step boundary in a `Trainer` subclass
(`compute_loss`, `training_step`: grads are read right after the backward, before the Trainer clips), the rest in a
`TrainerCallback` (`on_train_begin`: the wrapped model; `on_pre_optimizer_step`: the norm the Trainer's clipping
call returned; `on_optimizer_step`: the stepped params), the same calls as `loop.train` (`loop.StepProbes`).
The round trip saves through the Trainer's own checkpointing (the callback asks for the save after step
`SAVE_AFTER_STEP`; `on_save` records what it wrote) and resumes in a fresh Trainer, which loads inside `train()`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from transformers import PrinterCallback, Trainer, TrainerCallback, TrainingArguments

from ... import models
from .. import loop
from ..base import Batch, RunContext
from ..loop import SAVE_AFTER_STEP, Saved, StepProbes
from ..saved_files import index_names
from ..views import DTensorView, FSDP1View, ParamView, settle_groups
from . import ZERO_PLUGINS, staged, state
from .accelerate_loop import saved_contents, user_model

#: plugin -> (the FSDP version or None for DDP, the wrapper `state.wrapper_kind` must see). DDP runs with
#: `use_cpu=True` on CPU; FSDP through `TrainingArguments(fsdp=..., fsdp_config=...)`, behind the shim on CPU.
TRAINER_PLUGINS: dict[str, tuple[int | None, str]] = {"trainer-ddp": (None, "ddp"), "trainer-fsdp2": (2, "fsdp2"),
                                                      "trainer-fsdp2-full-state-dict": (2, "fsdp2"),
                                                      "trainer-fsdp1": (1, "fsdp1-orig-params")}
#: DeepSpeed through `TrainingArguments(deepspeed=config)`, behind the shim on CPU (see `zero`).
TRAINER_PLUGINS.update({plugin: (None, "deepspeed") for plugin in ZERO_PLUGINS if plugin.startswith("trainer-")})
#: plugin -> the FSDP state dict type its checkpoints take, named: the default moved (transformers 5.x's fsdp_config
#: defaults to FULL_STATE_DICT; 4.57.1 leaves it to the plugin, whose FSDP2 default is SHARDED_STATE_DICT), so a
#: plugin that left it out would save one way on one release and the other way on the other.
STATE_DICT_TYPES = {"trainer-fsdp2": "SHARDED_STATE_DICT", "trainer-fsdp2-full-state-dict": "FULL_STATE_DICT",
                    # FSDP1's default on both releases; on CPU behind the shim's two labelled FSDP1 offload patches
                    "trainer-fsdp1": "FULL_STATE_DICT"}
#: What a user passes for FSDP: every block in a unit of its own, the rest the Trainer's defaults.
FSDP_ARGS = "full_shard auto_wrap"
#: A model with no block class to wrap (a user's model) is one FSDP unit: no auto wrap.
FSDP_ONE_UNIT = "full_shard"
#: The adapter file `PeftModel.save_pretrained` writes (the Trainer's save of a peft model under DDP).
ADAPTER_FILES = "adapter_model*.safetensors"
#: The Trainer's checkpoint folder name (`PREFIX_CHECKPOINT_DIR`-`global_step`), spelled out: the resume loads it.
CHECKPOINT_FOLDER = "checkpoint-{step}"
SAVE_API = ("Trainer checkpointing (TrainingArguments(output_dir), a save after the step): model, optimizer.pt, "
            "scheduler.pt, trainer_state.json; resume: a fresh Trainer's train(resume_from_checkpoint=checkpoint-N)")


class _NormTap:
    """Keeps what `accelerator.clip_grad_norm_` returned: the Trainer logs it and drops it from the step."""

    def __init__(self) -> None:
        self.norm: float | None = None

    def install(self, accelerator: Any) -> None:
        clip = accelerator.clip_grad_norm_

        def tapped(*args: Any, **kwargs: Any) -> torch.Tensor:
            norm = clip(*args, **kwargs)
            value = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
            self.norm = None if value is None else float(value)
            return norm

        accelerator.clip_grad_norm_ = tapped

    def take(self) -> tuple[float | None, str]:
        taken, self.norm = self.norm, None
        if taken is None:
            return None, "the Trainer made no accelerator.clip_grad_norm_ call this step"
        return taken, "returned by accelerator.clip_grad_norm_ inside Trainer.train (max_grad_norm)"


def _safetensors_keys(path: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as opened:
        return list(opened.keys())


def _the_one_item(items: list[Batch]) -> Batch:
    (batch,) = items
    return batch


class CellLoop:
    """What the cell changes in any Trainer (a mixin before the Trainer class: transformers' own, TRL's): the cell's
    loss and batches, its grads read after each backward, its AdamW's decay on every param."""

    cell_run: TrainerRun

    def __init__(self, *args: Any, cell_run: TrainerRun, **kwargs: Any) -> None:
        self.cell_run = cell_run
        super().__init__(*args, **kwargs)

    def get_train_dataloader(self) -> torch.utils.data.DataLoader:
        # This rank's rows of each step's global batch, in step order (as the reference splits them).
        batches = [self.cell_run.ctx.local_batch(step) for step in range(self.cell_run.ctx.cell.hyper.steps)]
        # One step's batch an item (batch_size=1 unwrapped): a batch sampler, which the resume's skip of the
        # batches already trained (accelerate's skip_first_batches) needs.
        return torch.utils.data.DataLoader(batches, batch_size=1, shuffle=False, collate_fn=_the_one_item)

    def compute_loss(self, model: nn.Module, inputs: Batch, return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        loss = self.cell_run.ctx.loss(model, inputs)
        return (loss, None) if return_outputs else loss

    def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        loss = super().training_step(*args, **kwargs)
        self.cell_run.callback.backward_done()
        return loss

    def get_decay_parameter_names(self, model: nn.Module) -> list[str]:
        """Every param decays, as in the reference's AdamW (the Trainer's default spares biases and norms)."""
        return [name for name, _ in model.named_parameters()]


class _CellTrainer(CellLoop, Trainer):
    """The Transformers Trainer with the cell's loss and batches."""


class _Probes(TrainerCallback):
    """The probe's fixed points at the Trainer's events, from step `first_step`; the round trip's save request."""

    def __init__(self, run: TrainerRun, first_step: int, saves: bool) -> None:
        self.run, self.step, self.saves = run, first_step, saves
        self.probes: StepProbes | None = None
        self.saved: bool | None = None

    def on_train_begin(self, args: Any, state_: Any, control: Any, **kwargs: Any) -> None:
        staged.release(self.run.bare, self.run.late)  # train() has built its optimizer by this event
        self.probes = StepProbes(self.run.ctx.probe, self.run.wrapped())
        if self.step == 0:
            self.probes.wrapped()
        else:  # the resumed Trainer loaded inside train(), before this event: what `loop.load` records
            self.run.ctx.probe.loaded(self.probes.view)

    def on_step_begin(self, args: Any, state_: Any, control: Any, **kwargs: Any) -> None:
        assert self.probes is not None
        self.probes.forward(self.step)

    def backward_done(self) -> None:
        assert self.probes is not None
        self.probes.backward_done(self.step)
        if self.run.clips:
            self.probes.clipping(self.step)

    def on_pre_optimizer_step(self, args: Any, state_: Any, control: Any, **kwargs: Any) -> None:
        assert self.probes is not None
        if self.run.clips:
            self.probes.clipped(self.step, *self.run.tap.take())
        self.probes.optimizer_step(self.step)

    def on_optimizer_step(self, args: Any, state_: Any, control: Any, **kwargs: Any) -> None:
        assert self.probes is not None
        self.probes.stepped(self.step)
        self.step += 1

    def on_step_end(self, args: Any, state_: Any, control: Any, **kwargs: Any) -> Any:
        if self.saves and self.step - 1 == SAVE_AFTER_STEP:
            control.should_save = True  # the Trainer saves after this event (`_maybe_log_save_evaluate`)
            # what raises from here on is the Trainer's save (the stack's), not our last read of the params
            self.run.ctx.probe.phase(f"{loop.SAVE_PHASE} (Trainer._save_checkpoint)")
        return control

    def on_save(self, args: Any, state_: Any, control: Any, **kwargs: Any) -> None:
        if self.saves and self.saved is None:
            self.saved = loop.save(self.run.ctx, self.run, self.run.folder, SAVE_AFTER_STEP)


class TrainerRun:
    """One Trainer script: the user's model, built and frozen, and a `Trainer` over it: a `loop.Resumable`."""

    save_api = SAVE_API
    #: The arguments class the user fills in (TRL's subclasses it).
    arguments_class: type[TrainingArguments] = TrainingArguments

    def __init__(self, ctx: RunContext, plugin: str, folder: Path, first_step: int = 0, saves: bool = False,
                 stack: str | None = None) -> None:
        """`stack`: the `trainer-*` plugin whose wrapping this run asks for, where `plugin` names another trainer
        over the same stack (TRL's)."""
        self.ctx, self.plugin, self.folder = ctx, plugin, folder
        self.stack = stack = stack or plugin
        self.clips = ctx.cell.hyper.clips
        self.tap = _NormTap()
        # a fresh process (TrainingArguments writes ACCELERATE_* too), the model built and frozen, a late unfreeze held
        model, self.plan, self.late = user_model(ctx)
        self.bare = model
        ctx.probe.phase(f"wrap (Trainer, {plugin})")
        hyper = ctx.cell.hyper
        self.version, self.wrapper = TRAINER_PLUGINS[stack]
        fsdp: dict[str, Any] = {}
        if self.version is not None:
            blocks = sorted({type(m).__name__ for m in models.block_modules(model)})
            # sync_module_states=False: every rank builds the same seeded model, so rank 0's broadcast has nothing
            # to fix; its default (True) makes accelerate 1.10.1's plugin ask for an accelerator device to
            # materialize on (none on CPU), where 1.15.0 takes the CPU.
            fsdp = {"fsdp": FSDP_ARGS if blocks else FSDP_ONE_UNIT, "fsdp_config": {
                "version": self.version, "sync_module_states": False,
                "state_dict_type": STATE_DICT_TYPES[stack],
                **({"transformer_layer_cls_to_wrap": blocks} if blocks else {})}}
        if self.version is not None:
            # What `accelerate launch` with `fsdp_version: 2` and `fsdp_state_dict_type` exports: transformers
            # 4.57.1's fsdp_config has neither key (5.x's set the plugin's arguments); cleared with the cell's other
            # FSDP_* variables.
            os.environ["FSDP_VERSION"] = str(self.version)
            os.environ["FSDP_STATE_DICT_TYPE"] = STATE_DICT_TYPES[stack]
        if self.wrapper == "deepspeed":
            from . import zero  # only where DeepSpeed is installed (the template has it)

            fsdp = {"deepspeed": zero.config(ctx, stack)}
        args = self.arguments_class(**self.arguments(),
            output_dir=str(folder), use_cpu=ctx.device.type == "cpu" and self.wrapper == "ddp", **fsdp,
            per_device_train_batch_size=hyper.batch_per_rank,
            max_steps=hyper.steps, learning_rate=hyper.lr, adam_beta1=hyper.betas[0], adam_beta2=hyper.betas[1],
            adam_epsilon=hyper.eps, weight_decay=hyper.weight_decay, optim="adamw_torch",
            lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=hyper.max_norm, seed=hyper.seed,
            save_strategy="no", logging_strategy="no", report_to="none", disable_tqdm=True,
            dataloader_num_workers=0, remove_unused_columns=False)
        if self.wrapper == "deepspeed":
            zero.keep_trainer_groups(ctx, args)
        self.callback = _Probes(self, first_step, saves)
        self.trainer = self.build_trainer(model, args)
        self.trainer.remove_callback(PrinterCallback)  # disable_tqdm's stand-in prints every log to stdout
        self.tap.install(self.trainer.accelerator)
        self._view: ParamView | None = None

    def arguments(self) -> dict[str, Any]:
        """Arguments a user of this trainer sets beyond the cell's hyperparameters."""
        return {}

    def build_trainer(self, model: nn.Module, args: TrainingArguments) -> Trainer:
        return _CellTrainer(model=model, args=args, callbacks=[self.callback], cell_run=self)

    def wrapped(self) -> ParamView:
        """The view of what `train()` wrapped, once the stack is reported (`state.observe`) and checked
        (`state.check`)."""
        trainer = self.trainer
        want_type = "FSDP" if self.version else "MULTI_CPU" if self.ctx.device.type == "cpu" else "MULTI_GPU"
        if self.wrapper == "deepspeed":
            from . import zero

            want_type = zero.DISTRIBUTED_TYPE
        state.observe(self.ctx.probe, trainer.accelerator, trainer.model_wrapped, trainer)
        state.check(self.plugin, want_type, self.wrapper, trainer.accelerator, trainer.model_wrapped,
                    self.ctx.world_size)
        inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
        if self.wrapper == "deepspeed":
            self._view = zero.ZeroView(trainer.model_wrapped, self.stack)
        elif self.wrapper == "fsdp2":
            self._view = DTensorView(trainer.model_wrapped, inner)
        elif self.version == 1:
            self._view = FSDP1View(trainer.model_wrapped, inner)
        else:
            self._view = ParamView(trainer.model_wrapped.module, inner)
        self._view.grad_access += ", read in Trainer.training_step (train() zeroes grads after each step)"
        return self._view

    @property
    def view(self) -> ParamView:
        assert self._view is not None, "train() has not wrapped the model yet"
        return self._view

    def checkpoint(self) -> Path:
        return self.folder / CHECKPOINT_FOLDER.format(step=SAVE_AFTER_STEP + 1)

    # Resumable

    def save(self, directory: Path) -> None:
        dist.barrier()  # rank 0 writes the shared files: every rank reads them after it
        if not self.checkpoint().is_dir():
            raise FileNotFoundError(f"the Trainer wrote no {self.checkpoint()}")

    def saved(self, directory: Path) -> Saved:
        """What the checkpoint holds, by the bare model's names. A peft model's checkpoint is its adapter alone
        (`adapter_model.safetensors` under DDP; `adapter_only=True` in FSDP's model file): keyed as peft keys
        them, without the adapter's name, and frozen params are missing from it by design (`trainable_only`)."""
        inner = getattr(self.trainer.optimizer, "optimizer", self.trainer.optimizer)
        named = self.view.named_parameters()
        contents = saved_contents(self.checkpoint(), index_names(named, inner))
        peft = getattr(self.trainer.model, "peft_config", None)
        if self.wrapper == "deepspeed":
            from . import zero

            contents = zero.trainer_saved(self.checkpoint(), contents, self.view,
                                          getattr(self.trainer.model, "active_adapter", "default") if peft else None)
        if not peft:
            return contents
        adapter = getattr(self.trainer.model, "active_adapter", "default")
        by_peft_key = {name.replace(f".{adapter}.", "."): name for name in named}
        saved = set(contents.params or ()) | {key for path in self.checkpoint().glob(ADAPTER_FILES)
                                               for key in _safetensors_keys(path)}
        return Saved(frozenset(by_peft_key.get(key, key) for key in saved), contents.optimizer_state,
                     trainable_only=True)

    def close(self) -> None:
        settle_groups()
        dist.barrier()
        if self.wrapper == "deepspeed":  # the rank stays warm: the engine's hooks and registries go now
            from . import zero

            zero.destroy(self.trainer.model_wrapped)
        self.trainer.accelerator.free_memory()
        self.trainer = None  # type: ignore[assignment]

    def load(self, directory: Path, omit: str | None = None) -> None:
        raise NotImplementedError("the Trainer loads inside train(resume_from_checkpoint=...): see `run`")


def run(ctx: RunContext, plugin: str, emulation: Callable[[], Any],
        run_class: Callable[..., TrainerRun] = TrainerRun) -> None:
    """Train, save after step `SAVE_AFTER_STEP` where the cell runs the round trip, and resume in a fresh Trainer
    (`run_class`: a `TrainerRun`, or another trainer's). The Trainer saves inside `train()`: a save that raises ends
    the cell (an error), not only its round trip."""
    if ctx.cell.break_load is not None:
        raise NotImplementedError("break_load (tests only) is not implemented for the Trainer's own load")
    resumes = loop.runs_round_trip(ctx)
    with emulation(), loop.shared_folder(ctx) as folder:
        first = run_class(ctx, plugin, folder, saves=resumes)
        first.trainer.train()
        if not first.callback.saved:
            first.close()
            return
        ctx.probe.resuming("tear down")
        checkpoint = first.checkpoint()
        first.close()
        ctx.probe.phase("resume: rebuild")
        fresh = run_class(ctx, plugin, folder, first_step=SAVE_AFTER_STEP + 1)
        ctx.probe.phase("resume: load")
        fresh.trainer.train(resume_from_checkpoint=str(checkpoint))
        fresh.close()
