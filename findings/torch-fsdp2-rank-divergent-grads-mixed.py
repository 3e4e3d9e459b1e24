"""FSDP2 (fully_shard) mixes the gradients of two same-shaped branches when each rank uses a different one: no error.

What a user sees: a model with two branches of the same shape (two experts, two task heads) trains under
`fully_shard`. Rank 0's batch routes every row to branch 0 and rank 1's every row to branch 1; the forward skips a
branch that got no rows, as the expert loop of transformers 4.x's Mixtral block does. Backward runs and nothing
raises, but after it each branch holds the mean of branch 0's gradient on rank 0 and branch 1's on rank 1, summed
shard by shard into whatever param the rank believes it is reducing, and a shard of each branch has no gradient at
all on one rank (its optimizer skips it). A single process with the same global batch (mean loss) gives each
branch only its own rows' gradient.

Mechanism (torch 2.13.0): torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py, `FSDPParamGroup.post_backward`
collects `fsdp_params_with_grad` (the params whose unsharded grad is not None; the others only when
`reduce_scatter_unused_params` is set, which defaults to False) and passes them to
`_fsdp_collectives.py:foreach_reduce`, which packs their padded grads into one `reduce_scatter_input` and issues one
reduce-scatter. Rank 0 packs [branch0.weight, branch0.bias] and rank 1 packs [branch1.weight, branch1.bias]: the
same sizes, so the collective pairs branch 0's grad with branch 1's and completes. With unequal sizes the same
collective has mismatched inputs (gloo raises or times out; NCCL may hang, pytorch#158719).

Checks, 2 ranks (gloo, CPU; the script spawns them itself):
- `skip`  (the bug): the forward skips a branch with no rows. Same-shaped branches: grads mixed, no error.
- `skip` with `--shapes unequal` (branch 1 has no bias): the reduce-scatter has unequal inputs; the run is guarded
  by a 30 s process-group timeout and a join timeout, so the script never hangs.
- the fixes, each must match the reference: `keep` (`0 * branch(x).sum()` keeps the skipped branch in the graph),
  `dense` (every branch runs on every row, masked), `flag` (`model.set_reduce_scatter_unused_params(True)`, torch
  2.13's opt-in: FSDP2 reduce-scatters zeros for params without a grad).
Each prints expected against got per branch (the full grads, gathered from the shards) and the max |diff|.
REPRODUCED (exit 0) when `skip` with same-shaped branches finishes without an error and its grads differ from the
reference, and every fix matches it. NOT REPRODUCED (exit 1) when `skip` matches the reference.

Ran on torch 2.13.0+cpu and 2.7.0 (Python 3.11, Linux). 2.7.0 has no set_reduce_scatter_unused_params (`flag`
reads n/a), and its gloo reduce-scatter sums instead of averaging (pytorch#162338), which a dense control detects
and divides out before the comparison.

Run: python findings/torch-fsdp2-rank-divergent-grads-mixed.py            (all cases above)
     python findings/torch-fsdp2-rank-divergent-grads-mixed.py --mode skip --shapes same   (one case)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import tempfile
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

WORLD_SIZE = 2
DIM = 4
ROWS_PER_RANK = 3
PG_TIMEOUT_S = 30
JOIN_TIMEOUT_S = 120
MODES = ("skip", "keep", "dense", "flag")


class TwoBranches(nn.Module):
    """Two branches (experts or task heads); each row goes to the branch `route` names, as in an MoE block."""

    def __init__(self, shapes: str) -> None:
        super().__init__()
        self.branches = nn.ModuleList([nn.Linear(DIM, DIM), nn.Linear(DIM, DIM, bias=(shapes == "same"))])

    def forward(self, x: torch.Tensor, route: torch.Tensor, mode: str) -> torch.Tensor:
        out = torch.zeros_like(x)
        extra = x.new_zeros(())
        for i, branch in enumerate(self.branches):
            rows = route == i
            if mode == "dense":  # every branch on every row, masked
                out = out + branch(x) * rows.unsqueeze(-1)
                continue
            if not rows.any():  # no rows for this branch: skip it (transformers 4.x's MixtralSparseMoeBlock)
                if mode == "keep":
                    extra = extra + 0 * branch(x).sum()  # the fix: keep the skipped branch in the graph
                continue
            out = out.index_add(0, rows.nonzero().squeeze(-1), branch(x[rows]))
        return out + extra


def make_model(shapes: str) -> TwoBranches:
    torch.manual_seed(0)
    return TwoBranches(shapes)


def batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s rows, all routed to branch `rank`."""
    x = torch.arange(ROWS_PER_RANK * DIM, dtype=torch.float32).view(ROWS_PER_RANK, DIM) / 10 + rank
    return x, torch.full((ROWS_PER_RANK,), rank)


