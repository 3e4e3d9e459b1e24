"""CUDA-on-CPU emulation for ColossalAI plugins whose real logic runs fine on CPU but asks for CUDA.

Engaged only for cells a matrix rule marks `emulation = true` (never on a GPU), undone when the
cell ends, and every patch that engages is reported through `probe.emulated` (see `adapters.emulation`).
What it patches:

- `CpuAccelerator.Stream`, `.current_stream` and `.stream` become no-ops (CPU ops are synchronous; ColossalAI's
  CPU accelerator raises on them): LowLevelZero's buckets create a stream and its reduction enters the
  current one even without comm/compute overlap (which the matrix turns off on CPU).
- `LowLevelZeroOptimizer._sanity_checks` sees the accelerator named "cuda" for the length of that call
  only: it asserts `name in ["cuda", "npu"]` and nothing else in it depends on a GPU.
- `torch.cuda.current_device` answers the CPU device while `TorchFSDPPlugin.configure` runs: the plugin
  passes it to FSDP as `device_id`, and FSDP itself runs on CPU with gloo.

Gemini is out of reach (its HybridAdam CPU kernel is compiled against `cuda.h`, its chunks move to
CUDA); the matrix skips it on CPU instead.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch

from ...core.cell import Cell
from ..emulation import Patch, Shim, always


def _no_op(*args: Any, **kwargs: Any) -> None:
    return None


def _null_context(*args: Any, **kwargs: Any) -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext()


def _sanity_checks_on_cuda(report: Callable[[], None], original: Callable[..., Any]) -> Callable[..., Any]:
    from colossalai.accelerator import get_accelerator

    @functools.wraps(original)
    def sanity_checks(self: Any) -> None:
        accelerator = get_accelerator()
        if accelerator.name != "cpu":
            return original(self)
        report()
        accelerator._name = "cuda"
        try:
            return original(self)
        finally:
            accelerator._name = "cpu"

    return sanity_checks


def _configure_on_cpu(device: torch.device) -> Callable[[Callable[[], None], Any], Any]:
    def make(report: Callable[[], None], original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def configure(self: Any, *args: Any, **kwargs: Any) -> Any:
            real_current_device = torch.cuda.current_device
            report()
            torch.cuda.current_device = lambda: device  # type: ignore[assignment]
            try:
                return original(self, *args, **kwargs)
            finally:
                torch.cuda.current_device = real_current_device

        return configure

    return make


class ColossalAIShim(Shim):
    def patches(self, cell: Cell, device: torch.device) -> list[Patch]:
        from colossalai.accelerator import get_accelerator
        from colossalai.booster.plugin.torch_fsdp_plugin import TorchFSDPPlugin
        from colossalai.zero.low_level.low_level_optim import LowLevelZeroOptimizer

        accelerator = get_accelerator()
        patches = [Patch(accelerator, name, always(value), f"CpuAccelerator.{name} is a no-op")
                   for name, value in (("Stream", _no_op), ("current_stream", _no_op), ("stream", _null_context))
                   ] if accelerator.name == "cpu" else []
        return [*patches,
                Patch(LowLevelZeroOptimizer, "_sanity_checks", _sanity_checks_on_cuda,
                      "LowLevelZeroOptimizer._sanity_checks sees accelerator 'cuda'"),
                Patch(TorchFSDPPlugin, "configure", _configure_on_cpu(device),
                      "torch.cuda.current_device -> cpu during TorchFSDPPlugin.configure")]


SHIM = ColossalAIShim()
