"""CUDA-on-CPU shim for Megatron-core, engaged only for cells a rule marks `emulation = true`.

Megatron-core's real logic (grad buffers, distributed optimizer, schedules, recompute)
runs on CPU tensors once the places that hard-code CUDA are redirected: the RNG
tracker (onto the CPU generator), `torch.cuda.current_device()`, factory calls
and `.to()`/`.cuda()` that name a CUDA device (onto the CPU), `Tensor.type()`
(which the optimizers compare with `torch.cuda.*Tensor`), the CUDA stream and
synchronize calls the grad buffers make, and, before 0.10, the distributed optimizer's
demand for Apex's or TE's fused Adam kernel (torch's AdamW, the same math, stands in).
Everything is undone when the cell ends, and each patch is reported (`probe.emulated`)
only when it really engages (see `adapters.emulation`).
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
FUSED_ADAM = "DistributedOptimizer: Apex/TE FusedAdam -> torch.optim.AdamW (megatron-core < 0.10)"


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
        # Only what this release has: before 0.11, megatron.core.tensor_parallel.random had no _get_cuda_rng_state.
        return [Patch(owner, name, _reported_class(value) if isinstance(value, type) else always(value),
                      f"{owner.__name__}.{name}") for (owner, name), value in replacements.items()
                if owner is torch.cuda or hasattr(owner, name)] + _fused_adam_patches()

    def contexts(self, cell: Cell, probe: Probe, device: torch.device) -> list[contextlib.AbstractContextManager]:
        return [_cpu_rng_restored(), _CudaToCpu(probe)]


class _ReportingTrue:
    """A module flag that reads True and reports when the code that tests it runs."""

    def __init__(self, report: Callable[[], None]) -> None:
        self._report = report

    def __bool__(self) -> bool:
        self._report()
        return True


def _fused_adam_patches() -> list[Patch]:
    """Before 0.10, `DistributedOptimizer.__init__` asserts `HAVE_APEX_OR_TE` (Apex's or TE's FusedAdam, a
    CUDA kernel) and that its optimizer is that FusedAdam. Without them `get_megatron_optimizer` has already
    built the release's own fallback, torch's AdamW (the same math: Megatron calls FusedAdam a drop-in for
    it); let the distributed optimizer accept that one. From 0.10 the constructor takes a torch optimizer
    itself and never reads the flag: nothing is patched then, nor where Apex or TE is installed.
    """
    from megatron.core import optimizer as mcore_optimizer
    from megatron.core.optimizer import distrib_optimizer

    asserts_fused = "HAVE_APEX_OR_TE" in distrib_optimizer.DistributedOptimizer.__init__.__code__.co_names
    if not asserts_fused or getattr(distrib_optimizer, "HAVE_APEX_OR_TE", True):
        return []

    def flag(report: Callable[[], None], original: Any) -> _ReportingTrue:
        return _ReportingTrue(report)

    def fallback(report: Callable[[], None], original: Any) -> type:
        return mcore_optimizer.Adam

    return [Patch(distrib_optimizer, "HAVE_APEX_OR_TE", flag, FUSED_ADAM),
            Patch(distrib_optimizer, "Adam", fallback, FUSED_ADAM)]


def _reported_class(cls: type) -> Callable[[Callable[[], None], Any], type]:
    """A class stays a class (Megatron may subclass or isinstance-check it): report on construction."""

    def make(report: Callable[[], None], original: Any) -> type:
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            report()
            cls.__init__(self, *args, **kwargs)

        return type(cls.__name__, (cls,), {"__init__": __init__})

    return make


SHIM = MegatronShim()
