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

Each plugin id is one entry of `PLUGINS`: how to build it, how to read its grads, where its clip norm is, and
which of the Booster's two checkpoint formats the round trip uses (every plugin supports both; the
ZeRO-like ones are saved sharded, as their docs recommend).

The round trip (the `resume` check) goes through the Booster's checkpoint API, as ColossalAI's docs write it:
`booster.save_model(model, path, shard=...)` and `booster.save_optimizer(optimizer, path, shard=...)` on every
rank, then a fresh script's path: build, freeze (the same `build` as the first time), a fresh plugin and
Booster, `boost`, `booster.load_model(model, path)` and `booster.load_optimizer(optimizer, path)`.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
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
from colossalai.booster.plugin.hybrid_parallel_plugin import HybridParallelModule
from colossalai.booster.plugin.low_level_zero_plugin import LowLevelZeroModel
from colossalai.booster.plugin.torch_ddp_plugin import TorchDDPModel
from colossalai.booster.plugin.torch_fsdp_plugin import TorchFSDPModel
from colossalai.lazy import LazyInitContext, LazyTensor
from colossalai.shardformer.policies.base_policy import Policy
from colossalai.zero import GeminiDDP
from colossalai.zero.low_level import LowLevelZeroOptimizer
from torch import nn

from ... import models
from ...core.freeze import FreezePlan
from ..base import AdapterBase, Probe, RunContext, class_among, precision_of
from ..loop import Saved, train
from ..saved_files import full_contents, load_file
from ..views import FSDP1View, ParamView, settle_groups
from . import compat
from .compat import reported_grad_norm, reuses_fp16_chunk, unwrap_model, zero_grad_access, zero_param_grads


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


# -- reading the boosted model back by original names -----------------------------------------------


class PlainView(ParamView):
    """TorchDDP and HybridParallel zero 0: full params and all-reduced grads sit on the bare model."""

    def __init__(self, model: Any, optimizer: Any) -> None:
        # A peft model keeps its own names (`base_model.model.*`), the names the cell froze by.
        super().__init__(unwrap_model(model), optimizer)
        self.model = model

    def names_by_id(self) -> dict[int, str]:
        """The bare model's name of each param object (the plugins convert params in place, keeping identity)."""
        return {id(p): n for n, p in self.named_parameters().items()}


class ZeroView(PlainView):
    """LowLevelZero and HybridParallel zero 1: `param.grad` is None after `booster.backward`; the reduced
    grad sits in the optimizer's grad store, flat and sharded, read with `get_param_grad` (a collective).
    The optimizer holds fp32 master shards, mapped back to the model's params through
    `master_to_working_param`."""

    grad_access = ("optimizer.get_param_grad(param) (param.grad is None; collective); "
                   "params outside the optimizer keep their rank-local param.grad")

    def __init__(self, model: Any, optimizer: Any) -> None:
        super().__init__(model, optimizer)
        self.grad_access = zero_grad_access(optimizer, self.grad_access)

    def tracked_names(self) -> set[str]:
        optimizer = self.optimizers[0]
        by_id = self.names_by_id()
        masters = optimizer.get_master_to_working_map()
        return {by_id[id(masters[id(p)])] for group in optimizer.optim.param_groups for p in group["params"]}

    def full_grads(self) -> dict[str, torch.Tensor | None]:
        optimizer = self.optimizers[0]
        managed = {id(p) for group in optimizer._working_param_groups.values() for p in group}
        named = self.named_parameters()  # the same order on every rank: the ZeRO grads are read in a collective
        zero_names = [name for name, param in named.items() if id(param) in managed]
        zero_grads = dict(zip(zero_names, zero_param_grads(optimizer, [named[name] for name in zero_names])))
        grads: dict[str, torch.Tensor | None] = {}
        for name, param in named.items():
            grad = zero_grads[name] if name in zero_grads else param.grad
            grads[name] = None if grad is None else grad.detach().clone()
        return grads


def warm_up() -> None:
    """Once in each rank template, the imports every fresh rank would make in its first cell: the shim's Gemini
    patches import `colossalai.legacy` (apex amp, the parallel context, TorchScript-compiled helpers: ~1 s a
    process, again after every restart) and the Gemini modules they patch. And the logger's caller read from the
    frame, not `inspect.stack()` (`compat.log_call_sites_from_the_frame`)."""
    from .emulation import GEMINI_MODULES

    for module in ("colossalai.legacy.utils.memory", *GEMINI_MODULES):
        with contextlib.suppress(ImportError):
            importlib.import_module(module)
    compat.log_call_sites_from_the_frame()


