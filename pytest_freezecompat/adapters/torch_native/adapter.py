"""PyTorch's own wrappers: DDP, FSDP1 (flat params or original params) and FSDP2 (`fully_shard`).

Everything here is what a PyTorch user writes: freeze the bare model, wrap it
(FSDP wraps every block, as users do), build AdamW from the parameters they
mean to train, clip with the wrapper's own clipping API. The adapter to copy
when adding a framework: a `_Loop` for `loop.train`, a view from `views`, and
one `wrap` per plugin id its package declares.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

try:
    from torch.distributed.fsdp import fully_shard
except ImportError:  # torch < 2.6 keeps FSDP2 here
    from torch.distributed._composable.fsdp import fully_shard
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from ... import models
from ...core.freeze import FreezePlan
from ..base import AdapterBase, RunContext, apply_freeze
from ..loop import train
from ..materialize import MetaInit
from ..views import DTensorView, FSDP1View, ParamView, optimizer_params


@dataclass
class _Loop:
    ctx: RunContext
    model: nn.Module
    view: ParamView
    optimizer: torch.optim.Optimizer
    clip_source: str
    clips_in_step = False

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def forward_backward(self, step: int) -> None:
        self.ctx.loss(self.model, self.ctx.local_batch(step)).backward()

    def clip(self, max_norm: float) -> tuple[float | None, str]:
        if isinstance(self.model, FSDP):
            norm = self.model.clip_grad_norm_(max_norm)
        else:
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        return float(norm), self.clip_source

    def step(self) -> None:
        self.optimizer.step()

    def norm_after_step(self) -> tuple[float | None, str]:
        raise AssertionError("torch wrappers clip before step()")


def _meta_init(ctx: RunContext, model: nn.Module) -> MetaInit:
    return MetaInit(model, ctx.cell.hyper.seed, ctx.eager_buffers())


def _ddp(ctx: RunContext, model: nn.Module, plan: FreezePlan, find_unused: bool) -> _Loop:
    if ctx.cell.key.init == "meta":
        model.to_empty(device=ctx.device)
        _meta_init(ctx, model).all(model)
    device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    wrapped = DDP(model, device_ids=device_ids, find_unused_parameters=find_unused)
    optimizer = ctx.make_optimizer(optimizer_params(wrapped.module, plan.optimized))
    return _Loop(ctx, wrapped, ParamView(wrapped.module, optimizer), optimizer,
                 "returned by torch.nn.utils.clip_grad_norm_")


def _fsdp1(ctx: RunContext, model: nn.Module, plan: FreezePlan, orig_params: bool) -> _Loop:
    param_init_fn = None
    if ctx.cell.key.init == "meta":  # FSDP1 would call reset_parameters(), which not every module has
        meta_init = _meta_init(ctx, model)

        def param_init_fn(module: nn.Module) -> None:
            module.to_empty(device=ctx.device, recurse=False)
            meta_init(module)

    wrapped = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({type(m) for m in models.block_modules(model)}),
                   use_orig_params=orig_params, device_id=ctx.device, param_init_fn=param_init_fn)
    optimizer = ctx.make_optimizer(optimizer_params(wrapped, plan.optimized))
    return _Loop(ctx, wrapped, FSDP1View(wrapped, optimizer), optimizer, "returned by FSDP.clip_grad_norm_")


def _fsdp2(ctx: RunContext, model: nn.Module, plan: FreezePlan) -> _Loop:
    for block in models.block_modules(model):
        fully_shard(block)
    wrapped = fully_shard(model)
    if ctx.cell.key.init == "meta":  # allocate the local shards, then fill each from the deterministic init
        wrapped.to_empty(device=ctx.device)
        _meta_init(ctx, wrapped).all(wrapped)
    optimizer = ctx.make_optimizer(optimizer_params(wrapped, plan.optimized))
    return _Loop(ctx, wrapped, DTensorView(wrapped, optimizer), optimizer,
                 "returned by torch.nn.utils.clip_grad_norm_ (DTensor)")


#: Plugin id -> how a user wraps the frozen bare model with it.
WRAP: dict[str, Callable[[RunContext, nn.Module, FreezePlan], _Loop]] = {
    "ddp": functools.partial(_ddp, find_unused=False),
    "ddp-find-unused": functools.partial(_ddp, find_unused=True),
    "fsdp1": functools.partial(_fsdp1, orig_params=False),
    "fsdp1-orig-params": functools.partial(_fsdp1, orig_params=True),
    "fsdp2": _fsdp2,
}


class TorchAdapter(AdapterBase):
    def run(self, ctx: RunContext) -> None:
        self.run_plugin(ctx, ctx.cell.key.plugin)

    def run_plugin(self, ctx: RunContext, plugin: str) -> None:
        ctx.probe.phase("build model")
        model = ctx.build_model(device="meta" if ctx.cell.key.init == "meta" else ctx.device)
        plan = ctx.resolve_plan(model)
        apply_freeze(plan, model)
        ctx.probe.phase(f"wrap ({plugin})")
        loop = WRAP[plugin](ctx, model, plan)
        dist.barrier()
        train(ctx, loop)
