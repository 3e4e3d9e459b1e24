"""`freezecompat bisect`: the first release of a framework where selected cells change status.

Lists the releases between a good and a bad one from the package index (pip's own configuration), builds an
environment per probed release with the framework file's `[releases] install` rule and the adapter's
`environment_setup` where it ships one, as nox builds the declared releases (cached: a declared release reuses
its `.nox/<environment>`, any other lands in `.nox/<framework>@<release>`), runs the selected cells there as
`pytest --freeze-matrix --freeze-matrix-environment=<framework>@<release>`, and halves the range as `git bisect`
does. A release that cannot be built, or whose framework does not import, is skipped with its reason, as
`git bisect skip` is; so is one whose statuses match neither end.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from packaging.version import InvalidVersion, Version

from .core.cell import CellKey
from .core.names import RELEASE_SEPARATOR
from .spec.environments import setup_modules
from .spec.matrix import Framework, Spec

#: One probe's cells, on a 2-core machine: a pool start plus a few cells; a hung probe is cut off here.
PROBE_TIMEOUT_S = 1800
#: An environment build (a CUDA torch is several GB from the index).
BUILD_TIMEOUT_S = 1800


class BisectError(ValueError):
    """A bisection that cannot start (unknown framework, release not in the index, ...): one line."""


@dataclass
class Probe:
    release: str
    verdict: str  # "good" / "bad" (the statuses of that end), "skip"
    statuses: dict[str, str] = field(default_factory=dict)  # cell id without the release -> status
    reason: str = ""  # why a probe was skipped
    seconds: float = 0.0
    command: str = ""


@dataclass
class Bisection:
    framework: str
    select: str
    good: str
    bad: str
    first_changed: str | None
    last_before: str | None
    cells: list[str]
    probes: list[Probe]
    releases_between: int
    wall_s: float


def final_releases(listing: str) -> list[Version]:
    """`pip index versions` output -> its final releases (no pre-, post- or dev releases), oldest first."""
    found = re.search(r"Available versions:\s*(.+)", listing)
    versions = []
    for text in (found.group(1).split(",") if found else []):
        try:
            version = Version(text.strip())
        except InvalidVersion:
            continue
        if not (version.is_prerelease or version.is_devrelease or version.is_postrelease):
            versions.append(version)
    return sorted(set(versions))


def search(releases: Sequence[str], probe: Callable[[str], str]) -> tuple[int, int]:
    """Indices (last with the first release's status, first with the last release's) after halving the range.

    `releases` runs from one end to the other; `probe(release)` says "first" (the status of releases[0]), "last"
    (that of releases[-1]) or "skip". Skipped releases are stepped over, nearest the middle first; when every
    release between two probed ones is skipped, those two bound the change.
    """
    low, high = 0, len(releases) - 1
    skipped: set[int] = set()
    while high - low > 1:
        middle = (low + high) // 2
        candidates = sorted((k for k in range(low + 1, high) if k not in skipped), key=lambda k: abs(k - middle))
        if not candidates:
            break
        index = candidates[0]
        verdict = probe(releases[index])
        if verdict == "first":
            low = index
        elif verdict == "last":
            high = index
        else:
            skipped.add(index)
    return low, high


class Runner:
    """Builds (or finds) an environment per release and runs the selected cells there."""

    def __init__(self, spec: Spec, framework: Framework, select: str, root: Path, envs: Path) -> None:
        self.spec, self.framework, self.select, self.root, self.envs = spec, framework, select, root, envs

    def environment(self, release: str) -> tuple[Path | None, str]:
        """(the environment's python, "") or (None, why it could not be built)."""
        declared = next((r for r in self.framework.releases if r.version == release), None)
        if declared and (self.envs / declared.environment / "bin" / "python").exists():
            return self.envs / declared.environment / "bin" / "python", ""
        location = self.envs / f"{self.framework.name}{RELEASE_SEPARATOR}{release}"
        pins = [line.replace("{release}", release) for line in self.framework.any_release]
        setup = setup_modules([self.framework.adapter])  # as nox builds the declared releases (ops, caches)
        stamp = location / "freezecompat-pins.json"
        wanted = json.dumps({"python": sys.version, "pins": pins, **({"setup": setup} if setup else {})})
        python = location / "bin" / "python"
        if stamp.is_file() and stamp.read_text() == wanted and python.exists():
            return python, ""
        steps = [[sys.executable, "-m", "venv", "--clear", str(location)],
                 *([str(python), "-m", "pip", "install", "-q", *line.split()] for line in pins),
                 [str(python), "-m", "pip", "install", "-q", "-e", f"{self.root}[torch,test]"],
                 *([str(python), "-m", module] for module in setup)]
        for step in steps:
            try:
                done = subprocess.run(step, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False)
            except subprocess.TimeoutExpired:
                return None, f"building the environment took over {BUILD_TIMEOUT_S} s: {shlex.join(step)}"
            if done.returncode != 0:
                errors = [line for line in done.stderr.splitlines() if line.startswith("ERROR")] or \
                    done.stderr.strip().splitlines()[-1:] or [f"exit {done.returncode}"]
                return None, f"cannot build: {shlex.join(step[3:]) or step[0]}: {errors[0]}"
        stamp.write_text(wanted)
        return python, ""

    def run(self, release: str) -> Probe:
        started = time.monotonic()
        python, why = self.environment(release)
        if python is None:
            return Probe(release, "skip", reason=why, seconds=time.monotonic() - started)
        with tempfile.TemporaryDirectory(prefix="freezecompat-bisect-") as report:
            # "examples": the user-model cells too, as nox's matrix sessions run them (a peft model's cells)
            command = [str(python), "-m", "pytest", "--freeze-matrix", "-p", "no:cacheprovider", "-q", "examples",
                       f"--freeze-matrix-environment={self.framework.name}{RELEASE_SEPARATOR}{release}",
                       f"--freeze-matrix-select={self.select}", f"--freeze-matrix-report={report}"]
            if self.spec.path.resolve() != (self.root / "matrix" / "matrix.toml").resolve():
                command.append(f"--freeze-matrix-spec={self.spec.path}")
            shown = shlex.join(["pytest", *command[3:-1]])  # the repro: the env's pytest, no temp report
            try:
                done = subprocess.run(command, cwd=self.root, capture_output=True, text=True, check=False,
                                      timeout=PROBE_TIMEOUT_S, env={**os.environ, "OMP_NUM_THREADS": "1"})
            except subprocess.TimeoutExpired:
                return Probe(release, "skip", reason=f"the cells took over {PROBE_TIMEOUT_S} s",
                             seconds=time.monotonic() - started, command=shown)
            path = Path(report) / "matrix.json"
            if not path.exists():
                last = (done.stderr.strip() or done.stdout.strip()).splitlines()[-1:] or [f"exit {done.returncode}"]
                return Probe(release, "skip", reason=f"no report: {last[0]}", seconds=time.monotonic() - started,
                             command=shown)
            rows = json.loads(path.read_text())["cells"]
        statuses = {CellKey.parse(row["id"]).across_releases: row["status"] for row in rows}
        unrun = [row for row in rows if row["status"] == "skip"]
        if not rows or len(unrun) == len(rows):
            reason = unrun[0].get("message", "") if unrun else "no cell selected"
            return Probe(release, "skip", statuses, reason=reason, seconds=time.monotonic() - started, command=shown)
        return Probe(release, "", statuses, seconds=time.monotonic() - started, command=shown)


def bisect(spec: Spec, framework: str, select: str, good: str, bad: str, *, root: Path, envs: Path,
           listing: str, report: Callable[[str], None] = print) -> Bisection:
    """Run both ends, then halve the releases between until the first one with the other end's statuses."""
    started = time.monotonic()
    if framework not in spec.frameworks:
        raise BisectError(f"unknown framework {framework!r}; valid: {', '.join(spec.frameworks)}")
    fw = spec.frameworks[framework]
    if not fw.any_release:
        raise BisectError(f"framework {framework}: its file has no [releases] install rule to build a release with")
    index = [str(v) for v in final_releases(listing)]
    for end in (good, bad):
        if end not in index:
            raise BisectError(f"{fw.package} {end} is not a final release in the package index")
    ordered = sorted((good, bad), key=Version)
    releases = index[index.index(ordered[0]):index.index(ordered[1]) + 1]
    runner = Runner(spec, fw, f"{select},framework={framework}" if select else f"framework={framework}", root, envs)
    probes: list[Probe] = []

    def run(release: str) -> Probe:
        report(f"probing {fw.package} {release} ...")
        probe = runner.run(release)
        probes.append(probe)
        return probe

    ends = {release: run(release) for release in ordered}
    for release, probe in ends.items():
        if probe.verdict == "skip":
            raise BisectError(f"{fw.package} {release} (an end) could not run: {probe.reason}")
    first, last = ends[ordered[0]], ends[ordered[1]]
    first.verdict, last.verdict = ("good", "bad") if ordered[0] == good else ("bad", "good")
    if first.statuses == last.statuses:
        raise BisectError(f"the selected cells have the same statuses on {good} and {bad}: nothing to bisect")

    def verdict(release: str) -> str:
        probe = run(release)
        side = "first" if probe.statuses == first.statuses else "last" if probe.statuses == last.statuses else ""
        if probe.verdict == "skip" or not side:
            probe.verdict = "skip"
            probe.reason = probe.reason or "statuses match neither end: " + ", ".join(
                f"{cell} {status}" for cell, status in sorted(probe.statuses.items()))
            return "skip"
        probe.verdict = first.verdict if side == "first" else last.verdict
        return side

    low, high = search(releases, verdict)
    return Bisection(framework, select, good, bad, releases[high] if high - low == 1 else None, releases[low],
                     sorted(first.statuses), probes, len(releases) - 2, time.monotonic() - started)


def summary(found: Bisection) -> list[str]:
    """What the command prints after its progress lines: every probe, then the answer."""
    lines = []
    for probe in sorted(found.probes, key=lambda p: Version(p.release)):
        statuses = ", ".join(sorted(set(probe.statuses.values()))) or "-"
        why = f" ({probe.reason})" if probe.reason else ""
        lines.append(f"  {probe.release:>10}  {probe.verdict:<4}  {statuses:<24} {probe.seconds:6.0f} s{why}")
        if probe.command:
            lines.append(f"              {probe.command}")
    if found.first_changed:
        lines.append(f"first release with {found.bad if Version(found.bad) > Version(found.good) else found.good}'s "
                     f"statuses: {found.first_changed} (the last before it: {found.last_before}); "
                     f"{len(found.probes)} probes over {found.releases_between} releases between, "
                     f"{found.wall_s:.0f} s")
    else:
        lines.append(f"no single release found: the change lies after {found.last_before}, and the releases after it "
                     "up to the next probed one could not be run")
    return lines


def record(found: Bisection, path: Path) -> None:
    """Add (or replace: same framework and selection) this bisection in a JSON list the reports read."""
    entries: list[dict[str, Any]] = json.loads(path.read_text()) if path.exists() else []
    entries = [e for e in entries if (e["framework"], e["select"]) != (found.framework, found.select)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([*entries, asdict(found)], indent=1) + "\n")
