"""Whose code a slice's time is spent in: a sampling profile of its ranks and its controller, a benchmark.

    .nox/torch/bin/python benchmarks/profile_slice.py --environment torch [--select freeze=lora,freeze=none]
        [--keep torch.txt]
    python3 benchmarks/profile_slice.py --from torch.txt      # the tables of a profile taken before

Runs the environment's slice as `nox -s matrix-<env>` runs it (`bench_matrix.run_slice`, into a scratch report) under
`py-spy record --subprocesses` (`pip install py-spy`; it must be on PATH), then prints, for the rank processes and the
controller apart, each sample's owner: the package of the deepest frame outside the standard library (torch, a
framework, transformers, `pytest_freezecompat`: ours, an example's module). A sample whose whole stack is the standard
library is `stdlib`. Then the frames of ours that the ranks were in the most. Native code has no frame of its own
here: a torch op is counted to the Python frame that called it, so ours holds the ops our code calls (the probes'
gathers, the tiny model's forward) and, for Megatron, every op of the cell, which passes through its shim's
`TorchFunctionMode` (`adapters/megatron/emulation.py`).

Why: a cell's time can only be cut where it is ours. If the ranks spend nearly all their samples in torch and the
framework under test, what is left to save is in how many times the framework runs, not in how we drive it.
The rank's watchdog thread sleeps in `time.sleep`, which py-spy counts as busy: its samples are left out.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import tempfile
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

#: A py-spy frame: `function (path:line)`; the path is relative to the entry of sys.path it was found under.
FRAME = re.compile(r"^(?P<function>.*) \((?P<path>[^()]*):\d+\)$")
#: Frames whose samples are a sleeping thread, not work (py-spy's idle detection misses `time.sleep` there).
SLEEPING = ("_end_with_template.<locals>.watch",)
#: The process whose samples are rank work (a rank is a fork of its slot's template and keeps its command line).
RANK_COMMAND = "pytest_freezecompat.rank.template"
OURS = "pytest_freezecompat"


def owner(frame: str) -> str | None:
    """The package a frame's code belongs to; None for the standard library and the interpreter's own frames."""
    matched = FRAME.match(frame)
    if matched is None or matched["path"].startswith("<"):
        return None
    top = matched["path"].split("/")[0].removesuffix(".py")
    return None if top in sys.stdlib_module_names else top


@dataclass
class Owners:
    """Samples by owner, for one role (the ranks or the controller), and our own frames' self samples."""

    samples: int = 0
    by_owner: Counter[str] = field(default_factory=Counter)
    our_frames: Counter[str] = field(default_factory=Counter)

    def add(self, frames: list[str], count: int) -> None:
        self.samples += count
        for frame in reversed(frames):
            if (package := owner(frame)) is not None:
                self.by_owner[package] += count
                if package == OURS:
                    self.our_frames[frame] += count
                return
        self.by_owner["stdlib"] += count


def summarize(lines: Iterable[str]) -> dict[str, Owners]:
    """py-spy's raw lines (`process A;process B;frame;...;frame COUNT`, a child process's frames after its parent's
    process line) -> the owners of the ranks' samples and of the controller's."""
    roles = {"ranks": Owners(), "controller": Owners()}
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack or not count.isdigit():
            continue
        parts = stack.split(";")
        processes = [part for part in parts if part.startswith("process ")]
        frames = [part for part in parts if not part.startswith("process ")]
        if any(sleeping in frame for frame in frames for sleeping in SLEEPING):
            continue
        role = "ranks" if processes and RANK_COMMAND in processes[-1] else "controller"
        roles[role].add(frames, int(count))
    return roles


def tables(roles: dict[str, Owners], top: int = 12) -> str:
    out = []
    for role, owners in roles.items():
        out.append(f"{role}: {owners.samples} samples")
        for package, count in owners.by_owner.most_common(top):
            out.append(f"  {package:<24} {count / max(owners.samples, 1):6.1%}")
    ours = roles["ranks"].our_frames
    if ours:
        out.append(f"the ranks' samples in frames of ours (top {top} of {sum(ours.values())}):")
        out.extend(f"  {count:6d}  {frame}" for frame, count in ours.most_common(top))
    return "\n".join(out)


def profile(environment: str, select: list[str], rate: int, raw: Path, report: Path) -> None:
    """Run the slice under py-spy, its raw profile into `raw`, its report into `report`."""
    try:
        from bench_matrix import run_slice  # imports the package and torch: the environment's interpreter
    except ImportError as exc:
        raise SystemExit(f"{exc}: run this with the environment's interpreter, "
                         f".nox/{environment}/bin/python benchmarks/profile_slice.py ...") from None

    spy = shutil.which("py-spy")
    if spy is None:
        raise SystemExit("py-spy is not on PATH: pip install py-spy")
    try:
        wall, cells = run_slice(environment, report, extra=[f"--freeze-matrix-select={s}" for s in select],
                                under=[spy, "record", "--subprocesses", "--rate", str(rate), "--format", "raw",
                                       "--output", str(raw), "--"])
    except FileNotFoundError:  # pytest wrote no report: a usage error, printed above by pytest
        raise SystemExit(f"the {environment} slice wrote no report (pytest says why above)") from None
    print(f"{environment}: {len(cells)} cells, {wall:.0f} s wall, "
          f"{sum(c['duration_s'] or 0 for c in cells):.0f} s cell time (under the profiler)")


def print_tables(raw: Path) -> None:
    if not raw.is_file():
        raise SystemExit(f"no profile at {raw}")
    with raw.open() as lines:
        print(tables(summarize(lines)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--environment", help="profile this environment's slice (run with its interpreter)")
    source.add_argument("--from", dest="raw", type=Path, help="a py-spy raw profile to summarize")
    parser.add_argument("--select", action="append", default=[], help="as --freeze-matrix-select; repeatable")
    parser.add_argument("--rate", type=int, default=40, help="samples a second (py-spy's default 100 slows the run)")
    parser.add_argument("--keep", type=Path, help="write the raw profile here")
    args = parser.parse_args()
    if args.raw:
        print_tables(args.raw)
        return
    # The slice's report and (without --keep) the raw profile are scratch: gone once the tables are printed.
    with tempfile.TemporaryDirectory(prefix="freezecompat-profile-") as scratch:
        raw = args.keep or Path(scratch) / "profile.txt"
        profile(args.environment, args.select, args.rate, raw, Path(scratch) / "report")
        print_tables(raw)


if __name__ == "__main__":
    main()