def loss_fn(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).sum(-1).mean()


def reference_grads(shapes: str) -> dict[str, list]:
    """One process, the global batch (both ranks' rows), mean loss: each branch gets only its own rows' gradient."""
    model = make_model(shapes)
    xs, routes = zip(*(batch(rank) for rank in range(WORLD_SIZE)))
    loss_fn(model(torch.cat(xs), torch.cat(routes), "skip")).backward()
    return {name: param.grad.tolist() for name, param in model.named_parameters()}


def worker(rank: int, port: int, mode: str, shapes: str, out_dir: str) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    result: dict = {"rank": rank}
    try:
        dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE,
                                timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import DTensor

        model = fully_shard(make_model(shapes))
        if mode == "flag":
            if not hasattr(model, "set_reduce_scatter_unused_params"):
                raise NotImplementedError("this torch has no FSDPModule.set_reduce_scatter_unused_params")
            model.set_reduce_scatter_unused_params(True)
        x, route = batch(rank)
        loss_fn(model(x, route, "skip" if mode == "flag" else mode)).backward()
        grads, none_here = {}, []
        for name, param in model.named_parameters():
            # a shard whose grad is None on this rank (the optimizer skips it there) reads as zeros
            local = param.grad.to_local() if param.grad is not None else torch.zeros_like(param.to_local())
            if param.grad is None:
                none_here.append(name)
            grads[name] = DTensor.from_local(local, param.device_mesh, param.placements).full_tensor().tolist()
        result.update(grads=grads, none=none_here)
        dist.barrier()
        dist.destroy_process_group()
    except Exception as exc:  # reported per rank
        result["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
        result["trace"] = traceback.format_exc()[-2000:]
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)  # a rank stuck in a failed collective must not keep the process alive


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_case(mode: str, shapes: str) -> list[dict]:
    """Spawn the 2 ranks; a rank that did not report within JOIN_TIMEOUT_S is killed and reads as a hang."""
    ctx = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory() as out_dir:
        procs = [ctx.Process(target=worker, args=(rank, port, mode, shapes, out_dir)) for rank in range(WORLD_SIZE)]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(JOIN_TIMEOUT_S)
        results = []
        for rank, proc in enumerate(procs):
            hung = proc.is_alive()
            if hung:
                proc.kill()
                proc.join()
            path = Path(out_dir, f"rank{rank}.json")
            if path.exists():
                results.append(json.loads(path.read_text()))
            else:
                results.append({"rank": rank, "error": f"no result within {JOIN_TIMEOUT_S} s (hang; killed)" if hung
                                else f"the process died (exit code {proc.exitcode}; gloo's message above)"})
        return results


def max_diff(a: list, b: list) -> float:
    return (torch.tensor(a) - torch.tensor(b)).abs().max().item()


#: 1/world_size on a torch whose gloo reduce-scatter sums instead of averaging (pytorch#162338; before 2.8)
GRAD_SCALE = [1.0]


def calibrate() -> None:
    """The dense forward (every param gets a grad on every rank) must give the reference; where it gives exactly
    world_size times it, gloo summed instead of averaging (a separate, fixed bug): divide FSDP2's grads by that."""
    reference = reference_grads("same")
    results = run_case("dense", "same")
    if any("error" in r for r in results):
        return
    name = "branches.0.weight"
    if max_diff([[v / WORLD_SIZE for v in row] for row in results[0]["grads"][name]], reference[name]) < 1e-5:
        GRAD_SCALE[0] = 1 / WORLD_SIZE
        print(f"note: this torch's gloo reduce-scatter sums instead of averaging (pytorch#162338): the dense control "
              f"gave {WORLD_SIZE}x the reference, so FSDP2's grads are divided by {WORLD_SIZE} below")


