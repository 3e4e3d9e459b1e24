"""CUDA-on-CPU shim for Composer's FSDP paths, engaged only for cells a rule marks `emulation = true`.

Composer names CUDA outright where plain PyTorch would take the module's device:
FSDP1 wrapping passes `device_id=torch.cuda.current_device()`, its meta-init hook
calls `module.to_empty(device=f"cuda:{torch.cuda.current_device()}")`, and the
FSDP2 meta init calls `module.to_empty(device="cuda")`. While the Trainer wraps
the model, this shim answers those two calls with the CPU, and nothing else;
everything is restored when the `with` block ends. Each redirect reports itself
through `probe.emulated` the first time it is actually used.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ...core.cell import Cell
from ..emulation import Patch, Shim, always

CURRENT_DEVICE = "torch.cuda.current_device() -> cpu (Composer passes it to FSDP1 as device_id)"
TO_EMPTY = "nn.Module.to_empty(device='cuda...') -> cpu (Composer's meta-init hook materializes on CUDA)"


def _cpu_device() -> torch.device:
    return torch.device("cpu")


def _to_empty_on_cpu(report: Callable[[], None], to_empty: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    def cpu_to_empty(self: nn.Module, *, device: Any, recurse: bool = True) -> nn.Module:
        if str(device).startswith("cuda"):  # "cuda", "cuda:0" and "cuda:cpu" (a cpu current_device in an f-string)
            report()
            device = "cpu"
        return to_empty(self, device=device, recurse=recurse)

    return cpu_to_empty


class ComposerShim(Shim):
    def patches(self, cell: Cell, device: torch.device) -> list[Patch]:
        return [Patch(torch.cuda, "current_device", always(_cpu_device), CURRENT_DEVICE),
                Patch(nn.Module, "to_empty", _to_empty_on_cpu, TO_EMPTY)]


SHIM = ComposerShim()
