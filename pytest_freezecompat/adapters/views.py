"""The plainest `ModelView`: a module whose parameters are whole, full tensors with their grads on them.

DDP-style wrappers (torch DDP, ColossalAI's TorchDDP and HybridParallel zero 0, ...) leave the
bare model like that; sharding views subclass it. Only torch is imported, so adapters pinned to an
older torch can share it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .base import strip_wrapper_infixes

#: The module names FSDP1 inserts into parameter names.
FSDP1_INFIXES = ("_fsdp_wrapped_module",)


class ParamView:
    grad_access = "param.grad"

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.module = module
        self.optimizer = optimizer

    def named_parameters(self) -> dict[str, nn.Parameter]:
        return dict(self.module.named_parameters())

    def requires_grad_flags(self) -> dict[str, bool]:
        return {n: p.requires_grad for n, p in self.named_parameters().items()}

    def tracked_names(self) -> set[str]:
        by_id = {id(p): n for n, p in self.named_parameters().items()}
        return {by_id[id(p)] for group in self.optimizer.param_groups for p in group["params"]}

    def full_params(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.named_parameters().items()}

    def full_grads(self) -> dict[str, torch.Tensor | None]:
        return {n: None if p.grad is None else p.grad.detach().clone() for n, p in self.named_parameters().items()}


def flat_param_grads(fsdp_module: nn.Module,
                     infixes: tuple[str, ...] = FSDP1_INFIXES) -> dict[str, torch.Tensor | None]:
    """Full grads of every original param of an FSDP1 module with flat params (use_orig_params=False).

    `summon_full_params(with_grads=True)` refuses flat params, so gather each flat grad's shards
    and split it by the flat param's FQNs, shapes and padding. `infixes` are the wrapper module
    names to drop from names (add checkpoint wrappers where they sit inside FSDP units).
    A collective: every rank calls it.
    """
    grads: dict[str, torch.Tensor | None] = {}
    for name, flat in fsdp_module.named_parameters():  # same order on every rank
        owner = name.rpartition("_flat_param")[0]
        names = [strip_wrapper_infixes(owner + fqn, infixes) for fqn in flat._fqns]
        if flat.grad is None:
            grads.update(dict.fromkeys(names))
            continue
        shards = [torch.empty_like(flat.grad) for _ in range(dist.get_world_size())]
        dist.all_gather(shards, flat.grad.contiguous())
        full = torch.cat(shards)
        pieces = iter(zip(names, flat._shapes))
        offset = 0
        for numel, is_padding in zip(flat._numels_with_padding, flat._is_padding_mask):
            if not is_padding:
                original, shape = next(pieces)
                grads[original] = full[offset:offset + numel].view(shape).clone()
            offset += numel
    return grads
