"""Meta init done as a careful user does it: params by name, computed buffers from a model built for real."""

import torch
from torch import nn

from pytest_freezecompat import models
from pytest_freezecompat.adapters.materialize import MetaInit


class Rotary(nn.Module):
    """A computed, non-persistent buffer, as RoPE's `inv_freq`: `to_empty` leaves it uninitialized."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 4, 2).float() / 4)), persistent=False)


def test_a_meta_model_gets_deterministic_params_and_the_eager_buffers():
    eager = Rotary()
    with torch.device("meta"):
        model = Rotary()
    model.to_empty(device="cpu")
    MetaInit(model, seed=5, eager_buffers=dict(eager.named_buffers())).all(model)
    assert torch.equal(model.inv_freq, eager.inv_freq)
    assert torch.equal(model.proj.weight, models.deterministic_values(5, "proj.weight", model.proj.weight.shape))


def test_as_a_param_init_fn_it_fills_one_module_only():
    eager = Rotary()
    with torch.device("meta"):
        model = Rotary()
    model.to_empty(device="cpu")
    init = MetaInit(model, seed=5, eager_buffers=dict(eager.named_buffers()))
    init(model.proj)
    assert torch.equal(model.proj.bias, models.deterministic_values(5, "proj.bias", model.proj.bias.shape))
    init(model)
    assert torch.equal(model.inv_freq, eager.inv_freq)
