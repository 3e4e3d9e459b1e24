"""DeepSpeed through `deepspeed.initialize` and its engine, as a DeepSpeed user trains.

Per cell: build the bare model (inside `deepspeed.zero.Init` for init `zero-init`), freeze it, hand it to
`deepspeed.initialize` with a config (ZeRO stage, offload, clipping, precision, optionally the optimizer), then
`engine(batch)`, `engine.backward(loss)`, `engine.step()`: the engine clips inside `step()` with the config's
`gradient_clipping`. The view reads everything back by the bare model's names through DeepSpeed's public
debugging API (`deepspeed.utils.safe_get_full_grad` / `safe_get_full_optimizer_state`, `GatheredParameters` at
stage 3). The round trip is `engine.save_checkpoint` / a fresh engine's `engine.load_checkpoint`.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import deepspeed_ops
from ..deepspeed_ops import missing, use_environment_cache

use_environment_cache()  # before DeepSpeed is imported: its ops load from the environment's cache

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from deepspeed.runtime import engine as ds_engine  # noqa: E402
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus  # noqa: E402
from deepspeed.utils import safe_set_full_fp32_param  # noqa: E402
from torch import nn  # noqa: E402

from ... import models  # noqa: E402
from ..base import AdapterBase, RunContext, apply_freeze, cast_inputs  # noqa: E402
from ..deepspeed_views import (  # noqa: E402
    DeepSpeedView,
    Plugin,
    ds_config,
    engine_dtype,
    keep_world_clone,
    observe_engine,
    saved_contents,
)
from ..loop import Saved, train  # noqa: E402
from ..views import settle_groups  # noqa: E402
from . import CONFIG_OPTIMIZER  # noqa: E402

PLUGIN_RE = re.compile(r"^zero(?P<stage>[0-3])(?P<offload>-offload)?(?P<config>-config-optim)?(?P<bf16>-bf16)?$")
#: A rule's `options = {exclude_frozen_parameters = true}`: `save_checkpoint(..., exclude_frozen_parameters=True)`
#: (the PEFT recipe: the base model supplies the frozen weights), loaded with `load_module_strict=False`.
EXCLUDE_FROZEN = "exclude_frozen_parameters"
#: The round trip's checkpoint tag (a sub-folder of the cell's folder).
TAG = "freezecompat"
#: DeepSpeed logs at INFO on every initialize; a cell's log keeps its warnings.
LOG_LEVEL = "WARNING"


def parse_plugin(plugin: str) -> Plugin:
    match = PLUGIN_RE.match(plugin)
    if not match:
        raise ValueError(f"deepspeed adapter has no plugin {plugin!r} "
                         f"(expected zero<0-3>[-offload][{CONFIG_OPTIMIZER}][-bf16])")
    return Plugin(int(match["stage"]), bool(match["offload"]), bool(match["config"]), bool(match["bf16"]))


@dataclass
class _StageZeroNorm:
    """Stage 0 (fp32) clips inside `engine.step()` with `deepspeed.runtime.utils.clip_grad_norm_` and drops the
    norm it returns (`get_global_grad_norm()` stays None): record what that call returns, changing nothing."""

    norms: list[float] = field(default_factory=list)

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        original = ds_engine.clip_grad_norm_

        def clip_grad_norm_(*args: Any, **kwargs: Any) -> Any:
            norm = original(*args, **kwargs)
            self.norms.append(float(norm))
            return norm

        ds_engine.clip_grad_norm_ = clip_grad_norm_
        try:
            yield
        finally:
            ds_engine.clip_grad_norm_ = original


@dataclass
class _Loop:
    ctx: RunContext
    engine: Any
    plugin: Plugin
    view: DeepSpeedView
    exclude_frozen: bool
    clips_in_step = True
    stage0: _StageZeroNorm = field(default_factory=_StageZeroNorm)
    destroyed: bool = False

    @property
    def save_api(self) -> str:
        excluded = ", exclude_frozen_parameters=True" if self.exclude_frozen else ""
        strict = "load_module_strict=False" if self.exclude_frozen else "load_module_strict=True"
        return f"engine.save_checkpoint(dir{excluded}); fresh engine.load_checkpoint(dir, {strict})"

    def zero_grad(self) -> None:
        self.engine.zero_grad()

    def forward_backward(self, step: int) -> None:
        loss = self.ctx.loss(self.engine, self.ctx.local_batch(step))
        self.engine.backward(loss)

    def clip(self, max_norm: float) -> tuple[float | None, str]:
        raise AssertionError("the DeepSpeed engine clips inside step() (gradient_clipping)")

    def step(self) -> None:
        with self.stage0.recording() if self.plugin.stage == 0 else contextlib.nullcontext():
            self.engine.step()

    def norm_after_step(self) -> tuple[float | None, str]:
        norm = self.engine.get_global_grad_norm()
        if norm is not None:
            return float(norm), "engine.get_global_grad_norm() after engine.step() (gradient_clipping)"
        if self.plugin.stage == 0 and self.stage0.norms:
            return self.stage0.norms[-1], ("stage 0: get_global_grad_norm() is None; the norm returned by "
                                           "deepspeed.runtime.utils.clip_grad_norm_ inside engine.step() "
                                           "(engine.clip_fp32_gradients drops it), recorded around that call")
        return None, "engine.get_global_grad_norm() is None after engine.step()"

    # -- the model-checkpoint round trip ---------------------------------------------------------------
    def save(self, directory: Path) -> None:
        self.engine.save_checkpoint(str(directory), tag=TAG, exclude_frozen_parameters=self.exclude_frozen)
        dist.barrier()

    def saved(self, directory: Path) -> Saved:
        return saved_contents(directory / TAG, self.view, self.exclude_frozen)

    def close(self) -> None:
        self.destroy()
        settle_groups()
        dist.barrier()

    def destroy(self) -> None:
        """`engine.destroy()` (once): the optimizer's hooks and DeepSpeed's per-engine registries go with it."""
        destroy = getattr(self.engine, "destroy", None)
        if destroy is not None and not self.destroyed:
            destroy()
        self.destroyed = True

    def load(self, directory: Path, omit: str | None = None) -> None:
        fresh = None
        if omit is not None:
            fresh = self.view.full_params().get(omit)
        path, _ = self.engine.load_checkpoint(str(directory), tag=TAG, load_module_strict=not self.exclude_frozen)
        if path is None:
            raise RuntimeError(f"engine.load_checkpoint found no checkpoint in {directory}")
        if fresh is not None:
            _overwrite(self.view, omit, fresh)


def _overwrite(view: DeepSpeedView, name: str, value: torch.Tensor) -> None:
    """A broken load (tests only): put `name` back at its fresh value, in the model and the optimizer's master."""
    param = view.named_parameters()[name]
    if param.requires_grad and (hasattr(param, "_hp_mapping") or hasattr(param, "ds_id")):
        safe_set_full_fp32_param(param, value.to(param.dtype))
        return
    if hasattr(param, "ds_id"):
        with deepspeed.zero.GatheredParameters([param], modifier_rank=0), torch.no_grad():
            param.copy_(value.to(param.dtype))
        return
    with torch.no_grad():
        param.copy_(value.to(param.dtype))


