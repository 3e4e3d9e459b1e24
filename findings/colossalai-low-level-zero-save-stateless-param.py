"""LowLevelZero's sharded optimizer checkpoint raises `KeyError` for a param the optimizer holds but never stepped.

What a user sees: a model with a trainable branch a step did not reach (an unused branch, an MoE expert no token
was routed to, blocks behind reentrant activation checkpointing over a frozen input), boosted with
`Booster(plugin=LowLevelZeroPlugin(...))`, trains; saving the optimizer as ColossalAI's docs recommend for ZeRO,
`booster.save_optimizer(optimizer, path, shard=True)`, raises `KeyError: <index>`. Adam keeps no state for a param
that never had a grad, as in plain PyTorch.

Mechanism (colossalai/zero/low_level/low_level_optim.py, `LowLevelZeroOptimizer.state_dict_shard`, which
`LowLevelZeroCheckpointIO.save_sharded_optimizer` calls): from 0.4.8 it walks every master param of the optimizer's
groups and indexes the local states by it,

    param_idx = master2idx[master_param]
    states = local_states[param_idx]

where `local_states = self.optim.state_dict()["state"]` holds only the params Adam has stepped. 0.4.7 and earlier
iterate over `local_states.items()` (the states that exist) and save. The change came with "[hotfix] fix zero optim
save (#6191)" (commit 5ff5323, February 2025, first in 0.4.8), which in the same commit guards the unsharded
`state_dict` path with `if param not in self.optim.state: continue` and gives the sharded path no such guard. The
same code is in 0.5.0, 0.5.1 and on the main branch.

Workaround: save unsharded (`shard=False`: `LowLevelZeroOptimizer.state_dict` skips stateless params), or freeze
(`requires_grad_(False)`) what a step does not reach: LowLevelZero keeps frozen params out of its groups.

Run: python findings/colossalai-low-level-zero-save-stateless-param.py (one process on one CUDA device).
LowLevelZero needs CUDA (`LowLevelZeroOptimizer._sanity_checks`: `assert get_accelerator().name in ["cuda",
"npu"], "device is required"`; 0.3.4: "CUDA is required"); on a machine without one this script says SKIPPED. The
matrix shows the same on CPU only behind its CUDA-on-CPU emulation shim.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import traceback

import torch
import torch.distributed as dist
from torch import nn


class UsedAndUnused(nn.Module):
    """Both Linears require grad and are in the optimizer; the forward reaches only `used`."""

    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(4, 4)
        self.unused = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(backend: str) -> int:
    """One step of LowLevelZero stage 1 in fp32 on one rank, then `booster.save_optimizer(..., shard=True)`."""
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group(backend, rank=0, world_size=1)
    import colossalai
    from colossalai.booster import Booster
    from colossalai.booster.plugin import LowLevelZeroPlugin

    torch.manual_seed(0)
    model = UsedAndUnused()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    booster = Booster(plugin=LowLevelZeroPlugin(stage=1, precision="fp32"))
    model, optimizer, *_ = booster.boost(model, optimizer)
    device = next(model.parameters()).device
    booster.backward(model(torch.ones(2, 4, device=device)).sum(), optimizer)
    optimizer.step()
    stepped = len(optimizer.optim.state)
    held = sum(len(group["params"]) for group in optimizer.optim.param_groups)
    print(f"colossalai {colossalai.__version__}, torch {torch.__version__}: one step done; Adam has state for "
          f"{stepped} of the {held} params it holds (unused.* got no grad)")
    # state_dict_shard numbers the master params in param-group order, as optim.state_dict() does
    stateless = sorted(set(range(held)) - set(optimizer.optim.state_dict()["state"]))
    print(f"expected: booster.save_optimizer(shard=True) saves; stateless param indices {stateless}")
    with tempfile.TemporaryDirectory() as folder:
        try:
            booster.save_optimizer(optimizer, os.path.join(folder, "optimizer"), shard=True)
        except KeyError as error:
            dist.destroy_process_group()
            where = traceback.extract_tb(error.__traceback__)[-1]
            # low_level_optim.py, LowLevelZeroOptimizer.state_dict_shard: `states = local_states[param_idx]`
            if not (error.args and error.args[0] in stateless and where.name == "state_dict_shard"
                    and where.filename.endswith("low_level_optim.py")):
                raise  # another KeyError: not this entry's mechanism
            print(f"actual: booster.save_optimizer(shard=True) raised KeyError: {error} in {where.name} "
                  f"({os.path.basename(where.filename)}:{where.lineno}: {where.line})")
            print("REPRODUCED: LowLevelZero's sharded save_optimizer raises KeyError for params the optimizer "
                  "holds without state (state_dict_shard indexes the states by every master param)")
            return 0
    dist.destroy_process_group()
    print("actual: booster.save_optimizer(shard=True) saved")
    print("NOT REPRODUCED: the sharded optimizer checkpoint saved with a stateless param")
    return 1


def main() -> int:
    if not torch.cuda.is_available():
        print("SKIPPED: needs CUDA (LowLevelZeroOptimizer asserts a CUDA/NPU accelerator; the matrix runs it on CPU "
              "only behind an emulation shim)")
        return 3
    torch.cuda.set_device(0)
    return run("nccl")


if __name__ == "__main__":
    sys.exit(main())
