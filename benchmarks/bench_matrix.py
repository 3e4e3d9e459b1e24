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
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from pytest_freezecompat.controller.pool import RankPool
from pytest_freezecompat.core.phases import KINDS
from pytest_freezecompat.spec import matrix as spec
from pytest_freezecompat.spec.plan import Selection, plan

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
#: The phases that are the cell's own work; the rest is what running it on warm ranks costs.
COMPUTE = ("build", "wrap", "steps", "probes", "reference", "groups")


def run_slice(environment: str, report_dir: Path) -> tuple[float, list[dict[str, Any]]]:
    """The environment's slice as `nox -s matrix-<environment>` runs it: the built-in matrix and the examples."""
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "pytest", "--freeze-matrix", f"--freeze-matrix-environment={environment}",
                    f"--freeze-matrix-report={report_dir}", "-p", "no:cacheprovider", "-q", "--no-header",
                    str(EXAMPLES)], check=False, stdout=subprocess.DEVNULL)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--environment", default="torch")
    parser.add_argument("--rounds", type=int, default=3, help="whole-slice runs; the median one is reported")
    parser.add_argument("--fresh-samples", type=int, default=5)
    parser.add_argument("--restart-samples", type=int, default=5)
    parser.add_argument("--from-report", type=Path, help="only print the phase table of this matrix.json")
    args = parser.parse_args()
    if args.from_report:
        print(markdown(by_framework(json.loads(args.from_report.read_text())["cells"])))
        return
    result = benchmark(args.environment, args.rounds, args.fresh_samples, args.restart_samples)
    table = result.pop("phases_markdown")
    print(json.dumps(result, indent=1))
    print(table)


if __name__ == "__main__":
    main()
