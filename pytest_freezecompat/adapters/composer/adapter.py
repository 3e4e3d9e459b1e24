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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from composer import Callback, ComposerModel, Trainer
from composer.algorithms import GradientClipping
from composer.core import State
from composer.core.engine import Engine
from composer.loggers import Logger
from composer.utils import collect_env
from composer.utils.parallelism import FSDPConfig
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from ... import models
from ..base import AdapterBase, Batch, RunContext, apply_freeze
from ..loop import StepProbes
from ..materialize import MetaInit
from ..views import CHECKPOINT_WRAPPER_INFIXES, DTensorView, FSDP1View, ParamView
from . import DEFAULT_OPTIMIZER_SUFFIX, UNSHIMMED_GLOO_AVG, compat


def warm_up() -> None:
    """Once per rank template: the Trainer's first init asks py-cpuinfo for the CPU model in a subprocess
    (~1.1 s here; Composer caches the answer for the process), which every fresh rank would pay again."""
    collect_env.get_cpu_model()


#: Plugin ids that run another's wrapping unchanged.
BASE_OF = {UNSHIMMED_GLOO_AVG: "fsdp2"}

#: Where every view reads: grads exist only inside fit(), which clears them when it ends.
READ_IN_CALLBACK = ", read in Callback.after_backward (fit() clears grads when it ends)"
#: The checkpoint axis value for Composer's own activation checkpointing (an FSDP config option).
FRAMEWORK_CHECKPOINT = "framework"
TAP_NOTE = "(Composer discards the value; a pass-through wrapper kept it)"


def _parallelism(plugin: str, framework_ac: bool) -> dict[str, Any] | None:
    """The `parallelism_config` a user passes for each plugin id; None means DDP (Composer's default)."""
    if plugin == "ddp":
        return None
    if plugin == "fsdp2":
        fsdp2_config = compat.fsdp2_config_class()
        if fsdp2_config is None:
            raise NotImplementedError(f"Composer {compat.composer_version()} has no FSDP2Config (FSDP2 from Composer "
                                      f"{compat.FSDP2_FROM}): a rule in composer.toml should exclude {plugin!r}")
        return {"fsdp": fsdp2_config(activation_checkpointing=framework_ac)}
    strategies = {"fsdp1": ("FULL_SHARD", False), "fsdp1-orig-params": ("FULL_SHARD", True),
                  "fsdp1-shard-grad-op": ("SHARD_GRAD_OP", True)}
    if plugin not in strategies:
        raise ValueError(f"composer adapter has no plugin {plugin!r}")
    sharding, orig_params = strategies[plugin]
    return {"fsdp": FSDPConfig(sharding_strategy=sharding, use_orig_params=orig_params,
                               activation_checkpointing=framework_ac)}


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
    """The probe's fixed points at the Trainer's events (one microbatch per batch)."""

    def __init__(self, probes: StepProbes, tap: _NormTap, clips: bool) -> None:
        self.probes = probes
        self.tap = tap
        self.clips = clips
        self.step = 0

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


def _trainer(ctx: RunContext, shell: _Shell, optimizer: torch.optim.Optimizer | None,
             parallelism: dict[str, Any] | None) -> Trainer:
    """A Trainer that writes, downloads and logs nothing: no loggers, progress bars, checkpoints or autoresume."""
    hyper = ctx.cell.hyper
    return Trainer(
        model=shell, train_dataloader=[ctx.local_batch(step) for step in range(hyper.steps)],
        max_duration=f"{hyper.steps}ba", device_train_microbatch_size=hyper.batch_per_rank,
        optimizers=optimizer, parallelism_config=parallelism,
        algorithms=[GradientClipping(clipping_type="norm", clipping_threshold=hyper.max_norm)] if hyper.clips else [],
        device="gpu" if ctx.device.type == "cuda" else "cpu", seed=hyper.seed,
        loggers=[], progress_bar=False, log_to_console=False, save_folder=None, autoresume=False,
    )


def _view(base: str, shell: _Shell, state: State) -> ParamView:
    """Reads `shell.model` (whatever Composer made of it) by the bare model's names."""
    view_class = {"ddp": ParamView, "fsdp2": DTensorView}.get(base, FSDP1View)
    view = view_class(shell.model, state.optimizers, CHECKPOINT_WRAPPER_INFIXES)
    view.grad_access += READ_IN_CALLBACK
    return view


class ComposerAdapter(AdapterBase):
    def run(self, ctx: RunContext) -> None:
        plugin = ctx.cell.key.plugin
        default_optimizer = plugin.endswith(DEFAULT_OPTIMIZER_SUFFIX)
        base = BASE_OF.get(plugin, plugin.removesuffix(DEFAULT_OPTIMIZER_SUFFIX))
        meta = ctx.cell.key.init == "meta"
        parallelism = _parallelism(base, framework_ac=ctx.cell.key.checkpoint == FRAMEWORK_CHECKPOINT)
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
        optimizer = None if default_optimizer else ctx.make_optimizer(
            [p for n, p in model.named_parameters() if n in plan.optimized])
        shell = _Shell(model, ctx.loss)
        tap = _NormTap()
        trainer = None
        try:
            ctx.probe.phase(f"Trainer init ({base})")
            # The shim spans fit() too: FSDP2 reduces grads during the backward.
            with ctx.emulation():
                trainer = _trainer(ctx, shell, optimizer, parallelism)
                probes = StepProbes(ctx.probe, _view(base, shell, trainer.state))
                if default_optimizer and ctx.rank == 0:
                    ctx.probe.note(f"optimizers=None: the Trainer built {type(trainer.state.optimizers[0]).__name__}")
                probes.wrapped()
                trainer.state.callbacks.append(_Probes(probes, tap, ctx.cell.hyper.clips))
                with tap.installed():
                    trainer.fit()
            trainer.close()
        finally:
            if trainer is not None:
                trainer.engine.close()  # idempotent and without trainer.close()'s barrier: a failed rank can't hang
            # Every Engine registers Engine._close with atexit, holding its State (model, optimizer): drop them.
            atexit.unregister(Engine._close)
