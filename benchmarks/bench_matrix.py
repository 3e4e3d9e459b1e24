"""How long the matrix takes, where each cell's time goes, and what the warm pool saves: a benchmark, not a test.

    .nox/torch/bin/python benchmarks/bench_matrix.py --environment torch [--rounds 3] [--fresh-samples 5]
    python benchmarks/bench_matrix.py --from-report reports/matrix.json   # the phase table of a report

Run it with the environment's own interpreter. For each round it runs the environment's whole slice
(the built-in matrix and the examples, as `nox -s matrix-<env>` does) through `pytest --freeze-matrix` and reads the
report it wrote: wall time, cell time (the sum of `duration_s`), the median cell, pool restarts. Then:
- the per-phase table (`core.phases.KINDS`): median and p90 per cell, and each kind's share of cell time;
- `overhead`: a cell's time above its own compute (build, wrap, steps, probes, reference), per cell;
- restarts: the pool restarted cold-style (`RankPool.restart`, as after a crash) a few times, timed;
- fresh launch: the first few cells of the slice each on a brand-new pool (a pool-less runner's cost),
  against the same cells' warm times in the same run.
Prints a JSON summary and the Markdown the README's Performance section shows.

    .nox/torch/bin/python benchmarks/bench_matrix.py --compare 74f9877 [--environments torch,megatron]
        [--after-shards .freeze-matrix/shards]

Before vs after in one run on one machine: for each environment (all by default) its whole slice at commit
`--compare` (a git worktree, run by the environment's own python with that checkout first on PYTHONPATH), then at
this checkout, one after the other; per framework release: cells, cell time, time per phase, both ways, and the cells
whose status or severity changed. `--after-shards`: keep the after runs as the environments' shards (with their
`pip freeze`), so `nox -s report` publishes exactly what was measured.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from checkouts import worktree

from pytest_freezecompat.controller.pool import RankPool
from pytest_freezecompat.core.phases import KINDS
from pytest_freezecompat.spec import matrix as spec
from pytest_freezecompat.spec.plan import Selection, plan

ROOT = Path(__file__).resolve().parent.parent
#: The phases that are the cell's own work; the rest is what running it on warm ranks costs.
COMPUTE = ("build", "wrap", "steps", "probes", "reference", "groups")


def run_slice(environment: str, report_dir: Path, python: str = sys.executable, checkout: Path = ROOT,
              extra: Sequence[str] = (), under: Sequence[str] = ()) -> tuple[float, list[dict[str, Any]]]:
    """The environment's slice as `nox -s matrix-<environment>` runs it: the built-in matrix and the examples
    (those of `checkout`, whose package comes first on the path). `extra`: more pytest arguments (a selection);
    `under`: a command the run goes under (a profiler)."""
    started = time.perf_counter()
    subprocess.run([*under, python, "-m", "pytest", "--freeze-matrix", "--freeze-matrix-builtin",
                    f"--freeze-matrix-environment={environment}",
                    f"--freeze-matrix-report={report_dir}", "-p", "no:cacheprovider", "-q", "--no-header",
                    "examples", *extra], check=False, stdout=subprocess.DEVNULL, cwd=checkout,
                   env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(checkout)})
    return time.perf_counter() - started, json.loads((report_dir / "matrix.json").read_text())["cells"]


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))] if ordered else 0.0


def overhead_s(cell: dict[str, Any]) -> float:
    phases = cell["phases_s"]
    return cell["duration_s"] - phases.get("restart", 0.0) - sum(phases.get(kind, 0.0) for kind in COMPUTE)


def phase_rows(cells: list[dict[str, Any]]) -> list[tuple[str, float, float, float]]:
    """(kind, median ms, p90 ms, share of cell time %) for every kind that took any time."""
    ran = [c for c in cells if c.get("phases_s")]
    total = sum(c["duration_s"] for c in ran) or 1.0
    rows = []
    for kind in (*KINDS, "other"):
        values = [c["phases_s"].get(kind, 0.0) for c in ran]
        if sum(values):
            rows.append((kind, 1e3 * statistics.median(values), 1e3 * percentile(values, 0.9),
                         100 * sum(values) / total))
    return rows


def markdown(framework_cells: dict[str, list[dict[str, Any]]]) -> str:
    lines = []
    for framework, cells in sorted(framework_cells.items()):
        lines += [f"**{framework}** ({len(cells)} cells)", "", "| phase | median ms | p90 ms | share |",
                  "|---|---:|---:|---:|"]
        lines += [f"| {k} | {med:.1f} | {p90:.1f} | {share:.1f}% |" for k, med, p90, share in phase_rows(cells)]
        lines.append("")
    return "\n".join(lines)


def by_framework(cells: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    grouped: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for cell in cells:
        if cell["status"] != "skip" and cell.get("phases_s"):
            grouped[cell["framework"]].append(cell)
    return grouped


def restart_costs(environment: str, samples: int) -> list[float]:
    """Seconds for a pool restart as after a crash (the ranks killed, new ones ready), `samples` times."""
    loaded = spec.load()
    cells = [c for c in plan(loaded, Selection({}), world_size=2, device="cpu", environment=environment)
             if c.skip is None]
    pool = RankPool(2, sorted({c.adapter_module for c in cells}))
    try:
        pool.start()
        costs = []
        for _ in range(samples):
            started = time.perf_counter()
            pool.restart()
            costs.append(time.perf_counter() - started)
        return costs
    finally:
        pool.shutdown()


def fresh_launch(environment: str, samples: int, warm: dict[str, float]) -> list[tuple[str, float, float]]:
    """(cell id, fresh-launch seconds, warm seconds) for the first `samples` cells that ran warm."""
    loaded = spec.load()
    cells = [c for c in plan(loaded, Selection({}), world_size=2, device="cpu", environment=environment)
             if c.skip is None and c.key.id in warm][:samples]
    rows = []
    for cell in cells:
        started = time.perf_counter()
        pool = RankPool(2, [cell.adapter_module])
        try:
            pool.run(cell, timeout_s=300)
        finally:
            pool.shutdown()
        rows.append((cell.key.id, time.perf_counter() - started, warm[cell.key.id]))
    return rows


def benchmark(environment: str, rounds: int, fresh_samples: int, restart_samples: int) -> dict[str, Any]:
    summaries = []
    kept: list[dict[str, Any]] = []
    for _ in range(rounds):
        with tempfile.TemporaryDirectory() as tmp:
            wall, cells = run_slice(environment, Path(tmp))
        ran = [c for c in cells if c["status"] != "skip"]
        summaries.append({"wall_s": wall, "cell_s": sum(c["duration_s"] for c in ran),
                          "median_cell_s": statistics.median(c["duration_s"] for c in ran),
                          "restarts": [c["pool_start_s"] for c in ran if "pool_start_s" in c], "cells": cells})
    middle = sorted(summaries, key=lambda s: s["cell_s"])[len(summaries) // 2]
    kept = middle["cells"]
    ran = [c for c in kept if c["status"] != "skip" and c.get("phases_s")]
    warm = {c["id"]: c["duration_s"] for c in ran if "pool_start_s" not in c}
    fresh = fresh_launch(environment, fresh_samples, warm)
    restarts = restart_costs(environment, restart_samples)
    overheads = [overhead_s(c) for c in ran if "pool_start_s" not in c]
    return {
        "environment": environment,
        "cells": len(kept),
        "statuses": dict(Counter(c["status"] for c in kept)),
        "rounds": [{"wall_s": round(s["wall_s"], 1), "cell_s": round(s["cell_s"], 1),
                    "median_cell_s": round(s["median_cell_s"], 4), "starts": len(s["restarts"]),
                    "starts_s": {"median": round(statistics.median(s["restarts"]), 3),
                                 "max": round(max(s["restarts"]), 3)} if s["restarts"] else None}
                   for s in summaries],
        "median_round": {"wall_s": round(middle["wall_s"], 1), "cell_s": round(middle["cell_s"], 1),
                         "median_cell_s": round(middle["median_cell_s"], 4),
                         # pytest's start-up and collection, the templates' imports, per-item hooks, the report
                         "outside_cells_s": round(middle["wall_s"] - middle["cell_s"], 1)},
        "median_cell_s_by_framework": {fw: round(statistics.median(c["duration_s"] for c in cs), 4)
                                       for fw, cs in by_framework(kept).items()},
        "overhead_ms": {"median": round(1e3 * statistics.median(overheads), 1),
                        "p90": round(1e3 * percentile(overheads, 0.9), 1)} if overheads else None,
        "restart_s": {"median": round(statistics.median(restarts), 3), "samples": [round(r, 3) for r in restarts]}
        if restarts else None,
        "fresh_launch": {"median_fresh_s": round(statistics.median(f for _, f, _ in fresh), 3),
                         "median_warm_s": round(statistics.median(w for _, _, w in fresh), 4),
                         "speedup": round(statistics.median(f / w for _, f, w in fresh), 1),
                         "samples": len(fresh)} if fresh else None,
        "phases_markdown": markdown(by_framework(kept)),
    }


def cell_time(cells: list[dict[str, Any]]) -> tuple[float, dict[str, float]]:
    """(seconds of cell time, seconds per phase kind) over the cells that ran."""
    phases: dict[str, float] = defaultdict(float)
    for cell in cells:
        for kind, seconds in (cell.get("phases_s") or {}).items():
            phases[kind] += seconds
    return sum(c.get("duration_s") or 0.0 for c in cells if c["status"] != "skip"), phases


def compare(revision: str, environments: list[str], after_shards: Path | None) -> str:
    """Each environment's slice at `revision`, then at this checkout; the Markdown of both, per framework release."""
    rows = []
    with worktree(revision) as before_checkout, tempfile.TemporaryDirectory() as tmp:
        for env in environments:
            python = str(ROOT / ".nox" / env / "bin" / "python")
            before_wall, before = run_slice(env, Path(tmp) / "before" / env, python, before_checkout)
            shard = after_shards / env if after_shards else Path(tmp) / "after" / env
            shutil.rmtree(shard, ignore_errors=True)
            after_wall, after = run_slice(env, shard.resolve(), python)
            if after_shards:
                frozen = subprocess.run([python, "-m", "pip", "freeze", "--exclude-editable"], capture_output=True,
                                        text=True, check=True).stdout
                (shard / "pip-freeze.txt").write_text(frozen)
            old = {c["id"]: (c["status"], c.get("severity")) for c in before}
            changed = [c["id"] for c in after if c["id"] in old and old[c["id"]] != (c["status"], c.get("severity"))]
            release = next((f"{c['framework']} {c.get('release', '')}" for c in after if c["status"] != "skip"), env)
            rows.append((env, release, before, after, before_wall, after_wall, changed))
            print(f"{env}: {len(after)} cells, cell time {cell_time(before)[0]:.0f} s -> {cell_time(after)[0]:.0f} s, "
                  f"{len(changed)} changed", file=sys.stderr, flush=True)
    return compare_markdown(rows)


