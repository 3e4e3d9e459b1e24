"""CUDA-on-CPU shim for Megatron-core, engaged only for cells a rule marks `emulation = true`.

Megatron-core's real logic (grad buffers, distributed optimizer, schedules, recompute)
runs on CPU tensors once the places that hard-code CUDA are redirected: the RNG
tracker (onto the CPU generator), `torch.cuda.current_device()`, factory calls
and `.to()`/`.cuda()` that name a CUDA device (onto the CPU), `Tensor.type()`
(which the optimizers compare with `torch.cuda.*Tensor`), and the CUDA stream and
synchronize calls the grad buffers make. Everything is undone when the cell ends, and each patch
is reported (`probe.emulated`) only when it really engages (see `adapters.emulation`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ...core.cell import Cell
from ..base import Probe
from ..emulation import Patch, Shim, always

CPU = torch.device("cpu")
TO_CPU = "device='cuda' -> cpu (TorchFunctionMode)"
CUDA_NO_OP = "Tensor.cuda() no-op"
CUDA_TYPE = "Tensor.type() -> torch.cuda.*"


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

    def __init__(self, probe: Probe) -> None:
        super().__init__()
        self.probe = probe

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            self.probe.emulated(CUDA_NO_OP)
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            if ".cuda." in name:
                return name
            self.probe.emulated(CUDA_TYPE)
            return name.replace("torch.", "torch.cuda.", 1)
        if _is_cuda(kwargs.get("device")):
            self.probe.emulated(TO_CPU)
            kwargs["device"] = CPU
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            self.probe.emulated(TO_CPU)
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


@contextlib.contextmanager
def _cpu_rng_restored() -> Iterator[None]:
    """The redirected CUDA RNG calls draw on the CPU generator: give it back as it was."""
    state = torch.get_rng_state()
    try:
        yield
    finally:
        torch.set_rng_state(state)


class MegatronShim(Shim):
    def patches(self, cell: Cell, device: torch.device) -> list[Patch]:
        from megatron.core.tensor_parallel import random as mcore_random

        def null_stream(*args: Any, **kwargs: Any) -> _NullStream:
            return _NullStream()

        replacements: dict[tuple[Any, str], Callable[..., Any]] = {
            (torch.cuda, "current_device"): lambda: 0,
            (torch.cuda, "device_count"): lambda: 1,
            (torch.cuda, "synchronize"): lambda *a, **k: None,
            (torch.cuda, "current_stream"): null_stream,
            (torch.cuda, "default_stream"): null_stream,
            (torch.cuda, "Stream"): _NullStream,
            (torch.cuda, "stream"): lambda *a, **k: contextlib.nullcontext(),
            (torch.cuda, "get_rng_state"): lambda *a, **k: torch.get_rng_state(),
            (torch.cuda, "set_rng_state"): lambda state, *a, **k: torch.set_rng_state(state),
            (torch.cuda, "manual_seed"): lambda seed: torch.manual_seed(seed),
            (mcore_random, "_get_cuda_rng_state"): lambda *a, **k: torch.get_rng_state(),
            (mcore_random, "_set_cuda_rng_state"): lambda state, *a, **k: torch.set_rng_state(state),
        }
        return [Patch(owner, name, _reported_class(value) if isinstance(value, type) else always(value),
                      f"{owner.__name__}.{name}") for (owner, name), value in replacements.items()]

    def contexts(self, cell: Cell, probe: Probe, device: torch.device) -> list[contextlib.AbstractContextManager]:
        return [_cpu_rng_restored(), _CudaToCpu(probe)]


def _reported_class(cls: type) -> Callable[[Callable[[], None], Any], type]:
    """A class stays a class (Megatron may subclass or isinstance-check it): report on construction."""

    def make(report: Callable[[], None], original: Any) -> type:
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            report()
            cls.__init__(self, *args, **kwargs)

        return type(cls.__name__, (cls,), {"__init__": __init__})

    return make


SHIM = MegatronShim()
