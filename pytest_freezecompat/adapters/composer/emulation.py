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

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

CURRENT_DEVICE = "torch.cuda.current_device() -> cpu (Composer passes it to FSDP1 as device_id)"
TO_EMPTY = "nn.Module.to_empty(device='cuda...') -> cpu (Composer's meta-init hook materializes on CUDA)"


@contextmanager
def cuda_on_cpu(report: Callable[[str], None]) -> Iterator[None]:
    """Answer Composer's CUDA device requests with the CPU while it wraps; `report` gets what was used."""
    current_device = torch.cuda.current_device
    to_empty = nn.Module.to_empty

    def cpu_current_device() -> torch.device:
        report(CURRENT_DEVICE)
        return torch.device("cpu")

    def cpu_to_empty(self: nn.Module, *, device: str | torch.device | int | None, recurse: bool = True) -> nn.Module:
        if str(device).startswith("cuda"):  # "cuda", "cuda:0" and "cuda:cpu" (a cpu current_device in an f-string)
            report(TO_EMPTY)
            device = "cpu"
        return to_empty(self, device=device, recurse=recurse)

    torch.cuda.current_device = cpu_current_device
    nn.Module.to_empty = cpu_to_empty  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.cuda.current_device = current_device
        nn.Module.to_empty = to_empty  # type: ignore[method-assign]