def fsdp_view(model: Any, optimizer: Any) -> FSDP1View:
    """TorchFSDPPlugin wraps the whole model in one FSDP unit (flat params unless told otherwise)."""
    return FSDP1View(model.module, optimizer)


class GeminiView(PlainView):
    """Gemini keeps the params it trains in chunks (bf16 params and grads, fp32 masters in paired chunks) and
    ignores frozen ones (plain bf16 params outside any chunk). Read as `GeminiDDP.state_dict` reads chunks:
    `get_temp_total_chunk_on_cuda` gathers a chunk's shards into a temporary tensor and leaves its state alone
    (a collective per chunk, in `fp16_params` order on every rank)."""

    grad_access = ("in Gemini's chunks: chunk_manager.get_chunk(p) (the param's own bf16 chunk holds its grad "
                   "after backward under reuse_fp16_chunk, else .grad_chunk), gathered with "
                   "colossalai.zero.gemini.utils.get_temp_total_chunk_on_cuda; only params with "
                   "p._gemini_reduced have one (param.grad is None)")

    def tracked_names(self) -> set[str]:
        """Real params the optimizer holds a master (fake) param for, on any rank: a rank's fake params cover
        only the chunks it owns a shard of."""
        from colossalai.utils import is_ddp_ignored

        by_id = self.names_by_id()
        optimizer = self.optimizers[0]
        return {by_id[id(p)] for p in optimizer.id_to_real_params.values() if not is_ddp_ignored(p)}

    def _gathered(self, tensors: list[tuple[str, Any, Any]]) -> dict[str, torch.Tensor]:
        """(name, tensor in a chunk, chunk) -> that tensor's full value in fp32, one gather per chunk."""
        from colossalai.zero.gemini.utils import get_temp_total_chunk_on_cuda

        totals: dict[int, torch.Tensor] = {}
        values = {}
        for name, tensor, chunk in tensors:
            if id(chunk) not in totals:
                totals[id(chunk)] = get_temp_total_chunk_on_cuda(chunk, torch.float32).clone()
            info = chunk.tensors_info[tensor]
            values[name] = totals[id(chunk)][info.offset:info.end].view(tensor.shape).cpu()
        return values

    def full_params(self) -> dict[str, torch.Tensor]:
        """fp32 masters (the paired fp32 chunks), not the bf16 copies `state_dict()` returns; frozen params as
        Gemini keeps them (cast to the compute dtype, outside any chunk)."""
        model, manager = self.model, self.model.chunk_manager
        names = self.names_by_id()
        masters = self._gathered([(names[id(p)], fp32, manager.get_chunk(fp32))
                                  for p, fp32 in zip(model.fp16_params, model.fp32_params)])
        return {n: masters[n] if n in masters else p.detach().float().cpu().clone()
                for n, p in self.named_parameters().items()}

    def full_grads(self) -> dict[str, torch.Tensor | None]:
        model, manager = self.model, self.model.chunk_manager
        names = self.names_by_id()
        reuse = reuses_fp16_chunk(model)
        chunked = []
        for p in model.fp16_params:
            chunk = manager.get_chunk(p)
            chunked.append((names[id(p)], p, chunk if reuse else chunk.grad_chunk))
        # A chunk without a grad chunk still gathers (every rank calls the same collectives).
        gathered = self._gathered([entry for entry in chunked if entry[2] is not None])
        grads: dict[str, torch.Tensor | None] = {}
        for name, p, _ in chunked:
            # `grad_handle` marks a param whose grad it reduced into the chunk; otherwise the slice holds
            # whatever the chunk held (under reuse_fp16_chunk, the weights themselves).
            grads[name] = gathered.get(name) if getattr(p, "_gemini_reduced", False) else None
        for name, p in self.named_parameters().items():
            if name not in grads:  # ignored by Gemini (frozen): a plain param outside any chunk
                grads[name] = None if p.grad is None else p.grad.detach().float().clone()
        return grads


# -- the plugins ----------------------------------------------------------------------------------------

PluginFactory = Callable[[str, float, dict[str, Any]], Any]  # (precision, max_norm, options from rules)
CLIPPED_BY_WRAPPER = ("returned by OptimizerWrapper.clip_grad_by_norm (torch.nn.utils.clip_grad_norm_ over "
                      "the optimizer's params)")


