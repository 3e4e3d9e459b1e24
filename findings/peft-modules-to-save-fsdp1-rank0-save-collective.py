"""peft's `modules_to_save` under FSDP1: the rank-0-only adapter save issues an FSDP collective.

What a user sees: the Transformers Trainer with FSDP1 around a PeftModel with `modules_to_save=["lm_head"]` dies at its
first checkpoint (gloo: "Received data size doesn't match expected size. Is there a distributed collective mismatch",
SIGABRT; a collective mismatch or hang elsewhere). The Trainer's `_save` returns early on every rank but the main one,
which calls `PeftModel.save_pretrained(state_dict=<the gathered full state dict>)`.

Mechanism: peft/utils/other.py, `ModulesToSaveWrapper.adapter_state_dict` takes the values from the state dict it is
given but lists the keys with `self.modules_to_save[adapter_name].state_dict()`. Under FSDP1 that copy is an FSDP
unit of its own (peft's `fsdp_auto_wrap_policy` wraps every leaf whose weight trains), so its `state_dict()` runs
FSDP's state-dict pre-hook, which unshards the unit: an all-gather that only the main rank enters.

The reproducer: two CPU processes (gloo), a LoRA tiny Llama with `modules_to_save=["lm_head"]` in FSDP1 under peft's
policy; the full state dict gathered on every rank (a collective they all make), then rank 0 alone calls
`get_peft_model_state_dict(model, state_dict=...)`, as the Trainer's save does, with torch's all-gathers recorded
and refused there (so that the script reports instead of aborting). Control: the same without `modules_to_save`.

Run: python findings/peft-modules-to-save-fsdp1-rank0-save-collective.py
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RankZeroCollective(RuntimeError):
    """Rank 0 alone entered an all-gather; `via` names the frames that led there."""

    def __init__(self, via: list[str]) -> None:
        super().__init__(via)
        self.via = via


def calling_frames() -> list[str]:
    """The caller's stack as `Class.function (file)`, innermost first."""
    frames, frame = [], sys._getframe(2)
    while frame is not None:
        owner = frame.f_locals.get("self")
        prefix = f"{type(owner).__name__}." if owner is not None else ""
        frames.append(f"{prefix}{frame.f_code.co_name} ({'/'.join(Path(frame.f_code.co_filename).parts[-3:])})")
        frame = frame.f_back
    return frames


# The entry's mechanism: peft/utils/other.py, ModulesToSaveWrapper.adapter_state_dict lists its keys with
# self.modules_to_save[adapter_name].state_dict(), which runs FSDP's state-dict pre-hook
# (torch/distributed/fsdp/_state_dict_utils.py, _pre_state_dict_hook): it unshards the unit with an all-gather.
MECHANISM = ("ModulesToSaveWrapper.adapter_state_dict (peft/utils/other.py)",
             "_pre_state_dict_hook (distributed/fsdp/_state_dict_utils.py)")


def rank0_save_collectives(modules_to_save: list[str] | None) -> str:
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from peft.utils.other import fsdp_auto_wrap_policy
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=False))
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                            modules_to_save=modules_to_save))
    wrapped = FSDP(model, auto_wrap_policy=fsdp_auto_wrap_policy(model), use_orig_params=True,
                   device_id=torch.device("cpu"))
    with FSDP.state_dict_type(wrapped, StateDictType.FULL_STATE_DICT, FullStateDictConfig()):
        full = wrapped.state_dict()  # every rank: what accelerator.get_state_dict gathers
        outcome = "no collective"
        if dist.get_rank() == 0:  # the Trainer's _save: the main rank alone
            originals = dist.all_gather, dist.all_gather_into_tensor

            def refuse(*args: object, **kwargs: object) -> None:
                raise RankZeroCollective(calling_frames())

            dist.all_gather = dist.all_gather_into_tensor = refuse
            try:
                keys = get_peft_model_state_dict(wrapped, state_dict=full)
                outcome = f"no collective ({len(keys)} keys)"
            except RankZeroCollective as entered:
                via = list(dict.fromkeys(frame for frame in entered.via if frame in MECHANISM))
                outcome = f"rank 0 alone entered an all-gather via {via or entered.via[:4]}"
            finally:
                dist.all_gather, dist.all_gather_into_tensor = originals
    dist.barrier()
    return outcome


def rank_main(rank: int, port: int, folder: str) -> None:
    warnings.simplefilter("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        outcomes = [rank0_save_collectives(["lm_head"]), rank0_save_collectives(None)]
    finally:
        dist.destroy_process_group()
    if rank == 0:
        (Path(folder) / "outcome.txt").write_text("\n".join(outcomes))


def main() -> int:
    import peft

    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(rank_main, args=(free_port(), folder), nprocs=2, join=True)
        with_lm_head, control = (Path(folder) / "outcome.txt").read_text().splitlines()
    print(f"peft {peft.__version__}, torch {torch.__version__}: FSDP1 under peft's fsdp_auto_wrap_policy, 2 gloo "
          "ranks; rank 0 alone extracts the adapter from the gathered full state dict (the Trainer's save)")
    print(f"modules_to_save=['lm_head']: expected no collective, actual {with_lm_head}")
    print(f"no modules_to_save (control): expected no collective, actual {control}")
    mechanism = f"rank 0 alone entered an all-gather via {list(reversed(MECHANISM))}"
    if with_lm_head == mechanism and control.startswith("no collective"):
        print("REPRODUCED: ModulesToSaveWrapper.adapter_state_dict unshards its FSDP unit on the saving rank alone")
        return 0
    if with_lm_head.startswith("no collective") and control.startswith("no collective"):
        print("NOT REPRODUCED: the adapter is extracted from the given state dict without a collective")
        return 1
    print("the script is broken here: the control entered a collective, or the all-gather came from elsewhere")
    return 2


if __name__ == "__main__":
    sys.exit(main())
