"""Accelerate's FSDP1 `load_state` with SHARDED_STATE_DICT restores no optimizer state into a fresh optimizer.

What a user sees: `Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=1,
state_dict_type="SHARDED_STATE_DICT"))`, the model prepared, AdamW over it, training, `accelerator.save_state(dir)`.
A resume builds the model and optimizer afresh, prepares them and calls `accelerator.load_state(dir)`: no error, no
warning, the model comes back, and the optimizer holds no state: AdamW restarts its moments (exp_avg, exp_avg_sq)
and its bias correction (step), so the resumed run takes other steps than the uninterrupted one.

Mechanism (accelerate/utils/fsdp_utils.py, `load_fsdp_optimizer`, 1.10.1 and 1.15.0): for a state dict type other
than FULL_STATE_DICT the optimizer is loaded with `dist_cp.load(optim_state, ...)`, which fills in place only the
keys the template `optim_state` holds, and the template is built from the optimizer being loaded into:
`{"optimizer": FSDP.optim_state_dict(model, optimizer)}` from 1.13.0 (PR #3904), `{"optimizer":
optimizer.state_dict()}` before. A fresh optimizer has no state and FSDP1's `optim_state_dict` initializes none
(torch's `get_optimizer_state_dict`, the FSDP2 branch since PR #3904, does: `_init_optim_state`), so the template's
`state` is empty and nothing of the saved state is read; `FSDP.optim_state_dict_to_load` and
`optimizer.load_state_dict` then restore the param groups alone. FULL_STATE_DICT (the control below) loads the
saved file itself and restores the state whole.

Run: python findings/accelerate-fsdp-sharded-optimizer-load-restores-no-moments.py (one process, gloo). Without a
GPU, Accelerate takes FSDP only from its GPU-like distributed types (on CPU it silently wraps in DDP); the two
lines of `cpu_as_gpu_host` make it answer as on a GPU host, with gloo and the CPU as its device: device plumbing
only, the wrapping and the checkpoint code run as shipped. On a GPU host they are not applied.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import warnings

import accelerate
import torch
import torch.distributed as dist
from accelerate import Accelerator, FullyShardedDataParallelPlugin
from accelerate.state import PartialState
from accelerate.utils import DistributedType
from torch import nn


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class TwoBlocks(nn.Module):
    """Each block in an FSDP unit of its own (`transformer_based_wrap`), as a user wraps a transformer."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cpu_as_gpu_host() -> bool:
    """Without a GPU: Accelerate's backend answer of a GPU host (gloo, MULTI_GPU) and the CPU as its device."""
    if torch.cuda.is_available():
        return False
    os.environ["ACCELERATE_TORCH_DEVICE"] = "cpu"
    PartialState._prepare_backend = lambda self, cpu=False, sagemaker_dp=False, backend=None: (
        "gloo", DistributedType.MULTI_GPU)
    return True


def prepared(accelerator: Accelerator) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Accelerate's FSDP1 recipe: the model prepared first, then AdamW over its (flat) params."""
    torch.manual_seed(0)
    model = accelerator.prepare(TwoBlocks())
    optimizer = accelerator.prepare(torch.optim.AdamW(model.parameters(), lr=0.1))
    return model, optimizer


def round_trip(accelerator: Accelerator, state_dict_type: str) -> tuple[int, int]:
    """(params with optimizer state when saved, params with state after a fresh optimizer's load_state)."""
    plugin = accelerator.state.fsdp_plugin
    plugin.state_dict_config = plugin.optim_state_dict_config = None  # refilled for the type by set_state_dict_type
    plugin.set_state_dict_type(state_dict_type)
    model, optimizer = prepared(accelerator)
    accelerator.backward(model(torch.ones(2, 4)).sum())
    optimizer.step()
    saved = len(optimizer.optimizer.state)
    with tempfile.TemporaryDirectory() as folder:
        accelerator.save_state(folder)
        accelerator.free_memory()  # the resume: a freshly built model and optimizer, prepared, then load_state
        model, optimizer = prepared(accelerator)
        accelerator.load_state(folder)
        loaded = len(optimizer.optimizer.state)
    accelerator.free_memory()
    return saved, loaded


def main() -> int:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    shimmed = cpu_as_gpu_host()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FSDP's NO_SHARD-on-one-rank and CPU notes
        accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(
            fsdp_version=1, auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["Block"]))
        print(f"accelerate {accelerate.__version__}, torch {torch.__version__}: distributed_type "
              f"{accelerator.distributed_type}{' (CPU as a GPU host, gloo)' if shimmed else ''}; FSDP1 around two "
              "nn.Linear blocks, AdamW, one step, save_state, a fresh model + optimizer, load_state")
        sharded = round_trip(accelerator, "SHARDED_STATE_DICT")
        full = round_trip(accelerator, "FULL_STATE_DICT")
    if dist.is_initialized():
        dist.destroy_process_group()
    print(f"SHARDED_STATE_DICT: optimizer state for {sharded[0]} params saved, {sharded[1]} after load_state")
    print(f"FULL_STATE_DICT (control): optimizer state for {full[0]} params saved, {full[1]} after load_state")
    if full[0] == 0 or full[1] != full[0]:
        print("the control did not round-trip: the script is broken here")
        return 2
    if sharded[0] > 0 and sharded[1] == 0:
        print("REPRODUCED: load_state with SHARDED_STATE_DICT restores no optimizer state into a fresh optimizer "
              "(FULL_STATE_DICT restores it)")
        return 0
    print("NOT REPRODUCED: load_state with SHARDED_STATE_DICT restores the optimizer state")
    return 1


if __name__ == "__main__":
    sys.exit(main())
