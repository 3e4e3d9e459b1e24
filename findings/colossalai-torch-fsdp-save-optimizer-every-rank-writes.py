"""TorchFSDPPlugin's unsharded optimizer checkpoint is written by every rank, the non-zero ranks writing `{}`.

What a user sees: `booster.save_optimizer(optimizer, "optim.pt")` (shard=False, the only format this plugin saves
before 0.3.6) on every rank, as ColossalAI's docs write it, sometimes leaves a file without any optimizer state:
`booster.load_optimizer` then fails or restores nothing, depending on which rank's `torch.save` finished last (a
race: the same script passes on one run and loses the state on the next).

Mechanism (colossalai/booster/plugin/torch_fsdp_plugin.py, `TorchFSDPCheckpointIO.save_unsharded_optimizer`,
0.3.0 to 0.4.6): the docstring says "Save optimizer to checkpoint but only on master process", but the body is

    full_optimizer_state = FSDP.full_optim_state_dict(fsdp_model, optim=optimizer, rank0_only=True)
    utils.save_state_dict(full_optimizer_state, checkpoint_file_path=checkpoint, use_safetensors=False)

with no rank check: with `rank0_only=True` torch returns the full state on rank 0 and an empty dict on every other
rank, and every rank writes what it got to the same path. `save_unsharded_model` is the same (`state_dict()` under
`FullStateDictConfig(rank0_only=True)` is empty off rank 0). 0.4.7 writes only on the master
(`if self.coordinator.is_master():` around the save in both, added with the async-checkpoint work of PR #6152,
commit 130229f); 0.4.7 and 0.5.0 behave.

Workaround on the affected releases: save under `if dist.get_rank() == 0` yourself after the collective call, or
give each rank its own path and keep rank 0's file.

The plugin's `configure` asks for `torch.cuda.current_device()`; this script builds the same pair the plugin
builds (`TorchFSDPModel` around the model, `FSDPOptimizerWrapper` around the optimizer) with the CPU as FSDP's
device, so FSDP runs on CPU over gloo with 2 ranks, and calls the plugin's own checkpoint IO. Each rank saves to its
own path so that what rank 1 writes can be seen (with one shared path, as users call it, the two writes race).
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

WORLD_SIZE = 2


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rank_main(rank: int, port: int, folder: str) -> None:
    """One step of an FSDP-wrapped Linear, then the plugin's `save_optimizer(..., shard=False)` on every rank."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
    from colossalai.booster.plugin.torch_fsdp_plugin import FSDPOptimizerWrapper, TorchFSDPModel, TorchFSDPPlugin

    torch.manual_seed(0)
    # What TorchFSDPPlugin.configure builds, with the CPU where it passes `torch.cuda.current_device()`.
    model = TorchFSDPModel(nn.Linear(4, 4), device_id=torch.device("cpu"))
    optimizer = FSDPOptimizerWrapper(torch.optim.AdamW(model.parameters(), lr=1e-2), model.unwrap())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    checkpoint_io = TorchFSDPPlugin().get_checkpoint_io()
    checkpoint_io.save_optimizer(optimizer, os.path.join(folder, f"optimizer-from-rank{rank}.pt"), shard=False)
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(rank_main, args=(free_port(), folder), nprocs=WORLD_SIZE)
        written = {rank: os.path.join(folder, f"optimizer-from-rank{rank}.pt") for rank in range(WORLD_SIZE)}
        for rank, path in written.items():
            if os.path.exists(path):
                state = torch.load(path, map_location="cpu")
                print(f"rank {rank} wrote {os.path.basename(path)}: keys {sorted(state)}, "
                      f"{len(state.get('state', {}))} param states")
            else:
                print(f"rank {rank} wrote nothing")
        if os.path.exists(written[1]):
            contents = torch.load(written[1], map_location="cpu")
            print(f"REPRODUCED: rank 1 writes the unsharded optimizer checkpoint too ({contents!r}); with the one "
                  "path every rank passes, the file holds whichever write finished last")
            return 0
    print("NOT REPRODUCED: only rank 0 writes the unsharded optimizer checkpoint")
    return 1


if __name__ == "__main__":
    sys.exit(main())
