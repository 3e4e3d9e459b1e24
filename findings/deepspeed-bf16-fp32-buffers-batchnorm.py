"""DeepSpeed bf16 casts parameters only and leaves fp32 buffers alone. BatchNorm2d and FrozenBatchNorm2d then fail.

What a user sees: a conv net with BatchNorm (a ResNet-style backbone, frozen for fine-tuning a head) trained
under `deepspeed.initialize` with `bf16: {enabled: true}` (the inputs fed in bf16, as a bf16 engine expects).
The first forward raises, at any ZeRO stage:
- nn.BatchNorm2d: `RuntimeError: expected scalar type BFloat16 but found Float` in F.batch_norm. The engine made
  weight and bias bf16 but left running_mean and running_var fp32, and the CPU kernel accepts bf16 input with
  fp32 parameters only when all of them are fp32.
- torchvision-style FrozenBatchNorm2d (weight, bias, running_mean, running_var are all buffers): its fp32 buffers
  promote the bf16 activations to fp32 (`x * scale + shift`), and the next bf16 conv raises `RuntimeError: Input
  type (torch.FloatTensor) and weight type (CPUBFloat16Type) should be the same`.
DeepSpeed 0.19.1 and earlier ran `module.bfloat16()`, which cast the buffers too, so both models trained.

Mechanism: deepspeed/runtime/engine.py, `DeepSpeedEngine._configure_distributed_model`, since PR #8066
(b919284, "Mixed-precision: per-policy param/buffer dtype cast (preserve fp32 buffers)", first in 0.19.2):
"Cast params only; preserve fp32 buffers (e.g. rotary inv_freq) unless buffer_dtype is set. Replaces blanket
module.half()/bfloat16()". `_cast_module_mixed_precision` casts `self.module.parameters()` to bf16, and it casts
`self.module.buffers()` only when the config sets `data_types.buffer_dtype`. The code is the same in 0.19.2 and
0.19.8; 0.19.8 adds `keep_in_fp32_modules`.

Checks: one ZeRO-2 bf16 step per model, 2 ranks (gloo, CPU), backbone frozen and head trained. The dtypes of the
norm's weight and running_var after deepspeed.initialize are printed. REPRODUCED (exit 0) when both default-config
runs raise one of the two dtype errors in the forward, and both controls with `data_types: {buffer_dtype:
"bf16"}` (the workaround the PR names) finish their step. NOT REPRODUCED (exit 1) when both default-config runs
step. Any other state raises (the script is broken).

Run: python findings/deepspeed-bf16-fp32-buffers-batchnorm.py (CPU, gloo; it spawns its own 2 ranks).
"""

from __future__ import annotations

import json
import os
import re
import socket
import sys
import tempfile
from pathlib import Path

# DeepSpeed's CPU accelerator compiles its shared-memory comm op at init_distributed unless it is cached: use the
# environment's cache where one was built (a user's own TORCH_EXTENSIONS_DIR wins).
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))

import torch
import torch.multiprocessing as mp
from torch import nn

WORLD_SIZE = 2
DTYPE_ERROR = re.compile(r"expected scalar type BFloat16 but found Float"
                         r"|Input type \(torch\.FloatTensor\) and weight type \(CPUBFloat16Type\)")


class FrozenBatchNorm2d(nn.Module):
    """torchvision.ops.FrozenBatchNorm2d, as Detectron2 and torchvision's detection backbones use it: the affine
    parameters and the statistics are buffers."""

    def __init__(self, channels: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        for name, fill in (("weight", 1.0), ("bias", 0.0), ("running_mean", 0.0), ("running_var", 1.0)):
            self.register_buffer(name, torch.full((channels,), fill))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.weight * (self.running_var + self.eps).rsqrt()
        shift = self.bias - self.running_mean * scale
        return x * scale.view(1, -1, 1, 1) + shift.view(1, -1, 1, 1)


class ConvNet(nn.Module):
    """conv -> norm -> relu -> conv (the frozen backbone), then a linear head."""

    def __init__(self, norm: type[nn.Module]) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1, bias=False)
        self.norm = norm(4)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1, bias=False)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.conv2(torch.relu(self.norm(self.conv1(x)))).mean((2, 3)))


