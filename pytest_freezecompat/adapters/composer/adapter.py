"""MosaicML Composer: the `Trainer` owns the loop, wrapping (DDP, FSDP1, FSDP2) and the optimizer.

What a Composer user writes: freeze the bare model, wrap it in a `ComposerModel`,
mark the blocks for FSDP (`fsdp_wrap_fn`) and activation checkpointing
(`activation_checkpointing_fn`), give a deferred-init model a `param_init_fn`,
pass an AdamW over the params they mean to train (or `optimizers=None` for the
Trainer's default), clip with the `GradientClipping` algorithm, and call `fit()`.
The probe runs in Composer callbacks because `fit()` drives the steps and clears
the grads when it ends; they make the same probe calls as `loop.train` (`loop.StepProbes`).
The question this row exists for is what `trainer.state.optimizers` holds after the
Trainer has wrapped the model: until 0.24, Composer's FSDP path re-created the optimizer
over every parameter, frozen ones included.
"""

from __future__ import annotations

import atexit
import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from composer import Callback, ComposerModel, Trainer
from composer.algorithms import GradientClipping
from composer.callbacks import CheckpointSaver
from composer.core import Event, State
from composer.core.engine import Engine
from composer.loggers import Logger
from composer.utils import collect_env
from composer.utils.parallelism import FSDPConfig
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.nn.parallel import DistributedDataParallel as DDP

from ... import models
from .. import loop
from ..base import AdapterBase, Batch, Probe, RunContext, apply_freeze, class_among, precision_of, strip_wrapper_infixes
from ..loop import SAVE_AFTER_STEP, Saved, StepProbes
from ..materialize import MetaInit
from ..saved_files import dcp_keys, full_contents, load_file, state_names
from ..views import CHECKPOINT_WRAPPER_INFIXES, DTensorView, FSDP1View, ParamView
from . import DEFAULT_OPTIMIZER_SUFFIX, UNSHIMMED_GLOO_AVG, compat


def warm_up() -> None:
    """Once per rank template: the Trainer's first init asks py-cpuinfo for the CPU model in a subprocess
    (~1.1 s here; Composer caches the answer for the process), which every fresh rank would pay again; its commit
    hash, which it reads at every Trainer init, is read here once (`compat.remember_commit_hash`)."""
    collect_env.get_cpu_model()
    compat.remember_commit_hash()
    collect_env.get_composer_commit_hash()


#: Plugin ids that run another's wrapping unchanged.
BASE_OF = {UNSHIMMED_GLOO_AVG: "fsdp2"}

#: Where every view reads: grads exist only inside fit(), which clears them when it ends.
READ_IN_CALLBACK = ", read in Callback.after_backward (fit() clears grads when it ends)"
#: The checkpoint axis value for Composer's own activation checkpointing (an FSDP config option).
FRAMEWORK_CHECKPOINT = "framework"
TAP_NOTE = "(Composer discards the value; a pass-through wrapper kept it)"


#: FSDP1 plugins whose checkpoints are sharded (`state_dict_type='sharded'`); the others keep FSDPConfig's
#: default, full. FSDP2 keeps FSDP2Config's default, sharded. Both formats run on every Composer release.
SHARDED_FSDP1 = frozenset({"fsdp1-shard-grad-op"})


def _sharded(plugin: str) -> bool:
    """Whether the plugin's checkpoints are sharded (DCP, a folder) rather than full (one file from rank 0)."""
    return plugin == "fsdp2" or plugin in SHARDED_FSDP1


def _parallelism(plugin: str, framework_ac: bool) -> dict[str, Any] | None:
    """The `parallelism_config` a user passes for each plugin id; None means DDP (Composer's default)."""
    sharded = _sharded(plugin)
    if plugin == "ddp":
        return None
    if plugin == "fsdp2":
        fsdp2_config = compat.fsdp2_config_class()
        if fsdp2_config is None:
            raise NotImplementedError(f"Composer {compat.composer_version()} has no FSDP2Config (FSDP2 from Composer "
                                      f"{compat.FSDP2_FROM}): a rule in composer.toml should exclude {plugin!r}")
        return {"fsdp": fsdp2_config(activation_checkpointing=framework_ac,
                                     state_dict_type="sharded" if sharded else "full")}
    strategies = {"fsdp1": ("FULL_SHARD", False), "fsdp1-orig-params": ("FULL_SHARD", True),
                  "fsdp1-shard-grad-op": ("SHARD_GRAD_OP", True)}
    if plugin not in strategies:
        raise ValueError(f"composer adapter has no plugin {plugin!r}")
    sharding, orig_params = strategies[plugin]
    return {"fsdp": FSDPConfig(sharding_strategy=sharding, use_orig_params=orig_params,
                               activation_checkpointing=framework_ac,
                               state_dict_type="sharded" if sharded else "full")}


