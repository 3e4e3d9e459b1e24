"""Accelerate's process-wide singletons and environment variables, and the check that a cell got its stack.

`Accelerator` and `FullyShardedDataParallelPlugin` write `ACCELERATE_*` / `FSDP_*` environment variables
(`ACCELERATE_USE_FSDP`, `FSDP_CPU_RAM_EFFICIENT_LOADING`, ...) and read them back as defaults; the shared state
they keep survives a cell in a warm rank. `AcceleratorState._reset_state(True)` clears the shared state, not the
variables: a warm rank would run the next cell with the previous cell's FSDP settings (HF-STACK.md §2). Every
cell starts from `fresh()` and ends with `check()` of what it got, after `observe()` has reported it (the facts the
package's declaration promises, read from the accelerator's state and the wrapper it built).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from typing import Any

from ..base import Probe, class_among, precision_of

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


def _wrappers() -> tuple[type, ...]:
    """The classes a prepared model may be, by the names the declaration promises (DeepSpeed's where it is imported:
    an engine exists only where it is)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.nn.parallel import DistributedDataParallel as DDP

    engine = sys.modules.get("deepspeed.runtime.engine")
    return (DDP, FSDP, FSDPModule, *((engine.DeepSpeedEngine,) if engine is not None else ()))


def _driver(accelerator: Any, model: object, trainer: Any) -> str:
    """Who owns the loop: the Trainer inside its `train()` (its `is_in_train`, with `model` the one it wrapped), or
    the user's loop around a model their own `accelerator.prepare` returned (`accelerator._models` keeps it as
    `save_state` saves it: DDP's bare module, FSDP's and DeepSpeed's wrapper)."""
    if trainer is not None:
        if not trainer.is_in_train:
            return "Trainer outside train()"
        return "trainer" if trainer.model_wrapped is model else "a model the Trainer did not wrap"
    bare = accelerator.unwrap_model(model)
    prepared = any(m is model or m is bare for m in accelerator._models)
    return "accelerate" if prepared else "a model accelerator.prepare did not return"


def observe(probe: Probe, accelerator: Any, model: Any, trainer: Any = None) -> None:
    """What Accelerate built, read back from its state and the prepared model (`promises` in the package's
    declaration): the wrapper's class, the distributed type, who drives the loop, the precision it computes in, and
    FSDP's version, state dict type, flat or original params and sharding, or ZeRO's stage from the engine."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    state = accelerator.state
    wrapper = class_among(model, _wrappers())
    probe.observed("wrapper", wrapper)
    # Accelerate's mixed precision casts in autocast or FSDP's policy over fp32 params; "no": the params' own dtype.
    probe.observed("precision", accelerator.mixed_precision if accelerator.mixed_precision != "no"
                   else precision_of(model))
    probe.observed("distributed_type", state.distributed_type.name)
    probe.observed("driver", _driver(accelerator, model, trainer))
    if trainer is not None:  # the library's class under the cell's subclass: Trainer, or TRL's SFTTrainer
        probe.observed("trainer", next(c.__name__ for c in type(trainer).__mro__
                                       if c.__module__.startswith(("transformers.", "trl."))))
    if state.distributed_type.name == "FSDP":
        probe.observed("fsdp_version", state.fsdp_plugin.fsdp_version)
        probe.observed("state_dict_type", state.fsdp_plugin.state_dict_type.name)
    if isinstance(model, FSDP):
        probe.observed("use_orig_params", model._use_orig_params)
        probe.observed("sharding_strategy", model.sharding_strategy.name)
    if wrapper == "DeepSpeedEngine":
        probe.observed("zero_stage", model.zero_optimization_stage())
