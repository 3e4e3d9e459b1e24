"""A user model none of whose params splits evenly over two ranks (15, 5, 5 and 1 elements), for the tests of reads
that gather padded shards (`module:function` references of a cell's `UserModel`). bf16 stacks get bf16 inputs."""

from __future__ import annotations

import torch
from torch import nn

#: The `UserModel` references of this model.
FACTORY, BATCH, LOSS = "odd_sized:odd_sized_model", "odd_sized:odd_sized_batch", "odd_sized:odd_sized_loss"


def odd_sized_model() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 1))


def odd_sized_batch(global_batch_size: int, step: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return {"x": torch.randn(global_batch_size, 3, generator=generator),
            "y": torch.randn(global_batch_size, 1, generator=generator)}


def odd_sized_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    dtype = next(model.parameters()).dtype
    return nn.functional.mse_loss(model(batch["x"].to(dtype)).float(), batch["y"])


def odd_sized_uncast_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """A loss that feeds its batch as it comes: the stack (or its adapter, as a user of it does) casts the inputs."""
    return nn.functional.mse_loss(model(batch["x"]).float(), batch["y"].float())