def _clipped_in_step(optimizer_type: str) -> str:
    return f"optimizer.get_grad_norm() after step ({optimizer_type} clips inside step with max_norm)"


@dataclass(frozen=True)
class PluginSpec:
    """One plugin id: the Booster plugin a user builds, how we read it back, and how it clips."""

    make: PluginFactory
    view: Callable[[Any, Any], ParamView]
    #: True: the plugin takes `max_norm` and clips inside `optimizer.step()`; else `clip_grad_by_norm`.
    clips_in_step: bool
    clip_source: str
    #: Gemini accepts only its own HybridAdam (same math as AdamW with adamw_mode).
    hybrid_adam: bool = False
    #: The round trip's format: `shard=True` (a folder with an index file; what the docs recommend for ZeRO,
    #: Gemini and HybridParallel, whose state is spread over ranks) or `shard=False` (one file, rank 0).
    shard: bool = True


def _hybrid(zero_stage: int) -> PluginFactory:
    return lambda precision, max_norm, options: HybridParallelPlugin(**{
        "tp_size": 1, "pp_size": 1, "zero_stage": zero_stage, "precision": precision, "max_norm": max_norm,
        "custom_policy": NoShardingPolicy(), **options})


def _low_level_zero(stage: int) -> PluginFactory:
    return lambda precision, max_norm, options: LowLevelZeroPlugin(**{
        "stage": stage, "precision": precision, "max_norm": max_norm, **options})


#: Chunks of 12288 elements (ColossalAI's chunk search with no search range): tiny-gpt's 12112 params that train
#: fill chunk 0, and `unused-branch`'s vision branch lands in a chunk of its own. The plugin's default
#: (`min_chunk_size_m=32`) puts every trainable param in one chunk, so there the unused branch shares it.
SPLIT_CHUNKS = {"min_chunk_size_m": 0.0117, "search_range_m": 0}


def _gemini(placement: str, **chunking: Any) -> PluginFactory:
    return lambda precision, max_norm, options: GeminiPlugin(**{
        "placement_policy": placement, "precision": precision, "max_norm": max_norm, **chunking, **options})


def _torch_ddp(find_unused: bool) -> PluginFactory:
    return lambda precision, max_norm, options: TorchDDPPlugin(**{"find_unused_parameters": find_unused,
                                                                  **options})


PLUGINS: dict[str, PluginSpec] = {
    "torch-ddp": PluginSpec(_torch_ddp(False), PlainView, False, CLIPPED_BY_WRAPPER, shard=False),
    "torch-ddp-find-unused": PluginSpec(_torch_ddp(True), PlainView, False, CLIPPED_BY_WRAPPER, shard=False),
    "torch-fsdp": PluginSpec(
        lambda precision, max_norm, options: TorchFSDPPlugin(**options), fsdp_view, False,
        "returned by OptimizerWrapper.clip_grad_by_norm (torch.nn.utils.clip_grad_norm_ over this rank's "
        "flat-param shard; not reduced across ranks)", shard=False),
    "low-level-zero-1": PluginSpec(_low_level_zero(1), ZeroView, True, _clipped_in_step("LowLevelZeroOptimizer")),
    "low-level-zero-2": PluginSpec(_low_level_zero(2), ZeroView, True, _clipped_in_step("LowLevelZeroOptimizer")),
    "gemini": PluginSpec(_gemini("static"), GeminiView, True, _clipped_in_step("GeminiOptimizer"), hybrid_adam=True),
    "gemini-auto": PluginSpec(_gemini("auto"), GeminiView, True, _clipped_in_step("GeminiOptimizer"), hybrid_adam=True),
    "gemini-split-chunks": PluginSpec(_gemini("static", **SPLIT_CHUNKS), GeminiView, True,
                                      _clipped_in_step("GeminiOptimizer"), hybrid_adam=True),
    "hybrid-parallel": PluginSpec(_hybrid(0), PlainView, True, _clipped_in_step("HybridParallelNaiveOptimizer")),
    "hybrid-parallel-zero-1": PluginSpec(_hybrid(1), ZeroView, True,
                                         _clipped_in_step("HybridParallelZeroOptimizer")),
}


