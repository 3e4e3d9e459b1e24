"""PyTorch Lightning: the Trainer (it owns the loop) and Fabric (the user owns it), each with its DDP, FSDP or
DeepSpeed strategy (DeepSpeed's parts in `zero.py`, imported only for its cells).

What a Lightning user writes: freeze the bare model, hold it in a `LightningModule` whose `training_step` returns the
loss and whose `configure_optimizers` builds AdamW over the params that require grad, clip with
`gradient_clip_val`, checkpoint as `ModelCheckpoint` does (`trainer.save_checkpoint`) and resume with
`fit(ckpt_path=...)`; or, with Fabric, `fabric.setup(model, optimizer)`, `fabric.backward`,
`fabric.clip_gradients`, `fabric.save` / `fabric.load`. The ranks' process group exists already (the harness made
it, as torchrun would): Lightning finds it and joins it, and the environment's RANK / LOCAL_RANK / WORLD_SIZE tell
it that the processes were launched outside it. Each Trainer epoch is one step (`limit_train_batches=1`), so that a
callback unfreezing at an epoch (`finetuning.py`) unfreezes at a step.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric import Fabric
from lightning.fabric.strategies import DDPStrategy as FabricDDP
from lightning.fabric.strategies import FSDPStrategy as FabricFSDP
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.nn.parallel import DistributedDataParallel as DDP

from ... import models
from .. import loop
from ..base import (
    AdapterBase,
    ModelView,
    Probe,
    RunContext,
    apply_freeze,
    class_among,
    precision_of,
    strip_wrapper_infixes,
)
from ..loop import SAVE_AFTER_STEP, Saved, StepProbes
from ..saved_files import dcp_contents, full_contents, index_names, load_file
from ..views import FSDP1_INFIXES, FSDP1View, ParamView, optimizer_params
from .finetuning import UnfreezeAtFirstEpoch, unfrozen_modules

#: The cell's precision as Lightning names it.
LIGHTNING_PRECISION = {"fp32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"}
#: The one file each round trip writes.
CHECKPOINT_FILE = "checkpoint.ckpt"
#: The LightningModule holds the bare model as its child `model`: every key of its state dict starts with it.
MODULE_PREFIX = "model."
TAP_NOTE = "(Lightning discards the value; a pass-through wrapper kept it)"


def _accelerator(ctx: RunContext) -> str:
    return "gpu" if ctx.device.type == "cuda" else "cpu"


def _finds_unused(ctx: RunContext) -> bool:
    return ctx.cell.key.plugin.endswith("-find-unused")


def _fsdp_names_by_id(wrapped: nn.Module) -> dict[int, str]:
    """The Trainer's full FSDP checkpoint keys optimizer state by param id (`FSDP.rekey_optim_state_dict(...,
    PARAM_ID, model)`): the position among the wrapped model's params -> the bare name."""
    return {i: strip_wrapper_infixes(name, FSDP1_INFIXES).removeprefix(MODULE_PREFIX)
            for i, (name, _) in enumerate(wrapped.named_parameters())}


def _without_omitted(ctx: RunContext, path: Path, key: str, omit: str | None) -> Path:
    """The checkpoint at `path`, or (tests only: `omit`) a copy beside it without that param under `key`, as a load
    that misses it would leave it (rank 0 writes it; a collective)."""
    if omit is None:
        return path
    if path.is_dir():
        raise NotImplementedError("omit (tests only) is proven on DeepSpeed's folders by the deepspeed adapter's tests")
    broken = path.with_name(f"omitted-{path.name}")
    if ctx.rank == 0:
        state = load_file(path)
        state[key] = {k: v for k, v in state[key].items() if k.removeprefix(MODULE_PREFIX) != omit}
        torch.save(state, broken)
    dist.barrier()
    return broken


def _observe(probe: Probe, driver: str, strategy: object, wrapped: nn.Module,
             wrappers: tuple[type, ...] = (DDP, FSDP)) -> None:
    """The stack as it runs, read back from the strategy and the module it wrapped (`promises`)."""
    probe.observed("driver", driver)
    probe.observed("strategy", type(strategy).__name__)
    probe.observed("wrapper", class_among(wrapped, wrappers))
    if isinstance(wrapped, DDP):
        probe.observed("find_unused_parameters", wrapped.find_unused_parameters)
    if isinstance(wrapped, FSDP):
        probe.observed("use_orig_params", wrapped._use_orig_params)
    probe.observed("precision", precision_of(wrapped))


# Fabric: the user's own loop, `loop.train` drives it.

def _deepspeed(ctx: RunContext) -> bool:
    return "-deepspeed" in ctx.cell.key.plugin


def _fabric_strategy(ctx: RunContext, model: nn.Module) -> Any:
    """The strategy a Fabric user passes for the plugin: DDP, FSDP wrapping every block (Fabric's defaults:
    use_orig_params=True, sharded checkpoints), or DeepSpeed (`zero.fabric_strategy`)."""
    if _deepspeed(ctx):
        from . import zero

        return zero.fabric_strategy(ctx)
    if ctx.cell.key.plugin == "fabric-fsdp":
        return FabricFSDP(auto_wrap_policy={type(block) for block in models.block_modules(model)},
                          process_group_backend=dist.get_backend())
    return FabricDDP(process_group_backend=dist.get_backend(), find_unused_parameters=_finds_unused(ctx))


class _FabricLoop:
    clips_in_step = False

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx
        ctx.probe.phase("build model")
        self.bare = ctx.build_model(device=ctx.device)
        plan = ctx.resolve_plan(self.bare)
        apply_freeze(plan, self.bare)
        self.fabric = Fabric(accelerator=_accelerator(ctx), devices=ctx.world_size, num_nodes=1,
                             strategy=_fabric_strategy(ctx, self.bare),
                             precision=LIGHTNING_PRECISION[ctx.cell.precision])
        ctx.probe.phase(f"wrap (fabric.setup, {ctx.cell.key.plugin})")
        self.fabric.launch()  # launched outside it: joins the ranks' process group
        self.sharded = isinstance(self.fabric.strategy, FabricFSDP)
        self.engine: Any = None
        if _deepspeed(ctx):
            self._set_up_deepspeed(plan.optimized)
            return
        if self.sharded:  # FSDP's optimizer must see the flat-param-backed params: set up the model first
            self.model = self.fabric.setup_module(self.bare)
            optimizer = ctx.make_optimizer(optimizer_params(self.model._forward_module, plan.optimized))
            self.optimizer = self.fabric.setup_optimizers(optimizer)
        else:
            optimizer = ctx.make_optimizer(optimizer_params(self.bare, plan.optimized))
            self.model, self.optimizer = self.fabric.setup(self.bare, optimizer)
        # the _FabricModule holds what the strategy wrapped as its forward module
        wrapped = self.model._forward_module
        self.view = FSDP1View(wrapped, self.optimizer.optimizer) if self.sharded else ParamView(
            self.bare, self.optimizer.optimizer)
        self.save_api = ("fabric.save(path, {'model': model, 'optimizer': optimizer})"
                         + (" (FSDP: sharded, torch.distributed.checkpoint)" if self.sharded else "")
                         + "; fabric.load(path, state)")
        _observe(ctx.probe, "Fabric", self.fabric.strategy, wrapped)

    def _set_up_deepspeed(self, optimized: frozenset[str]) -> None:
        """`fabric.setup(model, optimizer)` (DeepSpeed sets both up together): the engine clips inside its step."""
        from . import zero

        ctx = self.ctx
        zero.keep_world_clone(ctx)
        optimizer = ctx.make_optimizer(optimizer_params(self.bare, optimized))
        self.model, self.optimizer = self.fabric.setup(self.bare, optimizer)
        self.engine = self.model._forward_module
        self.view = zero.LightningDeepSpeedView(self.engine, zero.plugin_of(ctx))
        self.clips_in_step = True
        self.save_api = (f"fabric.save(path, {{'model': model, 'optimizer': optimizer}}) (DeepSpeed: "
                         f"engine.save_checkpoint(path, tag='{zero.TAG}'){zero.exclusion_words(ctx)}); "
                         "fabric.load(path, state)")
        _observe(ctx.probe, "Fabric", self.fabric.strategy, self.engine, zero.WRAPPERS)
        zero.observe(ctx.probe, self.fabric.strategy, self.engine)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def forward_backward(self, step: int) -> None:
        self.fabric.backward(self.ctx.loss(self.model, self.ctx.local_batch(step)))

    def clip(self, max_norm: float) -> tuple[float | None, str]:
        norm = self.fabric.clip_gradients(self.model, self.optimizer, max_norm=max_norm)
        return float(norm), "returned by fabric.clip_gradients"

    def step(self) -> None:
        self.optimizer.step()

    def norm_after_step(self) -> tuple[float | None, str]:
        from . import zero

        return zero.norm(self.engine)

    # Resumable

    def save(self, directory: Path) -> None:
        self.fabric.save(directory / CHECKPOINT_FILE, {"model": self.model, "optimizer": self.optimizer})

    def saved(self, directory: Path) -> Saved:
        if self.engine is not None:
            from . import zero

            return zero.saved(directory / CHECKPOINT_FILE, self.view, zero.excludes_frozen(self.ctx))
        if self.sharded:  # a folder: FSDP's sharded model and optimizer state dicts, keyed by name
            return dcp_contents(directory / CHECKPOINT_FILE, "model", "optimizer",
                                rename=lambda key: strip_wrapper_infixes(key, FSDP1_INFIXES))
        state = load_file(directory / CHECKPOINT_FILE)
        return full_contents(state["model"], state["optimizer"]["state"],
                             index_names(dict(self.bare.named_parameters()), self.optimizer.optimizer))

    def close(self) -> None:
        self.fabric.barrier()
        if self.engine is not None:
            from ..deepspeed_views import destroy

            destroy(self.engine)

    def load(self, directory: Path, omit: str | None = None) -> None:
        self.fabric.load(_without_omitted(self.ctx, directory / CHECKPOINT_FILE, "model", omit),
                         {"model": self.model, "optimizer": self.optimizer}, strict=omit is None)


# Trainer: it owns the loop; a callback makes the probe calls `loop.train` makes.

class _Module(LightningModule):
    """The bare model as a LightningModule. Each epoch trains one batch, the cell's batch of that step
    (`global_step`: the optimizer steps taken, a resumed run's included)."""

    def __init__(self, model: nn.Module, ctx: RunContext, optimized: frozenset[str]) -> None:
        super().__init__()
        self.model = model
        self.cell_context = ctx
        self.optimized = optimized
        #: The total norm FSDP's clip_grad_norm_ returned this step (`configure_gradient_clipping`).
        self.fsdp_norm: float | None = None

    def training_step(self, batch: Any, batch_index: int) -> torch.Tensor:
        ctx = self.cell_context
        return ctx.loss(self.model, ctx.local_batch(self.trainer.global_step))

    def configure_gradient_clipping(self, optimizer: torch.optim.Optimizer, gradient_clip_val: float | None = None,
                                    gradient_clip_algorithm: str | None = None) -> None:
        """Lightning clips by norm itself except under FSDP, which it refuses ("not supported for FSDPPrecision"):
        there, as its FSDP docs have a user do, through the wrapped model's own `clip_grad_norm_`."""
        model = self.trainer.strategy.model
        if isinstance(model, FSDP) and gradient_clip_val:
            self.fsdp_norm = float(model.clip_grad_norm_(gradient_clip_val))
            return
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # Over the params that require grad now (a finetuning callback has frozen its modules by this point).
        return self.cell_context.make_optimizer(optimizer_params(self.model, self.optimized))


class _NormTap:
    """Keeps the total norm `torch.nn.utils.clip_grad_norm_` returns inside Lightning's `gradient_clip_val`
    clipping, which drops it; every call passes through unchanged."""

    def __init__(self) -> None:
        self.norm: float | None = None

    def take(self) -> tuple[float | None, str]:
        norm, self.norm = self.norm, None
        if norm is None:
            return None, "Lightning's gradient_clip_val made no clipping call this step"
        return norm, f"returned by torch.nn.utils.clip_grad_norm_ inside Lightning's gradient clipping {TAP_NOTE}"

    @contextmanager
    def installed(self) -> Iterator[None]:
        original = torch.nn.utils.clip_grad_norm_

        def tapped(*args: Any, **kwargs: Any) -> torch.Tensor:
            norm = original(*args, **kwargs)
            self.norm = float(norm)
            return norm

        torch.nn.utils.clip_grad_norm_ = tapped
        try:
            yield
        finally:
            torch.nn.utils.clip_grad_norm_ = original


class _Probes(Callback):
    """The probe's fixed points at the Trainer's hooks (one batch per epoch), from step `first_step`.

    `first_batch`: called at the first batch's start, once a finetuning callback has unfrozen what it unfreezes at
    that epoch (the state the run trains from: `wrapped`, or `loaded` after a resume). `save_after`: the round trip's
    save at the end of epoch SAVE_AFTER_STEP, where `ModelCheckpoint(save_on_train_epoch_end=True)` saves."""

    def __init__(self, probes: StepProbes, tap: _NormTap, clips: bool, first_batch: Callable[[], None],
                 first_step: int = 0, save_after: Callable[[int], bool] | None = None) -> None:
        self.probes, self.tap, self.clips = probes, tap, clips
        self.first_batch: Callable[[], None] | None = first_batch
        self.step = first_step
        self.save_after = save_after
        self.saved: bool | None = None

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self.first_batch is not None:
            self.first_batch()
            self.first_batch = None
        self.probes.forward(self.step)

    def on_after_backward(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.probes.backward_done(self.step)

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        if self.clips:
            self.probes.clipping(self.step)  # Lightning clips right after this hook

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.clips:
            self.probes.clipped(self.step, *self._norm(pl_module))
        self.probes.optimizer_step(self.step)
        self.probes.stepped(self.step)
        self.step += 1

    def _norm(self, pl_module: LightningModule) -> tuple[float | None, str]:
        engine = getattr(pl_module.trainer.strategy, "deepspeed_engine", None)
        if engine is not None:
            from . import zero

            return zero.norm(engine)
        norm, pl_module.fsdp_norm = pl_module.fsdp_norm, None
        if norm is None:
            return self.tap.take()
        return norm, "returned by FSDP.clip_grad_norm_ (the LightningModule's configure_gradient_clipping)"

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.save_after is not None and self.step - 1 == SAVE_AFTER_STEP:
            self.saved = self.save_after(self.step - 1)


class _TrainerRun:
    """One Lightning script: the user's model, freeze, LightningModule, callbacks and Trainer."""

    save_api = ("trainer.save_checkpoint (as ModelCheckpoint(save_on_train_epoch_end=True) does) at the end of "
                "epoch 0; resume: a new Trainer, fit(model, ckpt_path=<checkpoint>)")

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx
        ctx.probe.phase("build model")
        model = ctx.build_model(device=ctx.device)
        plan = ctx.resolve_plan(model)
        apply_freeze(plan, model)
        self.module = _Module(model, ctx, plan.optimized)
        paths = unfrozen_modules(ctx)
        hyper = ctx.cell.hyper
        self.trainer = Trainer(
            accelerator=_accelerator(ctx), devices=ctx.world_size, num_nodes=1,
            strategy=self._strategy(model),
            precision=LIGHTNING_PRECISION[ctx.cell.precision], max_epochs=hyper.steps, limit_train_batches=1,
            gradient_clip_val=hyper.max_norm if hyper.clips else None, gradient_clip_algorithm="norm",
            logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            num_sanity_val_steps=0, use_distributed_sampler=False,
            callbacks=[UnfreezeAtFirstEpoch(paths)] if paths else [])
        self.view: ModelView | None = None
        if _deepspeed(ctx):
            from . import zero

            self.trainer.callbacks.append(zero.KeepWorldClone(ctx))
            self.save_api = (f"trainer.save_checkpoint (DeepSpeed: engine.save_checkpoint(path, tag='{zero.TAG}')"
                             f"{zero.exclusion_words(ctx)}) at the end of epoch 0; resume: a new Trainer, "
                             "fit(model, ckpt_path=<checkpoint folder>)")

    def _strategy(self, model: nn.Module) -> Any:
        """What a Trainer user passes for the plugin: DDP, FSDP wrapping every block (the Trainer's defaults:
        use_orig_params=True, a full checkpoint from rank 0), or DeepSpeed (`zero.trainer_strategy`)."""
        if _deepspeed(self.ctx):
            from . import zero

            return zero.trainer_strategy(self.ctx)
        if self.ctx.cell.key.plugin == "trainer-fsdp":
            return FSDPStrategy(auto_wrap_policy={type(block) for block in models.block_modules(model)},
                                process_group_backend=dist.get_backend())
        return DDPStrategy(process_group_backend=dist.get_backend(), find_unused_parameters=_finds_unused(self.ctx))

    def fit(self, probes: _Probes, tap: _NormTap, ckpt_path: Path | None = None) -> None:
        self.trainer.callbacks.insert(0, probes)
        with tap.installed():
            self.trainer.fit(self.module, train_dataloaders=[0],
                             ckpt_path=None if ckpt_path is None else str(ckpt_path))

    def wrapped(self) -> ModelView:
        """The view, once the Trainer has wrapped the model and built the optimizer (inside fit)."""
        wrapped = self.trainer.strategy.model
        if _deepspeed(self.ctx):
            from . import zero

            _observe(self.ctx.probe, "Trainer", self.trainer.strategy, wrapped, zero.WRAPPERS)
            zero.observe(self.ctx.probe, self.trainer.strategy, wrapped)
            self.view = zero.LightningDeepSpeedView(wrapped, zero.plugin_of(self.ctx), prefix=MODULE_PREFIX)
            return self.view
        _observe(self.ctx.probe, "Trainer", self.trainer.strategy, wrapped)
        if isinstance(wrapped, FSDP):
            return _TrainerFSDPView(wrapped, self.trainer.optimizers)
        return ParamView(self.module.model, self.trainer.optimizers)

    # Resumable

    def save(self, directory: Path) -> None:
        self.trainer.save_checkpoint(directory / CHECKPOINT_FILE)

    def saved(self, directory: Path) -> Saved:
        if _deepspeed(self.ctx):
            from . import zero

            assert isinstance(self.view, zero.LightningDeepSpeedView), "saved before the Trainer wrapped the model"
            return zero.saved(directory / CHECKPOINT_FILE, self.view, zero.excludes_frozen(self.ctx))
        state = load_file(directory / CHECKPOINT_FILE)
        (optimizer,) = state["optimizer_states"]
        (live,) = self.trainer.optimizers
        names = (_fsdp_names_by_id(self.trainer.strategy.model) if isinstance(self.trainer.strategy, FSDPStrategy)
                 else index_names(dict(self.module.model.named_parameters()), live))
        return full_contents(state["state_dict"], optimizer["state"], names,
                             rename=lambda key: key.removeprefix(MODULE_PREFIX))

    def close(self) -> None:
        dist.barrier()
        if _deepspeed(self.ctx):
            from ..deepspeed_views import destroy

            destroy(self.trainer.strategy.deepspeed_engine)


class _LateView:
    """The view of a model the Trainer wraps only inside fit(): it reads through the view made then."""

    def __init__(self) -> None:
        self.inner: ModelView | None = None

    def become(self, view: ModelView) -> None:
        self.inner = view

    def _view(self) -> ModelView:
        assert self.inner is not None, "read before the Trainer wrapped the model"
        return self.inner

    @property
    def grad_access(self) -> str:
        return self._view().grad_access

    def requires_grad_flags(self) -> dict[str, bool]:
        return self._view().requires_grad_flags()

    def tracked_names(self) -> set[str]:
        return self._view().tracked_names()

    def full_params(self) -> dict[str, torch.Tensor]:
        return self._view().full_params()

    def full_grads(self) -> dict[str, torch.Tensor | None]:
        return self._view().full_grads()

    def full_buffers(self) -> dict[str, torch.Tensor] | None:
        """None where the view it became cannot read buffers (the check then says it did not run)."""
        reader = getattr(self._view(), "full_buffers", None)
        return None if reader is None else reader()


class _TrainerFSDPView(FSDP1View):
    """The Trainer's FSDP wraps the LightningModule: names lose its child's prefix (`model.`)."""

    def named_parameters(self) -> dict[str, nn.Parameter]:
        return {name.removeprefix(MODULE_PREFIX): p for name, p in super().named_parameters().items()}

    def full_buffers(self) -> dict[str, torch.Tensor]:
        return {name.removeprefix(MODULE_PREFIX): b for name, b in super().full_buffers().items()}

    def tracked_names(self) -> set[str]:
        return {name.removeprefix(MODULE_PREFIX) for name in super().tracked_names()}


def _train_with_trainer(ctx: RunContext) -> None:
    tap = _NormTap()
    resumes = loop.runs_round_trip(ctx)
    with loop.shared_folder(ctx) if resumes else contextlib.nullcontext(Path(os.devnull)) as folder:
        first = _TrainerRun(ctx)
        view = _LateView()
        probes = StepProbes(ctx.probe, view)

        def started() -> None:
            view.become(first.wrapped())
            probes.wrapped()

        ctx.probe.phase(f"Trainer.fit ({ctx.cell.key.plugin})")
        saves = _Probes(probes, tap, ctx.cell.hyper.clips, started,
                        save_after=functools.partial(loop.save, ctx, first, folder) if resumes else None)
        first.fit(saves, tap)
        if not saves.saved:
            return
        ctx.probe.resuming("tear down")
        first.close()
        ctx.probe.phase("resume: rebuild")
        fresh = _TrainerRun(ctx)
        fresh_view = _LateView()

        def resumed() -> None:
            fresh_view.become(fresh.wrapped())
            ctx.probe.loaded(fresh_view)

        path = _without_omitted(ctx, folder / CHECKPOINT_FILE, "state_dict", ctx.cell.break_load)
        fresh.module.strict_loading = ctx.cell.break_load is None
        ctx.probe.phase("resume: load (fit(ckpt_path))")
        fresh.fit(_Probes(StepProbes(ctx.probe, fresh_view), tap, ctx.cell.hyper.clips, resumed,
                          first_step=SAVE_AFTER_STEP + 1), tap, ckpt_path=path)
        fresh.close()


class LightningAdapter(AdapterBase):
    def run(self, ctx: RunContext) -> None:
        with ctx.emulation():
            if ctx.cell.key.plugin.startswith("fabric-"):
                loop.train(ctx, _FabricLoop(ctx), rebuild=lambda: _FabricLoop(ctx))
            else:
                _train_with_trainer(ctx)