class _Shell(ComposerModel):
    """The bare model as a ComposerModel; Composer wraps its child `model`, never the shell.

    The cell's loss takes the model and the batch, so the forward returns the loss and
    `loss()` hands it on (as Composer's Hugging Face models do with `outputs["loss"]`).
    """

    def __init__(self, model: nn.Module, loss: Callable[[nn.Module, Batch], torch.Tensor]) -> None:
        super().__init__()
        self.model = model
        self._loss = loss

    def forward(self, batch: Batch) -> torch.Tensor:
        return self._loss(self.model, batch)

    def loss(self, outputs: torch.Tensor, batch: Batch) -> torch.Tensor:
        return outputs


class _NormTap:
    """Keeps the total norm that the clipping call inside `GradientClipping` returns.

    Composer calls `FSDP.clip_grad_norm_` (FSDP1) or `torch.nn.utils.clip_grad_norm_`
    (DDP, FSDP2) and drops the result; the tap wraps both for the length of `fit()`,
    passes every call through unchanged and remembers the outermost call's value.
    """

    def __init__(self) -> None:
        self.norm: float | None = None
        self.source = "Composer's GradientClipping made no clipping call this step"
        self._depth = 0

    def take(self) -> tuple[float | None, str]:
        taken = self.norm, self.source
        self.norm, self.source = None, "Composer's GradientClipping made no clipping call this step"
        return taken

    def _wrap(self, fn: Callable[..., torch.Tensor], source: str) -> Callable[..., torch.Tensor]:
        def tapped(*args: Any, **kwargs: Any) -> torch.Tensor:
            self._depth += 1
            try:
                norm = fn(*args, **kwargs)
            finally:
                self._depth -= 1
            if self._depth == 0:
                value = norm.full_tensor() if compat.is_dtensor(norm) else norm
                self.norm, self.source = float(value), source
            return norm

        return tapped

    @contextmanager
    def installed(self) -> Iterator[None]:
        by_torch, by_fsdp = torch.nn.utils.clip_grad_norm_, FSDP.clip_grad_norm_
        torch.nn.utils.clip_grad_norm_ = self._wrap(
            by_torch, f"returned by torch.nn.utils.clip_grad_norm_ inside Composer's GradientClipping {TAP_NOTE}")
        FSDP.clip_grad_norm_ = self._wrap(  # type: ignore[method-assign]
            by_fsdp, f"returned by FSDP.clip_grad_norm_ inside Composer's GradientClipping {TAP_NOTE}")
        try:
            yield
        finally:
            torch.nn.utils.clip_grad_norm_ = by_torch
            FSDP.clip_grad_norm_ = by_fsdp  # type: ignore[method-assign]


class _Probes(Callback):
    """The probe's fixed points at the Trainer's events (one microbatch per batch), from step `first_step`.

    `save_after`: at that step's `Event.BATCH_CHECKPOINT`, the round trip's save (`loop.save`): it makes the
    call the Engine is about to make to Composer's `CheckpointSaver`, so that a save that raises is charged to
    the round trip (the Engine's own call then finds the batch saved and does nothing).
    """

    def __init__(self, probes: StepProbes, tap: _NormTap, clips: bool, first_step: int = 0,
                 save_after: Callable[[int], bool] | None = None) -> None:
        self.probes = probes
        self.tap = tap
        self.clips = clips
        self.step = first_step
        self.save_after = save_after
        self.saved: bool | None = None

    def before_forward(self, state: State, logger: Logger) -> None:
        self.probes.forward(self.step)

    def after_backward(self, state: State, logger: Logger) -> None:
        self.probes.backward_done(self.step)
        if self.clips:
            self.probes.clipping(self.step)

    def after_train_batch(self, state: State, logger: Logger) -> None:
        # Algorithms run before callbacks on an event: GradientClipping has clipped by now.
        if self.clips:
            self.probes.clipped(self.step, *self.tap.take())
        self.probes.optimizer_step(self.step)

    def batch_end(self, state: State, logger: Logger) -> None:
        self.probes.stepped(self.step)
        self.step += 1

    def batch_checkpoint(self, state: State, logger: Logger) -> None:
        if self.save_after is not None and self.step - 1 == SAVE_AFTER_STEP:
            self.saved = self.save_after(self.step - 1)