def make_optimizer(ctx: RunContext, spec: PluginSpec, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """AdamW with the cell's hyperparameters, or HybridAdam where the plugin accepts only that."""
    if not spec.hybrid_adam:
        return ctx.make_optimizer(params)
    from colossalai.nn.optimizer import HybridAdam

    h = ctx.cell.hyper
    return HybridAdam(params, lr=h.lr, betas=h.betas, eps=h.eps, weight_decay=h.weight_decay, adamw_mode=True)


# -- the loop -----------------------------------------------------------------------------------------


#: Where the round trip's files go inside its folder (`shard=True`: folders; `shard=False`: files).
MODEL, OPTIMIZER = "model", "optimizer"
UNSHARDED_SUFFIX = ".bin"  # what `load_state_dict` reads with torch.load (".safetensors" would switch it)


@dataclass
class _Loop:
    ctx: RunContext
    spec: PluginSpec
    booster: Booster
    model: Any
    optimizer: Any
    view: ParamView
    #: The bare model's names of the params given to the optimizer, in its order: an optimizer checkpoint
    #: keys its state by that index (every plugin numbers the user's param groups in order).
    optimized_names: tuple[str, ...]

    @property
    def clips_in_step(self) -> bool:
        return self.spec.clips_in_step

    def zero_grad(self) -> None:
        """Through the boosted optimizer alone, as ColossalAI's examples and docs write the loop (no plugin needs
        more): each plugin zeroes what its optimizer holds (TorchDDP, TorchFSDP and HybridParallel's naive
        optimizer `param.grad` of its params; LowLevelZero its grad store; Gemini its chunks). A param that
        requires grad but is outside the optimizer keeps accumulating into `param.grad` step after step, as it
        does for a user, where the stack itself leaves it there (Gemini rewrites its chunk each backward;
        LowLevelZero never reduces it, so it stays rank-local)."""
        self.optimizer.zero_grad()

    def forward_backward(self, step: int) -> None:
        self.booster.backward(self.ctx.loss(self.model, self.ctx.local_batch(step)), self.optimizer)

    def clip(self, max_norm: float) -> tuple[float | None, str]:
        return float(self.optimizer.clip_grad_by_norm(max_norm)), self.spec.clip_source

    def step(self) -> None:
        self.optimizer.step()

    def norm_after_step(self) -> tuple[float | None, str]:
        norm, missing = reported_grad_norm(self.optimizer)
        return norm, missing or self.spec.clip_source

    # -- the round trip: the Booster's checkpoint API ----------------------------------------------------

    @property
    def save_api(self) -> str:
        shard = self.spec.shard
        where = "a folder with an index file" if shard else "one file"
        return (f"booster.save_model(model, path, shard={shard}) + booster.save_optimizer(optimizer, path, "
                f"shard={shard}) ({where}); booster.load_model + booster.load_optimizer on a freshly boosted pair")

    def _paths(self, directory: Path) -> tuple[Path, Path]:
        suffix = "" if self.spec.shard else UNSHARDED_SUFFIX
        return directory / f"{MODEL}{suffix}", directory / f"{OPTIMIZER}{suffix}"

    def save(self, directory: Path) -> None:
        model_path, optimizer_path = self._paths(directory)
        self.booster.save_model(self.model, str(model_path), shard=self.spec.shard)
        self.booster.save_optimizer(self.optimizer, str(optimizer_path), shard=self.spec.shard)
        dist.barrier()  # rank 0 (the master) writes: its files are complete before any rank reads them

    def saved(self, directory: Path) -> Saved:
        model_path, optimizer_path = self._paths(directory)
        if self.spec.shard:
            model_names = _index(model_path)["weight_map"]
            states: dict[Any, Any] = {}
            for shard_file in sorted(set(_index(optimizer_path)["weight_map"].values())):
                states.update(load_file(optimizer_path / shard_file))
        else:
            model_names = load_file(model_path)
            states = load_file(optimizer_path).get("state", {})  # 0.3.x TorchFSDP: rank 1 may write {} last
        names = self._names_by_index()
        bare = set(self.view.named_parameters())
        # A peft model is saved as the model peft wraps (the booster unwraps it): keys lack `base_model.model.` and
        # `.base_layer`; map them back to the bare model's names.
        unwrapped = {_peft_unwrapped(name): name for name in bare}
        return full_contents(model_names, {_index_key(k): v for k, v in states.items()}, names,
                             rename=lambda key: key if key in bare else unwrapped.get(key, key))

    def _names_by_index(self) -> dict[int, str]:
        """Index in the optimizer checkpoint -> bare name. The plugins number the user's params in the order they
        were given; TorchFSDP's checkpoint (`FSDP.full_optim_state_dict`) numbers the original params of each flat
        param its optimizer holds, in the flat param's order (`_fqns`, relative to the bare model)."""
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        if params and all(hasattr(p, "_fqns") for p in params):
            return dict(enumerate(name for p in params for name in p._fqns))
        return dict(enumerate(self.optimized_names))

    def close(self) -> None:
        settle_groups()
        dist.barrier()

    def load(self, directory: Path, omit: str | None = None) -> None:
        model_path, optimizer_path = self._paths(directory)
        if omit is not None:  # a broken checkpoint: the same files less that one param, loaded non-strictly
            broken = directory / f"broken-{model_path.name}"
            if self.ctx.rank == 0:
                _drop_param(model_path, broken, omit, self.spec.shard)
            dist.barrier()
            model_path = broken
        self.booster.load_model(self.model, str(model_path), strict=omit is None)
        self.booster.load_optimizer(self.optimizer, str(optimizer_path))
        dist.barrier()


def _peft_unwrapped(name: str) -> str:
    """`base_model.model.x.q_proj.base_layer.weight` -> `x.q_proj.weight`: a peft model's name as the model it wraps."""
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".")


