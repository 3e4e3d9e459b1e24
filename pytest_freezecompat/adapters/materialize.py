"""Deterministic values into deferred-init params: whole tensors, or this rank's shard of a DTensor.

Shared by the adapters whose meta init materializes under FSDP2 (torch's own, Composer's `param_init_fn`).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, distribute_tensor


def fill_from_full(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a full tensor's values into `param`, or into this rank's shard of it when it is a DTensor."""
    full = full.to(param.dtype)
    if isinstance(param, DTensor):
        local = distribute_tensor(full.to(param.device), param.device_mesh, param.placements,
                                  src_data_rank=None).to_local()
        param.to_local().copy_(local)
    else:
        param.copy_(full.to(param.device))
