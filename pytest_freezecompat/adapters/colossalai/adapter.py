"""ColossalAI's Booster with each of its data-parallel plugins, written the way its docs show.

Freeze the bare model, build the optimizer from the params a user means to train, then
`booster.boost(model, optimizer, criterion)`, `booster.backward(loss, optimizer)`,
`optimizer.step()`. Clipping goes through each plugin's own mechanism: the `max_norm` that
LowLevelZero, HybridParallel and Gemini take (they clip inside `step()` and report the norm through
`optimizer.get_grad_norm()`), and the wrapped optimizer's `clip_grad_by_norm` for TorchDDP/TorchFSDP.
The rank's env:// gloo group is used as it is: the plugins only need `torch.distributed` to be
initialized, so `colossalai.launch` is not called.

Init modes: `eager` (the deterministic init of `models.py`), `lazy` (`LazyInitContext` as users write
it; the plugin must materialize), `lazy-materialize` (`LazyInitContext.materialize(model)` before boost,
for plugins that do not materialize by themselves). Under `LazyInitContext` the model keeps its own
`nn.init` init: copying values into lazy params recurses in `LazyTensor._materialize_data`.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from colossalai.booster import Booster
from colossalai.booster.plugin import (
    GeminiPlugin,
    HybridParallelPlugin,
    LowLevelZeroPlugin,
    TorchDDPPlugin,
    TorchFSDPPlugin,
)
from colossalai.lazy import LazyInitContext
from colossalai.shardformer.policies.base_policy import Policy
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from .. import models
from ..freeze import FreezePlan, apply
from .base import Batch, RunContext, strip_wrapper_infixes
from .colossalai_emulation import cuda_on_cpu
from .views import FSDP1_INFIXES, ParamView, flat_param_grads

INIT_MODES = ("eager", "lazy", "lazy-materialize")
#: Plugins that clip inside `optimizer.step()` with their `max_norm` and report the norm afterwards.
CLIP_IN_STEP = ("low-level-zero-1", "low-level-zero-2", "gemini", "hybrid-parallel", "hybrid-parallel-zero-1")


class NoShardingPolicy(Policy):
    """What a user gives HybridParallelPlugin for a model outside its zoo when tp=pp=1: nothing to shard."""

    def config_sanity_check(self) -> None:
        pass

    def preprocess(self) -> nn.Module:
        return self.model

    def module_policy(self) -> dict:
        return {}

    def postprocess(self) -> nn.Module:
        return self.model


def make_plugin(plugin_id: str, precision: str, max_norm: float, options: dict[str, Any]) -> Any:
    """The Booster plugin of a cell; `options` (from matrix rules) override the defaults here."""
    if plugin_id in ("torch-ddp", "torch-ddp-find-unused"):
        return TorchDDPPlugin(**{"find_unused_parameters": plugin_id == "torch-ddp-find-unused", **options})
    if plugin_id == "torch-fsdp":
        return TorchFSDPPlugin(**options)
    if plugin_id in ("low-level-zero-1", "low-level-zero-2"):
        return LowLevelZeroPlugin(**{"stage": int(plugin_id[-1]), "precision": precision, "max_norm": max_norm,
                                     **options})
    if plugin_id == "gemini":
        return GeminiPlugin(**{"precision": precision, "max_norm": max_norm, **options})
    if plugin_id in ("hybrid-parallel", "hybrid-parallel-zero-1"):
        return HybridParallelPlugin(**{"tp_size": 1, "pp_size": 1, "zero_stage": int(plugin_id.endswith("zero-1")),
                                       "precision": precision, "max_norm": max_norm,
                                       "custom_policy": NoShardingPolicy(), **options})
    raise ValueError(f"colossalai adapter has no plugin {plugin_id!r}")


def make_optimizer(ctx: RunContext, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """AdamW with the cell's hyperparameters; Gemini accepts only its own Adam (same math with adamw_mode)."""
    if ctx.cell.key.plugin != "gemini":
        return ctx.make_optimizer(params)
    from colossalai.nn.optimizer import HybridAdam

    h = ctx.cell.hyper
    return HybridAdam(params, lr=h.lr, betas=h.betas, eps=h.eps, weight_decay=h.weight_decay, adamw_mode=True)


# -- reading the boosted model back by original names -----------------------------------------------


class PlainView(ParamView):
    """TorchDDP and HybridParallel zero 0: full params and all-reduced grads sit on the bare model."""

    def __init__(self, model: Any, optimizer: Any) -> None:
        super().__init__(model.unwrap(), optimizer)
        self.model = model
        self.bare: nn.Module = self.module


