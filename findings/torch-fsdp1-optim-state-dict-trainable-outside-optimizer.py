"""FSDP1's `optim_state_dict` refuses a unit that holds a trainable param the optimizer was not given.

What a user sees: a model wrapped with `FullyShardedDataParallel(..., use_orig_params=True)` (the setting that lets
one FSDP unit mix params the optimizer steps with params it does not), every param requiring grad, an optimizer
over part of it (`AdamW(model.head.parameters())`: a head trained first, a body the user steps by hand or keeps
fixed by leaving it out of the optimizer). Training runs; checkpointing the optimizer with
`FSDP.optim_state_dict(model, optimizer)` raises

    RuntimeError: body.weight is not in the optimizer state. The FSDPParamInfo has the param keys [...] while the
    optimizer has the param keys [...].

Mechanism (torch/distributed/fsdp/_optim_utils.py, `_convert_state_with_orig_params`; seen in torch 2.2.2, 2.4,
2.5, 2.8, 2.9 and 2.13): the optimizer's state is gathered per FlatParameter, and for every original param of a
unit of which the optimizer holds at least one param it checks

    if key in _all_states: continue
    if not fsdp_param_info.param_requires_grad[idx]: continue
    raise RuntimeError(f"{key} is not in the optimizer state. ...")

so a param of that unit that is outside the optimizer passes only if it does not require grad. PR #110540 (torch
2.2) added the `requires_grad` skip for frozen params (fine-tuning); a param that requires grad but is outside the
optimizer is not covered. A unit none of whose params is in the optimizer is skipped whole (it has no entry), so
the error needs a unit that mixes the two.

Workaround: freeze what the optimizer does not hold (`requires_grad_(False)`), or wrap the params outside the
optimizer in their own FSDP unit.

Run: python findings/torch-fsdp1-optim-state-dict-trainable-outside-optimizer.py (CPU, gloo, one process; FSDP
falls back to NO_SHARD on one rank and takes the same path).
"""

from __future__ import annotations

import os
import socket
import sys
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


class BodyAndHead(nn.Module):
    """Both Linears require grad; only `head` goes to the optimizer."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(x)))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> int:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FSDP's "switching to NO_SHARD on one rank" and CPU notes
        model = FSDP(BodyAndHead(), use_orig_params=True, device_id=torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.head.parameters(), lr=0.1)  # the user trains the head only
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    print(f"torch {torch.__version__}: one FSDP unit (use_orig_params=True) of body + head, every param requires "
          "grad, AdamW over head.* only; one step done")
    print("expected: FSDP.optim_state_dict returns the state of head.weight and head.bias")
    try:
        state = FSDP.optim_state_dict(model, optimizer)
    except RuntimeError as error:
        dist.destroy_process_group()
        message = str(error)
        # _optim_utils.py, _convert_state_with_orig_params: f"{key} is not in the optimizer state. ..."
        if not any(message.startswith(f"{key} is not in the optimizer state. The FSDPParamInfo has the param keys")
                   for key in ("body.weight", "body.bias")):
            raise  # another failure: not this entry's mechanism
        print(f"actual: FSDP.optim_state_dict raised RuntimeError: {message[:200]}")
        print("REPRODUCED: FSDP.optim_state_dict raises 'is not in the optimizer state' for body.*, a param that "
              "requires grad in the optimizer's FSDP unit but is outside the optimizer")
        return 0
    dist.destroy_process_group()
    print(f"actual: FSDP.optim_state_dict saved the state of {sorted(state['state'])}")
    print("NOT REPRODUCED: FSDP.optim_state_dict saves with a trainable param outside the optimizer")
    return 1


if __name__ == "__main__":
    sys.exit(main())
