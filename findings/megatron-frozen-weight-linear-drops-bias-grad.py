"""BitFit under megatron-core: a ColumnParallelLinear whose weight is frozen never trains its bias.

What a user sees: freeze every weight and train only the biases (BitFit). Training runs without a
warning, but `self_attention.linear_qkv.bias` of every GPT layer gets no gradient (no `.grad`, or an
all-zero `main_grad` in Megatron's DDP grad buffer) and Adam never moves it. The other biases train:
`linear_fc1` (skip_bias_add=True: the MLP adds it), `linear_proj`/`linear_fc2` (RowParallelLinear adds it
outside its matmul) and the layernorms.

Mechanism: ColumnParallelLinear._forward_impl (megatron/core/tensor_parallel/layers.py) switches to
`linear_with_frozen_weight` when `not weight.requires_grad`, and hands it the bias when skip_bias_add is
False. LinearWithFrozenWeight.forward adds it (`output = output + bias`), but its backward returns a gradient
for the input only: `return grad_input, None, None, None, None` (0.16.1; `grad_input, None, None, None` in
0.8.0). The bias's gradient is dropped. Read in the released sources of megatron-core 0.8.0 and 0.16.1 and
still so on Megatron-LM main (August 2026).

Releases: megatron-core 0.8.0 and 0.16.1 (every release with LinearWithFrozenWeight taking the bias).
Workaround: keep the weight's requires_grad on and hold it another way (leave it out of the optimizer), or
build the layer with skip_bias_add=True and add the bias outside. Fix: return `grad_output` summed over all
but the last dim as the bias's gradient when the bias requires grad.

Run: python findings/megatron-frozen-weight-linear-drops-bias-grad.py (CPU, one gloo rank).
"""

from __future__ import annotations

import os
import socket
import sys

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel import ColumnParallelLinear


def free_port() -> int:
    """A port nothing listens on, for the one-rank gloo group Megatron's parallel state needs."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bias_grad(layer: ColumnParallelLinear, x: torch.Tensor) -> torch.Tensor | None:
    """The bias's gradient after one forward/backward of sum(layer(x))."""
    layer.bias.grad = None
    output, _ = layer(x)
    output.sum().backward()
    return layer.bias.grad


def main() -> int:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(free_port())
    dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    try:
        # CPU params, no Megatron init (its RNG tracker wants CUDA): the values are set below.
        config = ModelParallelConfig(use_cpu_initialization=True, perform_initialization=False)
        layer = ColumnParallelLinear(4, 3, config=config, init_method=torch.nn.init.zeros_, bias=True,
                                     gather_output=True)  # skip_bias_add=False, as attention's linear_qkv
        torch.manual_seed(0)
        with torch.no_grad():
            layer.weight.copy_(torch.randn(3, 4))
            layer.bias.zero_()
        x = torch.randn(2, 4, requires_grad=True)

        trained = bias_grad(layer, x)  # weight trainable: the bias gets d(sum)/d(bias) = 2 per entry
        layer.weight.requires_grad_(False)  # BitFit: the weight frozen, the bias still trainable
        frozen = bias_grad(layer, x)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()

    print(f"bias grad, weight trainable: {trained.tolist()}")
    print(f"bias grad, weight frozen:    {None if frozen is None else frozen.tolist()}")
    if frozen is None or not torch.allclose(frozen, trained):
        print("REPRODUCED: with its weight frozen, ColumnParallelLinear (LinearWithFrozenWeight) gives its "
              "trainable bias no gradient")
        return 0
    print("NOT REPRODUCED: the bias of a frozen-weight ColumnParallelLinear gets its gradient")
    return 1


if __name__ == "__main__":
    sys.exit(main())
