"""CUDA-on-CPU emulation for ColossalAI plugins whose real logic runs fine on CPU but asks for CUDA.

Engaged only for cells a matrix rule marks `emulation = true` (never on a GPU), undone when the
cell ends, and every patch that engages is reported through `probe.emulated` (see `adapters.emulation`).

LowLevelZero, HybridParallel (zero 1) and TorchFSDP cells:

- `CpuAccelerator.Stream`, `.current_stream`, `.stream` and `.synchronize` become no-ops (CPU ops are
  synchronous; ColossalAI's CPU accelerator raises on them): LowLevelZero's buckets create a stream and its
  reduction enters the current one even without comm/compute overlap (which the matrix turns off on CPU), and
  loading a sharded optimizer checkpoint (`checkpoint_io.utils.load_states_into_optimizer`) synchronizes.
- `LowLevelZeroOptimizer._sanity_checks` sees the accelerator named "cuda" for the length of that call
  only: it asserts `name in ["cuda", "npu"]` and nothing else in it depends on a GPU.
- `torch.cuda.current_device` answers the CPU device while `TorchFSDPPlugin.configure` runs: the plugin
  passes it to FSDP as `device_id`, and FSDP itself runs on CPU with gloo.
- `FullStateDictConfig` as `TorchFSDPCheckpointIO` calls it (`booster.save_model`, unsharded) keeps the full
  state dict where the params are (`offload_to_cpu=False`): the plugin asks to offload GPU params to the host,
  and where they already live in host memory torch's FSDP frees the storage it gathered into (rank 0 raises
  "setStorage: ... out of bounds for storage of size 0" while rank 1 goes on into the optimizer's
  collectives: a hang). Engages when the plugin asks to offload.

Gemini cells (the plugin built with `pin_memory=False` and, from 0.4, `enable_async_reduce=False`: pinned host
memory needs CUDA, and `enable_async_reduce=True` turns `pin_memory` on). Gemini
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
  over as a label whose `.type` is "cuda" and which equals `cpu:0` (these functions allocate with the current
  device; where the label reaches torch it is the string "cpu:0"). Without the first, `close_chunk`
  offloads every shard; without the others, moving a chunk "to CUDA" offloads it instead. Engage
  when a device is `cpu:0`.
- `GeminiManager.setup_grads_device`: placement's map of grad devices holds the same label for `cpu:0`, as
  GeminiDDP's `_init_chunks` tests `chunk_32.device_type != grads_device[p].type` to move fp32 masters "to
  CUDA" (0.3.x closes static chunks offloaded: without it they would stay so) and GeminiOptimizer allocates
  on it. Engages when an entry is `cpu:0`.
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
  has no effect on them there as here. The kernel's launcher (`multi_tensor_apply.cuh`) checks its inputs
  first, and so does the shim, by where Gemini holds each grad (the param's bf16 chunk under
  `reuse_fp16_chunk`, else its grad chunk): the first grad must be on CUDA ("expected input to be on cuda")
  and every other on the same device ("A tensor was not on the same device as the first tensor"). On CPU
  every tensor is host memory, so without that check a grad Gemini left offloaded (0.3.4 closes static
  chunks offloaded and moves a bf16 chunk to CUDA only when the forward accesses it: a chunk no forward
  reaches keeps its grad slot in host memory while its fp32 masters were moved to CUDA) would be applied
  where the GPU raises. The chunk of each
  param is looked up through the GeminiOptimizer whose `step` is running (`GeminiOptimizer.step` is
  wrapped only to make itself known; it runs as shipped, and that wrapper never reports).
  Engages when a step updates at least one param on the emulated device.
- `SyncCudaMemoryMonitor.start`/`.finish` (auto placement's warm-up sampling): no-ops; `finish` reads 0 bytes.
- `colossalai.legacy.utils.memory.colo_device_memory_capacity` (auto placement imports it lazily): the
  emulated device reports a fixed 80 GiB, so auto placement never evicts the tiny models; other devices
  as shipped.
- `torch.distributed.reduce_scatter` (the list API; Gemini cells, and every cell of a release without
  `colossalai.accelerator`): gloo lacks it, so over gloo it is
  an `all_reduce` of the inputs laid end to end, this rank's part kept (the same sum). Engages only where
  a release calls it: 0.3.x's sharded Gemini chunks and ZeRO-2 buckets (later ones use
  `reduce_scatter_tensor`, which gloo has).

Releases without `colossalai.accelerator` (0.3.x; `compat.has_accelerator_api`) pick devices through
`colossalai.utils.get_current_device` (the CPU when CUDA is missing) and call `torch.cuda` directly. There
the same device plumbing takes other patch targets, each found by feature detection:

- Gemini: `get_current_device`, in every loaded colossalai module that imported it by name, answers `cpu:0`
  (the accelerator's part above); auto placement's `placement_policy` module binds
  `colo_device_memory_capacity` at import, so that binding is patched as well; the CPU-Adam kernel is
  `CPUAdamBuilder.load`; `HybridAdam.__init__` loads the fused CUDA Adam kernel (`FusedOptimBuilder.load`:
  the same arithmetic in torch, `_torch_multi_tensor_adam`) and allocates its overflow flag with
  `torch.cuda.IntTensor` (a CPU int tensor here); `GeminiOptimizer.pack_optimizer_states_to_tensor` (the
  optimizer checkpoint of a sharded chunk, `collect_states`) defaults to `device=torch.device("cuda")`, bound
  at import, so its default and any "cuda" device answer `cpu:0` (from 0.3.5 on the default is the accelerator's
  device). Engages for each param whose shard this rank owns in a chunk with keep_gathered=False.
- the other plugins: `LowLevelZeroOptimizer._sanity_checks` sees `torch.cuda.is_available()` true for the
  length of that call (it asserts "CUDA is required"); `torch.cuda.Stream/current_stream/stream/synchronize`
  are no-ops; `torch.cuda.FloatTensor` (the norm buffers of LowLevelZero and HybridParallel) makes a CPU
  tensor; and a `TorchFunctionMode` keeps `.cuda()` (TorchDDP and HybridParallel move the model with it)
  and `device="cuda"` factory calls (LowLevelZero's step gathers shards into them) on the CPU. Not used
  for Gemini cells, whose ColoParameters dispatch their own `__torch_function__` (the param-op hook).

Nothing of Gemini's freeze logic is patched: `GeminiDDP._preprocess_param`/`_init_chunks` (chunk
initialisation, frozen params ignored), `grad_handle`, `_post_backward`, `GeminiZeROHook`, the param-op
hook, `GeminiOptimizer._set_grad_ptr`/`_calc_global_norm`/`step`, and `LazyInitContext` run as shipped.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ...core.cell import Cell
from ..base import Probe
from ..emulation import Patch, Shim, always
from .compat import has_accelerator_api, reuses_fp16_chunk

#: What the emulated CUDA accelerator calls its current device (host memory, unequal to `cpu`).
EMULATED_DEVICE = torch.device("cpu", 0)
#: Device capacity the emulated accelerator reports to auto placement (an 80 GiB card).
EMULATED_CAPACITY = 80 * 2**30


def _full_state_dict_in_place(report: Callable[[], None], original: Any) -> Callable[..., Any]:
    def full_state_dict_config(*args: Any, offload_to_cpu: bool = False, **kwargs: Any) -> Any:
        if offload_to_cpu:
            report()
        return original(*args, offload_to_cpu=False, **kwargs)

    return full_state_dict_config


def _fsdp_checkpoint_patch() -> Patch:
    from colossalai.booster.plugin import torch_fsdp_plugin

    return Patch(torch_fsdp_plugin, "FullStateDictConfig", _full_state_dict_in_place,
                 "FullStateDictConfig(offload_to_cpu=True) -> False in TorchFSDPCheckpointIO (params in host memory)")


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


class _CudaLabel(str):
    """`cpu:0` as chunk code's `device.type` tests must see it: type "cuda", equal to `cpu:0`.

    `Chunk.shard_move`, `ChunkManager.move_chunk` and `Chunk.shard_device` hand it to chunk code, which only reads
    `.type` and compares it with the current device; the map of grad devices that placement fills holds it too,
    where GeminiDDP tests `.type` and GeminiOptimizer allocates on it: as a string ("cpu:0") torch takes it for
    `cpu:0`.
    """

    type = "cuda"
    index = 0  # type: ignore[assignment]  (torch.device's field; str's method is never called on a device)

    def __new__(cls) -> _CudaLabel:
        return super().__new__(cls, str(EMULATED_DEVICE))

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


def _grads_device_labelled(report: Callable[[], None], original: Callable[..., Any]) -> Callable[..., Any]:
    """Placement's map of grad devices: `cpu:0` entries read as "cuda". GeminiDDP compares a master chunk's
    device type with its entry and moves the chunk "to CUDA" when they differ: 0.3.x closes every static chunk
    offloaded first, so with `cpu:0` (type "cpu") there the masters would stay offloaded as on no GPU."""

    @functools.wraps(original)
    def setup_grads_device(self: Any, params: Any, grads_device_map: dict[Any, Any]) -> None:
        original(self, params, grads_device_map)
        for param, device in grads_device_map.items():
            labelled = _labelled(device)
            if labelled is not device:
                report()
                grads_device_map[param] = labelled

    return setup_grads_device


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
    """`CPUAdamLoader.load(ext_name)` (0.3.6 on) or `CPUAdamBuilder.load(verbose)` (0.3.x)."""

    @functools.wraps(original)
    def load(self: Any, *args: Any, **kwargs: Any) -> Any:
        report()
        return _TorchCPUAdamExtension

    return load


def _torch_multi_tensor_adam(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: list[list[torch.Tensor]],
                             lr: float, beta1: float, beta2: float, eps: float, step: int, adamw_mode: int,
                             bias_correction: int, weight_decay: float, div_scale: float = -1) -> None:
    """ColossalAI's fused `multi_tensor_adam` CUDA kernel (grads, params, exp_avg, exp_avg_sq lists) in torch:
    per tensor, the same update as the CPU kernel (grad / div_scale, then `torch_adam_update`)."""
    with torch.no_grad():
        for grad, param, exp_avg, exp_avg_sq in zip(*tensor_lists):
            _cpu_adam_kernel_math(step, lr, beta1, beta2, eps, weight_decay, bool(bias_correction), param, grad,
                                  exp_avg, exp_avg_sq, div_scale, bool(adamw_mode))


class _TorchFusedOptim:
    multi_tensor_adam = staticmethod(_torch_multi_tensor_adam)


def _fused_optim_builder(report: Callable[[], None], original: Callable[..., Any]) -> Callable[..., Any]:
    """0.3.x's `FusedOptimBuilder.load` (HybridAdam loads it whether or not CUDA is there; it would JIT-build)."""

    @functools.wraps(original)
    def load(self: Any, *args: Any, **kwargs: Any) -> Any:
        report()
        return _TorchFusedOptim

    return load


