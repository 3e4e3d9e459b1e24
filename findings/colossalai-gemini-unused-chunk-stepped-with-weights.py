"""GeminiPlugin steps a trainable layer the forward never used, taking the layer's own weights for its gradient.

What a user sees: a model with a trainable branch that a batch does not reach (a vision tower on text-only
batches, an MoE expert no token is routed to) trains under GeminiPlugin without an error when clipping is off, and
after `optimizer.step()` the unused branch has moved: every weight by about `lr` toward zero (Adam on "grad = w"),
where PyTorch leaves a param with `grad is None` alone. Needs the branch to fill Gemini chunks of its own (a branch
sharing a chunk with used params stops at "ZERO DDP error: the synchronization of gradients doesn't exit
properly"; with `max_norm > 0` the step stops at `assert grad_chunk.l2_norm is not None`, #6102).

Mechanism (colossalai/zero/gemini/gemini_optimizer.py, `GeminiOptimizer._set_grad_ptr`, 0.3.x to 0.5.0 and the
main branch): with master weights and no gradient accumulation `reuse_fp16_chunk` is on, and Gemini's grad for
every param the optimizer holds is its slice of the param's own bf16/fp16 chunk:

    grad_chunk16 = chunk16 if self.module.chunk_manager.reuse_fp16_chunk else chunk16.grad_chunk
    fake_param.grad = grad_chunk16.payload[begin:end]

`GeminiDDP.grad_handle` (gemini_ddp.py) overwrites a chunk with reduced grads only once every param of it got one;
a chunk no param of which got a grad is never reduced and still holds the weights. Nothing marks it (the
`_gemini_reduced` flag is only read by `_post_backward`, which checks chunks that were accessed), so
HybridAdam applies the weights as the gradient. From 0.3.5 on (static placement keeps chunks on CUDA, commit
e5ce4c8ea) that step is silent; in 0.3.4 static chunks close offloaded and a chunk the forward never accesses stays
in host memory while its fp32 masters were moved to CUDA, so the fused CUDA Adam kernel refuses the step ("A tensor
was not on the same device as the first tensor" / "expected input to be on cuda").

Releases: 0.3.4 (the step raises), 0.3.5 to 0.5.0 (the unused layer is silently updated); not fixed upstream.
Workaround: freeze what a step will not reach (`requires_grad_(False)`: Gemini ignores frozen params).

Gemini needs CUDA (its chunks live on the accelerator; HybridAdam's fused kernel is CUDA); on a machine without
one this script says SKIPPED. The matrix shows the same on CPU only behind its CUDA-on-CPU emulation shim.
"""

from __future__ import annotations

import os
import socket
import sys
import traceback

import torch
import torch.distributed as dist
from torch import nn

#: What the fused CUDA Adam kernel of 0.3.4 says when the never-reduced chunk of `unused` (still in host memory) is
#: handed to it next to CUDA tensors: the device checks of `multi_tensor_apply` in
#: colossalai/kernel/cuda_native/csrc/multi_tensor_apply.cuh (TORCH_CHECK, raised in Python as RuntimeError). The
#: first when a CUDA tensor heads the list (the grad of `used`, this script's order), the second when the host-memory
#: grad comes first. Any other error of the step is not this mechanism.
MIXED_DEVICE_ERRORS = ("A tensor was not on the same device as the first tensor", "expected input to be on cuda")
#: A step of Adam moves a param by about `lr` (1e-2 here); `unused` has no gradient and weight_decay=0, so PyTorch
#: leaves it exactly where it was.
MOVED_ATOL = 1e-3


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    text = text if len(text) <= 300 else text[:297] + "..."
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def verdict_of_step_error(error: BaseException) -> tuple[int, str]:
    """The exit code and last line for an `optimizer.step()` that raised `error`: REPRODUCED only for the fused
    kernel's refusal of the mixed devices (the host-memory chunk stepped as a gradient), NOT REPRODUCED otherwise."""
    expected = "RuntimeError from multi_tensor_apply.cuh: " + " or ".join(f'"{m}"' for m in MIXED_DEVICE_ERRORS)
    actual = _one_line(error)
    if isinstance(error, RuntimeError) and any(message in str(error) for message in MIXED_DEVICE_ERRORS):
        return 0, ("REPRODUCED: GeminiOptimizer handed HybridAdam the never-reduced chunk of `unused` (its own "
                   "weights, left in host memory) as the gradient, and the fused CUDA kernel refused the step "
                   f"(expected {expected}; actual {actual})")
    return 1, ("NOT REPRODUCED: optimizer.step() raised, but not the fused kernel's refusal of the host-memory chunk "
               f"(expected {expected}; actual {actual})")