class ZeroView(PlainView):
    """LowLevelZero and HybridParallel zero 1: `param.grad` is None after `booster.backward`; the reduced
    grad sits in the optimizer's grad store, flat and sharded (CASES C5). The optimizer holds fp32 master
    shards, mapped back to the model's params through `master_to_working_param`."""

    grad_access = ("optimizer.get_param_grad(param) (param.grad is None; collective); "
                   "params outside the optimizer keep their rank-local param.grad")

    def tracked_names(self) -> set[str]:
        by_id = {id(p): n for n, p in self.named_parameters().items()}
        masters = self.optimizer.get_master_to_working_map()
        return {by_id[id(masters[id(p)])] for group in self.optimizer.optim.param_groups for p in group["params"]}

    def full_grads(self) -> dict[str, torch.Tensor | None]:
        managed = {id(p) for group in self.optimizer._working_param_groups.values() for p in group}
        grads: dict[str, torch.Tensor | None] = {}
        for name, param in self.named_parameters().items():  # collective: same order on every rank
            grad = self.optimizer.get_param_grad(param) if id(param) in managed else param.grad
            grads[name] = None if grad is None else grad.detach().clone()
        return grads


class FSDPView(PlainView):
    """TorchFSDPPlugin wraps the whole model in one FSDP unit with flat params (use_orig_params=False)."""

    grad_access = "flat_param.grad shards, all-gathered and split by flat_param._fqns"

    def __init__(self, model: Any, optimizer: Any) -> None:
        super().__init__(model, optimizer)
        self.fsdp: FSDP = model.module

    def _owner(self, flat_name: str) -> str:
        return strip_wrapper_infixes(flat_name.rpartition("_flat_param")[0], FSDP1_INFIXES)

    def requires_grad_flags(self) -> dict[str, bool]:
        with FSDP.summon_full_params(self.fsdp, writeback=False):
            return super().requires_grad_flags()

    def tracked_names(self) -> set[str]:
        flats = {id(p): (n, p) for n, p in self.fsdp.named_parameters()}
        tracked: set[str] = set()
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                name, flat = flats[id(p)]
                tracked.update(self._owner(name) + fqn for fqn in flat._fqns)
        return tracked

    def full_params(self) -> dict[str, torch.Tensor]:
        with FSDP.summon_full_params(self.fsdp, writeback=False):
            return super().full_params()

    def full_grads(self) -> dict[str, torch.Tensor | None]:
        return flat_param_grads(self.fsdp)


class GeminiView(PlainView):
    """Gemini keeps params and grads in chunks; the optimizer holds per-rank "fake" params."""

    grad_access = ("in Gemini's chunks: chunk_manager.get_chunk(p) (the fp16 chunk holds grads when "
                   "reuse_fp16_chunk, else .grad_chunk), gathered with chunk_manager.access_chunk")

    def tracked_names(self) -> set[str]:
        by_id = {id(p): n for n, p in self.named_parameters().items()}
        real = self.optimizer.id_to_real_params
        return {by_id[id(real[pid])] for pid in self.optimizer.id_to_fake_params}

    def full_params(self) -> dict[str, torch.Tensor]:
        state = self.model.state_dict(only_rank_0=False)  # collective
        return {n: state[n].detach().clone() for n in self.named_parameters()}

    def full_grads(self) -> dict[str, torch.Tensor | None]:
        """Gather each grad chunk, read the param's slice, scatter it back (as ColossalAI's own tests do)."""
        manager = self.model.chunk_manager
        accessed: list[tuple[Any, torch.device]] = []
        grads: dict[str, torch.Tensor | None] = {}
        for name, param in self.named_parameters().items():  # collective: same order on every rank
            if param.requires_grad is False or param not in manager.tensor_chunk_map:
                grads[name] = None if param.grad is None else param.grad.detach().clone()
                continue
            chunk = manager.get_chunk(param)
            grad_chunk = chunk if manager.reuse_fp16_chunk else chunk.grad_chunk
            if grad_chunk is None:
                grads[name] = None
                continue
            if all(grad_chunk is not c for c, _ in accessed):
                manager.access_chunk(grad_chunk)
                accessed.append((grad_chunk, self.model.grads_device[param]))
            info = grad_chunk.tensors_info[param]
            grads[name] = grad_chunk.cuda_global_chunk[info.offset:info.end].view(param.shape).detach().clone()
        for grad_chunk, device in accessed:
            manager.release_chunk(grad_chunk)
            manager.move_chunk(grad_chunk, device, force_copy=True)
        return grads


def make_view(plugin_id: str, model: Any, optimizer: Any) -> PlainView:
    if plugin_id in ("low-level-zero-1", "low-level-zero-2", "hybrid-parallel-zero-1"):
        return ZeroView(model, optimizer)
    if plugin_id == "torch-fsdp":
        return FSDPView(model, optimizer)
    if plugin_id == "gemini":
        return GeminiView(model, optimizer)
    return PlainView(model, optimizer)


