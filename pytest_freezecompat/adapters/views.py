"""The plainest `ModelView`: a module whose parameters are whole, full tensors with their grads on them.

DDP-style wrappers (torch DDP, ColossalAI's TorchDDP and HybridParallel zero 0, ...) leave the
bare model like that; sharding views subclass it. Only torch is imported, so adapters pinned to an
older torch can share it.
"""

from __future__ import annotations

import torch
from torch import nn


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
