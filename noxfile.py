"""Environments and jobs, read from the matrix data (matrix/frameworks/*.toml).

Each framework pins its own torch, so each environment is its own virtualenv:
  nox -t matrix   build every environment, run its slice of the matrix, merge into reports/
  nox -t tests    build every environment, run the plugin's tests that belong to it
  nox -s matrix-torch -- --freeze-matrix-select plugin=fsdp2   one slice, extra pytest args
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import nox

ROOT = Path(__file__).parent
SHARDS = ROOT / ".freeze-matrix" / "shards"
PUBLISHED = ROOT / "reports"
nox.options.reuse_venv = "yes"
nox.options.error_on_missing_interpreters = True
#: pytest's exit code 1 means "some cells are not pass": a finding of the matrix, not a broken job.
MATRIX_EXIT_CODES = [0, 1]


def environments() -> dict[str, dict[str, list[str]]]:
    """Environment name -> its pins and the frameworks it owns, as the matrix loader merges them.

    Asked of the package itself (stdlib only at that point), so nox, CI and the nightly workflow
    read one rule; a malformed matrix file stops here with the loader's one-line error.
    """
    found = subprocess.run([sys.executable, "-m", "pytest_freezecompat.spec.environments"], cwd=ROOT,
                           capture_output=True, text=True, check=False)
    if found.returncode != 0:
        raise SystemExit(found.stderr.strip())
    return json.loads(found.stdout)


def _install(session: nox.Session, pins: list[str]) -> None:
    # One pip call per requirement string, in order: some stacks must get their torch first.
    for requirement in pins:
        session.install(*requirement.split())
    session.install("-e", ".[test]")


def _matrix_session(name: str, pins: list[str]) -> None:
    @nox.session(name=f"matrix-{name}", tags=["matrix"])
    def matrix(session: nox.Session) -> None:
        _install(session, pins)
        frozen = session.run("python", "-m", "pip", "freeze", "--exclude-editable", silent=True)
        if frozen and not session.posargs:  # a whole slice starts a fresh shard: no cell of an older plan stays
            shutil.rmtree(SHARDS / name, ignore_errors=True)  # (a narrowed rerun updates its cells in place)
        if frozen:  # None under --install-only; the editable line (this checkout's path) is left out
            (SHARDS / name).mkdir(parents=True, exist_ok=True)
            (SHARDS / name / "pip-freeze.txt").write_text(frozen)
        # The built-in matrix plus the user-model examples (cells of frameworks this environment owns).
        session.run("pytest", "--freeze-matrix", f"--freeze-matrix-environment={name}",
                    f"--freeze-matrix-report={SHARDS / name}", "-p", "no:cacheprovider", "-q", "examples",
                    *session.posargs,
                    success_codes=MATRIX_EXIT_CODES, env={"OMP_NUM_THREADS": "1"})


def _tests_session(name: str, pins: list[str], frameworks: list[str]) -> None:
    @nox.session(name=f"tests-{name}", tags=["tests"])
    def tests(session: nox.Session) -> None:
        _install(session, pins)
        if name == "torch":  # the engine's own tests run once, in the torch environment
            session.run("ruff", "check", ".")
            session.run("pytest", "-n", "2", "tests", *session.posargs)  # framework tests skip here
        # tests/<fw>_adapter, not tests/<fw>: with tests/ on sys.path a folder named like the framework
        # would import as an empty namespace package wherever the framework is not installed.
        paths = [f"tests/{fw}_adapter" for fw in frameworks if (ROOT / "tests" / f"{fw}_adapter").is_dir()]
        if paths:
            session.run("pytest", *paths, *session.posargs)


for _name, _env in environments().items():
    _matrix_session(_name, _env["install"])
    _tests_session(_name, _env["install"], _env["frameworks"])


@nox.session(tags=["matrix"])
def report(session: nox.Session) -> None:
    """Merge the shards of every environment into the published report (no torch needed)."""
    shards = [str(SHARDS / env / "matrix.json") for env in environments() if (SHARDS / env / "matrix.json").exists()]
    session.install("packaging")
    if not shards:  # e.g. `nox -t matrix --install-only`; a failed matrix session has failed the run already
        session.skip("no shard to merge yet: run `nox -t matrix` (or a matrix-<env> session) first")
    session.run("python", "-m", "pytest_freezecompat.cli", "merge", *shards, "-o", str(PUBLISHED),
                "--known-issues", str(ROOT / "matrix" / "known_issues.toml"), env={"PYTHONPATH": str(ROOT)})
    for env in environments():  # each environment's exact versions, beside the table they produced
        frozen = SHARDS / env / "pip-freeze.txt"
        if frozen.exists():
            (PUBLISHED / f"pip-freeze-{env}.txt").write_text(frozen.read_text())