def _cpu_int_tensor(report: Callable[[], None], original: Any) -> Callable[..., torch.Tensor]:
    def int_tensor(*args: Any, **kwargs: Any) -> torch.Tensor:
        report()
        return torch.IntTensor(*args, **kwargs)

    return int_tensor


def _cpu_float_tensor(report: Callable[[], None], original: Any) -> Callable[..., torch.Tensor]:
    def float_tensor(*args: Any, **kwargs: Any) -> torch.Tensor:
        report()
        return torch.FloatTensor(*args, **kwargs)

    return float_tensor


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


def _grad_on_emulated_device(gemini: Any, fake_param: Any) -> bool:
    """Whether the chunk `GeminiOptimizer._set_grad_ptr` took this param's grad from is "on CUDA": its bf16 chunk
    under `reuse_fp16_chunk`, else that chunk's grad chunk. On CPU the tensor itself cannot tell."""
    chunk16 = gemini.param_to_chunk16[fake_param]
    grad_chunk = chunk16 if reuses_fp16_chunk(gemini.module) else chunk16.grad_chunk
    return grad_chunk is not None and grad_chunk.device_type == "cuda"


def _multi_tensor_apply_checks(grads_on_device: list[bool]) -> None:
    """The input checks of ColossalAI's `multi_tensor_apply.cuh` (`TORCH_CHECK`s, same words) on one param group's
    grads, which HybridAdam hands to the fused kernel first: the first on CUDA, every other on the same device."""
    if grads_on_device and not grads_on_device[0]:
        raise RuntimeError("expected input to be on cuda")
    if not all(grads_on_device):
        raise RuntimeError("A tensor was not on the same device as the first tensor")


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
                _multi_tensor_apply_checks([_grad_on_emulated_device(gemini, p) for p in group["params"]
                                            if id(p) in on_device])
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
    from colossalai.nn.optimizer import HybridAdam
    from colossalai.zero.gemini.chunk import Chunk, ChunkManager
    from colossalai.zero.gemini.gemini_mgr import GeminiManager
    from colossalai.zero.gemini.gemini_optimizer import GeminiOptimizer
    from colossalai.zero.gemini.memory_tracer.memory_monitor import SyncCudaMemoryMonitor

    device = _accelerator_patches() if has_accelerator_api() else _legacy_gemini_device_patches()
    return [
        *device,
        Patch(Chunk, "shard_device", _shard_device, "Chunk.shard_device cpu:0 reads as type 'cuda'"),
        Patch(Chunk, "shard_move", _device_argument(0), "Chunk.shard_move: cpu:0 passed as type 'cuda'"),
        Patch(ChunkManager, "move_chunk", _device_argument(1),
              "ChunkManager.move_chunk: cpu:0 passed as type 'cuda'"),
        Patch(GeminiManager, "setup_grads_device", _grads_device_labelled,
              "GeminiManager.setup_grads_device: cpu:0 entries read as type 'cuda'"),
        *_adam_kernel_patches(),
        Patch(GeminiOptimizer, "step", _gemini_step, "GeminiOptimizer.step makes itself known to HybridAdam.step"),
        Patch(HybridAdam, "step", _hybrid_adam_step,
              "HybridAdam.step: params on the emulated CUDA device get the fused CUDA Adam kernel's arithmetic "
              "in torch (grad/div_scale, then torch_adam_update)"),
        Patch(SyncCudaMemoryMonitor, "start", always(_no_op), "SyncCudaMemoryMonitor.start is a no-op"),
        Patch(SyncCudaMemoryMonitor, "finish", _memory_monitor_finish, "SyncCudaMemoryMonitor.finish reads 0 bytes"),
        *_device_capacity_patches(),
        _reduce_scatter_patch(),
    ]


