"""The one name mapping: wrapped parameter names (and FSDP1 flat params) back to the bare model's."""

import pytest
import torch
from torch import nn

from pytest_freezecompat.adapters import views
from pytest_freezecompat.adapters.views import CHECKPOINT_WRAPPER_INFIXES


class _Flat(nn.Parameter):
    """Stands in for an FSDP1 FlatParameter: what matters to the mapping is `_fqns`."""


def _flat(fqns: list[str]) -> nn.Parameter:
    param = _Flat(torch.zeros(1))
    param._fqns = fqns
    return param


@pytest.mark.parametrize(("wrapped", "bare"), [
    ("blocks.0.ln1.weight", "blocks.0.ln1.weight"),  # DDP (read from shell.model) and FSDP2
    ("blocks.0._checkpoint_wrapped_module.ln1.weight", "blocks.0.ln1.weight"),  # FSDP2 + Composer's checkpointing
    ("_fsdp_wrapped_module.blocks.0._fsdp_wrapped_module.qkv.lora_a", "blocks.0.qkv.lora_a"),  # FSDP1 orig params
    ("_fsdp_wrapped_module.blocks.1._fsdp_wrapped_module._checkpoint_wrapped_module.fc1.bias", "blocks.1.fc1.bias"),
])
def test_wrapped_names_map_back_to_the_bare_model(wrapped: str, bare: str) -> None:
    assert views.original_names(wrapped, nn.Parameter(torch.zeros(1)), CHECKPOINT_WRAPPER_INFIXES) == [bare]


def test_a_flat_param_stands_for_every_param_folded_into_it() -> None:
    block = _flat(["ln1.weight", "_checkpoint_wrapped_module.fc1.bias"])
    root = _flat(["tok_emb.weight", "head.bias"])
    assert views.original_names("_fsdp_wrapped_module.blocks.2._fsdp_wrapped_module._flat_param", block,
                                CHECKPOINT_WRAPPER_INFIXES) == [
        "blocks.2.ln1.weight", "blocks.2.fc1.bias"]
    assert views.original_names("_fsdp_wrapped_module._flat_param", root) == ["tok_emb.weight", "head.bias"]
