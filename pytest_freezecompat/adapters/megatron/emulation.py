"""CUDA-on-CPU shim for Megatron-core, engaged only for cells a rule marks `emulation = true`.

Megatron-core's real logic (grad buffers, distributed optimizer, schedules, recompute)
runs on CPU tensors once the places that hard-code CUDA are redirected: the RNG
tracker (onto the CPU generator), `torch.cuda.current_device()`, factory calls
and `.to()`/`.cuda()` that name a CUDA device (onto the CPU), `Tensor.type()`
(which the optimizers compare with `torch.cuda.*Tensor`), and the CUDA stream and
synchronize calls the grad buffers make. Everything is undone when the context exits.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

CPU = torch.device("cpu")


def _is_cuda(device: Any) -> bool:
    # An int device means cuda:N to torch; Megatron passes torch.cuda.current_device() that way.
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class _CudaToCpu(TorchFunctionMode):
    """Maps `device=cuda` to cpu, makes `.cuda()` a no-op and lets `Tensor.type()` report CUDA type names."""

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if ".cuda." in name else name.replace("torch.", "torch.cuda.", 1)
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = CPU
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], CPU, *args[2:])
        return func(*args, **kwargs)


class _NullStream:
    """Stands in for `torch.cuda.Stream`: CPU work is already ordered."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass


def _patches() -> dict[tuple[Any, str], Any]:
    from megatron.core.tensor_parallel import random as mcore_random

    return {
        (torch.cuda, "current_device"): lambda: 0,
        (torch.cuda, "device_count"): lambda: 1,
        (torch.cuda, "synchronize"): lambda *a, **k: None,
        (torch.cuda, "current_stream"): lambda *a, **k: _NullStream(),
        (torch.cuda, "default_stream"): lambda *a, **k: _NullStream(),
        (torch.cuda, "Stream"): _NullStream,
        (torch.cuda, "stream"): lambda *a, **k: contextlib.nullcontext(),
        (torch.cuda, "get_rng_state"): lambda *a, **k: torch.get_rng_state(),
        (torch.cuda, "set_rng_state"): lambda state, *a, **k: torch.set_rng_state(state),
        (torch.cuda, "manual_seed"): lambda seed: torch.manual_seed(seed),
        (mcore_random, "_get_cuda_rng_state"): lambda *a, **k: torch.get_rng_state(),
        (mcore_random, "_set_cuda_rng_state"): lambda state, *a, **k: torch.set_rng_state(state),
    }


@contextlib.contextmanager
def cuda_on_cpu() -> Iterator[list[str]]:
    """Engage the shim; yields the list of what it patched (for `probe.emulated`)."""
    patches = _patches()
    saved = {key: getattr(*key) for key in patches}
    rng = torch.get_rng_state()
    try:
        for (owner, name), value in patches.items():
            setattr(owner, name, value)
        with _CudaToCpu():
            yield [f"{getattr(owner, '__name__', owner)}.{name}" for owner, name in patches] + [
                "device='cuda' -> cpu (TorchFunctionMode)", "Tensor.cuda() no-op", "Tensor.type() -> torch.cuda.*"]
    finally:
        for (owner, name), value in saved.items():
            setattr(owner, name, value)
        torch.set_rng_state(rng)
