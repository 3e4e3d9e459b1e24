"""What every framework's findings test shares: the registry's findings for a framework, and one reproducer run.

A reproducer (`findings/<id>.py`) is a standalone script (the framework and torch only) whose last line says what
happened: `REPRODUCED: ...` (exit 0) where the failure shows, `NOT REPRODUCED: ...` (exit 1) where the framework
behaves (a fixed release), `SKIPPED: ...` (exit 3) where it cannot run here (e.g. it needs CUDA). Anything else is
the script broken. Imported as `findings_run` (tests/ is on sys.path, as for `slices`)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import pytest
from packaging.version import Version

from pytest_freezecompat.spec import known_issues
from pytest_freezecompat.spec import matrix as spec

ROOT = Path(__file__).resolve().parent.parent
#: A reproducer is a minimal example: a cold framework import and one or two steps on a busy 2-core runner.
REPRODUCER_TIMEOUT_S = 300
OUTCOMES = {0: "REPRODUCED", 1: "NOT REPRODUCED", 3: "SKIPPED"}


@dataclass(frozen=True)
class Run:
    returncode: int
    last_line: str
    output: str


def findings(framework: str) -> list[known_issues.Entry]:
    """The registry's entries with a reproducer whose selectors name `framework` (explicitly: a reproducer is about
    one stack): findings, and the entries triage made upstream, by-design or misuse, which keep theirs."""
    registry = known_issues.load()
    return [entry for entry in registry.entries if entry.reproducer
            and any(framework in when.get("framework", ()) for when in entry.when)]


def installed(framework: str) -> Version:
    """The release of `framework` in this environment (its distribution, as the matrix file names it); a test of
    another framework's findings skips here (`nox -s tests-<env>` runs them in that framework's environment)."""
    package = spec.load().frameworks[framework].package
    try:
        return Version(metadata.version(package))
    except metadata.PackageNotFoundError:
        pytest.skip(f"{package} is not installed here: its findings run in its own environment")


#: A reproducer that could not import what it needs.
MISSING_MODULE = re.compile(r"ModuleNotFoundError: No module named '([\w.]+)'")


def run_reproducer(entry: known_issues.Entry) -> Run:
    assert entry.reproducer is not None
    done = subprocess.run([sys.executable, str(ROOT / entry.reproducer)], capture_output=True, text=True,
                          timeout=REPRODUCER_TIMEOUT_S, cwd=ROOT, check=False)
    output = done.stdout + done.stderr
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    return Run(done.returncode, lines[-1] if lines else "", output)


def check_reproducer(framework: str, entry: known_issues.Entry) -> None:
    """Inside the entry's range the failure must show; outside it (a fixed release) it must not."""
    release = installed(framework)
    affected = entry.versions[framework].contains(release, prereleases=True) if framework in entry.versions else True
    run = run_reproducer(entry)
    if run.returncode == 3 and run.last_line.startswith("SKIPPED:"):
        pytest.skip(f"{entry.reproducer}: {run.last_line}")
    missing = MISSING_MODULE.search(run.output)
    if run.returncode != 0 and missing and importlib.util.find_spec(missing.group(1).split(".")[0]) is None:
        # a reproducer shared with another row (DeepSpeed's, cited by the Hugging Face row) in an environment that
        # holds the row's framework but not that one: it runs where both are (`nox -s tests-<env>`)
        pytest.skip(f"{entry.reproducer} imports {missing.group(1)}, which is not installed here")
    want = "REPRODUCED" if affected else "NOT REPRODUCED"
    assert OUTCOMES.get(run.returncode) == want and run.last_line.startswith(want + ":"), (
        f"{entry.reproducer} on {framework} {release} (affected: {affected}): exit {run.returncode}, "
        f"want {want}\n{run.output[-4000:]}")
