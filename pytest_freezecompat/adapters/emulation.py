"""The one shim interface: CUDA-on-CPU patches that report themselves only when they really engage.

A shim may replace device plumbing (devices, streams, synchronize, memory queries) and arithmetic
kernels with the same math; it never touches the freeze logic a cell tests. Each adapter's
`emulation.py` defines a `Shim` whose `patches(cell, device)` lists `Patch`es; `apply` installs them
for one cell, wraps every replacement so its first real call is reported through
`probe.emulated(what)`, and restores the originals when the cell ends.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..core.cell import Cell
from .base import Probe


@dataclass(frozen=True)
class Patch:
    owner: Any  # a module, class or object
    name: str
    #: `replacement(report, original)` -> the new attribute; call `report()` where it really engages.
    replacement: Callable[[Callable[[], None], Any], Any]
    what: str  # for the report, e.g. "torch.cuda.current_device -> cpu"


def reporting(what: str, probe: Probe) -> Callable[[], None]:
    return functools.partial(probe.emulated, what)


def always(value: Callable[..., Any]) -> Callable[[Callable[[], None], Any], Any]:
    """A replacement that engages on every call: report, then call `value`."""

    def make(report: Callable[[], None], original: Any) -> Callable[..., Any]:
        @functools.wraps(value)
        def replaced(*args: Any, **kwargs: Any) -> Any:
            report()
            return value(*args, **kwargs)

        return replaced

    return make


class Shim:
    """Subclass and define `patches`; `contexts` adds context managers (e.g. a TorchFunctionMode)."""

    def patches(self, cell: Cell, device: torch.device) -> list[Patch]:
        raise NotImplementedError

    def contexts(self, cell: Cell, probe: Probe, device: torch.device) -> list[contextlib.AbstractContextManager]:
        return []

    @contextlib.contextmanager
    def apply(self, cell: Cell, probe: Probe, device: torch.device) -> Iterator[None]:
        if device.type != "cpu":  # on a GPU the stack runs as shipped
            yield
            return
        patches = self.patches(cell, device)
        saved = [(p.owner, p.name, p.owner.__dict__.get(p.name, _ABSENT) if hasattr(p.owner, "__dict__")
                  else getattr(p.owner, p.name)) for p in patches]
        try:
            for patch in patches:
                setattr(patch.owner, patch.name,
                        patch.replacement(reporting(patch.what, probe), getattr(patch.owner, patch.name, None)))
            with contextlib.ExitStack() as stack:
                for context in self.contexts(cell, probe, device):
                    stack.enter_context(context)
                yield
        finally:
            for owner, name, original in reversed(saved):
                if original is _ABSENT:
                    with contextlib.suppress(AttributeError):
                        delattr(owner, name)
                else:
                    setattr(owner, name, original)


_ABSENT = object()

#: Where FSDP1 unflattens an optimizer state it gathered (`_unflatten_orig_param_states`).
FSDP1_OPTIM_UTILS = "torch.distributed.fsdp._optim_utils"


def fsdp1_cpu_offload_patches(saver: str) -> list[Patch]:
    """FSDP1's full state dict gathered with `offload_to_cpu=True` (made for CUDA params; `saver` asks for it, e.g.
    "Composer's full checkpoint"), on params that already live on the CPU.

    `FlatParamHandle.to_cpu` "moves" the unsharded flat param to the CPU and frees the storage it came from: for a
    param already on the CPU the move is a no-op and the freed storage is the one the state dict then reads (rank 0
    dies with SIGSEGV / SIGABRT). With `use_orig_params`, FSDP1 gathers each optimizer state (exp_avg, then
    exp_avg_sq) into one reused buffer and, offloading, relies on `.cpu()` to copy each out: on CPU tensors that is
    no copy, and every state saved ends up holding the last one gathered. The first patch makes the move a no-op
    without the free, the second takes FSDP's own non-offload branch (a clone): what a copy from CUDA to the CPU
    gives a GPU run."""
    from torch.distributed.fsdp._flat_param import FlatParamHandle

    return [Patch(FlatParamHandle, "to_cpu", _to_cpu_without_free,
                  "FSDP1 FlatParamHandle.to_cpu -> no-op for a flat param already on the CPU (the offload_to_cpu "
                  f"of {saver} would free the storage the state dict reads)"),
            Patch(importlib.import_module(FSDP1_OPTIM_UTILS), "_unflatten_orig_param_states", _clone_cpu_optim_state,
                  "FSDP1 optimizer state (use_orig_params) gathered on the CPU: cloned out of FSDP's reused gather "
                  "buffer, as offload_to_cpu's .cpu() copies it from CUDA")]


def _to_cpu_without_free(report: Callable[[], None], to_cpu: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """`FlatParamHandle.to_cpu` (a context manager): where the flat param already lives on the CPU, leave it,
    instead of `flat_param_to(cpu)` (the same storage) followed by `_free_unsharded_flat_param()` (freeing it)."""

    @contextlib.contextmanager
    def cpu_to_cpu(self: Any) -> Iterator[None]:
        if self.flat_param.device.type != "cpu":
            with to_cpu(self):
                yield
            return
        report()
        yield

    return cpu_to_cpu


def _clone_cpu_optim_state(report: Callable[[], None], unflatten: Callable[..., None]) -> Callable[..., None]:
    """`_unflatten_orig_param_states(info, output_states, state_name, shard_state, to_save, cpu_offload)`: with
    the gathered state already on the CPU, take its `not cpu_offload` branch (`.detach().clone()`)."""

    def cloned(fsdp_param_info: Any, output_states: Any, state_name: str, shard_state: bool, to_save: bool,
               cpu_offload: bool) -> None:
        if cpu_offload and fsdp_param_info.state.compute_device.type == "cpu":
            report()
            cpu_offload = False
        unflatten(fsdp_param_info, output_states, state_name, shard_state, to_save, cpu_offload)

    return cloned
