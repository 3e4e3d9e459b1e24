"""The `*-zero2` / `*-zero3` plugins: Accelerate's DeepSpeed path, from the user's own loop (`DeepSpeedPlugin`) and
from the Trainer (`TrainingArguments(deepspeed=config)`), read through the DeepSpeed row's view (`deepspeed_views`).

Under DeepSpeed `accelerator.backward(loss)` runs `engine.backward` and then `engine.step()` (Accelerate's
`DeepSpeedEngineWrapper`: clipping with the config's `gradient_clipping`, the optimizer step, zeroing);
`optimizer.step()` / `zero_grad()` are no-ops and `accelerator.clip_grad_norm_` returns the norm the engine clipped
with. ZeRO frees its grad partitions in that step, so the view reads the grads as the engine's step begins
(`ZeroView`): the probe's read after the backward gets those. The config is the DeepSpeed row's (`ds_config`: the
user's AdamW, ZeRO-3 partitioning every param of a tiny model).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from accelerate import Accelerator, DeepSpeedPlugin

from ..base import RunContext
from ..deepspeed_ops import missing
from ..deepspeed_views import DeepSpeedView, Plugin, destroy, ds_config, keep_world_clone, saved_contents
from ..loop import Saved, train
from ..views import optimizer_params
from . import ZERO_PLUGINS, staged, state
from .accelerate_loop import AccelerateLoop, user_model
from .environment_setup import OPS

#: The tag `accelerator.save_state` gives the first model's engine checkpoint (Accelerate's `MODEL_NAME`).
MODEL_TAG = "pytorch_model"
#: The folders the Trainer's engine checkpoint takes inside `checkpoint-N` (`global_step{N}`).
TRAINER_TAGS = "global_step*"
#: What `state.wrapper_kind` calls the engine and what Accelerate's distributed type must be.
WRAPPER, DISTRIBUTED_TYPE = "deepspeed", "DEEPSPEED"


def stage(plugin: str) -> int:
    """`accelerate-zero3` -> 3."""
    if plugin not in ZERO_PLUGINS:
        raise ValueError(f"hf adapter has no ZeRO plugin {plugin!r}; valid: {', '.join(ZERO_PLUGINS)}")
    return int(plugin[-1])


def config(ctx: RunContext, plugin: str) -> dict[str, Any]:
    """The DeepSpeed row's config for this cell: the user's optimizer, no offload, the cell's clipping."""
    absent = missing(OPS)
    if absent:
        raise RuntimeError(f"DeepSpeed ops {', '.join(absent)} are not built in this environment: run "
                           "`python -m pytest_freezecompat.adapters.hf.environment_setup` with its python")
    return ds_config(ctx.cell, Plugin(stage(plugin), offload=False, config_optimizer=False), ctx.world_size)


class ZeroView(DeepSpeedView):
    """The DeepSpeed row's view of an engine whose grads are read as its `step()` begins (they are freed in it)."""

    def __init__(self, engine: Any, plugin: str) -> None:
        super().__init__(engine, Plugin(stage(plugin), offload=False, config_optimizer=False))
        self.grad_access += ("; read as engine.step() begins, which accelerator.backward calls (ZeRO frees the "
                             "grads in it)")
        self._grads: dict[str, Any] | None = None
        step = engine.step

        def read_then_step(*args: Any, **kwargs: Any) -> Any:
            self._grads = DeepSpeedView.full_grads(self)
            return step(*args, **kwargs)

        engine.step = read_then_step

    def full_grads(self) -> dict[str, Any]:
        grads, self._grads = self._grads, None
        if grads is None:
            raise RuntimeError("the engine did not step in this backward: no grads were read")
        return grads


def keep_trainer_groups(ctx: RunContext, args: Any) -> None:
    """DeepSpeed's world-group clone kept with the rank's group (`keep_world_clone`; made in a cell, it would be
    destroyed with the cell and the next engine would meet it dead), once the arguments' Accelerate state has
    initialized DeepSpeed's comm, as the Trainer's constructor has it do first (`args.device`)."""
    _ = args.device
    keep_world_clone(ctx)


class AccelerateZeroLoop(AccelerateLoop):
    """The user's loop of `AccelerateLoop` with `Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=...))`."""

    save_api = ("accelerator.save_state(folder) (engine.save_checkpoint(folder, 'pytorch_model')); a fresh "
                "Accelerator's load_state(folder)")

    def __init__(self, ctx: RunContext, plugin: str) -> None:  # not AccelerateLoop's: it builds another stack
        self.ctx, self.plugin = ctx, plugin
        self.wrapper, self.want_type = WRAPPER, DISTRIBUTED_TYPE
        model, plan, late = user_model(ctx)
        ctx.probe.phase(f"wrap (Accelerator, {plugin})")
        self.accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config(ctx, plugin)))
        keep_world_clone(ctx)
        ctx.probe.phase(f"wrap (accelerator.prepare, {plugin})")
        optimizer = ctx.make_optimizer(optimizer_params(model, plan.optimized))
        self.model, self.optimizer = self.accelerator.prepare(model, optimizer)
        staged.release(model, late)
        state.observe(ctx.probe, self.accelerator, self.model)
        state.check(plugin, self.want_type, self.wrapper, self.accelerator, self.model, ctx.world_size)
        self.view = ZeroView(self.model, plugin)
        self.destroyed = False

    def saved(self, directory: Path) -> Saved:
        return saved_contents(directory / MODEL_TAG, self.view, exclude_frozen=False)

    def load(self, directory: Path, omit: str | None = None) -> None:
        if omit is not None:
            raise NotImplementedError("omit (tests only) is proven on ZeRO by the deepspeed adapter's tests")
        self.accelerator.load_state(str(directory))

    def close(self) -> None:
        self.destroy()
        super().close()

    def destroy(self) -> None:
        if not self.destroyed:
            destroy(self.model)
        self.destroyed = True


def run_accelerate(ctx: RunContext, plugin: str) -> None:
    """`loop.train` over `AccelerateZeroLoop`s; every engine built is destroyed at the end (the rank stays warm)."""
    built: list[AccelerateZeroLoop] = []

    def build() -> AccelerateZeroLoop:
        built.append(AccelerateZeroLoop(ctx, plugin))
        return built[-1]

    with ctx.emulation():
        try:
            train(ctx, build(), rebuild=build)
        finally:
            for loop in built:
                loop.destroy()


def trainer_saved(checkpoint: Path, top: Saved, view: DeepSpeedView, adapter: str | None) -> Saved:
    """What the Trainer's checkpoint under DeepSpeed holds: the optimizer state is in its engine checkpoint
    (`global_step{N}`), and so are the params the resume loads from it (ZeRO-3 without
    `stage3_gather_16bit_weights_on_model_save` writes no model file: "use zero_to_fp32.py"). A peft model's own
    params (`adapter`'s: LoRA, modules_to_save) count only from its adapter file, which the caller adds: that file is
    what `PeftModel.from_pretrained(checkpoint)` reads, and an empty one is the failure to show."""
    engine = [saved_contents(folder, view, exclude_frozen=adapter is not None)
              for folder in sorted(checkpoint.glob(TRAINER_TAGS))]
    if not engine:
        return Saved(top.params, frozenset())
    (engine_saved,) = engine
    params = set(top.params or ()) | {name for name in engine_saved.params or ()
                                      if adapter is None or f".{adapter}." not in name}
    return Saved(frozenset(params), engine_saved.optimizer_state)
