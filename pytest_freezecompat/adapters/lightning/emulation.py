"""CUDA-on-CPU shim for Lightning's FSDP strategy, engaged only for cells a rule marks `emulation = true`.

Fabric refuses `FSDPStrategy` unless its accelerator is a GPU (`_Connector._check_strategy_and_fallback`: "FSDP is
only available on GPU"; Lightning-AI/pytorch-lightning#21812 asks for CPU), although torch's FSDP runs on CPU with
gloo. While Fabric checks its configuration, this shim lets that one guard see "gpu" for an FSDP strategy on the CPU
and restores the CPU accelerator right after. Fabric then wraps with `device_id=root_device.index`, the CUDA index
(None for the CPU), which torch's FSDP1 refuses on CPU params ("FSDP needs a non-CPU accelerator device"): the shim
passes the CPU device instead, as the torch row does. Everything else, wrapping and the freeze logic included, runs as
shipped. Each patch reports itself through `probe.emulated` when it engages.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.fsdp
from lightning.fabric.connector import _Connector
from lightning.fabric.strategies import FSDPStrategy

from ...core.cell import Cell
from ..emulation import Patch, Shim

GPU_GUARD = ("Fabric's 'FSDP is only available on GPU' guard -> passes on the CPU (the accelerator stays 'cpu'; "
             "torch's FSDP runs on gloo)")


def _fsdp_guard_on_cpu(report: Callable[[], None], check: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def checked(connector: Any) -> Any:
        if type(connector._strategy_flag) is not FSDPStrategy or connector._accelerator_flag != "cpu":
            return check(connector)
        report()
        connector._accelerator_flag = "gpu"
        try:
            return check(connector)
        finally:
            connector._accelerator_flag = "cpu"

    return checked


DEVICE_ID = ("torch.distributed.fsdp.FullyShardedDataParallel(device_id=None) on CPU params -> device_id=cpu (Fabric "
             "passes the CUDA device's index)")


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
        return [Patch(_Connector, "_check_strategy_and_fallback", _fsdp_guard_on_cpu, GPU_GUARD),
                Patch(torch.distributed.fsdp, "FullyShardedDataParallel", _fsdp_device_id_on_cpu, DEVICE_ID)]


SHIM = LightningShim()
