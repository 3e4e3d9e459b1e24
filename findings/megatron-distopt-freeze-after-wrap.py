"""Freezing after Megatron's DDP wrap, then building the distributed optimizer: a bare KeyError.

What a user sees: wrap the model in megatron.core's DistributedDataParallel with
`use_distributed_optimizer=True`, then freeze part of it (`requires_grad_(False)`), then call
get_megatron_optimizer. It raises `KeyError: Parameter containing: tensor([...])`, naming neither the
parameter nor the cause. Freezing before the wrap works.

Mechanism: DistributedDataParallel.__init__ (megatron/core/distributed/distributed_data_parallel.py) gives a
slot in its contiguous grad buffers to every param that requires grad *at wrap time*. get_megatron_optimizer
(megatron/core/optimizer/__init__.py, _get_param_groups) builds its param groups from the params that
require grad *now* (`if not param.requires_grad: continue`). DistributedOptimizer._build_optimizer_group_ranges
(megatron/core/optimizer/distrib_optimizer.py) then looks up every param of the grad buffers' ranges in the
groups: `group_index = world_param_group_map[param]`, a KeyError for the param frozen after the wrap. Read in
megatron-core 0.8.0 and 0.16.1.

Releases: megatron-core 0.8.0 and 0.16.1. Workaround: freeze before wrapping (or rebuild the DDP wrapper after
freezing). Without the distributed optimizer, Megatron's DDP tolerates the late freeze (the frozen params'
buffer slots stay zero).

Needs CUDA: Megatron's DDP allocates its grad buffers on torch.cuda.current_device(), and 0.8.0's
DistributedOptimizer asserts Apex's or Transformer Engine's FusedAdam; elsewhere this prints SKIPPED (the
matrix sees it on CPU only through its CUDA-on-CPU shim).

Run: python findings/megatron-distopt-freeze-after-wrap.py (one rank).
"""

from __future__ import annotations

import os
import socket
import sys

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.transformer import TransformerConfig


def free_port() -> int:
    """A port nothing listens on, for the one-rank process group Megatron's parallel state needs."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def reproduce(backend: str) -> int:
    """Wrap two Linear layers in Megatron's DDP, freeze the first, build the distributed optimizer."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(free_port())
    dist.init_process_group(backend, rank=0, world_size=1)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    try:
        config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)).cuda()
        wrapped = DistributedDataParallel(config, DistributedDataParallelConfig(use_distributed_optimizer=True),
                                          model)
        model[0].requires_grad_(False)  # frozen after the wrap: its grad buffer slots already exist
        try:
            get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, use_distributed_optimizer=True),
                                   [wrapped])
        except KeyError as exc:
            print(f"KeyError: {str(exc)[:80]}...")
            print("REPRODUCED: get_megatron_optimizer raises a bare KeyError (distrib_optimizer.py, "
                  "_build_optimizer_group_ranges) for a param frozen after Megatron's DDP wrap")
            return 0
        except AssertionError as exc:
            if "Apex or Transformer Engine" in str(exc):
                print(f"SKIPPED: this release's DistributedOptimizer needs Apex or Transformer Engine ({exc})")
                return 3
            raise
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    print("NOT REPRODUCED: the distributed optimizer was built for a model frozen after Megatron's DDP wrap")
    return 1


def main() -> int:
    if not torch.cuda.is_available():
        print("SKIPPED: Megatron's DistributedDataParallel allocates its grad buffers on CUDA "
              "(torch.cuda.current_device()); no CUDA device here")
        return 3
    return reproduce("nccl")


if __name__ == "__main__":
    sys.exit(main())
