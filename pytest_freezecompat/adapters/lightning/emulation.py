"""CUDA-on-CPU shim for Lightning's FSDP and DeepSpeed strategies, engaged only for cells a rule marks
`emulation = true`.

Fabric and the Trainer refuse their `FSDPStrategy` unless the accelerator is a GPU (each connector's
`_check_strategy_and_fallback`; Lightning-AI/pytorch-lightning#21812 asks for CPU), although torch's FSDP runs on CPU
with gloo. While a connector checks its configuration, this shim lets that one guard see "gpu" for an FSDP strategy
on the CPU and restores the CPU accelerator right after. Both then wrap with `device_id=root_device.index`, the CUDA
index (None for the CPU), which torch's FSDP1 refuses on CPU params ("FSDP needs a non-CPU accelerator device"): the
shim passes the CPU device instead, as the torch row does. The Trainer's full FSDP checkpoint gathers with
`offload_to_cpu=True` (made for CUDA params), which on CPU params frees what it reads: the shim takes the shared FSDP1
patches for that (`adapters.emulation.fsdp1_cpu_offload_patches`), as Composer's does. Everything else, wrapping and
the freeze logic included, runs as shipped. Each patch reports itself through `probe.emulated` when it engages.

Both DeepSpeed strategies refuse any accelerator but CUDA in `setup_environment` ("The DeepSpeed strategy is only
supported on CUDA GPUs"), although DeepSpeed runs on its CPU accelerator with gloo (the DeepSpeed row): the shim
lets that one check pass for the CPU accelerator, and the next, that each rank's device index is its local rank
(`_validate_device_index_selection`: a CPU device has no index). Both then hand `deepspeed.initialize` the CUDA index as
`args.device_rank` (None for the CPU, which DeepSpeed compares with 0): the shim lets the engine take its local rank
instead, as it does when given no args (Accelerate's path). DeepSpeed is imported only for its cells.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.fabric.strategies.deepspeed as fabric_deepspeed
import lightning.pytorch.strategies.deepspeed as trainer_deepspeed
import torch
import torch.distributed.fsdp
from lightning.fabric.accelerators import CPUAccelerator as FabricCPU
from lightning.fabric.connector import _Connector
from lightning.fabric.strategies import FSDPStrategy
from lightning.pytorch.accelerators import CPUAccelerator as TrainerCPU
from lightning.pytorch.strategies import FSDPStrategy as TrainerFSDPStrategy
from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

from ...core.cell import Cell
from ..emulation import Patch, Shim, fsdp1_cpu_offload_patches

GPU_GUARD = ("{}'s 'FSDP requires a GPU accelerator' guard -> passes on the CPU (the accelerator stays 'cpu'; "
             "torch's FSDP runs on gloo)")


def _fsdp_guard_on_cpu(strategy: type) -> Callable[[Callable[[], None], Callable[[Any], Any]], Callable[[Any], Any]]:
    """The connector's check, with an FSDP `strategy` on the CPU seen as on a GPU for its length."""
    return lambda report, check: _guarded(strategy, report, check)


