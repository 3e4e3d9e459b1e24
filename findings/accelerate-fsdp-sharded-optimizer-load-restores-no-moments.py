"""Accelerate's FSDP1 `load_state` with SHARDED_STATE_DICT restores no optimizer state into a fresh optimizer.

What a user sees: `Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=1,
state_dict_type="SHARDED_STATE_DICT"))`, the model prepared, AdamW over it, training, `accelerator.save_state(dir)`.
A resume builds the model and optimizer afresh, prepares them and calls `accelerator.load_state(dir)`: no error, no
warning, the model and the param groups come back, and the optimizer holds no state: AdamW restarts its moments
(exp_avg, exp_avg_sq) and its bias correction (step), so the resumed run takes other steps than the uninterrupted
one. Not freeze-specific: nothing is frozen here.

Mechanism (accelerate/utils/fsdp_utils.py, `load_fsdp_optimizer`): for a state dict type other than
FULL_STATE_DICT the optimizer is loaded with `dist_cp.load(optim_state, ...)`, which fills in place only the keys
the template `optim_state` holds, and the template is built from the optimizer being loaded into:
`{"optimizer": optimizer.state_dict()}` from 1.7.0 (PR #3527), `{"optimizer": FSDP.optim_state_dict(model,
optimizer)}` for FSDP1 from 1.13.0 (PR #3904). A fresh optimizer has no state and neither call creates any, so the
template's `state` is empty and none of the saved state is read; `FSDP.optim_state_dict_to_load` and
`optimizer.load_state_dict` then restore the param groups alone. Up to 1.6.0 FSDP1 loaded with torch's
`load_sharded_optimizer_state_dict`, which builds the template from the checkpoint's metadata and reads it whole.
FULL_STATE_DICT (the control below) loads the saved file itself and restores the state whole.

Checks, on every rank, of its own (sharded) optimizer state: one AdamW step, `save_state`, then a fresh model and a
fresh optimizer (built with another lr, so that the restore of the param groups shows) prepared, and `load_state`.
Expected: after `load_state` the optimizer state equals the saved one (the same params; `step`, `exp_avg`,
`exp_avg_sq` torch.equal) and the lr is the saved one. Controls: the same sharded checkpoint loaded into another
fresh optimizer the way accelerate 1.6.0 did (torch's `load_sharded_optimizer_state_dict`, then
`FSDP.optim_state_dict_to_load`) restores the state equal, so the checkpoint holds it; and FULL_STATE_DICT's
`save_state` / `load_state` restores it equal (one process, or GPUs: see below).
REPRODUCED (exit 0): on every rank the SHARDED_STATE_DICT state after load_state is empty while the lr is restored
and the controls restore the state equal. NOT REPRODUCED (exit 1): SHARDED_STATE_DICT restores it equal on every
rank. Anything else: exit 2 (the script is broken here).

Run (CPU, gloo), one process or two:
    python findings/accelerate-fsdp-sharded-optimizer-load-restores-no-moments.py
    torchrun --nproc_per_node 2 findings/accelerate-fsdp-sharded-optimizer-load-restores-no-moments.py
Without a GPU, Accelerate takes FSDP only from its GPU-like distributed types (on CPU it silently wraps in DDP); the
two lines of `cpu_as_gpu_host` make it answer as on a GPU host, with gloo and the CPU as its device: device plumbing
only, the wrapping and the checkpoint code run as shipped. On a GPU host they are not applied. On CPU with several
processes the FULL_STATE_DICT control is left out: accelerate's `save_state` then saves FSDP1's full state dict with
`offload_to_cpu=True`, which on CPU params frees the storage the state dict reads (a torch RuntimeError or a
segfault), nothing to do with this bug.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
import tempfile
import warnings
from typing import Any

import accelerate
import torch
import torch.distributed as dist
from accelerate import Accelerator, FullyShardedDataParallelPlugin
from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType
from torch import nn

SAVED_LR, FRESH_LR = 0.1, 0.5


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


def prepared(accelerator: Accelerator, lr: float) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Accelerate's FSDP1 recipe: the model prepared first, then AdamW over its (flat) params."""
    torch.manual_seed(0)
    model = accelerator.prepare(TwoBlocks())
    optimizer = accelerator.prepare(torch.optim.AdamW(model.parameters(), lr=lr))
    return model, optimizer