def _checkpoint_blocks_with_deepspeed(model: nn.Module) -> None:
    """`checkpoint = "framework"`: each block through `deepspeed.checkpointing.checkpoint`. A transformers model
    takes it through its own switch, as its docs swap the checkpoint function (`_set_gradient_checkpointing`
    after `gradient_checkpointing_enable`: the switch also turns the KV cache off, which a recomputed layer would
    otherwise append to twice); any other model has each block's forward wrapped, as a model written for
    DeepSpeed calls it around its layers (Megatron-DeepSpeed)."""
    deepspeed.checkpointing.configure(None, partition_activations=False, contiguous_checkpointing=False,
                                      checkpoint_in_cpu=False, synchronize=False, profile=False)
    if hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=deepspeed.checkpointing.checkpoint)
        return
    for block in models.block_modules(model):
        inner = block.forward

        def forward(*args: Any, _inner: Any = inner) -> Any:
            return deepspeed.checkpointing.checkpoint(_inner, *args)

        block.forward = forward


def _partitioned(model: nn.Module) -> bool:
    """Whether the model came out of its constructor partitioned, as `zero.Init` leaves it: every param a ZeRO-3
    param (`ds_id`) whose data is not on this rank (`ds_status` NOT_AVAILABLE). Read before `deepspeed.initialize`,
    which partitions an eager model's params too."""
    params = list(model.parameters())
    return bool(params) and all(hasattr(p, "ds_id") and p.ds_status == ZeroParamStatus.NOT_AVAILABLE for p in params)


