"""The `accelerate-*` driver: a user's own training loop around `Accelerator`.

What an Accelerate user writes: build and freeze the bare model, AdamW over the params they mean to train,
`model, optimizer = accelerator.prepare(model, optimizer)`, then per step `optimizer.zero_grad()`,
`accelerator.backward(loss)`, `accelerator.clip_grad_norm_(model.parameters(), max_norm)`, `optimizer.step()`.
The round trip is `accelerator.save_state(folder)` / `accelerator.load_state(folder)` in a fresh `Accelerator`.
FSDP1 saves with `SHARDED_STATE_DICT`: its full state dict (Accelerate's FSDP1 default) offloads to the CPU when
there are several processes, which on CPU params frees the storage the state dict reads (rank 0 SIGSEGV); the
`-full-state-dict` plugins save the full one behind the shim's two labelled FSDP1 offload patches (`emulation`).
Each `AccelerateLoop` starts from a fresh Accelerate state and checks the stack it got (`state`).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import Accelerator, FullyShardedDataParallelPlugin
from torch import nn
from torch.distributed.tensor import DTensor

from ... import models
from ...core.freeze import FreezePlan
from ..base import RunContext, apply_freeze, strip_wrapper_infixes
from ..loop import Saved
from ..saved_files import dcp_keys, index_names, load_file, state_names
from ..views import FSDP1_INFIXES, DTensorView, FSDP1View, ParamView, optimizer_params, settle_groups
from . import staged, state
from .emulation import OWNED_ENV

#: A plugin id with this suffix saves FSDP1's full state dict (Accelerate's FSDP1 default), behind the shim's two
#: FSDP1 offload patches (see `emulation`); without it FSDP1 saves sharded.
FULL_STATE_DICT_SUFFIX = "-full-state-dict"
#: plugin -> (FSDP version or None for DDP, use_orig_params for FSDP1, the wrapper `state.wrapper_kind` must see).
PLUGINS: dict[str, tuple[int | None, bool | None, str]] = {
    "accelerate-ddp": (None, None, "ddp"),
    "accelerate-fsdp1": (1, None, "fsdp1-flat"),  # None: the plugin's own default (use_orig_params=False)
    "accelerate-fsdp1-orig-params": (1, True, "fsdp1-orig-params"),
    "accelerate-fsdp2": (2, None, "fsdp2"),
    **{f"accelerate-fsdp1{o}{FULL_STATE_DICT_SUFFIX}": (1, orig, f"fsdp1-{'orig-params' if orig else 'flat'}")
       for o, orig in (("", None), ("-orig-params", True))},
}
#: FSDP1's full state dict segfaults on CPU (see the module docstring); FSDP2 keeps Accelerate's default (sharded).
FSDP1_STATE_DICT = "SHARDED_STATE_DICT"


def fsdp_plugin(version: int, orig_params: bool | None, block_classes: list[str],
                full_state_dict: bool = False, peft_model: nn.Module | None = None) -> FullyShardedDataParallelPlugin:
    """The plugin a user passes: every block wrapped on its own (`transformer_based_wrap`), the rest defaults; FSDP1
    around a peft model takes peft's `fsdp_auto_wrap_policy` (its FSDP docs: each trainable leaf in a unit of its
    own, so that flat params never mix frozen and trainable)."""
    kwargs: dict[str, object] = {"fsdp_version": version, "auto_wrap_policy": "transformer_based_wrap",
                                 "transformer_cls_names_to_wrap": block_classes}
    if version == 1 and peft_model is not None:
        from peft.utils.other import fsdp_auto_wrap_policy

        kwargs = {"fsdp_version": version, "auto_wrap_policy": fsdp_auto_wrap_policy(peft_model)}
    if version == 1:
        kwargs["state_dict_type"] = "FULL_STATE_DICT" if full_state_dict else FSDP1_STATE_DICT
        if orig_params is not None:
            kwargs["use_orig_params"] = orig_params
    return FullyShardedDataParallelPlugin(**kwargs)


def _unwrap(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The user's optimizer inside Accelerate's `AcceleratedOptimizer`."""
    return getattr(optimizer, "optimizer", optimizer)


def user_model(ctx: RunContext) -> tuple[nn.Module, FreezePlan, tuple[str, ...]]:
    """The user's script up to the optimizer: a fresh process (the shim's variables only, no shared Accelerate
    state), the model built and frozen, a staged unfreeze's params held frozen until the optimizer is built."""
    state.fresh(keep=OWNED_ENV if ctx.cell.emulation else ())
    ctx.probe.phase("build model")
    model = ctx.build_model(device=ctx.device)
    plan = ctx.resolve_plan(model)
    apply_freeze(plan, model)
    late = staged.late_params(ctx)
    staged.hold(model, late)
    return model, plan, late


