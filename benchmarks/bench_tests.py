"""How long the README's test command spends in each environment's tests, before vs after a revision: a benchmark.

    python3 benchmarks/bench_tests.py --compare b2e8c86 [--environments hf,colossalai]

For each environment the test command runs tests in (`noxfile.tested()`, all by default; each must be built), its
pytest runs exactly as `nox -s tests-<env>` makes them (`noxfile.test_runs`: the engine's tests with `-n 2` in the
torch one, a framework's adapter tests in its releases' environments), first at commit `--compare` (a git worktree,
its checkout first on PYTHONPATH), then at this checkout, one after the other, so both sides meet the same machine.
Prints per environment the wall seconds and pytest's outcome line of both sides, and the totals. Environment builds
are not timed here: they depend on the caches (uv's wheels, ccache's objects), not on the tests.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from checkouts import worktree  # noqa: E402

import noxfile  # noqa: E402  (the sessions' own definitions: what `tests-<env>` runs)

OUTCOME = re.compile(r"^=*\s*(\d+ (passed|failed|error).*) in [\d.]+s")


def timed_run(environment: str, checkout: Path) -> tuple[float, str]:
    """Wall seconds of the environment's test runs (`noxfile.test_runs`) in `checkout`, and pytest's outcome line of
    each (or its exit code)."""
    python = ROOT / ".nox" / environment / "bin" / "python"
    started = time.perf_counter()
    outcomes = []
    for arguments in noxfile.test_runs(environment):
        done = subprocess.run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", *arguments],
                              cwd=checkout, capture_output=True, text=True, check=False,
                              env={**os.environ, "PYTHONPATH": str(checkout)})
        outcomes.append(next((m.group(1) for line in reversed(done.stdout.splitlines())
                              if (m := OUTCOME.match(line.strip()))), f"pytest exited {done.returncode}"))
    return time.perf_counter() - started, "; ".join(outcomes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compare", required=True, help="the git revision to time before this checkout")
    parser.add_argument("--environments", default="", help="comma-separated; default: every tested environment")
    args = parser.parse_args()
    names = [n for n in args.environments.split(",") if n] or noxfile.tested()
    unknown = [n for n in names if n not in noxfile.tested()]
    if unknown:
        raise SystemExit(f"no tests run in {', '.join(unknown)}; tested environments: {', '.join(noxfile.tested())}")
    missing = [n for n in names if not (ROOT / ".nox" / n / "bin" / "python").exists()]
    if missing:
        raise SystemExit(f"not built: {', '.join(missing)} (build one with `python3 -m nox -s tests-<env> -- --co -q`)")
    rows = []
    with worktree(args.compare) as before:
        for name in names:
            before_s, before_outcome = timed_run(name, before)
            after_s, after_outcome = timed_run(name, ROOT)
            rows.append((name, before_s, after_s, before_outcome, after_outcome))
            print(f"{name}: {before_s:.0f} -> {after_s:.0f} s", file=sys.stderr, flush=True)
    print(f"| environment | before ({args.compare}), s | after, s | before | after |\n|---|---:|---:|---|---|")
    for name, before_s, after_s, before_outcome, after_outcome in rows:
        print(f"| {name} | {before_s:.0f} | {after_s:.0f} | {before_outcome} | {after_outcome} |")
    print(f"| **all** | **{sum(r[1] for r in rows):.0f}** | **{sum(r[2] for r in rows):.0f}** | | |")


if __name__ == "__main__":
    main()
