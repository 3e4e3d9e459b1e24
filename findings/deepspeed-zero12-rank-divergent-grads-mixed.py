"""DeepSpeed ZeRO-1/2 mix the gradients of two same-shaped branches when each rank uses a different one: no error.

What a user sees: a model with two branches of the same shape (two experts, two task heads) trains under
`deepspeed.initialize` with ZeRO stage 1 or 2. Rank 0's batch routes every row to branch 0 and rank 1's every row
to branch 1; the forward skips a branch that got no rows, as the expert loop of transformers 4.x's Mixtral block
does. Backward and step run and nothing raises, but both branches are updated with the mean of branch 0's gradient
(from rank 0) and branch 1's (from rank 1). A single process with the same global batch (mean loss) gives each
branch only its own rows' gradient. ZeRO-0 gets it right (it zero-fills missing grads before its all-reduce);
ZeRO-3 mixes them too in step 1 and raises its own cross-rank check at the start of step 2's forward.

Mechanism (DeepSpeed 0.19.8): deepspeed/runtime/zero/stage_1_and_2.py. The per-param grad hooks
(`create_gradient_handling_hooks`, registered for ZeRO-2 and, with the default contiguous_gradients, ZeRO-1) fire
only for params that got a grad, and `reduce_gradients` likewise walks only params whose grad is not None;
`reduce_independent_p_g_buckets_and_remove_grads` copies each into the contiguous IPG bucket and records it in
`bucket.params`. `reduce_ipg_grads` hands the bucket
to `average_tensor`, which maps each bucket slice to the partition that owns that param's rank/offset and, with
`use_multi_rank_bucket_allreduce` (default True), all-reduces the bucket (`allreduce_and_scatter`). Rank 0's bucket
is [branch0.weight, branch0.bias] and rank 1's is [branch1.weight, branch1.bias]: the same number of elements, so
the all-reduce sums branch 0's grad with branch 1's, and each rank copies the sum into the partition it believes
it reduced. Nothing checks that the ranks' buckets hold the same params.
ZeRO-0 (deepspeed/runtime/engine.py, `_get_gradients_for_reduction`) gives a missing grad zeros "so that every rank
is reducing the same size" and holds. ZeRO-3 (deepspeed/runtime/zero/stage3.py,
`__reduce_and_partition_ipg_grads`) likewise reduce-scatters a bucket of only the params with grads (its
`assert_ints_same_as_other_ranks` check there runs only with sanity checks on);
`PartitionedParameterCoordinator.reset_step` (partitioned_param_coordinator.py), called at the start of every
forward, compares the recorded module trace across ranks and raises "Detected a disagreement on list contents" at
step 2, after step 1 has already applied the mixed gradients.

Checks, 2 ranks (gloo, CPU; the script spawns them itself; DeepSpeed's own CPU accelerator, no shim): one step of
torch.optim.SGD(lr=1) per case, gradient clipping off, so a param's update is its gradient. The update of each
branch (params gathered after the step) and the grad DeepSpeed's optimizer holds
(`deepspeed.utils.safe_get_full_grad` after backward) are compared with the single-process reference. Cases:
`skip` (the bug: the forward skips a branch with no rows) at ZeRO 0, 1, 2 and 3, and `keep` (the fix:
`0 * branch(x).sum()` keeps the skipped branch in the graph) at ZeRO 1 and 2.
REPRODUCED (exit 0) when `skip` at ZeRO-1 and ZeRO-2 finishes without an error and updates the branches wrongly,
while ZeRO-0 `skip` and the `keep` runs match the reference. NOT REPRODUCED (exit 1) when ZeRO-1 and ZeRO-2 `skip`
match the reference. The ZeRO-3 case (step 1, then step 2's forward) runs in its own processes under the same
timeouts and is reported, not judged.

Ran on DeepSpeed 0.19.8 with torch 2.13.0+cpu (Python 3.11, Linux).

Run: python findings/deepspeed-zero12-rank-divergent-grads-mixed.py              (all cases above)
     python findings/deepspeed-zero12-rank-divergent-grads-mixed.py --stage 2 --mode skip   (one case)
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

# DeepSpeed's CPU accelerator compiles its shared-memory comm op at init_distributed unless it is cached: use the
# environment's cache where one was built (a user's own TORCH_EXTENSIONS_DIR wins).
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))

import torch
import torch.multiprocessing as mp
from torch import nn

WORLD_SIZE = 2
DIM = 4
ROWS_PER_RANK = 3
PG_TIMEOUT_S = 30
JOIN_TIMEOUT_S = 150
DEFAULT_CASES = [(0, "skip"), (1, "skip"), (2, "skip"), (1, "keep"), (2, "keep")]


class TwoBranches(nn.Module):
    """Two branches (experts or task heads); each row goes to the branch `route` names, as in an MoE block."""

    def __init__(self) -> None:
        super().__init__()
        self.branches = nn.ModuleList([nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)])

    def forward(self, x: torch.Tensor, route: torch.Tensor, mode: str = "skip") -> torch.Tensor:
        out = torch.zeros_like(x)
        extra = x.new_zeros(())
        for i, branch in enumerate(self.branches):
            rows = route == i
            if not rows.any():  # no rows for this branch: skip it (transformers 4.x's MixtralSparseMoeBlock)
                if mode == "keep":
                    extra = extra + 0 * branch(x).sum()  # the fix: keep the skipped branch in the graph
                continue
            out = out.index_add(0, rows.nonzero().squeeze(-1), branch(x[rows]))
        return out + extra


def make_model() -> TwoBranches:
    torch.manual_seed(0)
    return TwoBranches()


def batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s rows, all routed to branch `rank`."""
    x = torch.arange(ROWS_PER_RANK * DIM, dtype=torch.float32).view(ROWS_PER_RANK, DIM) / 10 + rank
    return x, torch.full((ROWS_PER_RANK,), rank)


