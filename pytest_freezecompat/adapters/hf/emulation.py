"""CUDA-on-CPU shim for Accelerate's FSDP paths, engaged only for cells a rule marks `emulation = true`.

Accelerate switches to FSDP only from its GPU-like distributed types: `Accelerator(cpu=True, fsdp_plugin=...)`
silently wraps in DDP, and without `cpu=True` on a machine with no GPU every rank runs alone (HF-STACK.md §2).
The shim makes `PartialState._prepare_backend` answer what it answers on a GPU host (the multi-GPU type), with
gloo as the backend, and points Accelerate's device at the CPU (`ACCELERATE_TORCH_DEVICE=cpu`, a variable
Accelerate reads for exactly that). Both are device plumbing: wrapping, the optimizer, clipping and the
checkpoint code run as shipped. The patch reports itself when `PartialState` really asks for a backend.

FSDP1's full state dict (Accelerate's FSDP1 default; the `-full-state-dict` plugins) gathers with
`offload_to_cpu=True` whenever there are several processes, which on CPU params frees the storage the state dict
reads: the shim takes the shared FSDP1 patches for that (`adapters.emulation.fsdp1_cpu_offload_patches`, Composer's
too).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
from accelerate.state import PartialState
from accelerate.utils import DistributedType

from ...core.cell import Cell
from ..base import Probe
from ..emulation import Patch, Shim, fsdp1_cpu_offload_patches

BACKEND = ("PartialState._prepare_backend -> ('gloo', DistributedType.MULTI_GPU), device from "
           "ACCELERATE_TORCH_DEVICE=cpu (Accelerate takes FSDP and DeepSpeed only from a GPU-like distributed type; on "
           "CPU it silently falls back to DDP, or to one process per rank)")
#: The variables the shim sets for the length of a cell: a fresh state keeps them (see `state.fresh`).
OWNED_ENV = {"ACCELERATE_TORCH_DEVICE": "cpu"}


def _gloo_multi_gpu(report: Callable[[], None], original: Callable[..., Any]) -> Callable[..., Any]:
    def prepare_backend(self: Any, cpu: bool = False, sagemaker_dp: bool = False,
                        backend: str | None = None) -> tuple[str, DistributedType]:
        report()
        return "gloo", DistributedType.MULTI_GPU

    return prepare_backend


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
                *fsdp1_cpu_offload_patches("Accelerate's full state dict")]

    def contexts(self, cell: Cell, probe: Probe, device: torch.device) -> list[contextlib.AbstractContextManager]:
        return [_environment()]


SHIM = AccelerateShim()
