"""CUDA-on-CPU shim for Lightning's FSDP strategy, engaged only for cells a rule marks `emulation = true`.

Fabric and the Trainer refuse their `FSDPStrategy` unless the accelerator is a GPU (each connector's
`_check_strategy_and_fallback`; Lightning-AI/pytorch-lightning#21812 asks for CPU), although torch's FSDP runs on CPU
with gloo. While a connector checks its configuration, this shim lets that one guard see "gpu" for an FSDP strategy
on the CPU and restores the CPU accelerator right after. Both then wrap with `device_id=root_device.index`, the CUDA
index (None for the CPU), which torch's FSDP1 refuses on CPU params ("FSDP needs a non-CPU accelerator device"): the
shim passes the CPU device instead, as the torch row does. The Trainer's full FSDP checkpoint gathers with
`offload_to_cpu=True` (made for CUDA params), which on CPU params frees what it reads: the shim takes the shared FSDP1
patches for that (`adapters.emulation.fsdp1_cpu_offload_patches`), as Composer's does. Everything else, wrapping and
the freeze logic included, runs as shipped. Each patch reports itself through `probe.emulated` when it engages.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.fsdp
from lightning.fabric.connector import _Connector
from lightning.fabric.strategies import FSDPStrategy
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


class LightningShim(Shim):
    def patches(self, cell: Cell, device: torch.device) -> list[Patch]:
        return [Patch(_Connector, "_check_strategy_and_fallback", _fsdp_guard_on_cpu(FSDPStrategy),
                      GPU_GUARD.format("Fabric")),
                Patch(_AcceleratorConnector, "_check_strategy_and_fallback", _fsdp_guard_on_cpu(TrainerFSDPStrategy),
                      GPU_GUARD.format("the Trainer")),
                Patch(torch.distributed.fsdp, "FullyShardedDataParallel", _fsdp_device_id_on_cpu, DEVICE_ID),
                *fsdp1_cpu_offload_patches("the Trainer's full FSDP checkpoint")]


SHIM = LightningShim()