def _fill_partitioned(ctx: RunContext, model: nn.Module) -> None:
    """`models.init_weights` on a model built inside `zero.Init`: each param gathered, filled, re-partitioned."""
    for name, param in model.named_parameters():
        with deepspeed.zero.GatheredParameters([param], modifier_rank=0), torch.no_grad():
            param.copy_(models.deterministic_values(ctx.cell.hyper.seed, name, param.shape).to(param.dtype))


def _transformers_construction_under_zero3() -> contextlib.AbstractContextManager[None]:
    """What transformers' `from_config` enters around a model's constructor under ZeRO-3 (`modeling_utils`:
    `no_init_weights`, `prevent_arange_dtype_change`): a transformers model's own weight init would index its
    partitioned (empty) params (`weight[padding_idx]`). Its weights are filled after construction, gathered, as
    transformers' `initialize_weights_zero3` does (here `_fill_partitioned`). Nothing where transformers is absent."""
    stack = contextlib.ExitStack()
    try:
        from transformers import initialization
        from transformers.integrations.deepspeed import prevent_arange_dtype_change
    except ImportError:
        return stack
    stack.enter_context(initialization.no_init_weights())
    stack.enter_context(prevent_arange_dtype_change())
    return stack


class DeepSpeedAdapter(AdapterBase):
    def run(self, ctx: RunContext) -> None:
        absent = missing()
        if absent:
            raise RuntimeError(f"DeepSpeed ops {', '.join(absent)} are not built in this environment: run "
                               "`python -m pytest_freezecompat.adapters.deepspeed.environment_setup` with its python")
        deepspeed.utils.logger.setLevel(LOG_LEVEL)
        plugin = parse_plugin(ctx.cell.key.plugin)
        ctx.probe.phase("deepspeed.init_distributed")
        deepspeed.init_distributed(dist_backend=dist.get_backend())
        keep_world_clone(ctx)
        built: list[_Loop] = []

        def build() -> _Loop:
            built.append(self.build(ctx, plugin))
            return built[-1]

        train(ctx, build(), rebuild=build)
        # The ranks stay warm for the next cell: a user's script ends its process, we end the engines (their
        # ZeRO hooks and registries would otherwise live on in this process).
        for loop in built:
            loop.destroy()

    def build(self, ctx: RunContext, plugin: Plugin) -> _Loop:
        """What a user's script does before its first step (and again when it resumes)."""
        config = ds_config(ctx.cell, plugin, ctx.world_size)
        ctx.probe.phase("build model")
        if ctx.cell.key.init == "zero-init":
            if plugin.stage != 3:
                raise ValueError("zero.Init partitions params at construction: stage 3 only")
            with _transformers_construction_under_zero3(), deepspeed.zero.Init(config_dict_or_path=config):
                model = ctx.build_model(device=ctx.device, initialize=False)
            partitioned = _partitioned(model)
            _fill_partitioned(ctx, model)
        else:
            model = ctx.build_model(device=ctx.device)
            partitioned = _partitioned(model)
        if ctx.cell.key.checkpoint == "framework":
            _checkpoint_blocks_with_deepspeed(model)
        plan = ctx.resolve_plan(model)
        apply_freeze(plan, model)
        ctx.probe.phase(f"deepspeed.initialize ({ctx.cell.key.plugin})")
        if plugin.config_optimizer:
            engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        else:
            chosen = [p for n, p in model.named_parameters() if p.requires_grad and n in plan.optimized]
            engine, *_ = deepspeed.initialize(model=model, optimizer=ctx.make_optimizer(chosen), config=config)
        observe_engine(ctx.probe, engine)
        ctx.probe.observed("zero_init", partitioned)
        if engine_dtype(engine) != torch.float32:  # the engine casts no input: its users feed a bf16/fp16 module
            cast_inputs(engine.module, engine_dtype(engine))  # its float inputs so
        dist.barrier()
        exclude = bool(ctx.cell.options.get(EXCLUDE_FROZEN, False))
        return _Loop(ctx, engine, plugin, DeepSpeedView(engine, plugin), exclude)


def warm_up() -> None:
    """Once in each rank template (a fork then has it all): DeepSpeed's first uses (`deepspeed_ops.warm_up`)."""
    deepspeed_ops.warm_up()
