"""Transformers 4.57.1's Trainer cannot resume a multi-process CPU (DDP) run from its own checkpoint.

What a user sees: `TrainingArguments(use_cpu=True, save_strategy="steps", ...)` under torchrun with two processes
(Accelerate's MULTI_CPU: gloo, DDP) trains and saves `checkpoint-1`; `trainer.train(resume_from_checkpoint=...)`
then raises, on every rank,

    RuntimeError: don't know how to restore data location of torch.storage.UntypedStorage (tagged with cpu:0)

Mechanism: transformers/trainer.py, `Trainer._load_optimizer_and_scheduler` (4.57.1): in distributed training it
loads optimizer.pt with `map_location = self.args.device if self.args.world_size > 1 else "cpu"`, and
`args.device` is Accelerate's `PartialState.device`, which for MULTI_CPU is `torch.device("cpu", local_process_index
% torch.cpu.device_count())` (accelerate/state.py, `set_device`): `cpu:0`. torch.load restores a storage only to
the plain location "cpu", so the indexed one raises. 5.23.0 loads with plain "cpu" when `args.device.type` is "cpu"
(its comment: 'An indexed CPU device (e.g. "cpu:0") can't be restored by torch - use plain "cpu"').

Run: python findings/transformers-trainer-cpu-ddp-resume-map-location.py (two CPU processes, gloo).
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import warnings
from pathlib import Path

import torch
import torch.multiprocessing as mp
from torch import nn


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": (self.linear(x).squeeze(-1) - labels).pow(2).mean()}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rank_main(rank: int, port: int, folder: str) -> None:
    """One torchrun-like rank: train two steps saving checkpoint-1, then resume a fresh Trainer from it."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
    warnings.simplefilter("ignore")
    from transformers import Trainer, TrainingArguments

    data = [{"x": torch.full((4,), float(i)), "labels": torch.tensor(1.0)} for i in range(8)]
    args = TrainingArguments(output_dir=folder, use_cpu=True, per_device_train_batch_size=2, max_steps=2,
                             save_strategy="steps", save_steps=1, report_to="none", disable_tqdm=True)
    torch.manual_seed(0)
    Trainer(model=Regressor(), args=args, train_dataset=data).train()
    torch.manual_seed(0)
    try:
        Trainer(model=Regressor(), args=args, train_dataset=data).train(
            resume_from_checkpoint=str(Path(folder) / "checkpoint-1"))
        outcome = f"resumed (args.device {args.device})"
    except RuntimeError as error:
        outcome = f"raised (args.device {args.device}): {str(error)[:160]}"
    (Path(folder) / f"rank{rank}.txt").write_text(outcome)


def main() -> int:
    import transformers

    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(rank_main, args=(free_port(), folder), nprocs=2, join=True)
        outcomes = [(Path(folder) / f"rank{rank}.txt").read_text() for rank in range(2)]
    print(f"transformers {transformers.__version__}, torch {torch.__version__}: Trainer(use_cpu=True) on 2 gloo "
          "ranks, 2 steps saving checkpoint-1, a fresh Trainer's train(resume_from_checkpoint=checkpoint-1)")
    for rank, outcome in enumerate(outcomes):
        print(f"rank {rank}: {outcome}")
    if all("restore data location" in outcome for outcome in outcomes):
        print("REPRODUCED: the resume loads optimizer.pt with map_location=cpu:0, which torch.load refuses")
        return 0
    if all(outcome.startswith("resumed") for outcome in outcomes):
        print("NOT REPRODUCED: the Trainer resumes a CPU DDP run from its own checkpoint")
        return 1
    print("the script is broken here: the ranks disagree or raised something else")
    return 2


if __name__ == "__main__":
    sys.exit(main())
