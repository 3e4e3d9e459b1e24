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
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

try:
    from torch.distributed.fsdp import FSDPModule, fully_shard
except ImportError:  # torch < 2.6 keeps FSDP2 here
    from torch.distributed._composable.fsdp import FSDPModule, fully_shard
from torch.distributed import checkpoint as dcp
from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from ... import models
from ...core.freeze import FreezePlan
from ..base import AdapterBase, Probe, RunContext, apply_freeze, class_among, precision_of
from ..loop import Saved, train
from ..materialize import MetaInit
from ..saved_files import dcp_contents, full_contents, index_names, load_file
from ..views import DTensorView, FSDP1View, ParamView, optimizer_params, settle_groups

#: The one file of a full (rank-0) checkpoint.
FULL_FILE = "checkpoint.pt"


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

    def close(self) -> None:
        settle_groups()
        dist.barrier()

    def _names_by_index(self) -> dict[int, str]:
        return index_names(self.view.named_parameters(), self.optimizer)


class _FullSave(_Loop):
    """DDP, as PyTorch's DDP tutorial saves: rank 0 `torch.save`s the wrapped model's and the optimizer's
    state dicts, every rank loads them (`map_location`)."""

    save_api = "torch.save(ddp.state_dict(), optimizer.state_dict()) on rank 0; load_state_dict on every rank"

    def save(self, directory: Path) -> None:
        if self.ctx.rank == 0:
            torch.save({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()},
                       directory / FULL_FILE)
        dist.barrier()

    def saved(self, directory: Path) -> Saved:
        state = load_file(directory / FULL_FILE)
        return full_contents(state["model"], state["optimizer"]["state"], self._names_by_index(),
                             rename=_without_ddp_prefix)

    def load(self, directory: Path, omit: str | None = None) -> None:
        state = load_file(directory / FULL_FILE)
        model_state = {k: v for k, v in state["model"].items() if _without_ddp_prefix(k) != omit}
        self.model.load_state_dict(model_state, strict=omit is None)
        self.optimizer.load_state_dict(state["optimizer"])


class _PeftAdapterSave(_FullSave):
    """A peft model under DDP, saved as peft users ship LoRA: adapter weights only
    (`get_peft_model_state_dict`), loaded into a fresh base with `set_peft_model_state_dict`."""

    save_api = ("peft get_peft_model_state_dict (adapter only) + optimizer.state_dict(), torch.save on rank 0; "
                "set_peft_model_state_dict into a fresh base")

    def save(self, directory: Path) -> None:
        from peft import get_peft_model_state_dict

        if self.ctx.rank == 0:
            torch.save({"model": get_peft_model_state_dict(self.model.module),
                        "optimizer": self.optimizer.state_dict()}, directory / FULL_FILE)
        dist.barrier()

    def saved(self, directory: Path) -> Saved:
        state = load_file(directory / FULL_FILE)
        peft_names = _peft_names(self.model.module)
        contents = full_contents(state["model"], state["optimizer"]["state"], self._names_by_index(),
                                 rename=lambda key: peft_names.get(key, key))
        return Saved(contents.params, contents.optimizer_state, trainable_only=True)

    def load(self, directory: Path, omit: str | None = None) -> None:
        from peft import set_peft_model_state_dict

        state = load_file(directory / FULL_FILE)
        peft_names = _peft_names(self.model.module)
        set_peft_model_state_dict(self.model.module, {k: v for k, v in state["model"].items()
                                                      if peft_names.get(k, k) != omit})
        self.optimizer.load_state_dict(state["optimizer"])


def _peft_names(model: nn.Module) -> dict[str, str]:
    """peft's adapter-only keys drop the adapter's name (`lora_A.default.weight` -> `lora_A.weight`)."""
    from peft import get_peft_model_state_dict

    params = dict(model.named_parameters())
    by_id = {id(param): name for name, param in params.items()}
    return {key: by_id[id(tensor)] for key, tensor in get_peft_model_state_dict(model, state_dict=params).items()
            if id(tensor) in by_id}  # peft picks the adapter's tensors out of the dict it is given: same objects


def _without_ddp_prefix(name: str) -> str:
    return name.removeprefix("module.")


