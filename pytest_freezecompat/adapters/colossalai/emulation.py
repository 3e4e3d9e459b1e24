"""CUDA-on-CPU emulation for ColossalAI plugins whose real logic runs fine on CPU but asks for CUDA.

Engaged only for cells a matrix rule marks `emulation = true` (never on a GPU), undone when the
cell ends, and every patch that engages is reported through `probe.emulated`. What it patches:

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
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .base import Probe

_ACCELERATOR_NO_OPS: dict[str, Callable[..., Any]] = {
    "Stream": lambda *args, **kwargs: None,
    "current_stream": lambda *args, **kwargs: None,
    "stream": lambda *args, **kwargs: contextlib.nullcontext(),
}


@contextlib.contextmanager
def _accelerator_no_ops(probe: Probe) -> Iterator[None]:
    from colossalai.accelerator import get_accelerator

    accelerator = get_accelerator()
    if accelerator.name != "cpu":
        yield
        return
    for name, no_op in _ACCELERATOR_NO_OPS.items():
        setattr(accelerator, name, _reported(no_op, probe, f"CpuAccelerator.{name} is a no-op"))
    try:
        yield
    finally:
        for name in _ACCELERATOR_NO_OPS:
            accelerator.__dict__.pop(name, None)


def _reported(func: Callable[..., Any], probe: Probe, what: str) -> Callable[..., Any]:
    """`func`, reporting `what` the first time it is really called (so the report lists only engaged patches)."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        probe.emulated(what)
        return func(*args, **kwargs)

    return wrapper


@contextlib.contextmanager
def _zero_device_check(probe: Probe) -> Iterator[None]:
    from colossalai.accelerator import get_accelerator
    from colossalai.zero.low_level.low_level_optim import LowLevelZeroOptimizer

    original = LowLevelZeroOptimizer.__dict__["_sanity_checks"]

    @functools.wraps(original)
    def sanity_checks(self: Any) -> None:
        accelerator = get_accelerator()
        if accelerator.name != "cpu":
            return original(self)
        probe.emulated("LowLevelZeroOptimizer._sanity_checks sees accelerator 'cuda'")
        accelerator._name = "cuda"
        try:
            return original(self)
        finally:
            accelerator._name = "cpu"

    LowLevelZeroOptimizer._sanity_checks = sanity_checks
    try:
        yield
    finally:
        LowLevelZeroOptimizer._sanity_checks = original


@contextlib.contextmanager
def _fsdp_device(probe: Probe, device: torch.device) -> Iterator[None]:
    from colossalai.booster.plugin.torch_fsdp_plugin import TorchFSDPPlugin

    original = TorchFSDPPlugin.__dict__["configure"]

    @functools.wraps(original)
    def configure(self: Any, *args: Any, **kwargs: Any) -> Any:
        real_current_device = torch.cuda.current_device
        probe.emulated("torch.cuda.current_device -> cpu during TorchFSDPPlugin.configure")
        torch.cuda.current_device = lambda: device  # type: ignore[assignment]
        try:
            return original(self, *args, **kwargs)
        finally:
            torch.cuda.current_device = real_current_device

    TorchFSDPPlugin.configure = configure
    try:
        yield
    finally:
        TorchFSDPPlugin.configure = original


@contextlib.contextmanager
def cuda_on_cpu(probe: Probe, device: torch.device) -> Iterator[None]:
    """All patches of this module, for one cell; each reports itself when it really engages."""
    with _accelerator_no_ops(probe), _zero_device_check(probe), _fsdp_device(probe, device):
        yield