def _accelerator_patches() -> list[Patch]:
    import colossalai.accelerator.api as accelerator_api

    return [Patch(accelerator_api, "_ACCELERATOR", _emulated_accelerator,
                  "colossalai accelerator: CPU named 'cuda' (current device cpu:0; streams, events, synchronize, "
                  "empty_cache, memory queries are no-ops)")]


#: The modules a Gemini cell runs through, imported by the Gemini plugin or lazily by auto placement.
GEMINI_MODULES = ("colossalai.booster.plugin.gemini_plugin", "colossalai.zero.gemini.placement_policy",
                  "colossalai.zero.gemini.memory_tracer.chunk_memstats_collector", "colossalai.zero.gemini.utils")


def _legacy_gemini_device_patches() -> list[Patch]:
    """0.3.x: each module binds `colossalai.utils.get_current_device` at import (the CPU without CUDA)."""
    from colossalai.utils import cuda as cuda_utils
    from colossalai.zero.gemini.gemini_ddp import GeminiDDP
    from colossalai.zero.gemini.gemini_optimizer import GeminiOptimizer

    for module in GEMINI_MODULES:  # loaded before looking for the name they bind
        importlib.import_module(module)

    original = cuda_utils.get_current_device
    owners = [module for name, module in sorted(sys.modules.items())
              if name.startswith("colossalai") and getattr(module, "get_current_device", None) is original]
    return [Patch(module, "get_current_device", always(lambda: EMULATED_DEVICE),
                  "colossalai.utils.get_current_device -> cpu:0 (the emulated CUDA device; this release has no "
                  "accelerator API)") for module in owners] + [
        Patch(torch.cuda, "IntTensor", _cpu_int_tensor, "torch.cuda.IntTensor -> a CPU IntTensor"),
        Patch(GeminiOptimizer, "pack_optimizer_states_to_tensor", _packed_on_emulated_device,
              "GeminiOptimizer.pack_optimizer_states_to_tensor: device 'cuda' (its 0.3.x default) -> cpu:0"),
        Patch(GeminiDDP, "_cast_buffers", _buffers_stay_on_cpu,
              "GeminiDDP._cast_buffers: buffer.cuda() (0.3.x) stays on the CPU; the dtype cast is its own")]