def one_step(norm: type[nn.Module], buffer_dtype: str | None) -> dict:
    """One bf16 ZeRO-2 step; the norm's dtypes after initialize, and the error the step raised (None if none)."""
    import deepspeed

    torch.manual_seed(0)
    model = ConvNet(norm)
    for name, param in model.named_parameters():
        param.requires_grad_(name.startswith("head."))  # fine-tune the head on a frozen backbone
    config = {"train_batch_size": 2 * WORLD_SIZE, "train_micro_batch_size_per_gpu": 2,
              "gradient_accumulation_steps": 1, "bf16": {"enabled": True}, "zero_optimization": {"stage": 2},
              "zero_allow_untested_optimizer": True, "steps_per_print": 1 << 30}
    if buffer_dtype is not None:
        config["data_types"] = {"buffer_dtype": buffer_dtype}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    seen = {"weight": str(engine.module.norm.weight.dtype), "running_var": str(engine.module.norm.running_var.dtype),
            "error": None}
    images = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(engine.global_rank))
    try:
        loss = engine(images.to(torch.bfloat16)).float().pow(2).mean()  # a bf16 engine casts no input itself
    except RuntimeError as error:
        seen["error"] = f"forward: {type(error).__name__}: {error}"
    else:
        engine.backward(loss)
        engine.step()
    engine.destroy()
    return seen


CASES = [("BatchNorm2d", nn.BatchNorm2d, None), ("FrozenBatchNorm2d", FrozenBatchNorm2d, None),
         ("BatchNorm2d", nn.BatchNorm2d, "bf16"), ("FrozenBatchNorm2d", FrozenBatchNorm2d, "bf16")]


def rank_main(rank: int, port: int, folder: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD_SIZE), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    import deepspeed

    deepspeed.utils.logger.setLevel("WARNING")
    deepspeed.init_distributed(dist_backend="gloo")
    results = [one_step(norm, buffer_dtype) for _, norm, buffer_dtype in CASES]
    with open(os.path.join(folder, f"rank{rank}.json"), "w") as out:
        json.dump(results, out)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> int:
    import deepspeed

    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(rank_main, args=(free_port(), folder), nprocs=WORLD_SIZE)
        ranks = [json.loads(Path(folder, f"rank{rank}.json").read_text()) for rank in range(WORLD_SIZE)]
    print(f"deepspeed {deepspeed.__version__}, torch {torch.__version__}; bf16, ZeRO-2, {WORLD_SIZE} ranks (gloo, "
          f"CPU); backbone frozen, head trained")
    outcomes = []
    for index, (name, _, buffer_dtype) in enumerate(CASES):
        config = f"data_types.buffer_dtype={buffer_dtype}" if buffer_dtype else "default config"
        errors = []
        for rank, results in enumerate(ranks):
            seen = results[index]
            print(f"[rank {rank}] {name}, {config}: norm.weight {seen['weight']}, norm.running_var "
                  f"{seen['running_var']}; step: {seen['error'] or 'ok'}")
            errors.append(seen["error"])
        if all(error is None for error in errors):
            outcomes.append("ok")
        elif all(error and DTYPE_ERROR.search(error) for error in errors):
            outcomes.append("dtype error")
        else:
            raise AssertionError(f"unexpected state for {name}, {config}: {errors}")
    failing, controls = outcomes[:2], outcomes[2:]
    if failing == ["dtype error", "dtype error"] and controls == ["ok", "ok"]:
        print("REPRODUCED: under bf16 DeepSpeed cast the params to bf16 but left the fp32 buffers as they were: "
              "BatchNorm2d's forward raised on its fp32 running stats beside a bf16 weight, and FrozenBatchNorm2d's "
              "fp32 buffers turned the activations fp32 before a bf16 conv; with data_types.buffer_dtype=bf16 both "
              "stepped")
        return 0
    if failing == ["ok", "ok"]:
        print("NOT REPRODUCED: both models stepped under bf16 with the default config (buffers cast with the "
              "params, or the norms accept fp32 buffers)")
        return 1
    raise AssertionError(f"unexpected state: default config {failing}, buffer_dtype=bf16 {controls}")


if __name__ == "__main__":
    sys.exit(main())