def _guarded(strategy: type, report: Callable[[], None], check: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def checked(connector: Any) -> Any:
        if type(connector._strategy_flag) is not strategy or connector._accelerator_flag != "cpu":
            return check(connector)
        report()
        connector._accelerator_flag = "gpu"
        try:
            return check(connector)
        finally:
            connector._accelerator_flag = "cpu"

    return checked


DEVICE_ID = ("torch.distributed.fsdp.FullyShardedDataParallel(device_id=None) on CPU params -> device_id=cpu "
             "(Lightning passes the CUDA device's index)")


def _fsdp_device_id_on_cpu(report: Callable[[], None], fsdp_class: type) -> type:
    class FullyShardedDataParallel(fsdp_class):  # type: ignore[misc, valid-type]
        def __init__(self, module: torch.nn.Module, *args: Any, device_id: Any = None, **kwargs: Any) -> None:
            if device_id is None and all(p.device.type in ("cpu", "meta") for p in module.parameters()):
                report()
                device_id = torch.device("cpu")
            super().__init__(module, *args, device_id=device_id, **kwargs)

    return FullyShardedDataParallel


DEEPSPEED_GUARD = ("{}'s DeepSpeedStrategy.setup_environment 'only supported on CUDA GPUs' check -> passes for the "
                   "CPU accelerator (DeepSpeed runs on its CPU accelerator with gloo)")


def _deepspeed_guard_on_cpu(module: Any, cpu: type) -> Callable[[Callable[[], None], Callable[[Any], Any]], Any]:
    """`setup_environment` with the module's `CUDAAccelerator` check answering yes for the CPU accelerator."""

    def make(report: Callable[[], None], original: Callable[[Any], Any]) -> Callable[[Any], Any]:
        def setup_environment(strategy: Any) -> Any:
            if not isinstance(strategy.accelerator, cpu):
                return original(strategy)
            report()
            cuda = module.CUDAAccelerator
            module.CUDAAccelerator = cpu
            try:
                return original(strategy)
            finally:
                module.CUDAAccelerator = cuda

        return setup_environment

    return make


DEVICE_INDEX = ("{}'s DeepSpeed _validate_device_index_selection (each CUDA index must be the local rank) -> "
                "passes for CPU devices, which have no index")


def _device_index_on_cpu(report: Callable[[], None], original: Callable[[Any], None]) -> Callable[[Any], None]:
    def validate(parallel_devices: Any) -> None:
        if parallel_devices and all(device.type == "cpu" for device in parallel_devices):
            report()
            return
        original(parallel_devices)

    return validate


DEVICE_RANK = ("deepspeed.initialize(args=Namespace(device_rank=None)) on the CPU -> the engine takes its local rank, "
               "as without args (Lightning passes the CUDA device's index)")


def _device_rank_on_cpu(report: Callable[[], None], original: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    def set_distributed_vars(engine: Any, args: Any) -> Any:
        if args is not None and getattr(args, "device_rank", 0) is None:
            report()
            args = None
        return original(engine, args)

    return set_distributed_vars


def _deepspeed_patches() -> list[Patch]:
    from deepspeed.runtime.engine import DeepSpeedEngine

    return [Patch(trainer_deepspeed.DeepSpeedStrategy, "setup_environment",
                  _deepspeed_guard_on_cpu(trainer_deepspeed, TrainerCPU), DEEPSPEED_GUARD.format("the Trainer")),
            Patch(fabric_deepspeed.DeepSpeedStrategy, "setup_environment",
                  _deepspeed_guard_on_cpu(fabric_deepspeed, FabricCPU), DEEPSPEED_GUARD.format("Fabric")),
            Patch(trainer_deepspeed, "_validate_device_index_selection", _device_index_on_cpu,
                  DEVICE_INDEX.format("the Trainer")),
            Patch(fabric_deepspeed, "_validate_device_index_selection", _device_index_on_cpu,
                  DEVICE_INDEX.format("Fabric")),
            Patch(DeepSpeedEngine, "_set_distributed_vars", _device_rank_on_cpu, DEVICE_RANK)]


class LightningShim(Shim):
    def patches(self, cell: Cell, device: torch.device) -> list[Patch]:
        if "-deepspeed" in cell.key.plugin:
            return _deepspeed_patches()
        return [Patch(_Connector, "_check_strategy_and_fallback", _fsdp_guard_on_cpu(FSDPStrategy),
                      GPU_GUARD.format("Fabric")),
                Patch(_AcceleratorConnector, "_check_strategy_and_fallback", _fsdp_guard_on_cpu(TrainerFSDPStrategy),
                      GPU_GUARD.format("the Trainer")),
                Patch(torch.distributed.fsdp, "FullyShardedDataParallel", _fsdp_device_id_on_cpu, DEVICE_ID),
                *fsdp1_cpu_offload_patches("the Trainer's full FSDP checkpoint")]


SHIM = LightningShim()