def _buffers_stay_on_cpu(report: Callable[[], None], original: Callable[..., Any]) -> Callable[..., Any]:
    """0.3.x moves every buffer with `buffer.cuda()` (later releases to the accelerator's device): a model with
    buffers (BatchNorm's statistics) reached real CUDA there. The move alone is emulated; the cast is Gemini's."""

    @functools.wraps(original)
    def cast_buffers(self: Any) -> Any:
        with _CudaToCpu(lambda what: report()):  # the patch's own words, not the mode's
            return original(self)

    return cast_buffers


def _packed_on_emulated_device(report: Callable[[], None], original: Callable[..., Any]) -> Callable[..., Any]:
    """0.3.x's `collect_states` packs a sharded chunk's optimizer states on `torch.device("cuda")` (a default bound
    at import): on no GPU that raises on the ranks owning a shard of the param only, the others wait in the
    next `dist.barrier`, and the save hangs. Pack on the emulated device instead."""

    @functools.wraps(original)
    def pack(self: Any, param_id: int, state_names: list, device: Any = None,
             dtype: torch.dtype = torch.float32) -> Any:
        if device is None or _is_cuda(device):
            if param_id in self.id_to_fake_params:  # otherwise the original returns None without allocating
                report()
            device = EMULATED_DEVICE
        return original(self, param_id, state_names, device, dtype)

    return pack


