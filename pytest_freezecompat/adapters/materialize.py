"""Materializing a deferred-init (meta) model the way a careful user does.

`to_empty` gives every param and buffer fresh, uninitialized storage. Params get the deterministic
init by name (this rank's shard of it, for a DTensor); buffers get the values the model computes
when built for real (RoPE's `inv_freq`, position ids), read from a twin built on the CPU. Forgetting
the buffers makes every meta cell of a model with computed buffers train wrong whatever is frozen.
"""

from __future__ import annotations

import torch
from torch import nn

try:
    from torch.distributed.tensor import DTensor, distribute_tensor
except ImportError:  # torch < 2.4 (Composer < 0.24 pins 2.3.1): the same classes, before they were public
    from torch.distributed._tensor import DTensor, distribute_tensor

from .. import models


def fill_from_full(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a full tensor's values into `param`, or into this rank's shard of it when it is a DTensor."""
    full = full.to(param.dtype)
    if isinstance(param, DTensor):
        local = distribute_tensor(full.to(param.device), param.device_mesh, param.placements,
                                  src_data_rank=None).to_local()
        param.to_local().copy_(local)
    else:
        param.copy_(full.to(param.device))


class MetaInit:
    """Fill one module's own params and buffers (a `param_init_fn`), or a whole model's (`all`)."""

    def __init__(self, model: nn.Module, seed: int, eager_buffers: dict[str, torch.Tensor]) -> None:
        self.prefixes = {module: f"{name}." if name else "" for name, module in model.named_modules()}
        self.seed = seed
        self.eager_buffers = eager_buffers

    @torch.no_grad()
    def __call__(self, module: nn.Module) -> None:
        prefix = self.prefixes[module]
        for name, param in module.named_parameters(recurse=False):
            fill_from_full(param, models.deterministic_values(self.seed, prefix + name, param.shape))
        for name, buffer in module.named_buffers(recurse=False):
            if prefix + name in self.eager_buffers:
                buffer.copy_(self.eager_buffers[prefix + name].to(buffer.device, buffer.dtype))

    def all(self, model: nn.Module) -> None:
        for module in model.modules():
            self(module)