class _FSDP1FullSave(_Loop):
    """FSDP1's full state dict, as its docs save one: gathered to rank 0 (offloaded to the CPU) with
    `FSDP.optim_state_dict`, `torch.save`d there; loaded on every rank with `FSDP.optim_state_dict_to_load`."""

    save_api = "FSDP FULL_STATE_DICT + FSDP.optim_state_dict (rank 0, torch.save); optim_state_dict_to_load"

    def save(self, directory: Path) -> None:
        # The docs offload to the CPU; where the params already live there, FSDP 2.13 frees the storage it
        # gathered into (setStorage: out of bounds for storage of size 0): offloading is for GPU params only.
        offload = self.ctx.device.type != "cpu"
        with FSDP.state_dict_type(self.model, StateDictType.FULL_STATE_DICT,
                                  FullStateDictConfig(offload_to_cpu=offload, rank0_only=True),
                                  FullOptimStateDictConfig(offload_to_cpu=offload, rank0_only=True)):
            model_state = self.model.state_dict()
            optim_state = FSDP.optim_state_dict(self.model, self.optimizer)
        if self.ctx.rank == 0:
            torch.save({"model": model_state, "optimizer": optim_state}, directory / FULL_FILE)
        dist.barrier()

    def saved(self, directory: Path) -> Saved:
        state = load_file(directory / FULL_FILE)
        return full_contents(state["model"], state["optimizer"]["state"], {})

    def load(self, directory: Path, omit: str | None = None) -> None:
        state = load_file(directory / FULL_FILE)
        model_state = {k: v for k, v in state["model"].items() if k != omit}
        with FSDP.state_dict_type(self.model, StateDictType.FULL_STATE_DICT,
                                  FullStateDictConfig(rank0_only=False), FullOptimStateDictConfig(rank0_only=False)):
            self.model.load_state_dict(model_state, strict=omit is None)
            optim_state = FSDP.optim_state_dict_to_load(self.model, self.optimizer, state["optimizer"])
        self.optimizer.load_state_dict(optim_state)


class _FSDP1ShardedSave(_Loop):
    """FSDP1's sharded state dict through `torch.distributed.checkpoint`, as the DCP recipe for FSDP1 does:
    each rank writes its own shards; the optimizer comes back through `load_sharded_optimizer_state_dict`."""

    save_api = ("FSDP SHARDED_STATE_DICT + FSDP.optim_state_dict, dcp.save; dcp.load + "
                "load_sharded_optimizer_state_dict + optim_state_dict_to_load")

    def save(self, directory: Path) -> None:
        with FSDP.state_dict_type(self.model, StateDictType.SHARDED_STATE_DICT):
            state = {"model": self.model.state_dict(), "optim": FSDP.optim_state_dict(self.model, self.optimizer)}
        dcp.save(state, checkpoint_id=str(directory))

    def saved(self, directory: Path) -> Saved:
        return dcp_contents(directory)

    def load(self, directory: Path, omit: str | None = None) -> None:
        with FSDP.state_dict_type(self.model, StateDictType.SHARDED_STATE_DICT):
            model_state = self.model.state_dict()
            kept = {"model": {k: v for k, v in model_state.items() if k != omit}}
            dcp.load(kept, checkpoint_id=str(directory))
            model_state.update(kept["model"])
            self.model.load_state_dict(model_state)
            optim = load_sharded_optimizer_state_dict(model_state_dict=model_state, optimizer_key="optim",
                                                      storage_reader=dcp.FileSystemReader(str(directory)))
            optim_state = FSDP.optim_state_dict_to_load(self.model, self.optimizer, optim["optim"])
        self.optimizer.load_state_dict(optim_state)


class _DCPSave(_Loop):
    """FSDP2 as its docs checkpoint it: `get_state_dict` / `dcp.save`, then `dcp.load` / `set_state_dict`."""

    save_api = "torch.distributed.checkpoint: get_state_dict + dcp.save; dcp.load + set_state_dict"

    def save(self, directory: Path) -> None:
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(directory))

    def saved(self, directory: Path) -> Saved:
        return dcp_contents(directory)

    def load(self, directory: Path, omit: str | None = None) -> None:
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        state = {"model": {k: v for k, v in model_state.items() if k != omit}, "optim": optim_state}
        dcp.load(state, checkpoint_id=str(directory))
        model_state.update(state["model"])
        set_state_dict(self.model, self.optimizer, model_state_dict=model_state, optim_state_dict=state["optim"])


def _meta_init(ctx: RunContext, model: nn.Module) -> MetaInit:
    return MetaInit(model, ctx.cell.hyper.seed, ctx.eager_buffers())


