"""MosaicML Composer: the `Trainer` owns the loop, wrapping (DDP, FSDP1, FSDP2) and the optimizer.

What a Composer user writes: freeze the bare model, wrap it in a `ComposerModel`,
mark the blocks for FSDP (`fsdp_wrap_fn`) and activation checkpointing
(`activation_checkpointing_fn`), give a deferred-init model a `param_init_fn`,
pass an AdamW over the params they mean to train (or `optimizers=None` for the
Trainer's default), clip with the `GradientClipping` algorithm, and call `fit()`.
The probe runs in Composer callbacks because `fit()` drives the steps and clears
the grads when it ends. The question this row exists for (CASES C7) is what
`trainer.state.optimizers` holds after the Trainer has wrapped the model.
"""

from __future__ import annotations

import atexit
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from composer import Callback, ComposerModel, Trainer
from composer.algorithms import GradientClipping
from composer.core import State
from composer.core.engine import Engine
from composer.loggers import Logger
from composer.utils.parallelism import FSDP2Config, FSDPConfig
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.tensor import DTensor, distribute_tensor

from .. import models
from ..freeze import apply
from .base import Batch, RunContext, strip_wrapper_infixes
from .composer_emulation import cuda_on_cpu
from .views import flat_param_grads

#: Module names that Composer's wrappers (FSDP1, checkpoint_wrapper) insert into parameter names.
INFIXES = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module")
#: A plugin id with this suffix runs the base plugin with `optimizers=None` (the Trainer's default optimizer).
DEFAULT_OPTIMIZER_SUFFIX = "-default-optimizer"
#: The checkpoint axis value for Composer's own activation checkpointing (an FSDP config option).
FRAMEWORK_CHECKPOINT = "framework"
TAP_NOTE = "(Composer discards the value; a pass-through wrapper kept it)"


def _parallelism(plugin: str, framework_ac: bool) -> dict[str, Any] | None:
    """The `parallelism_config` a user passes for each plugin id; None means DDP (Composer's default)."""
    if plugin == "ddp":
        return None
    if plugin == "fsdp2":
        return {"fsdp": FSDP2Config(activation_checkpointing=framework_ac)}
    strategies = {"fsdp1": ("FULL_SHARD", False), "fsdp1-orig-params": ("FULL_SHARD", True),
                  "fsdp1-shard-grad-op": ("SHARD_GRAD_OP", True)}
    if plugin not in strategies:
        raise ValueError(f"composer adapter has no plugin {plugin!r}")
    sharding, orig_params = strategies[plugin]
    return {"fsdp": FSDPConfig(sharding_strategy=sharding, use_orig_params=orig_params,
                               activation_checkpointing=framework_ac)}


def original_names(name: str, param: nn.Parameter) -> list[str]:
    """The bare model's names one wrapped parameter stands for (an FSDP1 flat param stands for many)."""
    fqns = getattr(param, "_fqns", None)
    if fqns is None:
        return [strip_wrapper_infixes(name, INFIXES)]
    owner = name.rpartition("_flat_param")[0]
    return [strip_wrapper_infixes(owner + fqn, INFIXES) for fqn in fqns]


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


class _View:
    """Reads `shell.model` (whatever Composer made of it) by the bare model's names."""

    grad_access = "param.grad, read in Callback.after_backward (fit() clears grads when it ends)"

    def __init__(self, shell: _Shell, state: State) -> None:
        self.shell = shell
        self.state = state

    @property
    def module(self) -> nn.Module:
        return self.shell.model

    def named_parameters(self) -> dict[str, nn.Parameter]:
        return {strip_wrapper_infixes(n, INFIXES): p for n, p in self.module.named_parameters()}

    def requires_grad_flags(self) -> dict[str, bool]:
        return {n: p.requires_grad for n, p in self.named_parameters().items()}

    def tracked_names(self) -> set[str]:
        owners = {id(p): (n, p) for n, p in self.module.named_parameters()}
        tracked: set[str] = set()
        for optimizer in self.state.optimizers:
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if id(param) in owners:
                        tracked.update(original_names(*owners[id(param)]))
                    else:  # the optimizer holds a tensor the wrapped model does not: name it so the check shows it
                        tracked.add(f"<not a model param: {tuple(param.shape)}>")
        return tracked

    def full_params(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.named_parameters().items()}

    def full_grads(self) -> dict[str, torch.Tensor | None]:
        return {n: None if p.grad is None else p.grad.detach().clone() for n, p in self.named_parameters().items()}