def loss_fn(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).sum(-1).mean()


def reference_grads() -> dict[str, list]:
    """One process, the global batch (both ranks' rows), mean loss: each branch gets only its own rows' gradient."""
    model = make_model()
    xs, routes = zip(*(batch(rank) for rank in range(WORLD_SIZE)))
    loss_fn(model(torch.cat(xs), torch.cat(routes))).backward()
    return {name: param.grad.tolist() for name, param in model.named_parameters()}


def one_case(rank: int, stage: int, mode: str) -> dict:
    """One SGD(lr=1) step at ZeRO `stage`; per param: the held grad after backward and the update (before - after)."""
    import deepspeed

    model = make_model()
    before = {name: param.detach().clone() for name, param in model.named_parameters()}
    config = {"train_batch_size": ROWS_PER_RANK * WORLD_SIZE, "train_micro_batch_size_per_gpu": ROWS_PER_RANK,
              "gradient_accumulation_steps": 1, "zero_optimization": {"stage": stage},
              "gradient_clipping": 0.0,  # DeepSpeed's default is 1.0: off, so an update is the gradient itself
              "zero_allow_untested_optimizer": True, "steps_per_print": 1 << 30}
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    x, route = batch(rank)
    engine.backward(loss_fn(engine(x, route, mode)))
    held = {}
    for name, param in engine.module.named_parameters():
        grad = deepspeed.utils.safe_get_full_grad(param)
        held[name] = None if grad is None else grad.tolist()
    engine.step()
    update = {}
    for name, param in engine.module.named_parameters():
        with deepspeed.zero.GatheredParameters([param]):
            update[name] = (before[name] - param.detach()).tolist()
    result = {"held": held, "update": update}
    if stage == 3:  # ZeRO-3 compares the module trace across ranks at the start of the next forward
        try:
            engine(x, route, mode)
        except RuntimeError as exc:
            result["next_forward"] = f"{type(exc).__name__}: {' '.join(str(exc).split())}"[:300]
        else:
            result["next_forward"] = "ok"
    engine.destroy()
    return result


