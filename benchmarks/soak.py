"""Soak: an environment's row, back to back, hurt on purpose; nothing may be lost or left behind.

    python benchmarks/soak.py --clean CLEAN/matrix.json [--environment torch] [--rounds 3] [--kill-every 20]

Each round runs the row through `pytest --freeze-matrix -v` into its own report directory and
`kill -9`s a random rank after every ~N finished cells. One round is also sent SIGTERM halfway
and then run again into the same directory (the rerun completes what the first part did not).
After each round it counts:
  lost     cells pytest reported as finished that the report does not hold
  orphans  processes of the round (found by pid through a marker in their environment) or pool
           folders (in the round's own TMPDIR) still there 10 s after pytest exits
  changed  cells whose status differs from the clean run, other than the cells a kill hit
A benchmark-style tool, not a test: it takes minutes and the numbers go in a closing note.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

MARKER = "FREEZECOMPAT_SOAK_MARKER"
FINISHED = re.compile(r"^freeze-matrix::(\S+) (PASSED|FAILED|XFAIL|XPASS|SKIPPED|ERROR)")


def ours(marker: str) -> list[int]:
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if f"{MARKER}={marker}".encode() in environ.read_bytes():
                found.append(int(environ.parent.name))
        except OSError:
            continue
    return found


def ranks(marker: str) -> list[int]:
    pids = []
    for pid in ours(marker):
        try:
            if b"pytest_freezecompat.rank.main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                pids.append(pid)
        except OSError:
            continue
    return pids


def journal_cells(report_dir: Path) -> int:
    count = 0
    for journal in (report_dir / "journal").glob("*.jsonl"):
        count += sum(1 for line in journal.read_text(errors="replace").splitlines() if line.startswith('{"cell"'))
    return count


def run_once(environment: str, report_dir: Path, tmp: Path, marker: str, kill_every: int,
             sigterm_after: int | None, rng: random.Random) -> dict:
    env = {**os.environ, MARKER: marker, "TMPDIR": str(tmp), "OMP_NUM_THREADS": "1"}
    log = report_dir.with_suffix(f".{uuid.uuid4().hex[:6]}.log")
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "pytest", "--freeze-matrix", "-v", "-p", "no:cacheprovider",
                                 f"--freeze-matrix-environment={environment}", f"--freeze-matrix-report={report_dir}"],
                                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        kills, next_kill, terminated = 0, kill_every, False
        while proc.poll() is None:
            done = journal_cells(report_dir)
            if done >= next_kill:
                alive = ranks(marker)
                if alive:
                    os.kill(rng.choice(alive), signal.SIGKILL)
                    kills += 1
                next_kill = done + rng.randint(kill_every // 2, kill_every * 3 // 2)
            if sigterm_after is not None and done >= sigterm_after and not terminated:
                proc.send_signal(signal.SIGTERM)
                terminated = True
            time.sleep(0.2)
    finished = [m.group(1) for m in map(FINISHED.match, log.read_text().splitlines()) if m]
    deadline = time.monotonic() + 10
    while (ours(marker) or list(tmp.glob("freezecompat-*"))) and time.monotonic() < deadline:
        time.sleep(0.2)
    return {"exit": proc.returncode, "kills": kills, "finished": finished, "terminated": terminated,
            "orphans": len(ours(marker)) + len(list(tmp.glob("freezecompat-*"))), "log": str(log)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clean", required=True, type=Path, help="matrix.json of a clean run of the same row")
    parser.add_argument("--environment", default="torch")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kill-every", type=int, default=20)
    parser.add_argument("--seed", type=int, default=13)
    args = parser.parse_args()
    clean = {c["id"]: c["status"] for c in json.loads(args.clean.read_text())["cells"]
             if c["environment"] == args.environment and c["repro"].startswith("pytest --freeze-matrix")}
    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="soak-"))
    print(f"soak of {args.environment} ({len(clean)} clean cells) in {work}")
    for round_no in range(1, args.rounds + 1):
        report_dir, tmp = work / f"round-{round_no}", work / f"tmp-{round_no}"
        tmp.mkdir()
        marker = f"soak-{round_no}-{uuid.uuid4().hex[:8]}"
        started = time.perf_counter()
        sigterm_at = len(clean) // 2 if round_no == 2 else None
        parts = [run_once(args.environment, report_dir, tmp, marker, args.kill_every, sigterm_at, rng)]
        if parts[0]["terminated"]:  # the SIGTERMed part: check it kept every cell it finished, then run again
            kept = {c["id"] for c in json.loads((report_dir / "matrix.json").read_text())["cells"]}
            lost_at_term = set(parts[0]["finished"]) - kept
            print(f"  SIGTERM after {len(parts[0]['finished'])} cells: exit {parts[0]['exit']}, "
                  f"lost {len(lost_at_term)}, orphans {parts[0]['orphans']}")
            parts.append(run_once(args.environment, report_dir, tmp, marker, args.kill_every, None, rng))
        cells = {c["id"]: c for c in json.loads((report_dir / "matrix.json").read_text())["cells"]}
        finished = {cell for part in parts for cell in part["finished"]}
        killed = {i for i, c in cells.items() if "killed by signal SIGKILL" in c.get("message", "")}
        changed = {i: (clean.get(i), c["status"]) for i, c in cells.items()
                   if i not in killed and clean.get(i) != c["status"]}
        missing = set(clean) - set(cells)
        print(f"round {round_no}: {time.perf_counter() - started:.0f} s, exits {[p['exit'] for p in parts]}, "
              f"cells {len(cells)}/{len(clean)} (missing {len(missing)}), kills {sum(p['kills'] for p in parts)} "
              f"-> crash cells {len(killed)}, lost {len(finished - set(cells))}, "
              f"orphans {sum(p['orphans'] for p in parts)}, changed {len(changed)}")
        for cell_id, (was, now) in sorted(changed.items()):
            print(f"    changed: {cell_id}: {was} -> {now}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