class _DTensorView(_View):
    grad_access = "param.grad.full_tensor() (FSDP2 DTensor), read in Callback.after_backward"

    def full_params(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().full_tensor() for n, p in self.named_parameters().items()}

    def full_grads(self) -> dict[str, torch.Tensor | None]:
        # collective: the same order on every rank
        return {n: None if p.grad is None else p.grad.full_tensor() for n, p in self.named_parameters().items()}


class _FSDP1View(_View):
    grad_access = "FSDP.summon_full_params(shell.model, with_grads=True), read in Callback.after_backward"

    def __init__(self, shell: _Shell, state: State) -> None:
        super().__init__(shell, state)
        if not self.fsdp._use_orig_params:
            self.grad_access = ("flat_param.grad shards, all-gathered and split by flat_param._fqns, "
                                "read in Callback.after_backward")

    @property
    def fsdp(self) -> FSDP:
        return self.module  # type: ignore[return-value]  # Composer wraps each child of the shell

    def requires_grad_flags(self) -> dict[str, bool]:
        with FSDP.summon_full_params(self.fsdp, writeback=False):
            return super().requires_grad_flags()

    def full_params(self) -> dict[str, torch.Tensor]:
        with FSDP.summon_full_params(self.fsdp, writeback=False):
            return super().full_params()

    def full_grads(self) -> dict[str, torch.Tensor | None]:
        if self.fsdp._use_orig_params:
            with FSDP.summon_full_params(self.fsdp, writeback=False, with_grads=True):
                return super().full_grads()
        # summon_full_params(with_grads=True) refuses flat params: gather the shards ourselves.
        return flat_param_grads(self.module, INFIXES)


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
                value = norm.full_tensor() if isinstance(norm, DTensor) else norm
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
    """The probe's fixed points, at the Trainer's events (one microbatch per batch)."""

    def __init__(self, ctx: RunContext, view: _View, tap: _NormTap) -> None:
        self.ctx = ctx
        self.view = view
        self.tap = tap
        self.step = 0

    def before_forward(self, state: State, logger: Logger) -> None:
        self.ctx.probe.phase(f"step {self.step}: forward/backward")

    def after_backward(self, state: State, logger: Logger) -> None:
        self.ctx.probe.after_backward(self.step, self.view)
        self.ctx.probe.phase(f"step {self.step}: clip")

    def after_train_batch(self, state: State, logger: Logger) -> None:
        # Algorithms run before callbacks on an event: GradientClipping has clipped by now.
        norm, source = self.tap.take()
        self.ctx.probe.clipped(self.step, norm, source)
        self.ctx.probe.phase(f"step {self.step}: optimizer step")

    def batch_end(self, state: State, logger: Logger) -> None:
        self.ctx.probe.after_step(self.step, self.view)
        self.step += 1


def _param_init_fn(model: nn.Module, seed: int) -> Callable[[nn.Module], None]:
    """The `param_init_fn` a deferred-init user gives Composer: fill one module's own params.

    Composer calls it per module: FSDP1 before flattening (plain tensors), FSDP2 after
    sharding (DTensors, each rank fills its shard); values depend only on the param's name.
    """
    prefixes = {module: f"{name}." if name else "" for name, module in model.named_modules()}

    @torch.no_grad()
    def init(module: nn.Module) -> None:
        for name, param in module.named_parameters(recurse=False):
            full = models.deterministic_values(seed, prefixes[module] + name, param.shape).to(param.dtype)
            if isinstance(param, DTensor):
                local = distribute_tensor(full.to(param.device), param.device_mesh, param.placements,
                                          src_data_rank=None).to_local()
                param.to_local().copy_(local)
            else:
                param.copy_(full.to(param.device))

    return init