def optimizer_state(optimizer: torch.optim.Optimizer) -> dict[int, dict[str, torch.Tensor]]:
    """This rank's optimizer state, copied: {param index: {"step", "exp_avg", "exp_avg_sq"}}."""
    return {index: {key: value.detach().clone() for key, value in state.items()}
            for index, state in optimizer.optimizer.state_dict()["state"].items()}


def head(tensor: torch.Tensor) -> str:
    return "[" + ", ".join(f"{value:.4g}" for value in tensor.flatten()[:2].tolist()) + "]"


def describe(state: dict[int, dict[str, torch.Tensor]]) -> str:
    if not state:
        return "state for 0 params {}"
    return f"state for {len(state)} params: " + "; ".join(
        f"{index}: step={float(s['step']):g} exp_avg[:2]={head(s['exp_avg'])} exp_avg_sq[:2]={head(s['exp_avg_sq'])} "
        f"({s['exp_avg'].numel()} elements)"
        if {"step", "exp_avg", "exp_avg_sq"} <= set(s) else f"{index}: keys {sorted(s)}" for index, s in state.items())


def equal(a: dict[int, dict[str, torch.Tensor]], b: dict[int, dict[str, torch.Tensor]]) -> bool:
    return a.keys() == b.keys() and all(
        a[i].keys() == b[i].keys() and all(torch.equal(a[i][k], b[i][k]) for k in a[i]) for i in a)


def load_as_accelerate_1_6(model: nn.Module, optimizer: torch.optim.Optimizer, folder: str) -> None:
    """Accelerate 1.6.0's FSDP1 sharded optimizer load: torch builds the DCP template from the checkpoint's metadata."""
    import torch.distributed.checkpoint as dist_cp
    from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    plugin = AcceleratorState().fsdp_plugin
    with FSDP.state_dict_type(model, plugin.state_dict_type, plugin.state_dict_config, plugin.optim_state_dict_config):
        optim_state = load_sharded_optimizer_state_dict(model_state_dict=model.state_dict(), optimizer_key="optimizer",
                                                        storage_reader=dist_cp.FileSystemReader(folder))
        optimizer.load_state_dict(FSDP.optim_state_dict_to_load(model, optimizer.optimizer, optim_state["optimizer"]))


def round_trip(accelerator: Accelerator, state_dict_type: str, folder: str, tag: str) -> dict[str, Any]:
    """One step, save_state, a fresh model + optimizer, load_state: the optimizer state at each point."""
    plugin = accelerator.state.fsdp_plugin
    plugin.state_dict_config = plugin.optim_state_dict_config = None  # refilled for the type by set_state_dict_type
    plugin.set_state_dict_type(state_dict_type)
    model, optimizer = prepared(accelerator, SAVED_LR)
    accelerator.backward(model(torch.ones(2, 4, device=accelerator.device)).sum())
    optimizer.step()
    out: dict[str, Any] = {"saved": optimizer_state(optimizer)}
    accelerator.save_state(folder)
    accelerator.free_memory()  # the resume: a freshly built model and optimizer, prepared, then load_state
    model, optimizer = prepared(accelerator, FRESH_LR)
    out["before"] = optimizer_state(optimizer)
    accelerator.load_state(folder)
    out["loaded"], out["lr"] = optimizer_state(optimizer), optimizer.param_groups[0]["lr"]
    accelerator.free_memory()
    name = f"{tag} {state_dict_type},"
    print(f"{name} saved (expected after load_state): {describe(out['saved'])}")
    print(f"{name} fresh optimizer before load_state:  {describe(out['before'])}, lr {FRESH_LR}")
    print(f"{name} after load_state (actual):          {describe(out['loaded'])}, lr {out['lr']} (saved: {SAVED_LR})")
    if state_dict_type == "SHARDED_STATE_DICT":  # the checkpoint holds the state: accelerate 1.6.0's load reads it
        model, optimizer = prepared(accelerator, FRESH_LR)
        load_as_accelerate_1_6(model, optimizer, os.path.join(folder, "optimizer_0"))
        out["as_1_6"] = optimizer_state(optimizer)
        accelerator.free_memory()
        print(f"{name} the same checkpoint loaded into another fresh optimizer as accelerate 1.6.0 did (torch's "
              f"load_sharded_optimizer_state_dict): {describe(out['as_1_6'])}")
    return out