def report(mode: str, shapes: str) -> str:
    """Run one case and print it; 'match', 'mixed' or 'error'."""
    reference = reference_grads(shapes)
    results = run_case(mode, shapes)
    for r in results:
        for name, grad in r.get("grads", {}).items():
            r["grads"][name] = (torch.tensor(grad) * GRAD_SCALE[0]).tolist()
    print(f"--- mode={mode} shapes={shapes} (branch 1 {'has' if shapes == 'same' else 'has no'} bias)")
    errors = [r for r in results if "error" in r]
    if errors:
        for r in results:
            print(f"[rank {r['rank']}] {r.get('error', 'finished')}")
        return "n/a" if any(r["error"].startswith("NotImplementedError") for r in errors) else "error"
    worst = 0.0
    for name in reference:
        diffs = [max_diff(r["grads"][name], reference[name]) for r in results]
        worst = max(worst, *diffs)
        if name.endswith("weight"):
            print(f"{name}: expected row 0 {[round(v, 3) for v in reference[name][0]]}, "
                  f"got row 0 {[round(v, 3) for v in results[0]['grads'][name][0]]}; max |diff| {max(diffs):.3g}")
        else:
            print(f"{name}: expected {[round(v, 3) for v in reference[name]]}, "
                  f"got {[round(v, 3) for v in results[0]['grads'][name]]}; max |diff| {max(diffs):.3g}")
    for r in results:
        if r["none"]:
            print(f"[rank {r['rank']}] grad None on this rank's shard of: {', '.join(r['none'])}")
    verdict = "match" if worst < 1e-5 else "mixed"
    if verdict == "mixed" and shapes == "same":
        # what each rank holds for its own branch: its shard of (branch 0's grad + branch 1's grad), not its own
        for r in results:
            rows = slice(r["rank"] * DIM // WORLD_SIZE, (r["rank"] + 1) * DIM // WORLD_SIZE)
            name = f"branches.{r['rank']}.weight"
            summed = torch.tensor(reference["branches.0.weight"]) + torch.tensor(reference["branches.1.weight"])
            diff = (torch.tensor(r["grads"][name])[rows] - summed[rows]).abs().max().item()
            print(f"[rank {r['rank']}] its shard of {name} == that shard of expected branch 0 + expected branch 1 "
                  f"grads: max |diff| {diff:.3g}")
    print(f"=> no error; grads {'match the single-process reference' if verdict == 'match' else 'WRONG'} "
          f"(max |diff| {worst:.3g})")
    return verdict


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=MODES)
    parser.add_argument("--shapes", choices=("same", "unequal"))
    args = parser.parse_args()
    print(f"torch {torch.__version__}; fully_shard, {WORLD_SIZE} ranks (gloo, CPU); rank r's rows all go to branch r")
    calibrate()
    if args.mode or args.shapes:
        verdict = report(args.mode or "skip", args.shapes or "same")
        return 0 if (args.mode or "skip") == "skip" and verdict == "mixed" else 1
    bug = report("skip", "same")
    unequal = report("skip", "unequal")
    fixes = {mode: report(mode, "same") for mode in ("keep", "dense", "flag")}
    if bug == "match":
        print("NOT REPRODUCED: with same-shaped branches used by different ranks, FSDP2's grads match the reference")
        return 1
    if bug != "mixed" or any(verdict not in ("match", "n/a") for verdict in fixes.values()):
        raise SystemExit(f"unexpected: skip={bug}, fixes={fixes} (the script is broken)")
    print(f"REPRODUCED: FSDP2 reduce-scattered only the params that got grads, so rank 0's branch-0 grads were summed "
          f"with rank 1's branch-1 grads with no error (unequal shapes: {unequal}); keeping every branch in the graph "
          f"(0 * branch(x).sum(), a dense forward) gives the reference grads (set_reduce_scatter_unused_params(True): "
          f"{fixes['flag']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