def _ddp(ctx: RunContext, model: nn.Module, plan: FreezePlan, find_unused: bool) -> _Loop:
    if ctx.cell.key.init == "meta":
        model.to_empty(device=ctx.device)
        _meta_init(ctx, model).all(model)
    device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    wrapped = DDP(model, device_ids=device_ids, find_unused_parameters=find_unused)
    optimizer = ctx.make_optimizer(optimizer_params(wrapped.module, plan.optimized))
    # A peft model whose trainable params are all its adapter's ships the adapter alone, as peft users do; one
    # whose base trains too (the nothing-frozen control) needs a full save, which is what such a user makes.
    adapter_only = hasattr(model, "peft_config") and set(plan.trainable) <= set(_peft_names(model).values())
    saves = _PeftAdapterSave if adapter_only else _FullSave
    return saves(ctx, wrapped, ParamView(wrapped.module, optimizer), optimizer,
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
    # Both of FSDP1's documented formats are exercised: full with flat params, sharded with original ones.
    saves = _FSDP1ShardedSave if orig_params else _FSDP1FullSave
    return saves(ctx, wrapped, FSDP1View(wrapped, optimizer), optimizer, "returned by FSDP.clip_grad_norm_")


def _fsdp2(ctx: RunContext, model: nn.Module, plan: FreezePlan, reduce_unused: bool = False) -> _Loop:
    """`reduce_unused`: `set_reduce_scatter_unused_params(True)` on every unit, FSDP2's opt-in for params some ranks'
    forwards do not reach (zero grads join the reduce-scatter; in torch 2.13.0, absent in 2.9.0)."""
    for block in models.block_modules(model):
        fully_shard(block)
    wrapped = fully_shard(model)
    if reduce_unused:
        wrapped.set_reduce_scatter_unused_params(True)
    if ctx.cell.key.init == "meta":  # allocate the local shards, then fill each from the deterministic init
        wrapped.to_empty(device=ctx.device)
        _meta_init(ctx, wrapped).all(wrapped)
    optimizer = ctx.make_optimizer(optimizer_params(wrapped, plan.optimized))
    return _DCPSave(ctx, wrapped, DTensorView(wrapped, optimizer), optimizer,
                    "returned by torch.nn.utils.clip_grad_norm_ (DTensor)")


#: Plugin id -> how a user wraps the frozen bare model with it.
WRAP: dict[str, Callable[[RunContext, nn.Module, FreezePlan], _Loop]] = {
    "ddp": functools.partial(_ddp, find_unused=False),
    "ddp-find-unused": functools.partial(_ddp, find_unused=True),
    "fsdp1": functools.partial(_fsdp1, orig_params=False),
    "fsdp1-orig-params": functools.partial(_fsdp1, orig_params=True),
    "fsdp2": _fsdp2,
    "fsdp2-reduce-unused": functools.partial(_fsdp2, reduce_unused=True),
}


class TorchAdapter(AdapterBase):
    def run(self, ctx: RunContext) -> None:
        self.run_plugin(ctx, ctx.cell.key.plugin)

    def run_plugin(self, ctx: RunContext, plugin: str) -> None:
        train(ctx, self.build(ctx, plugin), rebuild=lambda: self.build(ctx, plugin))

    @staticmethod
    def build(ctx: RunContext, plugin: str) -> _Loop:
        """What a user's script does before its first step (and again when it resumes)."""
        ctx.probe.phase("build model")
        model = ctx.build_model(device="meta" if ctx.cell.key.init == "meta" else ctx.device)
        plan = ctx.resolve_plan(model)
        apply_freeze(plan, model)
        ctx.probe.phase(f"wrap ({plugin})")
        loop = WRAP[plugin](ctx, model, plan)
        _observe(ctx.probe, loop.model)
        dist.barrier()
        return loop


def _observe(probe: Probe, wrapped: nn.Module) -> None:
    """The wrapper as it was built, read back from it (`promises` in the package's declaration)."""
    probe.observed("wrapper", class_among(wrapped, (DDP, FSDP, FSDPModule)))
    probe.observed("precision", precision_of(wrapped))
    if isinstance(wrapped, DDP):
        probe.observed("find_unused_parameters", wrapped.find_unused_parameters)
    if isinstance(wrapped, FSDP):
        probe.observed("use_orig_params", wrapped._use_orig_params)
        probe.observed("sharding_strategy", wrapped.sharding_strategy.name)
