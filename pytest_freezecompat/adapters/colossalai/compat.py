"""Where ColossalAI's releases differ in what the adapter calls, one small function per difference.

The matrix runs 0.3.4 (the last release with C1's param-op hook assert), 0.4.7 (the last before LazyInit kept
`requires_grad`, C2) and 0.5.0. Each function detects the feature it needs (an attribute, a keyword, a module)
and falls back to what the older release offers; none changes what the stack does.
"""

from __future__ import annotations

import importlib.util
import inspect
from typing import Any

import torch
from torch import nn

from ..views import all_gather_json, all_gather_tensors


def has_accelerator_api() -> bool:
    """`colossalai.accelerator` (0.3.5 on) picks the device; up to 0.3.4 `colossalai.utils.get_current_device`
    and direct `torch.cuda` calls do, so the CPU shim needs other patches there."""
    return importlib.util.find_spec("colossalai.accelerator") is not None


def unwrap_model(model: Any) -> nn.Module:
    """The bare model behind a boosted one, a peft model kept whole (its names are the ones the cell froze by).

    0.5.0's `ModelWrapper.unwrap` also unwraps a peft model unless `unwrap_peft=False`; earlier releases take
    no argument and never unwrap peft."""
    if "unwrap_peft" in inspect.signature(model.unwrap).parameters:
        return model.unwrap(unwrap_peft=False)
    return model.unwrap()


def reuses_fp16_chunk(gemini_model: Any) -> bool:
    """Whether Gemini writes a param's grad into its own bf16 chunk (else into `chunk.grad_chunk`).

    The flag sits on `ChunkManager` from 0.4 on and on `GeminiDDP` itself in 0.3.x."""
    manager = gemini_model.chunk_manager
    if hasattr(manager, "reuse_fp16_chunk"):
        return bool(manager.reuse_fp16_chunk)
    return bool(gemini_model.reuse_fp16_chunk)


def reported_grad_norm(optimizer: Any) -> tuple[float | None, str | None]:
    """(the norm the last `step()` clipped by, None) where the optimizer reports it (`get_grad_norm`, 0.4 on);
    (None, why) where the release keeps that norm to itself (0.3.x computes it inside `step()` and drops it)."""
    get_grad_norm = getattr(optimizer, "get_grad_norm", None)
    if get_grad_norm is None:
        return None, f"{type(optimizer).__name__} of this release has no get_grad_norm (added in 0.4)"
    norm = get_grad_norm()
    return (None if norm is None else float(norm)), None


def zero_grad_access(optimizer: Any, documented: str) -> str:
    """Where a ZeRO param's grad is read, for the report: `documented` (`get_param_grad`) where the release has
    it, else the 0.3.x grad store that `zero_param_grads` reads."""
    if hasattr(optimizer, "get_param_grad"):
        return documented
    return ("optimizer._grad_store._grads_of_params[group][id(param)] (this release has no get_param_grad; "
            "param.grad is None): the working slice all-gathered; params outside the optimizer keep their "
            "rank-local param.grad")


def zero_param_grads(optimizer: Any, params: list[nn.Parameter]) -> list[torch.Tensor | None]:
    """Each ZeRO param's full, reduced grad, or None where it got none (a collective: every rank, the same params).

    What `LowLevelZeroOptimizer.get_param_grad` (0.4 on) gives one param at a time, one all_gather each (a third
    of a LowLevelZero cell's probes): here one all_gather for every param of a process group. A param's grad is
    kept flat and sharded, each rank's slice the same size (padded to a multiple of the ranks): the ranks' slices
    in rank order, cut to the param's size. In 0.3.x the grad store keeps, per param group and param id, the slices
    this rank holds (every rank's slice under stage 1, its own under stage 2), its own at `_working_index`. A store
    over several groups (0.4's n-d tuple) takes `get_param_grad`.

    The ranks may hold slices of different params: where their forwards reached different params, ZeRO's buckets
    paired one rank's grad with another's (`rank-divergent`). A param only some ranks hold a slice of has no whole
    grad anywhere: None, which the verdict judges against the reference's grad (never a grad made up here)."""
    grads: list[torch.Tensor | None] = [None] * len(params)
    by_group: dict[int, tuple[Any, list[tuple[int, torch.Tensor]]]] = {}
    for index, param in enumerate(params):
        local, group = _own_grad_slice(optimizer, param)
        if isinstance(group, tuple):
            grads[index] = None if local is None else optimizer.get_param_grad(param)
            continue
        held = by_group.setdefault(id(group), (group, []))[1]  # every rank joins its group's gather, holding or not
        if local is not None:
            held.append((index, local.flatten()))
    for group, held in by_group.values():
        sizes = all_gather_json([[index, local.numel()] for index, local in held], group)
        by_rank = all_gather_tensors([local for _, local in held], group,
                                     shapes=[[[size] for _, size in rank_sizes] for rank_sizes in sizes])
        slices = [{index: piece for (index, _), piece in zip(rank_sizes, pieces)}
                  for rank_sizes, pieces in zip(sizes, by_rank)]
        for index, local in held:
            if all(index in rank_slices for rank_slices in slices):
                whole = torch.cat([rank_slices[index] for rank_slices in slices])[:params[index].numel()]
                grads[index] = whole.view_as(params[index]).to(local.device, local.dtype)
    return grads


def _own_grad_slice(optimizer: Any, param: nn.Parameter) -> tuple[torch.Tensor | None, Any]:
    """This rank's slice of `param`'s reduced grad and the process group its slices are spread over."""
    if hasattr(optimizer, "pid_to_grad_store"):
        store = optimizer.pid_to_grad_store[id(param)]
        return store.get_working_grad_by_param_id(id(param)), store.torch_pg
    store = optimizer._grad_store
    slices = next((group[id(param)] for group in store._grads_of_params.values() if id(param) in group), None)
    return (slices[store._working_index] if slices else None), optimizer.dp_pg


def log_call_sites_from_the_frame() -> None:
    """ColossalAI's `DistributedLogger` names its caller (`file:line function`) with `inspect.stack()` on every
    `info`/`debug`/`warning`/`error`, before the level drops the message: every frame's source is looked up and
    `inspect.getmodule` scans `sys.modules` for each frame. Gemini's backward logs at debug level: in a slice of
    HybridParallel ZeRO-1, LowLevelZero-1 and Gemini cells it took 17.6% of the ranks' CPU. The same three values,
    read from the caller's frame (what `inspect.stack()[2]` holds for a source file); nothing logged changes, and
    logging is not what a cell tests. Every release from 0.3.4 to 0.5.0 has the same private helper."""
    import sys

    from colossalai.logging.logger import DistributedLogger

    def call_info() -> tuple[str, int, str]:
        caller = sys._getframe(2)  # 0: here, 1: the logger's info/debug/..., 2: who logged
        return caller.f_code.co_filename, caller.f_lineno, caller.f_code.co_name

    if hasattr(DistributedLogger, "_DistributedLogger__get_call_info"):
        DistributedLogger._DistributedLogger__get_call_info = staticmethod(call_info)