def compare_markdown(rows: list[tuple[str, str, list[Any], list[Any], float, float, list[str]]]) -> str:
    kinds = [k for k in (*KINDS, "other") if any(cell_time(r[2])[1].get(k) or cell_time(r[3])[1].get(k) for r in rows)]
    lines = ["| framework release | cells | cell time s (before → after) | pytest wall s | changed | "
             + " | ".join(kinds) + " |", "|---" * (5 + len(kinds)) + "|"]
    totals = [0.0, 0.0, 0.0, 0.0]
    for _env, release, before, after, before_wall, after_wall, changed in rows:
        (b_total, b_phases), (a_total, a_phases) = cell_time(before), cell_time(after)
        totals = [totals[0] + b_total, totals[1] + a_total, totals[2] + before_wall, totals[3] + after_wall]
        lines.append(f"| {release} | {len(after)} | {b_total:.0f} → {a_total:.0f} | {before_wall:.0f} → "
                     f"{after_wall:.0f} | {len(changed)} | " + " | ".join(
                         f"{b_phases.get(k, 0):.0f} → {a_phases.get(k, 0):.0f}" for k in kinds) + " |")
    lines.append(f"| **all** | {sum(len(r[3]) for r in rows)} | **{totals[0]:.0f} → {totals[1]:.0f}** "
                 f"({totals[0] / 60:.1f} → {totals[1] / 60:.1f} min) | {totals[2]:.0f} → {totals[3]:.0f} | "
                 f"{sum(len(r[6]) for r in rows)} |" + " |" * len(kinds))
    changed = [cell for r in rows for cell in r[6]]
    if changed:
        lines += ["", "Changed (status or severity): " + ", ".join(f"`{c}`" for c in changed[:40])]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--environment", default="torch")
    parser.add_argument("--rounds", type=int, default=3, help="whole-slice runs; the median one is reported")
    parser.add_argument("--fresh-samples", type=int, default=5)
    parser.add_argument("--restart-samples", type=int, default=5)
    parser.add_argument("--from-report", type=Path, help="only print the phase table of this matrix.json")
    parser.add_argument("--compare", metavar="REVISION", help="before (REVISION) vs after (this checkout)")
    parser.add_argument("--environments", default="", help="with --compare: comma-separated (default: all)")
    parser.add_argument("--after-shards", type=Path, help="with --compare: keep the after runs as shards here")
    args = parser.parse_args()
    if args.compare:
        from pytest_freezecompat.spec.matrix import load

        names = [n for n in args.environments.split(",") if n] or list(load().environments)
        print(compare(args.compare, names, args.after_shards))
        return
    if args.from_report:
        print(markdown(by_framework(json.loads(args.from_report.read_text())["cells"])))
        return
    result = benchmark(args.environment, args.rounds, args.fresh_samples, args.restart_samples)
    table = result.pop("phases_markdown")
    print(json.dumps(result, indent=1))
    print(table)


if __name__ == "__main__":
    main()