def _index_key(key: Any) -> Any:
    """Optimizer checkpoints key state by index (an int, or its string in an index file's weight map)."""
    return int(key) if isinstance(key, str) and key.isdigit() else key


def _index(folder: Path) -> dict[str, Any]:
    """The index file of a sharded checkpoint folder (`pytorch_model.bin.index.json`, `pytorch_optim...`)."""
    (index,) = folder.glob("*.index.json")
    return json.loads(index.read_text())


def _drop_param(source: Path, target: Path, name: str, sharded: bool) -> None:
    """A copy of a model checkpoint without `name` (tests only: what a broken load leaves out)."""
    if not sharded:
        state = load_file(source)
        del state[name]
        torch.save(state, target)
        return
    shutil.copytree(source, target)
    (index_path,) = target.glob("*.index.json")
    index = json.loads(index_path.read_text())
    shard_file = target / index["weight_map"].pop(name)
    state = load_file(shard_file)
    del state[name]
    torch.save(state, shard_file)
    index_path.write_text(json.dumps(index))


def freeze(plan: FreezePlan, model: nn.Module) -> None:
    """Freeze as ColossalAI's users write it: `param.requires_grad = flag`, an attribute assignment.

    On a plain param that is `requires_grad_(flag)`; on a LazyInitContext param it is not: up to 0.4.7
    `LazyTensor.materialize` replays a recorded `requires_grad_` after every other op, assignments included, so
    an assignment is undone (C2) while a `requires_grad_(False)` is itself the call replayed last and survives.
    0.4.8 keeps the lazy tensor's own flag either way."""
    for name, param in model.named_parameters():
        param.requires_grad = name in plan.trainable


def build(ctx: RunContext) -> tuple[nn.Module, FreezePlan]:
    """Build and freeze the bare model the way the cell's init mode says (freezing always before boost)."""
    if ctx.cell.key.init == "eager":
        model = ctx.build_model()
    else:
        with LazyInitContext():
            model = ctx.build_model(initialize=False)
    plan = ctx.resolve_plan(model)
    freeze(plan, model)
    return model, plan


def boost(ctx: RunContext, plugin_id: str) -> _Loop:
    """What a user's script does before its first step, and again, whole, when it resumes: build and freeze
    the bare model, the optimizer over the params to train, a fresh plugin and Booster, `boost`."""
    spec = PLUGINS[plugin_id]
    ctx.probe.phase("build model")
    model, plan = build(ctx)
    # What a user passes to the optimizer: the params they mean to train, picked by name.
    optimized = [(n, p) for n, p in model.named_parameters() if n in plan.optimized and p.requires_grad]
    optimizer = make_optimizer(ctx, spec, [p for _, p in optimized])
    # Whether the params are LazyInitContext's LazyTensors as built and as boost gets them (before boost: a boost that
    # fails on a lazy model still shows what it got).
    ctx.probe.observed("lazy_init", _lazy(model))
    if ctx.cell.key.init == "lazy-materialize":
        ctx.probe.phase("LazyInitContext.materialize")
        LazyInitContext.materialize(model)
    ctx.probe.observed("lazy_at_boost", _lazy(model))
    ctx.probe.phase(f"boost ({plugin_id})")
    booster = Booster(plugin=spec.make(ctx.cell.precision, ctx.cell.hyper.max_norm, dict(ctx.cell.options)))
    boosted, boosted_optimizer, *_ = booster.boost(model, optimizer, criterion=models.loss_fn)
    _observe(ctx.probe, booster, boosted, boosted_optimizer)
    dist.barrier()
    return _Loop(ctx, spec, booster, boosted, boosted_optimizer, spec.view(boosted, boosted_optimizer),
                 tuple(n for n, _ in optimized))


