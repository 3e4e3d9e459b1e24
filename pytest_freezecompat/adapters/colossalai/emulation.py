"""CUDA-on-CPU emulation for ColossalAI plugins whose real logic runs fine on CPU but asks for CUDA.

Engaged only for cells a matrix rule marks `emulation = true` (never on a GPU), undone when the
cell ends, and every patch that engages is reported through `probe.emulated` (see `adapters.emulation`).

LowLevelZero, HybridParallel (zero 1) and TorchFSDP cells:

- `CpuAccelerator.Stream`, `.current_stream` and `.stream` become no-ops (CPU ops are synchronous; ColossalAI's
  CPU accelerator raises on them): LowLevelZero's buckets create a stream and its reduction enters the
  current one even without comm/compute overlap (which the matrix turns off on CPU).
- `LowLevelZeroOptimizer._sanity_checks` sees the accelerator named "cuda" for the length of that call
  only: it asserts `name in ["cuda", "npu"]` and nothing else in it depends on a GPU.
- `torch.cuda.current_device` answers the CPU device while `TorchFSDPPlugin.configure` runs: the plugin
  passes it to FSDP as `device_id`, and FSDP itself runs on CPU with gloo.

Gemini cells (the plugin built with `enable_async_reduce=False, pin_memory=False`: pinned host memory needs
CUDA, and `enable_async_reduce=True` turns `pin_memory` on). Gemini
keeps each chunk either "on CUDA" (a cuda_shard or the gathered chunk) or offloaded (a cpu_shard), and
decides by device type. The shim makes host memory play both parts: the emulated CUDA device is
`torch.device("cpu", 0)` and the offload device stays `torch.device("cpu")`; torch puts both in host
memory, yet they compare unequal, so Gemini's bookkeeping of which shard lives where runs as shipped.

- `colossalai.accelerator.api._ACCELERATOR`: a CPU accelerator that calls itself "cuda" (so
  `Chunk.device_type` answers "cuda" for on-device chunks), whose current device is `cpu:0`, and whose
  streams, events, synchronize, empty_cache and memory queries are no-ops. The previous accelerator comes
  back when the cell ends. Engages on any use.
- `Chunk.shard_device` (a descriptor over the value `Chunk.__init__` stores), `Chunk.shard_move` and
  `ChunkManager.move_chunk`: where chunk code tests `device.type == "cuda"`, the device `cpu:0` is handed
  over as a label whose `.type` is "cuda" and which equals `cpu:0` (it never reaches torch: these
  functions allocate with `get_accelerator().get_current_device()`). Without the first, `close_chunk`
  offloads every shard; without the others, moving a chunk "to CUDA" offloads it instead. Engage
  when a device is `cpu:0`.
- `CPUAdamLoader.load`: the CPU-Adam kernel is built as a CUDA extension here (`cuda.h`), so it is
  replaced by its own arithmetic in torch (ColossalAI's `CPUAdam.torch_adam_update`, grads divided by
  `div_scale` first as the kernel does). Engages when HybridAdam is built.
- `HybridAdam.step`: HybridAdam picks its kernel by the device of each fp32 master shard. On a GPU, a
  shard on CUDA goes through the fused `multi_tensor_adam` kernel, which divides the grad by `div_scale`
  (Gemini's combined loss scale x clip coefficient); on CPU every shard looks like host memory and would
  take the bf16 CPU branch, which drops `div_scale`, i.e. clipping. So params whose chunk Gemini holds on
  the emulated CUDA device get that kernel's arithmetic in torch (same as `torch_adam_update` after
  `grad / div_scale`); the rest (chunks Gemini really offloaded: auto placement's sharded chunks, static's
  `offload_optim_frac`) run the shipped step, whose bf16 branch drops `div_scale` on a GPU too, so max_norm
  has no effect on them there as here. The chunk of each
  param is looked up through the GeminiOptimizer whose `step` is running (`GeminiOptimizer.step` is
  wrapped only to make itself known; it runs as shipped, and that wrapper never reports).
  Engages when a step updates at least one param on the emulated device.
- `SyncCudaMemoryMonitor.start`/`.finish` (auto placement's warm-up sampling): no-ops; `finish` reads 0 bytes.
- `colossalai.legacy.utils.memory.colo_device_memory_capacity` (auto placement imports it lazily): the
  emulated device reports a fixed 80 GiB, so auto placement never evicts the tiny models; other devices
  as shipped.

Nothing of Gemini's freeze logic is patched: `GeminiDDP._preprocess_param`/`_init_chunks` (chunk
initialisation, frozen params ignored), `grad_handle`, `_post_backward`, `GeminiZeROHook`, the param-op
hook, `GeminiOptimizer._set_grad_ptr`/`_calc_global_norm`/`step`, and `LazyInitContext` run as shipped.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import sys
from collections.abc import Callable
from typing import Any

import torch

from ...core.cell import Cell
from ..emulation import Patch, Shim, always

#: What the emulated CUDA accelerator calls its current device (host memory, unequal to `cpu`).
EMULATED_DEVICE = torch.device("cpu", 0)
#: Device capacity the emulated accelerator reports to auto placement (an 80 GiB card).
EMULATED_CAPACITY = 80 * 2**30


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


# -- Gemini ---------------------------------------------------------------------------------------------


class _CudaLabel:
    """`cpu:0` as chunk code's `device.type` tests must see it: type "cuda", equal to `cpu:0`.

    Only `Chunk.shard_move`, `ChunkManager.move_chunk` and `Chunk.shard_device` hand it out, and those
    only read `.type` and compare it with `get_accelerator().get_current_device()`; torch never sees it.
    """

    type = "cuda"
    index = 0

    def __eq__(self, other: object) -> bool:
        return other is self or (isinstance(other, torch.device) and other == EMULATED_DEVICE)

    def __hash__(self) -> int:
        return hash(EMULATED_DEVICE)

    def __repr__(self) -> str:
        return "device(type='cuda', index=0) [emulated: cpu:0]"


CUDA_LABEL = _CudaLabel()


def _labelled(device: Any) -> Any:
    return CUDA_LABEL if isinstance(device, torch.device) and device == EMULATED_DEVICE else device


class _NoStream:
    """A stream/event on a synchronous device: every operation is already complete."""

    def __getattr__(self, name: str) -> Callable[..., Any]:
        return _no_op

    def query(self) -> bool:
        return True


def _emulated_accelerator(report: Callable[[], None], original: Any) -> Any:
    from colossalai.accelerator import CpuAccelerator

    class EmulatedCudaAccelerator(CpuAccelerator):
        """Host memory posing as one CUDA device (`cpu:0`), for Gemini's chunk placement."""

        def __init__(self) -> None:
            super().__init__()
            self._name = "cuda"

        def __getattribute__(self, attr: str) -> Any:
            if not attr.startswith("_"):
                report()
            return super().__getattribute__(attr)

        def get_current_device(self) -> torch.device:
            return EMULATED_DEVICE

        def current_device(self) -> int:
            return 0

        def set_device(self, device: Any = None) -> None:
            return None

        def get_device_name(self, device: Any = None) -> str:
            return "cpu (emulating cuda)"

        def synchronize(self, device: Any = None) -> None:
            return None

        def device_count(self) -> int:
            return 1

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        manual_seed_all = manual_seed

        def empty_cache(self) -> None:
            return None

        def memory_stats(self, device: Any = None) -> dict[str, Any]:
            return {}

        def memory_allocated(self, device: Any = None) -> int:
            return 0

        max_memory_allocated = memory_reserved = max_memory_reserved = memory_allocated

        def reset_max_memory_allocated(self, device: Any = None) -> None:
            return None

        reset_max_memory_cached = reset_peak_memory_stats = reset_max_memory_allocated

        def Stream(self, device: Any = None, priority: int = 0, **kwargs: Any) -> _NoStream:
            return _NoStream()

        def Event(self, enable_timing: bool = False, blocking: bool = False,
                  interprocess: bool = False) -> _NoStream:
            return _NoStream()

        def current_stream(self, device: Any = None) -> _NoStream:
            return _NoStream()

        default_stream = current_stream

        def set_stream(self, stream_: Any) -> None:
            return None

        def stream(self, stream_: Any) -> contextlib.AbstractContextManager[None]:
            return contextlib.nullcontext()

    return EmulatedCudaAccelerator()