def verdict_of_moves(moved: dict[str, float]) -> tuple[int, str]:
    """The exit code and last line for a step that went through: `moved` is each state-dict entry's max |change|."""
    expected = (f"unused.weight and unused.bias each moved > {MOVED_ATOL:.0e}, about lr; PyTorch leaves them at 0 "
                "change: no grad, weight_decay=0")
    actual = f"unused.weight moved {moved['unused.weight']:.1e}, unused.bias moved {moved['unused.bias']:.1e}"
    if moved["unused.weight"] > MOVED_ATOL and moved["unused.bias"] > MOVED_ATOL:
        return 0, ("REPRODUCED: `unused` got no gradient yet one step moved it (Adam applied its own weights as the "
                   f"gradient; expected {expected}; actual {actual})")
    return 1, f"NOT REPRODUCED: `unused` stayed where it was (expected {expected}; actual {actual})"


class UsedAndUnused(nn.Module):
    """`used` is in every forward; `unused` is trainable, in the optimizer, and never reached."""

    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(64, 64)
        self.unused = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def main() -> int:
    if not torch.cuda.is_available():
        print("SKIPPED: needs CUDA (GeminiPlugin keeps its chunks on the CUDA device and HybridAdam steps them with "
              "its fused CUDA kernel; the matrix runs it on CPU only behind an emulation shim)")
        return 3
    with socket.socket() as sock:  # one process: a free port on this host
        sock.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(sock.getsockname()[1]))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)

    from colossalai.booster import Booster
    from colossalai.booster.plugin import GeminiPlugin
    from colossalai.nn.optimizer import HybridAdam

    torch.manual_seed(0)
    model = UsedAndUnused()
    # weight_decay=0: without a gradient nothing may move `unused`.
    optimizer = HybridAdam(model.parameters(), lr=1e-2, weight_decay=0.0)
    # Chunks of 5120 elements: `used` (4160 params) fills one, `unused` lands in a chunk of its own.
    plugin = GeminiPlugin(placement_policy="static", precision="bf16", max_norm=0.0, min_chunk_size_m=0.004161,
                          search_range_m=0)
    booster = Booster(plugin=plugin)
    model, optimizer, *_ = booster.boost(model, optimizer)
    manager = model.chunk_manager
    bare = model.unwrap()
    if manager.get_chunk(bare.used.weight) is manager.get_chunk(bare.unused.weight):
        print("SKIPPED: the chunk search put `used` and `unused` in one chunk (this case needs separate chunks)")
        return 3

    before = {k: v.detach().float().cpu().clone() for k, v in model.state_dict().items()}
    loss = model(torch.randn(4, 64, device="cuda", dtype=torch.bfloat16)).float().pow(2).mean()
    booster.backward(loss, optimizer)
    try:
        optimizer.step()
    except Exception as error:  # 0.3.4: the unused chunk is still in host memory (anything else: not this finding)
        print(f"optimizer.step() raised: {_one_line(error)}")
        code, line = verdict_of_step_error(error)
        if code != 0:
            traceback.print_exc()
        print(line)
        return code
    optimizer.zero_grad()
    after = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    moved = {k: float((after[k] - before[k]).abs().max()) for k in before}
    for name, delta in moved.items():
        print(f"{name}: max |change| after one step = {delta:.2e}")
    code, line = verdict_of_moves(moved)
    print(line)
    return code


if __name__ == "__main__":
    code = main()
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.exit(code)