def rank_main(rank: int, port: int, cases: list, folder: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD_SIZE), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    results = []
    try:
        import deepspeed

        deepspeed.utils.logger.setLevel("WARNING")
        deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
        for stage, mode in cases:
            try:
                results.append(one_case(rank, stage, mode))
            except Exception as exc:  # reported per rank
                results.append({"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                                [:400], "trace": traceback.format_exc()[-3000:]})
                break  # a failed collective leaves the group unusable
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    except Exception as exc:
        results.append({"error": f"{type(exc).__name__}: {exc}"[:400]})
    Path(folder, f"rank{rank}.json").write_text(json.dumps(results))
    sys.stdout.flush()
    os._exit(0)  # a rank stuck in a failed collective must not keep the process alive


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_cases(cases: list) -> list[list[dict]]:
    """Spawn the 2 ranks for `cases`; a rank that did not report within JOIN_TIMEOUT_S is killed (a hang)."""
    ctx = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory() as folder:
        procs = [ctx.Process(target=rank_main, args=(rank, port, cases, folder)) for rank in range(WORLD_SIZE)]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(JOIN_TIMEOUT_S)
        ranks = []
        for rank, proc in enumerate(procs):
            hung = proc.is_alive()
            if hung:
                proc.kill()
                proc.join()
            path = Path(folder, f"rank{rank}.json")
            if path.exists():
                ranks.append(json.loads(path.read_text()))
            else:
                ranks.append([{"error": f"no result within {JOIN_TIMEOUT_S} s (hang; killed)" if hung
                               else f"the process died (exit code {proc.exitcode})"}])
        return ranks


def max_diff(a: list, b: list) -> float:
    return (torch.tensor(a) - torch.tensor(b)).abs().max().item()


def shown(values: list) -> list:
    """A weight's row 0, or a bias, rounded for printing."""
    return [round(v, 3) for v in (values[0] if isinstance(values[0], list) else values)]


def report(stage: int, mode: str, results: list[dict], reference: dict) -> str:
    """Print one case; 'match', 'mixed' or 'error'."""
    print(f"--- ZeRO-{stage}, mode={mode}")
    errors = [(rank, r) for rank, r in enumerate(results) if "error" in r]
    if errors:
        for rank, r in errors:
            print(f"[rank {rank}] {r['error']}")
        return "error"
    worst = 0.0
    for name in reference:
        diffs = [max_diff(r["update"][name], reference[name]) for r in results]
        worst = max(worst, *diffs)
        got = results[0]["update"][name]
        what = "row 0 " if name.endswith("weight") else ""
        held = [r["held"][name] for r in results]
        held_note = ("held grad: None" if any(h is None for h in held)
                     else f"held grad max |diff| {max(max_diff(h, reference[name]) for h in held):.3g}")
        print(f"{name}: expected update {what}{shown(reference[name])}, got {what}{shown(got)}; "
              f"max |diff| {max(diffs):.3g} ({held_note})")
    verdict = "match" if worst < 1e-5 else "mixed"
    if verdict == "mixed" and stage in (1, 2):
        summed = (torch.tensor(reference["branches.0.weight"]) + torch.tensor(reference["branches.1.weight"]))
        for name in ("branches.0.weight", "branches.1.weight"):
            diff = (torch.tensor(results[0]["update"][name]) - summed).abs().max().item()
            print(f"{name} update == expected branch 0 grad + expected branch 1 grad: max |diff| {diff:.3g}")
    print(f"=> no error; update {'matches the single-process reference' if verdict == 'match' else 'WRONG'} "
          f"(max |diff| {worst:.3g})")
    for rank, r in enumerate(results):
        if "next_forward" in r:
            print(f"[rank {rank}] step 2's forward: {r['next_forward']}")
    return verdict


def main() -> int:
    import deepspeed

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", type=int, choices=(0, 1, 2, 3))
    parser.add_argument("--mode", choices=("skip", "keep"))
    args = parser.parse_args()
    print(f"deepspeed {deepspeed.__version__}, torch {torch.__version__}; {WORLD_SIZE} ranks (gloo, CPU), SGD lr=1; "
          f"rank r's rows all go to branch r")
    reference = reference_grads()
    if args.stage is not None or args.mode:
        case = (2 if args.stage is None else args.stage, args.mode or "skip")
        ranks = run_cases([case])
        verdict = report(*case, [results[0] for results in ranks], reference)
        return 0 if case[1] == "skip" and verdict == "mixed" else 1
    ranks = run_cases(DEFAULT_CASES)
    verdicts = {}
    for index, case in enumerate(DEFAULT_CASES):
        results = [r[index] if index < len(r) else {"error": "not run (an earlier case failed)"} for r in ranks]
        verdicts[case] = report(*case, results, reference)
    zero3 = [results[0] for results in run_cases([(3, "skip")])]
    verdicts[(3, "skip")] = report(3, "skip", zero3, reference)
    zero3_next = "; ".join(sorted({r.get("next_forward", r.get("error", "")).split(":")[0] for r in zero3}))
    bug = [verdicts[(1, "skip")], verdicts[(2, "skip")]]
    if bug == ["match", "match"]:
        print("NOT REPRODUCED: with same-shaped branches used by different ranks, ZeRO-1 and ZeRO-2 match the "
              "reference")
        return 1
    controls = [verdicts[(0, "skip")], verdicts[(1, "keep")], verdicts[(2, "keep")]]
    if bug != ["mixed", "mixed"] or controls != ["match"] * 3:
        raise SystemExit(f"unexpected: {verdicts} (the script is broken)")
    print(f"REPRODUCED: ZeRO-1 and ZeRO-2 reduced only the params that got grads, so rank 0's branch-0 grads were "
          f"summed with rank 1's branch-1 grads and both branches stepped with the mix, with no error; ZeRO-0 and "
          f"keeping every branch in the graph (0 * branch(x).sum()) match the reference; ZeRO-3: step 1 "
          f"{verdicts[(3, 'skip')]}, step 2's forward {zero3_next}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
