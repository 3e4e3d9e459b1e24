"""TorchFSDPPlugin's `optimizer.clip_grad_by_norm` measures and clips each rank's shard by that shard's own norm.

What a user sees: with `Booster(plugin=TorchFSDPPlugin())`, gradient clipping as ColossalAI documents it,
`optimizer.clip_grad_by_norm(max_norm)` after `booster.backward`, returns a different norm on every rank, none of
them the model's gradient norm, and when clipping engages each rank scales its part of the gradient by its own
factor: the update is no longer the clipped gradient's direction. No error, no warning; with nothing frozen.

Mechanism: the boosted optimizer is `FSDPOptimizerWrapper` (colossalai/booster/plugin/torch_fsdp_plugin.py), which
adds no clipping of its own, so `OptimizerWrapper.clip_grad_by_norm` (colossalai/interface/optimizer.py) runs:

    norm = nn.utils.clip_grad_norm_(self.parameters, max_norm, norm_type, error_if_nonfinite, *args, **kwargs)

over the optimizer's params, which under FSDP1 are this rank's shards of the flat params. torch's plain
`clip_grad_norm_` reduces nothing across ranks; `FullyShardedDataParallel.clip_grad_norm_` exists for exactly this
(its docstring: with a sharded strategy "you should use this method instead of torch.nn.utils.clip_grad_norm_
since this method handles the fact that gradients are sharded across ranks"; pytorch #72548 asked for it because
plain `clip_grad_norm_` on FSDP's sharded params would be incorrect). The same code from the plugin's first
release (0.3.0) to 0.5.1 and on the main branch; seen here in 0.3.4, 0.4.7 and 0.5.0. Each rank's norm is its
shard's: their L2 sum is the model's.

Workaround: clip through FSDP, `model.unwrap().clip_grad_norm_(max_norm)` (the boosted model's `unwrap()` is the
FSDP module in 0.3.4, 0.4.7 and 0.5.0), instead of `optimizer.clip_grad_by_norm`.

Run: python findings/colossalai-torch-fsdp-shard-local-clip-norm.py (CPU, gloo, 2 ranks). `TorchFSDPPlugin.configure`
wraps the model as `TorchFSDPModel(model, device_id=torch.cuda.current_device())`, re-creates the optimizer over
the wrapped model's params and wraps it in `FSDPOptimizerWrapper`; this script builds the same pair with the CPU
as FSDP's device (the only difference), so FSDP runs on CPU over gloo.
"""

from __future__ import annotations

import json
import math
import os
import socket
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

WORLD_SIZE = 2
MAX_NORM = 1e-3  # small enough that clipping engages on every rank


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rank_main(rank: int, port: int, folder: str) -> None:
    """One backward through the plugin's FSDP pair, then its `clip_grad_by_norm`; rank 0 writes what each saw."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
    from colossalai.booster.plugin.torch_fsdp_plugin import FSDPOptimizerWrapper, TorchFSDPModel

    model = TorchFSDPModel(make_model(), device_id=torch.device("cpu"))  # configure: device_id=current CUDA device
    optimizer = FSDPOptimizerWrapper(torch.optim.SGD(model.parameters(), lr=0.1), model)
    model(torch.ones(2, 4)).sum().backward()  # the same batch on both ranks: FSDP's averaged grad is the local one
    before = [p.grad.detach().clone() for p in optimizer.parameters if p.grad is not None]
    shard_norm = math.sqrt(sum(float(b.pow(2).sum()) for b in before))  # this rank's shard alone
    norm = float(optimizer.clip_grad_by_norm(MAX_NORM))
    after = [p.grad.detach() for p in optimizer.parameters if p.grad is not None]
    scale = float(sum((a * b).sum() for a, b in zip(after, before)) / sum((b * b).sum() for b in before))
    seen: list[tuple[float, float, float] | None] = [None] * WORLD_SIZE
    dist.all_gather_object(seen, (norm, scale, shard_norm))
    if rank == 0:
        with open(os.path.join(folder, "seen.json"), "w") as out:
            json.dump(seen, out)
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    import colossalai

    reference = make_model()
    reference(torch.ones(2, 4)).sum().backward()
    model_norm = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in reference.parameters()))
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(rank_main, args=(free_port(), folder), nprocs=WORLD_SIZE)
        with open(os.path.join(folder, "seen.json")) as saved:
            seen = json.load(saved)
    norms = [norm for norm, _, _ in seen]
    scales = [scale for _, scale, _ in seen]
    print(f"colossalai {colossalai.__version__}, torch {torch.__version__}; model grad norm {model_norm:.6g}, "
          f"max_norm {MAX_NORM}")

    def factor(norm: float) -> float:  # torch's clip_grad_norm_: max_norm / (total_norm + 1e-6), clamped to 1
        return min(1.0, MAX_NORM / (norm + 1e-6))

    for rank, (norm, scale, shard_norm) in enumerate(seen):
        print(f"rank {rank}: clip_grad_by_norm returned {norm:.6g} (expected the model's {model_norm:.6g}; its "
              f"shard's own norm {shard_norm:.6g}), scaled its grads by {scale:.6g} (expected "
              f"{factor(model_norm):.6g}; by its shard's norm {factor(shard_norm):.6g})")
    print(f"L2 sum of the ranks' norms: {math.sqrt(sum(n * n for n in norms)):.6g}")

    def close(a: float, b: float) -> bool:
        return math.isclose(a, b, rel_tol=1e-4)

    # OptimizerWrapper.clip_grad_by_norm (colossalai/interface/optimizer.py): nn.utils.clip_grad_norm_ over this
    # rank's flat-param shards, so each rank returns and clips by its own shard's norm, and these L2-sum to the model's.
    shard_local = (all(close(norm, shard) and close(scale, factor(shard)) for norm, scale, shard in seen)
                   and close(math.sqrt(sum(n * n for n in norms)), model_norm)
                   and not any(close(norm, model_norm) for norm in norms)
                   and not close(scales[0], scales[1]))
    global_norm = all(close(norm, model_norm) and close(scale, factor(model_norm))
                      for norm, scale in zip(norms, scales))
    if not (shard_local or global_norm):
        raise AssertionError(f"unexpected state: neither shard-local nor global clipping: {seen}")
    if shard_local:
        print("REPRODUCED: TorchFSDPPlugin's clip_grad_by_norm returns each rank's shard norm, not the model's, "
              "and the ranks clip their shards by different factors")
        return 0
    print("NOT REPRODUCED: every rank returned the model's grad norm and clipped by the same factor")
    return 1


if __name__ == "__main__":
    sys.exit(main())