def _view(base: str, shell: _Shell, state: State) -> ParamView:
    """Reads `shell.model` (whatever Composer made of it) by the bare model's names."""
    view_class = {"ddp": ParamView, "fsdp2": DTensorView}.get(base, FSDP1View)
    view = view_class(shell.model, state.optimizers, CHECKPOINT_WRAPPER_INFIXES)
    view.grad_access += READ_IN_CALLBACK
    return view


#: Composer's default names, spelled out because the round trip loads what they name: a full checkpoint is
#: one file written by rank 0; a sharded one a folder (`FSDPConfig.sharded_ckpt_prefix_dir`) of DCP files.
#: The cell's precision as Composer's Trainer names it.
COMPOSER_PRECISION = {"fp32": "fp32", "bf16": "amp_bf16", "fp16": "amp_fp16"}
SAVE_FILENAME = "ep{epoch}-ba{batch}-rank{rank}.pt"
SHARDED_FOLDER = "ep{epoch}-ba{batch}"
#: The bare model is the shell's child `model`: every key of Composer's model state dict starts with it.
SHELL_PREFIX = "model."


def _saves_after(step: int) -> Callable[[State, Event], bool]:
    """A `save_interval` (Composer takes `(State, Event) -> bool`): the checkpoint after batch `step + 1` only,
    the round trip's save; a resuming Trainer finds nothing newer in the folder."""

    def interval(state: State, event: Event) -> bool:
        return event == Event.BATCH_CHECKPOINT and int(state.timestamp.batch) == step + 1

    return interval


def _bare(name: str) -> str:
    """A key of Composer's model or optimizer state dict -> the bare model's name."""
    return strip_wrapper_infixes(name.removeprefix(SHELL_PREFIX), CHECKPOINT_WRAPPER_INFIXES)


def _dcp_contents(directory: Path) -> Saved:
    """A sharded Composer checkpoint: DCP flattens `{'state': State.state_dict(), 'rng': ...}` into
    `state.model.<fqn>` and `state.optimizers.<optimizer class>.state.<fqn>.<moment>` (metadata only)."""
    model, optimizers = "state.model.", "state.optimizers."
    params, state = set(), []
    for key in dcp_keys(directory):
        if key.startswith(model):
            params.add(_bare(key[len(model):]))
        elif key.startswith(optimizers):
            _, _, rest = key[len(optimizers):].partition(".")  # the optimizer's class name, then its state dict
            if rest.startswith("state."):
                state.append(rest[len("state."):])
    return Saved(frozenset(params), state_names(state, _bare))


