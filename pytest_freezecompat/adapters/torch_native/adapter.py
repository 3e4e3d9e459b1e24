"""PyTorch's own wrappers: DDP, FSDP1 (flat params or original params) and FSDP2 (`fully_shard`).

Everything here is what a PyTorch user writes: freeze the bare model, wrap it
(FSDP wraps every block, as users do), build AdamW from the parameters they
mean to train, clip with the wrapper's own clipping API.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

try:
    from torch.distributed.fsdp import fully_shard
except ImportError:  # torch < 2.6 keeps FSDP2 here
    from torch.distributed._composable.fsdp import fully_shard
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.nn.parallel import DistributedDataParallel as DDP

from .. import models
from ..freeze import FreezePlan, apply
from ..scenario import run_explicit_loop
from .base import Batch, RunContext, strip_wrapper_infixes
from .views import FSDP1_INFIXES, ParamView, flat_param_grads


class _DTensorView(ParamView):
    grad_access = "param.grad.full_tensor() (DTensor)"

    def full_params(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().full_tensor() for n, p in self.named_parameters().items()}

    def full_grads(self) -> dict[str, torch.Tensor | None]:
        grads = {}
        for name, param in self.named_parameters().items():  # collective: same order on every rank
            grads[name] = None if param.grad is None else param.grad.full_tensor()
        return grads


class _FSDP1View(ParamView):
    grad_access = "FSDP.summon_full_params(model, with_grads=True)"

    def __init__(self, module: FSDP, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(module, optimizer)
        if not module._use_orig_params:
            self.grad_access = "flat_param.grad shards, all-gathered and split by flat_param._fqns"

    def named_parameters(self) -> dict[str, nn.Parameter]:
        return {strip_wrapper_infixes(n, FSDP1_INFIXES): p for n, p in self.module.named_parameters()}

    def requires_grad_flags(self) -> dict[str, bool]:
        with FSDP.summon_full_params(self.module, writeback=False):
            return super().requires_grad_flags()

    def tracked_names(self) -> set[str]:
        tracked: set[str] = set()
        params = {id(p): (n, p) for n, p in self.module.named_parameters()}
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                name, param = params[id(p)]
                fqns = getattr(param, "_fqns", None)
                if fqns is None:  # use_orig_params=True: the optimizer holds the original params
                    tracked.add(strip_wrapper_infixes(name, FSDP1_INFIXES))
                    continue
                # A flat param stands for every original param folded into it.
                owner = strip_wrapper_infixes(name.rpartition("_flat_param")[0], FSDP1_INFIXES)
                tracked.update(owner + fqn for fqn in fqns)
        return tracked

    def full_params(self) -> dict[str, torch.Tensor]:
        with FSDP.summon_full_params(self.module, writeback=False):
            return super().full_params()

    def full_grads(self) -> dict[str, torch.Tensor | None]:
        if self.module._use_orig_params:
            with FSDP.summon_full_params(self.module, writeback=False, with_grads=True):
                return super().full_grads()
        # summon_full_params(with_grads=True) refuses flat params: gather the shards ourselves.
        return flat_param_grads(self.module)


class _Loop:
    def __init__(self, ctx: RunContext, model: nn.Module, view: ParamView, optimizer: torch.optim.Optimizer,
                 clip_source: str) -> None:
        self.ctx = ctx
        self.model = model
        self.view = view
        self.optimizer = optimizer
        self.clip_source = clip_source

    def forward_backward(self, batch: Batch) -> torch.Tensor:
        loss = self.ctx.loss(self.model, batch)
        loss.backward()
        return loss

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

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)


def _optimizer_params(named: dict[str, nn.Parameter], plan: FreezePlan) -> list[nn.Parameter]:
    """What a user passes to AdamW: the params they mean to train, picked by name."""
    chosen: list[nn.Parameter] = []
    for name, param in named.items():
        fqns = getattr(param, "_fqns", None)
        owner = strip_wrapper_infixes(name.rpartition("_flat_param")[0], FSDP1_INFIXES)
        names = [owner + f for f in fqns] if fqns else [strip_wrapper_infixes(name, FSDP1_INFIXES)]
        if any(n in plan.optimized for n in names) and param.requires_grad:
            chosen.append(param)
    return chosen


def _materialize_dtensors(model: nn.Module, seed: int, device: torch.device) -> None:
    """Meta init under FSDP2: allocate the local shards, then fill each from the deterministic init."""
    model.to_empty(device=device)
    with torch.no_grad():
        for name, param in model.named_parameters():
            full = models.deterministic_values(seed, name, param.shape).to(param.dtype)
            if isinstance(param, DTensor):
                local = distribute_tensor(full.to(param.device), param.device_mesh, param.placements,
                                          src_data_rank=None).to_local()
                param.to_local().copy_(local)
            else:
                param.copy_(full)


class Adapter:
    def run(self, ctx: RunContext) -> None:
        self.run_plugin(ctx, ctx.cell.key.plugin)

    def run_plugin(self, ctx: RunContext, plugin: str) -> None:
        meta = ctx.cell.key.init == "meta"
        ctx.probe.phase("build model")
        model = ctx.build_model(device="meta" if meta else ctx.device)
        plan = ctx.resolve_plan(model)
        apply(plan, model)
        ctx.probe.phase(f"wrap ({plugin})")
        if plugin in ("ddp", "ddp-find-unused"):
            if meta:
                model.to_empty(device=ctx.device)
                models.init_weights(model, ctx.cell.hyper.seed)
            device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
            wrapped = DDP(model, device_ids=device_ids, find_unused_parameters=plugin == "ddp-find-unused")
            named = dict(wrapped.module.named_parameters())
            optimizer = ctx.make_optimizer(_optimizer_params(named, plan))
            view: ParamView = ParamView(wrapped.module, optimizer)
            source = "returned by torch.nn.utils.clip_grad_norm_"
        elif plugin in ("fsdp1", "fsdp1-orig-params"):
            wrapped = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({type(m) for m in models.block_modules(model)}),
                           use_orig_params=plugin == "fsdp1-orig-params",
                           device_id=ctx.device)
            named = dict(wrapped.named_parameters())
            optimizer = ctx.make_optimizer(_optimizer_params(named, plan))
            view = _FSDP1View(wrapped, optimizer)
            source = "returned by FSDP.clip_grad_norm_"
        elif plugin == "fsdp2":
            for block in models.block_modules(model):
                fully_shard(block)
            wrapped = fully_shard(model)
            if meta:
                _materialize_dtensors(wrapped, ctx.cell.hyper.seed, ctx.device)
            named = dict(wrapped.named_parameters())
            optimizer = ctx.make_optimizer(_optimizer_params(named, plan))
            view = _DTensorView(wrapped, optimizer)
            source = "returned by torch.nn.utils.clip_grad_norm_ (DTensor)"
        else:
            raise ValueError(f"torch adapter has no plugin {plugin!r}")
        dist.barrier()
        run_explicit_loop(ctx, _Loop(ctx, wrapped, view, optimizer, source))
