"""Declared cases for tests/test_quantized_params.py, in a module pytest does not collect (a test module's
@freeze_case runs as matrix cells)."""

import torch
from torch import nn

from pytest_freezecompat import freeze_case


class Packed(nn.Module):
    """A stand-in for a 4-bit layer: packed uint8 storage, frozen, and an fp32 adapter beside it."""

    def __init__(self) -> None:
        super().__init__()
        self.packed = nn.Parameter(torch.zeros(8, 1, dtype=torch.uint8), requires_grad=False)
        self.adapter = nn.Linear(4, 4)


class StoredAsFloat(nn.Module):
    """bitsandbytes' bf16 storage: a float dtype, known by the quantization state beside the data."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(8, 1, dtype=torch.bfloat16), requires_grad=False)
        self.weight.quant_state = object()
        self.quant_state = self.weight.quant_state
        self.head = nn.Linear(4, 4)


def batch(size: int, step: int) -> dict[str, torch.Tensor]:
    return {"x": torch.ones(size, 4)}


def loss(model: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    return model.adapter(inputs["x"]).sum()


@freeze_case(batch=batch, loss=loss, patterns={"adapter": {"trainable": ["adapter.*"]}})
def packed() -> nn.Module:
    return Packed()


@freeze_case(batch=batch, loss=loss, patterns={"adapter": {"trainable": ["adapter.*"]}})
def plain() -> nn.Module:
    return nn.ModuleDict({"adapter": nn.Linear(4, 4)})