def _adam_kernel_patches() -> list[Patch]:
    """The CPU-Adam kernel's loader, and (0.3.x, where HybridAdam always loads it) the fused CUDA Adam kernel's."""
    what = "-> CPU-Adam kernel arithmetic in torch (torch_adam_update after grad/div_scale)"
    try:
        from colossalai.kernel.kernel_loader import CPUAdamLoader
    except ImportError:  # 0.3.x: op_builder
        from colossalai.kernel.op_builder import CPUAdamBuilder, FusedOptimBuilder

        return [Patch(CPUAdamBuilder, "load", _cpu_adam_loader, f"CPUAdamBuilder.load {what}"),
                Patch(FusedOptimBuilder, "load", _fused_optim_builder,
                      "FusedOptimBuilder.load -> fused CUDA Adam kernel arithmetic in torch (never JIT-built)")]
    return [Patch(CPUAdamLoader, "load", _cpu_adam_loader, f"CPUAdamLoader.load {what}")]


def _device_capacity_patches() -> list[Patch]:
    """`colo_device_memory_capacity` where auto placement looks it up: its own module (imported lazily from 0.3.5
    on), and the name `placement_policy` bound at import in 0.3.x."""
    import colossalai.legacy.utils.memory  # noqa: F401  (patched in place)
    import colossalai.zero.gemini.placement_policy as placement_policy

    what = "colossalai.legacy.utils.memory.colo_device_memory_capacity(cpu:0) -> 80 GiB"
    owners = [sys.modules["colossalai.legacy.utils.memory"]]
    if hasattr(placement_policy, "colo_device_memory_capacity"):
        owners.append(placement_policy)
    return [Patch(owner, "colo_device_memory_capacity", _device_capacity, what) for owner in owners]


def _gloo_reduce_scatter(report: Callable[[], None], original: Callable[..., Any]) -> Callable[..., Any]:
    """`dist.reduce_scatter` (a list of inputs) over gloo, which lacks it: all-reduce the inputs laid end to end
    (the same sum), keep this rank's part. Other backends, and `reduce_scatter_tensor`, as shipped."""
    import torch.distributed as dist

    @functools.wraps(original)
    def reduce_scatter(output: torch.Tensor, input_list: list[torch.Tensor], op: Any = dist.ReduceOp.SUM,
                       group: Any = None, async_op: bool = False) -> Any:
        if async_op or dist.get_backend(group) != "gloo":
            return original(output, input_list, op=op, group=group, async_op=async_op)
        report()
        flat = torch.cat([t.reshape(-1) for t in input_list])
        dist.all_reduce(flat, op=op, group=group)
        sizes = [t.numel() for t in input_list]
        output.copy_(flat.split(sizes)[dist.get_rank(group)].view_as(output))
        return None

    return reduce_scatter