def verdict(sharded: dict[str, Any], full: dict[str, Any] | None) -> int:
    """This rank's outcome: 0 reproduced, 1 not reproduced, 2 the script is broken here."""
    moments = bool(sharded["saved"]) and all({"step", "exp_avg", "exp_avg_sq"} <= set(s)
                                             for s in sharded["saved"].values())
    controls = equal(sharded["saved"], sharded["as_1_6"]) and (
        full is None or (equal(full["saved"], full["loaded"]) and full["lr"] == SAVED_LR))
    if not (moments and controls and sharded["lr"] == SAVED_LR):
        return 2
    if sharded["loaded"] == {}:
        return 0
    return 1 if equal(sharded["saved"], sharded["loaded"]) else 2


def main() -> int:
    if "RANK" not in os.environ:  # plain `python`: one gloo process
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                          LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    shimmed = cpu_as_gpu_host()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FSDP's NO_SHARD-on-one-rank and CPU notes
        accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(
            fsdp_version=1, state_dict_type="SHARDED_STATE_DICT", auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=["Block"]))
        rank, world = accelerator.process_index, accelerator.num_processes
        tag = f"[rank {rank}/{world}]"
        print(f"{tag} accelerate {accelerate.__version__}, torch {torch.__version__}: distributed_type "
              f"{accelerator.distributed_type}{' (CPU as a GPU host, gloo)' if shimmed else ''}, use_orig_params "
              f"{accelerator.state.fsdp_plugin.use_orig_params}; FSDP1 around two nn.Linear blocks, AdamW, one step, "
              "save_state, a fresh model + optimizer, load_state")
        folder = [tempfile.mkdtemp() if accelerator.is_main_process else None]
        dist.broadcast_object_list(folder)  # one checkpoint folder for every rank
        sharded = round_trip(accelerator, "SHARDED_STATE_DICT", os.path.join(folder[0], "sharded"), tag)
        full = None
        if world == 1 or not shimmed:
            full = round_trip(accelerator, "FULL_STATE_DICT", os.path.join(folder[0], "full"), tag)
        else:
            print(f"{tag} FULL_STATE_DICT control not run: with several processes save_state offloads FSDP1's full "
                  "state dict to the CPU, which on CPU params fails in torch (run it with one process, or on GPUs)")
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            shutil.rmtree(folder[0], ignore_errors=True)
    outcomes = [None] * world
    dist.all_gather_object(outcomes, verdict(sharded, full))
    dist.destroy_process_group()
    outcome = outcomes[0] if len(set(outcomes)) == 1 else 2
    ranks = "one rank" if world == 1 else f"each of {world} ranks"
    if rank != 0:
        return outcome
    if outcome == 0:
        print(f"REPRODUCED: on {ranks}, load_state with SHARDED_STATE_DICT restores the param groups (lr {SAVED_LR}) "
              f"but no optimizer state: expected step/exp_avg/exp_avg_sq for {len(sharded['saved'])} params, got "
              "state for 0 params (the checkpoint holds them: accelerate 1.6.0's load restores them equal"
              f"{'; so does FULL_STATE_DICT' if full else ''})")
    elif outcome == 1:
        print(f"NOT REPRODUCED: on {ranks}, load_state with SHARDED_STATE_DICT restores the optimizer state equal "
              f"({len(sharded['loaded'])} params: step, exp_avg, exp_avg_sq)")
    else:
        print(f"the script is broken here: outcomes per rank {outcomes} (0 reproduced, 1 not, 2 neither: no AdamW "
              "state saved, a control that did not restore it, or a partial sharded load)")
    return outcome


if __name__ == "__main__":
    sys.exit(main())