def _shard_device(report: Callable[[], None], original: Any) -> property:
    """`Chunk.__init__` stores `shard_device` as shipped; reads of `cpu:0` answer the "cuda" label."""

    def get(chunk: Any) -> Any:
        device = chunk.__dict__["shard_device"]
        labelled = _labelled(device)
        if labelled is not device:
            report()
        return labelled

    def set_(chunk: Any, device: Any) -> None:
        chunk.__dict__["shard_device"] = device

    return property(get, set_)


def _device_argument(position: int) -> Callable[[Callable[[], None], Any], Any]:
    """A method whose `device` argument (at `position` after self) is labelled "cuda" when it is `cpu:0`."""

    def make(report: Callable[[], None], original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def replaced(self: Any, *args: Any, **kwargs: Any) -> Any:
            if "device" in kwargs:
                labelled = _labelled(kwargs["device"])
                changed = labelled is not kwargs["device"]
                kwargs["device"] = labelled
            elif len(args) > position:
                labelled = _labelled(args[position])
                changed = labelled is not args[position]
                args = (*args[:position], labelled, *args[position + 1:])
            else:
                changed = False
            if changed:
                report()
            return original(self, *args, **kwargs)

        return replaced

    return make


def _cpu_adam_kernel_math(step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                          bias_correction: bool, param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                          exp_avg_sq: torch.Tensor, div_scale: float, adamw_mode: bool) -> None:
    """One Adam(W) update in torch, as ColossalAI's CPU kernel and its fused CUDA kernel compute it:
    the grad (in fp32) divided by `div_scale` when that is positive, then `CPUAdam.torch_adam_update`."""
    from colossalai.nn.optimizer.cpu_adam import CPUAdam

    grad = grad.float()
    if div_scale > 0:
        grad = grad / div_scale
    bias_correction1 = 1 - beta1**step if bias_correction else 1.0
    bias_correction2 = 1 - beta2**step if bias_correction else 1.0
    CPUAdam.torch_adam_update(None, param, grad, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, weight_decay,
                              bias_correction1, bias_correction2, adamw_mode)


class _TorchCPUAdamOptimizer:
    """The pybind `CPUAdamOptimizer` of ColossalAI's CPU-Adam extension, in torch (same arithmetic)."""

    def __init__(self, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                 adamw_mode: bool) -> None:
        self.adamw_mode = adamw_mode

    @torch.no_grad()
    def step(self, step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
             bias_correction: bool, param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
             exp_avg_sq: torch.Tensor, div_scale: float) -> None:
        _cpu_adam_kernel_math(step, lr, beta1, beta2, eps, weight_decay, bias_correction, param, grad, exp_avg,
                              exp_avg_sq, div_scale, self.adamw_mode)


class _TorchCPUAdamExtension:
    CPUAdamOptimizer = _TorchCPUAdamOptimizer


def _cpu_adam_loader(report: Callable[[], None], original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def load(self: Any, ext_name: str | None = None) -> Any:
        report()
        return _TorchCPUAdamExtension

    return load


#: The GeminiOptimizer whose `step` is running (HybridAdam.step asks it where each param's chunk lives).
_GEMINI_STEP: contextvars.ContextVar[Any] = contextvars.ContextVar("gemini_step", default=None)


def _gemini_step(report: Callable[[], None], original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        token = _GEMINI_STEP.set(self)
        try:
            return original(self, *args, **kwargs)
        finally:
            _GEMINI_STEP.reset(token)

    return step


def _on_emulated_device(gemini: Any) -> set[int]:
    """ids of the inner optimizer's params whose updated chunk Gemini holds "on CUDA" (a shard on `cpu:0`)."""
    on_device = set()
    for group in gemini.optim.param_groups:
        for fake_param in group["params"]:
            chunk16 = gemini.param_to_chunk16.get(fake_param)
            if fake_param.grad is None or chunk16 is None:
                continue
            chunk = chunk16.paired_chunk if gemini.module.master_weights else chunk16
            if chunk.device_type == "cuda":
                on_device.add(id(fake_param))
    return on_device


def _hybrid_adam_step(report: Callable[[], None], original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def step(self: Any, closure: Callable[[], Any] | None = None, div_scale: float = -1) -> Any:
        gemini = _GEMINI_STEP.get()
        on_device = _on_emulated_device(gemini) if gemini is not None and gemini.optim is self else set()
        if not on_device:
            return original(self, closure, div_scale)
        report()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.no_grad():
            # What HybridAdam's CUDA branch does: state as it creates it, then the fused kernel's arithmetic.
            for group in self.param_groups:
                beta1, beta2 = group["betas"]
                for p in group["params"]:
                    if id(p) not in on_device:
                        continue
                    state = self.state[p]
                    if len(state) == 0:
                        state["step"] = 0
                        state["exp_avg"] = torch.zeros_like(p)
                        state["exp_avg_sq"] = torch.zeros_like(p)
                        self._post_state_init(p)
                    state["step"] += 1
                    _cpu_adam_kernel_math(state["step"], group["lr"], beta1, beta2, group["eps"],
                                          group["weight_decay"], group["bias_correction"], p.data, p.grad.data,
                                          state["exp_avg"], state["exp_avg_sq"], div_scale, self.adamw_mode)
        # Params on chunks Gemini really offloaded: the shipped step, which sees only them.
        kept = [group["params"] for group in self.param_groups]
        try:
            for group in self.param_groups:
                group["params"] = [p for p in group["params"] if id(p) not in on_device]
            original(self, None, div_scale)
        finally:
            for group, params in zip(self.param_groups, kept):
                group["params"] = params
        return loss

    return step


def _memory_monitor_finish(report: Callable[[], None], original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def finish(self: Any) -> int:
        from time import time

        report()
        self.time_stamps.append(time())
        self.mem_stats.append(0)
        return 0

    return finish


def _device_capacity(report: Callable[[], None], original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def colo_device_memory_capacity(device: torch.device) -> int:
        if isinstance(device, torch.device) and device == EMULATED_DEVICE:
            report()
            return EMULATED_CAPACITY
        return original(device)

    return colo_device_memory_capacity


def _gemini_patches() -> list[Patch]:
    import colossalai.accelerator.api as accelerator_api
    import colossalai.legacy.utils.memory  # noqa: F401  (auto placement imports it lazily; patched in place)
    from colossalai.kernel.kernel_loader import CPUAdamLoader
    from colossalai.nn.optimizer import HybridAdam
    from colossalai.zero.gemini.chunk import Chunk, ChunkManager
    from colossalai.zero.gemini.gemini_optimizer import GeminiOptimizer
    from colossalai.zero.gemini.memory_tracer.memory_monitor import SyncCudaMemoryMonitor

    legacy_memory = sys.modules["colossalai.legacy.utils.memory"]
    return [
        Patch(accelerator_api, "_ACCELERATOR", _emulated_accelerator,
              "colossalai accelerator: CPU named 'cuda' (current device cpu:0; streams, events, synchronize, "
              "empty_cache, memory queries are no-ops)"),
        Patch(Chunk, "shard_device", _shard_device, "Chunk.shard_device cpu:0 reads as type 'cuda'"),
        Patch(Chunk, "shard_move", _device_argument(0), "Chunk.shard_move: cpu:0 passed as type 'cuda'"),
        Patch(ChunkManager, "move_chunk", _device_argument(1),
              "ChunkManager.move_chunk: cpu:0 passed as type 'cuda'"),
        Patch(CPUAdamLoader, "load", _cpu_adam_loader,
              "CPUAdamLoader.load -> CPU-Adam kernel arithmetic in torch (torch_adam_update after grad/div_scale)"),
        Patch(GeminiOptimizer, "step", _gemini_step, "GeminiOptimizer.step makes itself known to HybridAdam.step"),
        Patch(HybridAdam, "step", _hybrid_adam_step,
              "HybridAdam.step: params on the emulated CUDA device get the fused CUDA Adam kernel's arithmetic "
              "in torch (grad/div_scale, then torch_adam_update)"),
        Patch(SyncCudaMemoryMonitor, "start", always(_no_op), "SyncCudaMemoryMonitor.start is a no-op"),
        Patch(SyncCudaMemoryMonitor, "finish", _memory_monitor_finish, "SyncCudaMemoryMonitor.finish reads 0 bytes"),
        Patch(legacy_memory, "colo_device_memory_capacity", _device_capacity,
              "colossalai.legacy.utils.memory.colo_device_memory_capacity(cpu:0) -> 80 GiB"),
    ]


class ColossalAIShim(Shim):
    def patches(self, cell: Cell, device: torch.device) -> list[Patch]:
        if cell.key.plugin.startswith("gemini"):
            return _gemini_patches()
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