# -- the loop -----------------------------------------------------------------------------------------


def _clip_source(plugin_id: str) -> str:
    if plugin_id == "torch-fsdp":
        return ("returned by OptimizerWrapper.clip_grad_by_norm (torch.nn.utils.clip_grad_norm_ over this rank's "
                "flat-param shard; not reduced across ranks)")
    if plugin_id in CLIP_IN_STEP:
        return f"optimizer.get_grad_norm() after step ({_optimizer_type(plugin_id)} clips inside step with max_norm)"
    return "returned by OptimizerWrapper.clip_grad_by_norm (torch.nn.utils.clip_grad_norm_ over the optimizer's params)"


def _optimizer_type(plugin_id: str) -> str:
    return {"low-level-zero-1": "LowLevelZeroOptimizer", "low-level-zero-2": "LowLevelZeroOptimizer",
            "gemini": "GeminiOptimizer", "hybrid-parallel": "HybridParallelNaiveOptimizer",
            "hybrid-parallel-zero-1": "HybridParallelZeroOptimizer"}.get(plugin_id, "OptimizerWrapper")


def train(ctx: RunContext, booster: Booster, model: Any, optimizer: Any, view: PlainView) -> None:
    """The probe calls of `scenario.run_explicit_loop`, except that in-step clippers report after `step()`."""
    plugin_id, probe = ctx.cell.key.plugin, ctx.probe
    probe.wrapped(view)
    for step in range(ctx.cell.hyper.steps):
        probe.phase(f"step {step}: forward/backward")
        optimizer.zero_grad()
        if plugin_id != "gemini":  # params outside the optimizer would keep last step's grads
            model.zero_grad(set_to_none=True)
        batch: Batch = ctx.local_batch(step)
        loss = ctx.loss(model, batch)
        booster.backward(loss, optimizer)
        probe.after_backward(step, view)
        if plugin_id not in CLIP_IN_STEP:
            probe.phase(f"step {step}: clip")
            probe.clipped(step, float(optimizer.clip_grad_by_norm(ctx.cell.hyper.max_norm)), _clip_source(plugin_id))
        probe.phase(f"step {step}: optimizer step")
        optimizer.step()
        if plugin_id in CLIP_IN_STEP:
            norm = optimizer.get_grad_norm()
            probe.clipped(step, None if norm is None else float(norm), _clip_source(plugin_id))
        probe.after_step(step, view)


@contextlib.contextmanager
def _emulation(ctx: RunContext) -> Iterator[None]:
    if ctx.cell.emulation and ctx.device.type == "cpu":
        with cuda_on_cpu(ctx.probe, ctx.device):
            yield
    else:
        yield


def build(ctx: RunContext) -> tuple[nn.Module, FreezePlan]:
    """Build and freeze the bare model the way the cell's init mode says (freezing always before boost)."""
    init = ctx.cell.key.init
    if init not in INIT_MODES:
        raise ValueError(f"colossalai adapter has no init {init!r}; valid: {', '.join(INIT_MODES)}")
    if init == "eager":
        model = ctx.build_model()
    else:
        with LazyInitContext():
            model = ctx.build_model(initialize=False)
    plan = ctx.resolve_plan(model)
    apply(plan, model)
    return model, plan


def _optimizer_params(model: nn.Module, plan: FreezePlan) -> list[nn.Parameter]:
    """What a user passes to the optimizer: the params they mean to train, picked by name."""
    return [p for n, p in model.named_parameters() if n in plan.optimized and p.requires_grad]


class Adapter:
    def run(self, ctx: RunContext) -> None:
        plugin_id = ctx.cell.key.plugin
        with _emulation(ctx):
            ctx.probe.phase("build model")
            model, plan = build(ctx)
            optimizer = make_optimizer(ctx, _optimizer_params(model, plan))
            if ctx.cell.key.init == "lazy-materialize":
                ctx.probe.phase("LazyInitContext.materialize")
                LazyInitContext.materialize(model)
            ctx.probe.phase(f"boost ({plugin_id})")
            booster = Booster(plugin=make_plugin(plugin_id, ctx.cell.precision, ctx.cell.hyper.max_norm,
                                                 dict(ctx.cell.options)))
            boosted, boosted_optimizer, *_ = booster.boost(model, optimizer, criterion=models.loss_fn)
            dist.barrier()
            try:
                train(ctx, booster, boosted, boosted_optimizer, make_view(plugin_id, boosted, boosted_optimizer))
            finally:
                # Plugins free their process groups in __del__: let that happen while the cell's group lives.
                del booster, boosted, boosted_optimizer, optimizer, model
                gc.collect()

