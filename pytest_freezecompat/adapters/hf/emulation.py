"""CUDA-on-CPU shim for Accelerate's FSDP paths, engaged only for cells a rule marks `emulation = true`.

Accelerate switches to FSDP only from its GPU-like distributed types: `Accelerator(cpu=True, fsdp_plugin=...)`
silently wraps in DDP, and without `cpu=True` on a machine with no GPU every rank runs alone (HF-STACK.md §2).
The shim makes `PartialState._prepare_backend` answer what it answers on a GPU host (the multi-GPU type), with
gloo as the backend, and points Accelerate's device at the CPU (`ACCELERATE_TORCH_DEVICE=cpu`, a variable
Accelerate reads for exactly that). Both are device plumbing: wrapping, the optimizer, clipping and the
checkpoint code run as shipped. The patch reports itself when `PartialState` really asks for a backend.

FSDP1's full state dict (Accelerate's FSDP1 default; the `-full-state-dict` plugins) gathers with
`offload_to_cpu=True` whenever there are several processes. `FlatParamHandle.to_cpu` "moves" the unsharded flat
param to the CPU and frees the storage it came from: on CPU params the move is a no-op and the freed storage is the
one the state dict reads (rank 0 SIGSEGV). With `use_orig_params`, FSDP1 gathers each optimizer state into one
reused buffer and relies on `.cpu()` to copy it out: on CPU tensors that is no copy, and every saved state holds the
last one gathered. On the CPU the shim makes the first move a no-op without the free and takes FSDP's own
non-offload branch (a clone) for the second: what a copy from CUDA to the CPU gives a GPU run. (The same two
patches as Composer's shim, `adapters/composer/emulation.py`; copied, not shared, to leave that adapter untouched.)
"""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
from accelerate.state import PartialState
from accelerate.utils import DistributedType
from torch.distributed.fsdp._flat_param import FlatParamHandle

from ...core.cell import Cell
from ..base import Probe
from ..emulation import Patch, Shim

BACKEND = ("PartialState._prepare_backend -> ('gloo', DistributedType.MULTI_GPU), device from "
           "ACCELERATE_TORCH_DEVICE=cpu (Accelerate takes FSDP only from a GPU-like distributed type; on CPU it "
           "silently falls back to DDP)")
FSDP1_TO_CPU = ("FSDP1 FlatParamHandle.to_cpu -> no-op for a flat param already on the CPU (the offload_to_cpu "
                "of Accelerate's full state dict would free the storage the state dict reads)")
FSDP1_OPTIM_GATHER = ("FSDP1 optimizer state (use_orig_params) gathered on the CPU: cloned out of FSDP's reused "
                      "gather buffer, as offload_to_cpu's .cpu() copies it from CUDA")
FSDP1_OPTIM_UTILS = "torch.distributed.fsdp._optim_utils"
#: The variables the shim sets for the length of a cell: a fresh state keeps them (see `state.fresh`).
OWNED_ENV = {"ACCELERATE_TORCH_DEVICE": "cpu"}


def _gloo_multi_gpu(report: Callable[[], None], original: Callable[..., Any]) -> Callable[..., Any]:
    def prepare_backend(self: Any, cpu: bool = False, sagemaker_dp: bool = False,
                        backend: str | None = None) -> tuple[str, DistributedType]:
        report()
        return "gloo", DistributedType.MULTI_GPU

    return prepare_backend


def _to_cpu_without_free(report: Callable[[], None], to_cpu: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """`FlatParamHandle.to_cpu` (a context manager): where the flat param already lives on the CPU, leave it."""

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
    """`_unflatten_orig_param_states(info, output_states, state_name, shard_state, to_save, cpu_offload)`: with the
    gathered state already on the CPU, take its `not cpu_offload` branch (`.detach().clone()`)."""

    def cloned(fsdp_param_info: Any, output_states: Any, state_name: str, shard_state: bool, to_save: bool,
               cpu_offload: bool) -> None:
        if cpu_offload and fsdp_param_info.state.compute_device.type == "cpu":
            report()
            cpu_offload = False
        unflatten(fsdp_param_info, output_states, state_name, shard_state, to_save, cpu_offload)

    return cloned


@contextlib.contextmanager
def _environment() -> Iterator[None]:
    """The shim's variables for the length of the cell (PartialState reads them when it is built, then the
    patched `_prepare_backend` reports the pair)."""
    saved = {name: os.environ.get(name) for name in OWNED_ENV}
    os.environ.update(OWNED_ENV)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class AccelerateShim(Shim):
    def patches(self, cell: Cell, device: torch.device) -> list[Patch]:
        return [Patch(PartialState, "_prepare_backend", _gloo_multi_gpu, BACKEND),
                Patch(FlatParamHandle, "to_cpu", _to_cpu_without_free, FSDP1_TO_CPU),
                Patch(importlib.import_module(FSDP1_OPTIM_UTILS), "_unflatten_orig_param_states",
                      _clone_cpu_optim_state, FSDP1_OPTIM_GATHER)]

    def contexts(self, cell: Cell, probe: Probe, device: torch.device) -> list[contextlib.AbstractContextManager]:
        return [_environment()]


SHIM = AccelerateShim()