def _build(ctx: RunContext, device: str | torch.device) -> nn.Module:
    """The bare model; with Composer's own checkpointing (`framework`) the model's forward does none."""
    return ctx.build_model(device=device)


def _trainer(ctx: RunContext, shell: _Shell, optimizer: torch.optim.Optimizer | None,
             parallelism: dict[str, Any] | None) -> Trainer:
    """A Trainer that writes, downloads and logs nothing: no loggers, progress bars, checkpoints or autoresume."""
    hyper = ctx.cell.hyper
    return Trainer(
        model=shell, train_dataloader=[ctx.local_batch(step) for step in range(hyper.steps)],
        max_duration=f"{hyper.steps}ba", device_train_microbatch_size=hyper.batch_per_rank,
        optimizers=optimizer, parallelism_config=parallelism,
        algorithms=[GradientClipping(clipping_type="norm", clipping_threshold=hyper.max_norm)],
        device="gpu" if ctx.device.type == "cuda" else "cpu", seed=hyper.seed,
        loggers=[], progress_bar=False, log_to_console=False, save_folder=None, autoresume=False,
    )


def _view(base: str, shell: _Shell, state: State) -> _View:
    if base == "ddp":
        return _View(shell, state)
    if base == "fsdp2":
        return _DTensorView(shell, state)
    return _FSDP1View(shell, state)


class Adapter:
    def run(self, ctx: RunContext) -> None:
        plugin = ctx.cell.key.plugin
        default_optimizer = plugin.endswith(DEFAULT_OPTIMIZER_SUFFIX)
        base = plugin.removesuffix(DEFAULT_OPTIMIZER_SUFFIX)
        meta = ctx.cell.key.init == "meta"
        parallelism = _parallelism(base, framework_ac=ctx.cell.key.checkpoint == FRAMEWORK_CHECKPOINT)
        ctx.probe.phase("build model")
        model = _build(ctx, "meta" if meta else ctx.device)
        plan = ctx.resolve_plan(model)
        apply(plan, model)
        # Composer reads these hooks off the shell's child: wrap and checkpoint every block, as users do.
        blocks = set(models.block_modules(model))
        model.fsdp_wrap_fn = model.activation_checkpointing_fn = lambda module: module in blocks
        if meta:
            model.param_init_fn = _param_init_fn(model, ctx.cell.hyper.seed)
        ctx.probe.phase("build optimizer")
        optimizer = None if default_optimizer else ctx.make_optimizer(
            [p for n, p in model.named_parameters() if n in plan.optimized])
        shell = _Shell(model, ctx.loss)
        tap = _NormTap()
        trainer = None
        try:
            ctx.probe.phase(f"Trainer init ({base})")
            with cuda_on_cpu(ctx.probe.emulated) if ctx.cell.emulation else nullcontext():
                trainer = _trainer(ctx, shell, optimizer, parallelism)
            view = _view(base, shell, trainer.state)
            if default_optimizer and ctx.rank == 0:
                ctx.probe.note(f"optimizers=None: the Trainer built {type(trainer.state.optimizers[0]).__name__}")
            ctx.probe.wrapped(view)
            trainer.state.callbacks.append(_Probes(ctx, view, tap))
            with tap.installed():
                trainer.fit()
            trainer.close()
        finally:
            if trainer is not None:
                trainer.engine.close()  # idempotent and without trainer.close()'s barrier: a failed rank can't hang
            # Every Engine registers Engine._close with atexit, holding its State (model, optimizer): drop them.
            atexit.unregister(Engine._close)
