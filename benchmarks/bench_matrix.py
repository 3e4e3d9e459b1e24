"""How long the matrix takes, and what the warm pool saves: a benchmark, not a test.

    python benchmarks/bench_matrix.py [--environment torch] [--fresh-samples 5]

1. Runs the environment's whole slice through `pytest --freeze-matrix` and reports its wall
   time and the per-cell times the report recorded (warm ranks).
2. Runs a few cells each on a brand-new pool (the cost of a fresh `world_size`-rank launch
   per cell, which is what a pool-less runner would pay for every cell).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from pytest_freezecompat.controller.pool import RankPool
from pytest_freezecompat.spec import matrix as spec
from pytest_freezecompat.spec.plan import Selection, plan


def full_slice(environment: str, report_dir: Path) -> tuple[float, dict]:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "pytest", "--freeze-matrix", f"--freeze-matrix-environment={environment}",
                    f"--freeze-matrix-report={report_dir}", "-p", "no:cacheprovider", "-q", "--no-header"],
                   check=False, stdout=subprocess.DEVNULL)
    return time.perf_counter() - started, json.loads((report_dir / "matrix.json").read_text())


def fresh_launch_costs(environment: str, samples: int) -> list[float]:
    loaded = spec.load()
    cells = [c for c in plan(loaded, Selection({}), world_size=2, device="cpu", environment=environment)
             if c.skip is None][:samples]
    costs = []
    for cell in cells:
        started = time.perf_counter()
        pool = RankPool(2, [cell.adapter_module])
        try:
            pool.run(cell, timeout_s=300)
        finally:
            pool.shutdown()
        costs.append(time.perf_counter() - started)
    return costs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--environment", default="torch")
    parser.add_argument("--fresh-samples", type=int, default=5)
    parser.add_argument("--report-dir", type=Path, default=None, help="keep the slice's report here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        wall, report = full_slice(args.environment, args.report_dir or Path(tmp))
    ran = [c for c in report["cells"] if c["status"] != "skip"]
    warm = [c["duration_s"] for c in ran if "pool_start_s" not in c]
    starts = [c["pool_start_s"] for c in ran if "pool_start_s" in c]
    fresh = fresh_launch_costs(args.environment, args.fresh_samples)
    print(json.dumps({
        "environment": args.environment,
        "cells": len(report["cells"]),
        "statuses": dict(Counter(c["status"] for c in report["cells"])),
        "wall_s": round(wall, 1),
        "slowest": sorted(((c["duration_s"], c["id"]) for c in ran), reverse=True)[:3],
        "warm_cell_s": {"median": round(statistics.median(warm), 3), "max": round(max(warm), 3)} if warm else None,
        "pool_starts": len(starts), "pool_start_s": [round(s, 2) for s in starts],
        "fresh_launch_cell_s": {"median": round(statistics.median(fresh), 3), "samples": len(fresh)} if fresh else None,
    }, indent=1))


if __name__ == "__main__":
    main()