def _reduce_scatter_patch() -> Patch:
    """0.3.x reduce-scatters Gemini's sharded chunks and ZeRO-2's buckets with the list API; later releases use
    `reduce_scatter_tensor` (which gloo has), so there it never engages."""
    import torch.distributed as dist

    return Patch(dist, "reduce_scatter", _gloo_reduce_scatter,
                 "torch.distributed.reduce_scatter over gloo -> all_reduce, keep this rank's part")


# -- the other plugins ----------------------------------------------------------------------------------


def _is_cuda(device: Any) -> bool:
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class _CudaToCpu(TorchFunctionMode):
    """0.3.x's `.cuda()` and `device="cuda"` stay on the CPU (the model and every tensor already live there)."""

    def __init__(self, emulated: Callable[[str], None]) -> None:
        super().__init__()
        self.emulated = emulated

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            self.emulated("Tensor.cuda() is a no-op (TorchFunctionMode)")
            return args[0]
        if _is_cuda(kwargs.get("device")):
            self.emulated("device='cuda' -> cpu (TorchFunctionMode)")
            kwargs["device"] = torch.device("cpu")
        return func(*args, **kwargs)


def _sanity_checks_with_cuda_available(report: Callable[[], None],
                                       original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def sanity_checks(self: Any) -> None:
        if torch.cuda.is_available():
            return original(self)
        report()
        real_is_available = torch.cuda.is_available
        torch.cuda.is_available = lambda: True  # type: ignore[assignment]
        try:
            return original(self)
        finally:
            torch.cuda.is_available = real_is_available

    return sanity_checks


def _accelerator_stream_patches() -> list[Patch]:
    from colossalai.accelerator import get_accelerator

    accelerator = get_accelerator()
    if accelerator.name != "cpu":
        return []
    return [Patch(accelerator, name, always(value), f"CpuAccelerator.{name} is a no-op")
            for name, value in (("Stream", _no_op), ("current_stream", _no_op), ("stream", _null_context),
                                ("synchronize", _no_op))]


def _legacy_cuda_patches() -> list[Patch]:
    """0.3.x calls torch.cuda directly: streams and synchronize (no-ops on a synchronous device), norm buffers."""
    from colossalai.zero.low_level.low_level_optim import LowLevelZeroOptimizer

    return [
        Patch(LowLevelZeroOptimizer, "_sanity_checks", _sanity_checks_with_cuda_available,
              "LowLevelZeroOptimizer._sanity_checks sees torch.cuda.is_available()"),
        *[Patch(torch.cuda, name, always(value), f"torch.cuda.{name} is a no-op")
          for name, value in (("Stream", _NoStream), ("current_stream", _NoStream), ("stream", _null_context),
                              ("synchronize", _no_op))],
        Patch(torch.cuda, "FloatTensor", _cpu_float_tensor, "torch.cuda.FloatTensor -> a CPU FloatTensor"),
    ]


class ColossalAIShim(Shim):
    def patches(self, cell: Cell, device: torch.device) -> list[Patch]:
        if cell.key.plugin.startswith("gemini"):
            return _gemini_patches()
        from colossalai.booster.plugin.torch_fsdp_plugin import TorchFSDPPlugin
        from colossalai.zero.low_level.low_level_optim import LowLevelZeroOptimizer

        if not has_accelerator_api():
            return [*_legacy_cuda_patches(), _reduce_scatter_patch(),
                    Patch(TorchFSDPPlugin, "configure", _configure_on_cpu(device),
                          "torch.cuda.current_device -> cpu during TorchFSDPPlugin.configure"),
                    _fsdp_checkpoint_patch()]
        return [*_accelerator_stream_patches(),
                Patch(LowLevelZeroOptimizer, "_sanity_checks", _sanity_checks_on_cuda,
                      "LowLevelZeroOptimizer._sanity_checks sees accelerator 'cuda'"),
                Patch(TorchFSDPPlugin, "configure", _configure_on_cpu(device),
                      "torch.cuda.current_device -> cpu during TorchFSDPPlugin.configure"),
                _fsdp_checkpoint_patch()]

    def contexts(self, cell: Cell, probe: Probe, device: torch.device) -> list[contextlib.AbstractContextManager]:
        if cell.key.plugin.startswith("gemini") or has_accelerator_api():
            return []
        return [_CudaToCpu(probe.emulated)]


SHIM = ColossalAIShim()
