"""CUDA-on-CPU shim for Composer's FSDP paths, engaged only for cells a rule marks `emulation = true`.

Composer names CUDA outright where plain PyTorch would take the module's device:
FSDP1 wrapping passes `device_id=torch.cuda.current_device()`, its meta-init hook
calls `module.to_empty(device=f"cuda:{torch.cuda.current_device()}")`, and the
FSDP2 meta init calls `module.to_empty(device="cuda")`. While the Trainer wraps
the model, this shim answers those two calls with the CPU, and nothing else;
everything is restored when the `with` block ends. Each redirect reports itself
through `probe.emulated` the first time it is actually used.

On torch < 2.8, FSDP2 asks gloo's reduce-scatter for `ReduceOp.AVG`, which gloo does not
honour: grads come out world_size times too large (pytorch#162338), on CPU only. The shim
makes FSDP2 sum and then divide by the world size (the upstream fix, the same arithmetic as
AVG), so Composer's freeze logic is what the cell judges. The plugin `fsdp2-no-avg-shim`
runs without it and shows the artefact itself.

Composer's checkpoints gather FSDP1's full state dict with `cpu_offload=True` (made for CUDA params): on CPU
params the shim takes the two shared FSDP1 patches for that (`adapters.emulation.fsdp1_cpu_offload_patches`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from packaging.version import Version
from torch import nn

from ...core.cell import Cell
from ..emulation import Patch, Shim, always, fsdp1_cpu_offload_patches
from . import UNSHIMMED_GLOO_AVG

CURRENT_DEVICE = "torch.cuda.current_device() -> cpu (Composer passes it to FSDP1 as device_id)"
TO_EMPTY = "nn.Module.to_empty(device='cuda...') -> cpu (Composer's meta-init hook materializes on CUDA)"
GLOO_AVG = ("FSDP2 reduce-scatter on gloo: SUM, then divide by the world size (gloo ignores ReduceOp.AVG on "
            "torch < 2.8; pytorch#162338)")
SYNCHRONIZE = ("torch.cuda.synchronize -> no-op (torch 2.3's FSDP1 gathers use_orig_params optimizer state with "
               "torch.cuda.synchronize(), whatever the device)")
#: Where FSDP2 decides how grads are averaged; the first torch release whose gloo averages for it.
FSDP2_COLLECTIVES = "torch.distributed.fsdp._fully_shard._fsdp_collectives"
GLOO_AVERAGES_FROM = Version("2.8")


def _cpu_device() -> torch.device:
    return torch.device("cpu")


def _no_op(*args: Any, **kwargs: Any) -> None:
    return None


def _to_empty_on_cpu(report: Callable[[], None], to_empty: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    def cpu_to_empty(self: nn.Module, *, device: Any, recurse: bool = True) -> nn.Module:
        if str(device).startswith("cuda"):  # "cuda", "cuda:0" and "cuda:cpu" (a cpu current_device in an f-string)
            report()
            device = "cpu"
        return to_empty(self, device=device, recurse=recurse)

    return cpu_to_empty


def _sum_then_divide_on_gloo(report: Callable[[], None], original: Callable[..., Any]) -> Callable[..., Any]:
    """`_get_gradient_divide_factors`: where it would leave averaging to ReduceOp.AVG on a gloo group, ask
    for a SUM (pre-divide by 1) and a division by the data-parallel size afterwards."""

    def divide_factors(reduce_scatter_group: Any, all_reduce_group: Any, *args: Any, **kwargs: Any) -> Any:
        factors = original(reduce_scatter_group, all_reduce_group, *args, **kwargs)
        if factors != (None, None) or dist.get_backend(reduce_scatter_group) != "gloo":
            return factors
        report()
        size = reduce_scatter_group.size() * (all_reduce_group.size() if all_reduce_group is not None else 1)
        return 1.0, float(size)

    return divide_factors


def _gloo_avg_patches(cell: Cell) -> list[Patch]:
    if cell.key.plugin == UNSHIMMED_GLOO_AVG or Version(torch.__version__).release >= GLOO_AVERAGES_FROM.release:
        return []
    try:
        collectives = importlib.import_module(FSDP2_COLLECTIVES)
    except ImportError:  # no FSDP2 here
        return []
    if not hasattr(collectives, "_get_gradient_divide_factors"):
        return []
    return [Patch(collectives, "_get_gradient_divide_factors", _sum_then_divide_on_gloo, GLOO_AVG)]


class ComposerShim(Shim):
    def patches(self, cell: Cell, device: torch.device) -> list[Patch]:
        return [Patch(torch.cuda, "current_device", always(_cpu_device), CURRENT_DEVICE),
                Patch(nn.Module, "to_empty", _to_empty_on_cpu, TO_EMPTY),
                Patch(torch.cuda, "synchronize", always(_no_op), SYNCHRONIZE),
                *fsdp1_cpu_offload_patches("Composer's full checkpoint"),
                *_gloo_avg_patches(cell)]


SHIM = ComposerShim()