class _Run:
    """One Composer training script: the user's model, freeze, optimizer and `Trainer`, and the round trip.

    Saving is Composer's own checkpointing: `Trainer(save_folder=..., save_interval=...)` adds a
    `CheckpointSaver` that writes `State.state_dict()` at `Event.BATCH_CHECKPOINT`; resuming is a new Trainer
    with `load_path` (which loads in its `__init__`, after wrapping) and `fit()`, which goes on from the saved
    timestamp, spinning the dataloader past the batches already trained.
    """

    def __init__(self, ctx: RunContext, plugin: str, tap: _NormTap) -> None:
        self.ctx, self.tap = ctx, tap
        self.default_optimizer = plugin.endswith(DEFAULT_OPTIMIZER_SUFFIX)
        self.base = BASE_OF.get(plugin, plugin.removesuffix(DEFAULT_OPTIMIZER_SUFFIX))
        self.sharded = _sharded(self.base)
        self.parallelism = _parallelism(self.base, framework_ac=ctx.cell.key.checkpoint == FRAMEWORK_CHECKPOINT)
        self.save_api = (
            "Composer Trainer(save_folder, save_interval) -> CheckpointSaver: State.state_dict() "
            + ("dist_cp.save (FSDP state_dict_type='sharded'); " if self.sharded else
               "torch.save on rank 0 (full state dict); ")
            + "resume: Trainer(load_path=<checkpoint>) + fit()")
        meta = ctx.cell.key.init == "meta"
        ctx.probe.phase("build model")
        # With Composer's own checkpointing (`framework`), the bare model's forward does none.
        model = ctx.build_model(device="meta" if meta else ctx.device)
        plan = ctx.resolve_plan(model)
        apply_freeze(plan, model)
        # Composer reads these hooks off the shell's child: wrap and checkpoint every block, as users do.
        blocks = set(models.block_modules(model))
        model.fsdp_wrap_fn = model.activation_checkpointing_fn = lambda module: module in blocks
        if meta:
            # Composer calls it per module after to_empty: FSDP1 before flattening (plain tensors), FSDP2 after
            # sharding (DTensors, each rank fills its shard).
            model.param_init_fn = MetaInit(model, ctx.cell.hyper.seed, ctx.eager_buffers())
        ctx.probe.phase("build optimizer")
        self.optimizer = None if self.default_optimizer else ctx.make_optimizer(
            [p for n, p in model.named_parameters() if n in plan.optimized])
        self.shell = _Shell(model, ctx.loss)
        self.trainer: Trainer | None = None
        self._view: ParamView | None = None

    def start(self, save_folder: Path | None = None, load_path: Path | None = None,
              ignore_keys: list[str] | None = None) -> Trainer:
        """The Trainer (no loggers, progress bars or autoresume); it wraps the model, and loads `load_path`."""
        hyper = self.ctx.cell.hyper
        self.trainer = Trainer(
            model=self.shell, train_dataloader=[self.ctx.local_batch(step) for step in range(hyper.steps)],
            max_duration=f"{hyper.steps}ba", device_train_microbatch_size=hyper.batch_per_rank,
            optimizers=self.optimizer, parallelism_config=self.parallelism,
            algorithms=[GradientClipping(clipping_type="norm", clipping_threshold=hyper.max_norm)]
            if hyper.clips else [],
            device="gpu" if self.ctx.device.type == "cuda" else "cpu", seed=hyper.seed,
            # Said, not left to the default: on a GPU, Trainer picks AMP fp16 where it is given none.
            precision=COMPOSER_PRECISION[self.ctx.cell.precision],
            loggers=[], progress_bar=False, log_to_console=False, autoresume=False,
            save_folder=None if save_folder is None else str(save_folder), save_filename=SAVE_FILENAME,
            save_interval=_saves_after(SAVE_AFTER_STEP),
            load_path=None if load_path is None else str(load_path), load_progress_bar=False,
            load_ignore_keys=ignore_keys, load_strict_model_weights=not ignore_keys,
        )
        self._view = _view(self.base, self.shell, self.trainer.state)
        _observe(self.ctx.probe, self.trainer.state)
        return self.trainer

    @property
    def view(self) -> ParamView:
        assert self._view is not None, "the Trainer is not built yet"
        return self._view

    def fit(self, callback: _Probes) -> None:
        assert self.trainer is not None
        # First: at BATCH_CHECKPOINT it must run before the CheckpointSaver (see `_Probes`).
        self.trainer.state.callbacks.insert(0, callback)
        with self.tap.installed():
            self.trainer.fit()

    def checkpoint(self, directory: Path) -> Path:
        """What `save` wrote after step SAVE_AFTER_STEP, as `load_path` names it (epoch 0: one epoch of batches)."""
        names = {"epoch": 0, "batch": SAVE_AFTER_STEP + 1}
        return directory / (SHARDED_FOLDER.format(**names) if self.sharded else SAVE_FILENAME.format(rank=0, **names))

    # Resumable

    def save(self, directory: Path) -> None:
        assert self.trainer is not None
        (saver,) = [c for c in self.trainer.state.callbacks if isinstance(c, CheckpointSaver)]
        saver.batch_checkpoint(self.trainer.state, self.trainer.logger)
        if not self.checkpoint(directory).exists():
            raise FileNotFoundError(f"Composer's CheckpointSaver wrote no {self.checkpoint(directory)}")

    def saved(self, directory: Path) -> Saved:
        path = self.checkpoint(directory)
        if self.sharded:
            return _dcp_contents(path)
        state = load_file(path)["state"]
        (optimizer,) = state["optimizers"].values()  # keyed by the optimizer's class name
        return full_contents(state["model"], optimizer["state"], {}, rename=_bare)

    def close(self) -> None:
        if self.trainer is not None:
            self.trainer.close()  # a collective (a barrier): every rank calls it

    def load(self, directory: Path, omit: str | None = None) -> None:
        # Composer's documented way to leave keys out of a load; it loads non-strict then.
        self.start(load_path=self.checkpoint(directory),
                   ignore_keys=None if omit is None else [f"state/model/{SHELL_PREFIX}{omit}"])


