"""Environments and jobs, read from the matrix data (matrix/frameworks/*.toml).

Each framework pins its own torch, so each environment is its own virtualenv, `.nox/<env>`, shared by
its `matrix-<env>` and `tests-<env>` sessions (built once per pin set, not once per session):
  nox -t matrix   build every environment, run its slice of the matrix, merge into reports/
  nox -t tests    build every environment, run the plugin's tests that belong to it; then a built wheel
                  in fresh venvs, with and without torch
  nox -s matrix-torch -- --freeze-matrix-select=plugin=fsdp2   one slice, extra pytest args
FREEZECOMPAT_DROP_ENVIRONMENTS=1 removes each environment once its tests or its slice ran (CI: one CUDA torch on disk
at a time; all ten environments together take ~45 GB).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import nox

ROOT = Path(__file__).parent
SHARDS = ROOT / ".freeze-matrix" / "shards"
PUBLISHED = ROOT / "reports"
ENVIRONMENTS = ROOT / ".nox"
nox.options.reuse_venv = "yes"
nox.options.error_on_missing_interpreters = True
#: pytest's exit code 1 means "some cells are not pass": a finding of the matrix, not a broken job.
MATRIX_EXIT_CODES = [0, 1]


def environments() -> dict[str, dict[str, Any]]:
    """Environment name -> its pins and the frameworks it owns, as the matrix loader merges them.

    Asked of the package itself (stdlib only at that point), so nox, CI and the nightly workflow
    read one rule; a malformed matrix file stops here with the loader's one-line error.
    """
    found = subprocess.run([sys.executable, "-m", "pytest_freezecompat.spec.environments"], cwd=ROOT,
                           capture_output=True, text=True, check=False)
    if found.returncode != 0:
        raise SystemExit(found.stderr.strip())
    return json.loads(found.stdout)


def interpreter(version: str) -> str:
    """A Python `version` (`3.10`) to build a virtualenv with: on PATH, or installed by pyenv (whose shim for a
    version that is not pyenv's global one refuses to run), or a one-line stop naming what to install."""
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    candidates = [shutil.which(f"python{version}"), *sorted(map(str, pyenv.glob(f"{version}.*/bin/python{version}")),
                                                            reverse=True), f"/usr/bin/python{version}"]
    for candidate in filter(None, candidates):
        if subprocess.run([candidate, "--version"], capture_output=True, check=False).returncode == 0:
            return candidate
    raise SystemExit(f"an environment needs Python {version}, found neither on PATH nor under {pyenv}: "
                     f"install it (pyenv install {version}, or apt-get install python{version}-venv)")


class Environment:
    """One pin set's virtualenv, shared by the sessions that need it (nox would build one per session):
    rebuilt only when its pins, the interpreter or its setup modules change, the checkout installed editable each
    time. `setup`: modules run once with the environment's python right after it is built (`python -m <module>`,
    see `pytest_freezecompat.spec.environments`); the environment counts as built only once they all succeeded."""

    def __init__(self, session: nox.Session, name: str, pins: list[str], python: str = "",
                 setup: list[str] | None = None) -> None:
        self.session = session
        self.location = ENVIRONMENTS / name
        stamp = self.location / "freezecompat-pins.json"
        # An environment without setup keeps the stamp it always had (no rebuild of the existing ones).
        wanted = json.dumps({"python": python or sys.version, "pins": pins, **({"setup": setup} if setup else {})})
        built = stamp.is_file() and stamp.read_text() == wanted and self.bin("python").exists()
        if not built:
            shutil.rmtree(self.location, ignore_errors=True)
            other = ["-p", interpreter(python)] if python else []  # a release that needs another Python
            session.run_install(sys.executable, "-m", "virtualenv", "-q", *other, str(self.location))
            for requirement in pins:  # one pip call per requirement string, in order: some stacks need torch first
                self.pip("install", *requirement.split())
        self.pip("install", "-q", "-e", ".[torch,test]")
        if not built:
            for module in setup or ():  # after the checkout is installed: setup modules live in it
                session.run_install(str(self.bin("python")), "-m", module)
            stamp.write_text(wanted)

    def bin(self, program: str) -> Path:
        return self.location / "bin" / program

    def pip(self, *args: str) -> None:
        self.session.run_install(str(self.bin("python")), "-m", "pip", *args)

    def run(self, program: str, *args: str, **kwargs: object) -> str | bool | None:
        return self.session.run(str(self.bin(program)), *args, **kwargs)

    def drop_if_asked(self) -> None:
        if os.environ.get("FREEZECOMPAT_DROP_ENVIRONMENTS") == "1":
            shutil.rmtree(self.location, ignore_errors=True)


def _matrix_session(name: str, pins: list[str], python: str, setup: list[str]) -> None:
    @nox.session(name=f"matrix-{name}", tags=["matrix"], venv_backend="none")
    def matrix(session: nox.Session) -> None:
        env = Environment(session, name, pins, python, setup)
        frozen = env.run("python", "-m", "pip", "freeze", "--exclude-editable", silent=True)
        if frozen and not session.posargs:  # a whole slice starts a fresh shard: no cell of an older plan stays
            shutil.rmtree(SHARDS / name, ignore_errors=True)  # (a narrowed rerun updates its cells in place)
        if isinstance(frozen, str):  # None under --install-only; the editable line (this checkout) is left out
            (SHARDS / name).mkdir(parents=True, exist_ok=True)
            (SHARDS / name / "pip-freeze.txt").write_text(frozen)
        # The built-in matrix plus the user-model examples (cells of frameworks this environment owns).
        env.run("pytest", "--freeze-matrix", f"--freeze-matrix-environment={name}",
                f"--freeze-matrix-report={SHARDS / name}", "-p", "no:cacheprovider", "-q", "examples",
                *session.posargs, success_codes=MATRIX_EXIT_CODES, env={"OMP_NUM_THREADS": "1"})
        env.drop_if_asked()


def _tests_session(name: str, pins: list[str], frameworks: list[str], python: str, setup: list[str]) -> None:
    @nox.session(name=f"tests-{name}", tags=["tests"], venv_backend="none")
    def tests(session: nox.Session) -> None:
        # tests/<fw>_adapter, not tests/<fw>: with tests/ on sys.path a folder named like the framework
        # would import as an empty namespace package wherever the framework is not installed.
        paths = [f"tests/{fw}_adapter" for fw in frameworks if (ROOT / "tests" / f"{fw}_adapter").is_dir()]
        if name != "torch" and not paths:
            session.skip(f"no adapter tests for {', '.join(frameworks)}: its release runs in the matrix only")
        env = Environment(session, name, pins, python, setup)
        if name == "torch":  # the engine's own tests run once, in the torch environment
            env.run("ruff", "check", ".")
            env.run("pytest", "-n", "2", "tests", *session.posargs)  # framework tests skip here
        if paths:
            env.run("pytest", *paths, *session.posargs)
        env.drop_if_asked()


for _name, _env in environments().items():
    _matrix_session(_name, _env["install"], _env["python"], _env["setup"])
    _tests_session(_name, _env["install"], _env["frameworks"], _env["python"], _env["setup"])


@nox.session(tags=["tests"], reuse_venv="no")
def wheel(session: nox.Session) -> None:
    """The package as a user gets it: a built wheel in fresh venvs, run from an empty folder, with torch (a few
    cells) and without it (the report tools; the matrix refuses in one line). tests/wheel/ holds the checks."""
    work = Path(tempfile.mkdtemp(prefix="freezecompat-wheel-"))  # outside the checkout: no ini file above it
    try:
        dist, bare = work / "dist", work / "without-torch"
        session.install("build")
        session.run("python", "-m", "build", "--wheel", "--sdist", "--outdir", str(dist))
        built = next(dist.glob("*.whl"))
        session.run(sys.executable, "-m", "virtualenv", "-q", str(bare), external=True)
        session.run(str(bare / "bin" / "python"), "-m", "pip", "install", "-q", str(built), external=True)
        session.install(f"{built}[torch]", "torch==2.13.0")
        session.install("--force-reinstall", "--no-deps", str(built))  # a reused venv holds an older build of 0.1.0
        checks = {"FREEZECOMPAT_WHEEL_DIST": str(dist), "FREEZECOMPAT_BARE_PYTHON": str(bare / "bin" / "python")}
        session.run("pytest", "-p", "no:cacheprovider", "-q", f"--basetemp={work / 'runs'}",
                    str(ROOT / "tests" / "wheel"), env=checks)
    finally:
        shutil.rmtree(work, ignore_errors=True)


@nox.session(tags=["matrix"])
def report(session: nox.Session) -> None:
    """Merge the shards of every environment into the published report (no torch needed)."""
    shards = [str(SHARDS / env / "matrix.json") for env in environments() if (SHARDS / env / "matrix.json").exists()]
    session.install(".")  # no torch: the report tools need none
    if not shards:  # e.g. `nox -t matrix --install-only`; a failed matrix session has failed the run already
        session.skip("no shard to merge yet: run `nox -t matrix` (or a matrix-<env> session) first")
    bisections = PUBLISHED / "bisections.json"  # written by `freezecompat bisect --record`
    session.run("freezecompat", "merge", *shards, "-o", str(PUBLISHED),
                "--known-issues", str(ROOT / "matrix" / "known_issues.toml"),
                *(["--bisections", str(bisections)] if bisections.exists() else []))
    for env in environments():  # each environment's exact versions, beside the table they produced
        frozen = SHARDS / env / "pip-freeze.txt"
        if frozen.exists():
            (PUBLISHED / f"pip-freeze-{env}.txt").write_text(frozen.read_text())
