"""Accelerate's process-wide singletons and environment variables, and the check that a cell got its stack.

`Accelerator` and `FullyShardedDataParallelPlugin` write `ACCELERATE_*` / `FSDP_*` environment variables
(`ACCELERATE_USE_FSDP`, `FSDP_CPU_RAM_EFFICIENT_LOADING`, ...) and read them back as defaults; the shared state
they keep survives a cell in a warm rank. `AcceleratorState._reset_state(True)` clears the shared state, not the
variables: a warm rank would run the next cell with the previous cell's FSDP settings (HF-STACK.md §2). Every
cell starts from `fresh()` and ends with `check()` of what it got.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

#: The environment variable prefixes Accelerate and Transformers write and read as defaults.
ENV_PREFIXES = ("ACCELERATE_", "FSDP_")


class StackMismatch(RuntimeError):
    """The stack a cell got is not the one its plugin asked for (a leaked variable, a silent fallback)."""


def clear_environment(keep: Iterable[str] = ()) -> list[str]:
    """Remove every `ACCELERATE_*` / `FSDP_*` variable except `keep`; the names removed, sorted."""
    kept = set(keep)
    removed = sorted(name for name in os.environ if name.startswith(ENV_PREFIXES) and name not in kept)
    for name in removed:
        del os.environ[name]
    return removed


def reset_state() -> None:
    """Accelerate's shared state (`AcceleratorState`, `PartialState`, `GradientState`) as a fresh process has it."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def fresh(keep: Iterable[str] = ()) -> list[str]:
    """What a user's fresh process starts from: no Accelerate variable but `keep`, no shared state."""
    removed = clear_environment(keep)
    reset_state()
    return removed


def wrapper_kind(model: object) -> str:
    """`ddp`, `fsdp1-flat`, `fsdp1-orig-params`, `fsdp2`, `deepspeed` or the class name: what wraps the prepared
    model."""
    import sys

    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.nn.parallel import DistributedDataParallel as DDP

    if isinstance(model, DDP):
        return "ddp"
    if isinstance(model, FSDP):
        return "fsdp1-orig-params" if model._use_orig_params else "fsdp1-flat"
    if isinstance(model, FSDPModule):
        return "fsdp2"
    engine = sys.modules.get("deepspeed.runtime.engine")  # imported where an engine can exist
    if engine is not None and isinstance(model, engine.DeepSpeedEngine):
        return "deepspeed"
    return type(model).__name__


def check(plugin: str, want_type: str, want_wrapper: str, accelerator: object, model: object,
          world_size: int) -> None:
    """Raise `StackMismatch` unless the prepared stack is the one asked for: Accelerate's distributed type, its
    process count and the wrapper around the model."""
    got_type = str(getattr(accelerator, "distributed_type", None)).rpartition(".")[2]
    got_processes = getattr(accelerator, "num_processes", None)
    got_wrapper = wrapper_kind(model)
    if (got_type, got_processes, got_wrapper) != (want_type, world_size, want_wrapper):
        raise StackMismatch(
            f"{plugin} asked for distributed_type={want_type}, num_processes={world_size}, wrapper {want_wrapper}; "
            f"Accelerate gave distributed_type={got_type}, num_processes={got_processes}, wrapper {got_wrapper} "
            f"(a leaked ACCELERATE_*/FSDP_* variable, or Accelerate's silent CPU fallback to DDP or to one process)")
