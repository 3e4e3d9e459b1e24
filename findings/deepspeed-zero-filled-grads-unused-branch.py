"""DeepSpeed moves a trainable branch the forward never reaches: AdamW's weight decay shrinks it at every ZeRO stage.

What a user sees: a model with a branch that gets no input this step (a vision tower on a text-only batch, an
unrouted expert) trains under `deepspeed.initialize` with AdamW(weight_decay > 0). In plain PyTorch the branch's
`.grad` stays None and `torch.optim.AdamW` skips it: its weights are unchanged. Under DeepSpeed they shrink by
lr * weight_decay every step, silently, at ZeRO stages 0, 1, 2 and 3.

Mechanism (DeepSpeed 0.19.2 and 0.19.8, same code): DeepSpeed hands the optimizer a zero-filled gradient where
autograd gave none.
- stage 0: `deepspeed/runtime/engine.py`, `DeepSpeedEngine._get_gradients_for_reduction` (called by
  `buffered_allreduce_fallback` from `allreduce_gradients` after every backward) sets
  `param.grad = torch.zeros(param.size(), ...)` for every param that requires grad and has none, "so that every
  rank is reducing the same size"; the torch AdamW then decays it.
- stages 1-2: `deepspeed/runtime/zero/stage_1_and_2.py`: the base optimizer steps one flat fp32 partition per
  param group; `DeepSpeedZeroOptimizer.get_all_grad_tensors` puts `torch.zeros_like(tensor)` in place of a missing
  grad and `get_flat_partition` flattens it into the partition's grad (`independent_gradient_partition_epilogue`,
  `step`): AdamW decays the whole flat tensor, the unused branch's slice included.
- stage 3: `deepspeed/runtime/zero/stage3.py`: each param's grad is a slice of `grad_partitions_flat_buffer`
  (`torch.zeros(...)` at init, `DeepSpeedZeroOptimizer_Stage3.__init__`); `independent_gradient_partition_epilogue`
  and `_prepare_fp32_grad_for_sub_group` hand that whole flat buffer to AdamW as the flat fp32 partition's grad.
The same silent harm as DDP's zero-filled grads for unused params (pytorch#28294) and FSDP1's (pytorch#87308).

Workaround: keep branches that get no input out of the optimizer for those steps, or use weight_decay=0 for them
(a param group of their own); the zeros also enter Adam's moments, so momentum decays too.

Run: python findings/deepspeed-zero-filled-grads-unused-branch.py (CPU, gloo, one process).
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

# DeepSpeed's CPU accelerator compiles its shared-memory comm op at init_distributed unless it is cached: use the
# environment's cache where one was built (a user's own TORCH_EXTENSIONS_DIR wins).
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))

import deepspeed
import torch
from torch import nn

LR = 0.1
WEIGHT_DECAY = 0.1


class TwoBranches(nn.Module):
    """`used` is on the forward path; `unused` is trainable but never reached (a vision tower, text-only batch)."""

    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(4, 4)
        self.unused = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_model() -> TwoBranches:
    torch.manual_seed(0)
    return TwoBranches()


def unused_after_one_step_in_pytorch() -> torch.Tensor:
    """The reference: plain PyTorch, AdamW over every param; the unused branch's grad is None, so it is skipped."""
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    model(torch.ones(2, 4)).sum().backward()
    assert model.unused.weight.grad is None
    optimizer.step()
    return model.unused.weight.detach().clone()


def unused_after_one_step_in_deepspeed(stage: int) -> tuple[torch.Tensor, bool]:
    """One engine step at ZeRO `stage`; the unused weight afterwards, and whether its grad was None after backward."""
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    config = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
              "steps_per_print": 1 << 30}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    engine.backward(engine(torch.ones(2, 4)).sum())
    grad = deepspeed.utils.safe_get_full_grad(engine.module.unused.weight)
    engine.step()
    with deepspeed.zero.GatheredParameters([engine.module.unused.weight]):
        weight = engine.module.unused.weight.detach().clone()
    engine.destroy()
    return weight, grad is None


def main() -> int:
    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(free_port())})
    deepspeed.utils.logger.setLevel("WARNING")
    deepspeed.init_distributed(dist_backend="gloo")
    initial = make_model().unused.weight.detach().clone()
    reference = unused_after_one_step_in_pytorch()
    print(f"deepspeed {deepspeed.__version__}, torch {torch.__version__}; AdamW lr={LR} weight_decay={WEIGHT_DECAY}")
    print(f"plain PyTorch: unused weight max |change| = {(reference - initial).abs().max().item():.3g} (grad None)")
    moved = []
    for stage in range(4):
        weight, grad_none = unused_after_one_step_in_deepspeed(stage)
        change = (weight - initial).abs().max().item()
        ratio = (weight / initial).mean().item()
        print(f"ZeRO stage {stage}: unused weight max |change| = {change:.3g} (weight / initial = {ratio:.4f}; "
              f"grad after backward: {'None' if grad_none else 'zeros'})")
        if change > 0:
            moved.append(stage)
    if moved:
        print(f"REPRODUCED: the unused, trainable branch moved under AdamW weight decay at ZeRO stage(s) "
              f"{', '.join(map(str, moved))} (plain PyTorch leaves it unchanged)")
        return 0
    print("NOT REPRODUCED: the unused branch is unchanged at every ZeRO stage, as in plain PyTorch")
    return 1


if __name__ == "__main__":
    sys.exit(main())