def _lazy(model: nn.Module) -> bool:
    """Whether the model's params are LazyInitContext's LazyTensors (`materialize` turns each into a plain param)."""
    return any(isinstance(p, LazyTensor) for p in model.parameters())


#: The model wrappers the plugins build: TorchDDP, TorchFSDP, LowLevelZero, Gemini and HybridParallel's.
WRAPPERS = (TorchDDPModel, TorchFSDPModel, LowLevelZeroModel, GeminiDDP, HybridParallelModule)


def _observe(probe: Probe, booster: Booster, model: Any, optimizer: Any) -> None:
    """The stack as `boost` built it, read back from the boosted pair and the booster (`promises` in the package's
    declaration): never from the plugin id or the options we passed."""
    probe.observed("wrapper", class_among(model, WRAPPERS))
    # The class's own name: LowLevelZeroPlugin renames its class after the last stage it was built with.
    probe.observed("plugin", type(booster.plugin).__qualname__)
    probe.observed("optimizer", type(optimizer).__name__)
    probe.observed("precision", precision_of(model))
    # Whether boost handed back params still lazy (only ShardFormer and GeminiDDP materialize by themselves).
    probe.observed("lazy_after_boost", _lazy(model))
    if isinstance(model, TorchDDPModel):
        probe.observed("find_unused_parameters", model.module.find_unused_parameters)
    if isinstance(model, TorchFSDPModel):
        probe.observed("sharding_strategy", model.module.sharding_strategy.name)
        probe.observed("use_orig_params", model.module._use_orig_params)
    if isinstance(model, (LowLevelZeroModel, HybridParallelModule)):
        # ZeRO as the optimizer runs it: stage 2 partitions grads, stage 1 only the optimizer states; HybridParallel
        # without ZeRO keeps a plain (naive or AMP) optimizer.
        stage = (("2" if optimizer._partition_grads else "1") if isinstance(optimizer, LowLevelZeroOptimizer)
                 else "0")
        probe.observed("zero_stage", stage)
    if isinstance(model, GeminiDDP):
        probe.observed("placement_policy", model.gemini_manager.policy_name)
        probe.observed("param_chunks", _param_chunks(model.chunk_manager))


def _param_chunks(manager: Any) -> str:
    """Gemini's chunks of (bf16) params as its ChunkManager built them: `count x capacity`, and whether they stay
    gathered (params fewer than the minimum chunk size: one chunk, never sharded) or are sharded over the ranks.
    Not promised: `gemini-split-chunks` (a minimum of 12288) splits only a model whose params outgrow one chunk
    (tiny-gpt with `unused-branch`: 2 x 12288, sharded); with fewer it builds what `gemini` builds."""
    groups = []
    for name, chunks in manager.chunk_groups.items():
        if name.startswith("fp16_param") and chunks:
            capacities = sorted({chunk.chunk_size for chunk in chunks})
            kept = sorted({"kept gathered" if chunk.keep_gathered else "sharded" for chunk in chunks})
            groups.append(f"{len(chunks)} x {'/'.join(map(str, capacities))} ({', '.join(kept)})")
    return "; ".join(groups) or "none"


class ColossalAIAdapter(AdapterBase):
    def run(self, ctx: RunContext) -> None:
        plugin_id = ctx.cell.key.plugin
        built: list[_Loop] = []

        def rebuild() -> _Loop:
            built.append(boost(ctx, plugin_id))
            return built[-1]

        # The shim stays on for the whole run: saving and loading go through the same plugin code.
        with ctx.emulation():
            try:
                train(ctx, rebuild(), rebuild=rebuild)
                settle_groups()  # no gloo worker may still be finishing an async op below (a torch deadlock)
            finally:
                # Plugins free their process groups in __del__: let that happen while the cell's group lives.
                built.clear()
                gc.collect()