class AccelerateLoop:
    """One `Accelerator`, its prepared model and optimizer: a `loop.Loop` and `loop.Resumable`."""

    clips_in_step = False
    save_api = "accelerator.save_state(folder); a fresh Accelerator's load_state(folder)"

    def __init__(self, ctx: RunContext, plugin: str) -> None:
        self.ctx, self.plugin = ctx, plugin
        version, orig_params, self.wrapper = PLUGINS[plugin]
        model, plan, late = user_model(ctx)
        ctx.probe.phase(f"wrap (Accelerator, {plugin})")
        if version is None:
            self.accelerator = Accelerator(cpu=ctx.device.type == "cpu")
            self.want_type = "MULTI_CPU" if ctx.device.type == "cpu" else "MULTI_GPU"
        else:
            blocks = sorted({type(m).__name__ for m in models.block_modules(model)})
            self.accelerator = Accelerator(fsdp_plugin=fsdp_plugin(
                version, orig_params, blocks, full_state_dict=plugin.endswith(FULL_STATE_DICT_SUFFIX),
                peft_model=model if hasattr(model, "peft_config") else None))
            self.want_type = "FSDP"
        ctx.probe.phase(f"wrap (accelerator.prepare, {plugin})")
        if version == 1:
            # Accelerate's FSDP1 recipe: prepare the model first, then build the optimizer over the wrapped params
            # (prepared together with flat params, the optimizer kept the params FSDP1 had flattened away: 1.15.0).
            self.model = self.accelerator.prepare(model)
            self.optimizer = self.accelerator.prepare(ctx.make_optimizer(optimizer_params(self.model, plan.optimized)))
        else:  # DDP keeps the params; FSDP2 must have both at once (Accelerate swaps the optimizer's params)
            optimizer = ctx.make_optimizer(optimizer_params(model, plan.optimized))
            self.model, self.optimizer = self.accelerator.prepare(model, optimizer)
        staged.release(model, late)
        state.observe(ctx.probe, self.accelerator, self.model)
        state.check(plugin, self.want_type, self.wrapper, self.accelerator, self.model, ctx.world_size)
        inner = _unwrap(self.optimizer)
        if self.wrapper == "ddp":
            self.view: ParamView = ParamView(self.model.module, inner)
        elif self.wrapper == "fsdp2":
            self.view = DTensorView(self.model, inner)
        else:
            self.view = FSDP1View(self.model, inner)
        dist.barrier()

    # Loop

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def forward_backward(self, step: int) -> None:
        self.accelerator.backward(self.ctx.loss(self.model, self.ctx.local_batch(step)))

    def clip(self, max_norm: float) -> tuple[float | None, str]:
        norm = self.accelerator.clip_grad_norm_(self.model.parameters(), max_norm)
        if norm is None:
            return None, "accelerator.clip_grad_norm_ returned None"
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        return float(norm), "returned by accelerator.clip_grad_norm_"

    def step(self) -> None:
        self.optimizer.step()

    def norm_after_step(self) -> tuple[float | None, str]:
        raise AssertionError("the user's loop clips before optimizer.step()")

    # Resumable

    def save(self, directory: Path) -> None:
        self.accelerator.save_state(str(directory))
        dist.barrier()

    def saved(self, directory: Path) -> Saved:
        return saved_contents(directory, self._names_by_index())

    def close(self) -> None:
        settle_groups()
        dist.barrier()
        self.accelerator.free_memory()
        self.model = self.optimizer = None  # type: ignore[assignment]

    def load(self, directory: Path, omit: str | None = None) -> None:
        kept = self._fresh_value(omit) if omit is not None else None
        self.accelerator.load_state(str(directory))
        if self.ctx.rank == 0:  # a fact for the report: Adam's moments after the load (0: a fresh optimizer)
            inner = _unwrap(self.optimizer)
            self.ctx.probe.note(f"after load_state rank 0's optimizer holds state for {len(inner.state)} of its "
                                f"{sum(len(g['params']) for g in inner.param_groups)} params "
                                "(a param whose local shard is empty has none)")
        if kept is not None:
            with torch.no_grad():
                kept[0].copy_(kept[1])

    def _fresh_value(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(the param's local tensor, its fresh value): `omit` puts it back after the load, as a broken load would
        leave it. Whole params and DTensor shards only; FSDP1's flat params hold many params in one."""
        if isinstance(self.view, FSDP1View):
            raise NotImplementedError("omit (tests only) is not implemented for FSDP1's flat params")
        param = self.view.named_parameters()[name]
        local = param.to_local() if isinstance(param, DTensor) else param
        return local, local.detach().clone()

    def _names_by_index(self) -> dict[int, str]:
        return index_names(self.view.named_parameters(), _unwrap(self.optimizer))


#: What `save_state` names its model and optimizer files and folders (Accelerate's constants, spelled out so the
#: reader sees when a release renames them: it then reads nothing and the `resume` check says so).
MODEL_PREFIXES = ("model", "pytorch_model")
OPTIMIZER_PREFIX = "optimizer"


def _bare(name: str) -> str:
    return strip_wrapper_infixes(name.removeprefix("module."), FSDP1_INFIXES)


def saved_contents(directory: Path, names_of: dict[int, str]) -> Saved:
    """What `save_state` wrote, by the bare model's names: a safetensors / `torch.save` file (DDP, full state dicts)
    or a DCP folder (sharded state dicts) for the model, and the same for the optimizer."""
    params: set[str] = set()
    optimized: set[str] = set()
    for path in sorted(directory.iterdir()):
        if path.name.startswith(MODEL_PREFIXES):
            params.update(_bare(k) for k in _model_keys(path))
        elif path.name.startswith(OPTIMIZER_PREFIX):
            optimized.update(_optimizer_names(path, names_of))
    return Saved(frozenset(params), frozenset(optimized))


def _model_keys(path: Path) -> list[str]:
    if path.is_dir():  # DCP: {"model": state_dict}
        return [k.removeprefix("model.") for k in dcp_keys(path)]
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as opened:
            return list(opened.keys())
    return list(load_file(path))


def _optimizer_names(path: Path, names_of: dict[int, str]) -> frozenset[str]:
    if path.is_dir():  # DCP: {"optimizer": optim_state_dict} keyed by param name
        prefix = "optimizer.state."
        return state_names((k[len(prefix):] for k in dcp_keys(path) if k.startswith(prefix)), _bare)
    saved = load_file(path)
    return frozenset(_bare(names_of.get(k, str(k))) if isinstance(k, int) else _bare(k)
                     for k, v in saved.get("state", {}).items() if v)