#: Composer's AMP precisions (`Precision` values, the same on every release) -> the dtype autocast computes in.
AUTOCAST = {"amp_fp16": "fp16", "amp_bf16": "bf16", "amp_fp8": "fp8"}


def _observe(probe: Probe, state: State) -> None:
    """The stack the Trainer built, read back from its State once `__init__` has wrapped the model, built or
    re-created the optimizer and loaded any checkpoint (`promises` in the package's declaration).

    The wrapper is the outermost DDP / FSDP1 / FSDP2 module in `state.model` (DDP wraps the ComposerModel, FSDP its
    child); precision is the dtype autocast computes in under an AMP `state.precision`, else the params' own (under
    `fp32`, Composer's FSDP mixed precision 'DEFAULT' keeps fp32 params); the optimizer is what the Trainer steps;
    Composer's own activation checkpointing shows as its `CheckpointWrapper`s.
    """
    wrappers = (DDP, FSDP, *compat.fsdp2_module_classes())
    outer = next((module for module in state.model.modules() if isinstance(module, wrappers)), state.model)
    probe.observed("wrapper", class_among(outer, wrappers))
    probe.observed("precision", AUTOCAST.get(state.precision.value) or precision_of(state.model))
    probe.observed("optimizer", "+".join(type(optimizer).__name__ for optimizer in state.optimizers))
    probe.observed("framework_activation_checkpointing",
                   any(isinstance(module, CheckpointWrapper) for module in state.model.modules()))
    if isinstance(outer, DDP):
        probe.observed("find_unused_parameters", outer.find_unused_parameters)
    if isinstance(outer, FSDP):
        probe.observed("use_orig_params", outer._use_orig_params)
        probe.observed("sharding_strategy", outer.sharding_strategy.name)
    if state.fsdp_enabled:  # the format Composer's CheckpointSaver writes: 'full' (rank 0's file) or 'sharded' (DCP)
        probe.observed("state_dict_type", state.fsdp_state_dict_type)


def _release(run: _Run | None) -> None:
    if run is not None and run.trainer is not None:
        run.trainer.engine.close()  # idempotent and without trainer.close()'s barrier: a failed rank can't hang


class ComposerAdapter(AdapterBase):
    def run(self, ctx: RunContext) -> None:
        tap = _NormTap()
        first: _Run | None = None
        fresh: _Run | None = None
        try:
            # The shim spans fit() too: FSDP2 reduces grads during the backward.
            with ctx.emulation(), loop.shared_folder(ctx) as folder:
                first = _Run(ctx, ctx.cell.key.plugin, tap)
                ctx.probe.phase(f"Trainer init ({first.base})")
                resumes = loop.runs_round_trip(ctx)
                # The Trainer saves on its own once given a folder: a cell that cites its group's round trip has none.
                trainer = first.start(save_folder=folder if resumes else None)
                if first.default_optimizer and ctx.rank == 0:
                    ctx.probe.note(f"optimizers=None: the Trainer built {type(trainer.state.optimizers[0]).__name__}")
                probes = StepProbes(ctx.probe, first.view)
                probes.wrapped()
                saves = _Probes(probes, tap, ctx.cell.hyper.clips, save_after=functools.partial(
                    loop.save, ctx, first, folder) if resumes else None)
                first.fit(saves)
                if not saves.saved:
                    first.close()
                    return
                ctx.probe.resuming("tear down")
                first.close()
                _release(first)
                ctx.probe.phase("resume: rebuild")
                fresh = _Run(ctx, ctx.cell.key.plugin, tap)
                loop.load(ctx, fresh, folder)
                fresh.fit(_Probes(StepProbes(ctx.probe, fresh.view), tap, ctx.cell.hyper.clips,
                                  first_step=SAVE_AFTER_STEP + 1))
                fresh.close()
        finally:
            _release(first)
            _release(fresh)
            # Every Engine registers Engine._close with atexit, holding its State (model, optimizer): drop them.
            atexit.unregister(Engine._close)
