"""The matrix's options: command line first, then the ini file (`[tool.pytest.ini_options]`), then defaults.

Resolved and checked when pytest configures, before anything is collected, so a bad value is one
`ERROR:` line rather than a collection error; nothing here imports torch.
"""

from __future__ import annotations

import math
import os
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest

from .core.names import SEVERITIES

#: A warm cell takes well under a second; framework imports on the first cell of a pool take up to a minute.
DEFAULT_TIMEOUT_S = 120.0
#: Below a second a cell cannot even join its process group; a day is longer than any CI allows.
TIMEOUT_RANGE_S = (1.0, 86400.0)
DEFAULT_WORLD_SIZE = 2
DEFAULT_REPORT_DIR = ".freeze-matrix"
ENVIRONMENT_VARIABLE = "FREEZECOMPAT_ENVIRONMENT"
#: Options a project may set in its ini file, as pytest-timeout's `timeout` (the command line wins).
INI_HELP = {
    "freeze_matrix_spec": "matrix file instead of the packaged one (relative to the ini file)",
    "freeze_matrix_report": f"report directory (relative to the ini file; default {DEFAULT_REPORT_DIR}/)",
    "freeze_matrix_timeout": f"seconds one cell may take (default {DEFAULT_TIMEOUT_S:.0f})",
    "freeze_matrix_world_size": f"ranks per cell (default {DEFAULT_WORLD_SIZE})",
    "freeze_matrix_environment": f"run only the frameworks this environment owns (${ENVIRONMENT_VARIABLE} wins)",
    "freeze_matrix_fail_on": "severities of your own models' cells that fail the run (default silent)",
}
#: What fails a run by default on a user's own model: the harm nobody would otherwise see. A refusal is loud, a cost
#: is a cost: a project opts into failing on them (`--freeze-matrix-fail-on=silent,refused`).
DEFAULT_FAIL_ON = ("silent",)
#: The severities a run may fail on (`harness`, our own failure, always fails; `ok` and `skipped` never do).
FAILABLE = tuple(s for s in SEVERITIES if s not in ("harness", "ok", "skipped"))
T = TypeVar("T")


@dataclass(frozen=True)
class Options:
    matrix: bool  # --freeze-matrix: plan the built-in matrix (user cases run without it)
    select: str  # every --freeze-matrix-select, joined: values of one axis are alternatives
    timeout_s: float
    world_size: int
    spec_path: str | None
    report_dir: Path
    report_dir_is_default: bool
    environment: str | None
    command: str = ""  # the command line, as the report's run metadata shows it
    rootdir: Path = Path()  # whose git commit the report names
    #: --freeze-matrix-every-round-trip: each cell runs its own round trip (re-measures what `[round_trip]` shares).
    every_round_trip: bool = False
    #: --freeze-matrix-fail-on: the severities of a `@freeze_case` cell that fail the run, explained by an entry or not.
    fail_on: tuple[str, ...] = DEFAULT_FAIL_ON
    #: --freeze-matrix-builtin: the built-in matrix runs beside the project's own `@freeze_case` models.
    builtin: bool = False


def add_options(parser: pytest.Parser) -> None:
    group = parser.getgroup("freeze-matrix", "partial-freeze compatibility matrix (pytest-freezecompat)")
    group.addoption("--freeze-matrix", action="store_true", help="run the freeze compatibility matrix")
    group.addoption("--freeze-matrix-select", action="append", default=[], metavar="AXIS=VALUE,...",
                    help="keep only cells with these exact axis values; repeat the option or an axis for "
                         "alternatives, e.g. --freeze-matrix-select=framework=torch,freeze=embedding")
    group.addoption("--freeze-matrix-timeout", type=float, default=None, metavar="S",
                    help=f"seconds one cell may take before it is a timeout (default {DEFAULT_TIMEOUT_S:.0f})")
    group.addoption("--freeze-matrix-world-size", type=int, default=None, metavar="N",
                    help=f"ranks per cell (default {DEFAULT_WORLD_SIZE})")
    group.addoption("--freeze-matrix-spec", default=None, metavar="FILE",
                    help="matrix file to use instead of the packaged one")
    group.addoption("--freeze-matrix-report", default=None, metavar="DIR",
                    help=f"where matrix.json, .md and .html go (default {DEFAULT_REPORT_DIR}/ under the rootdir, "
                         "a directory that ignores itself in git)")
    group.addoption("--freeze-matrix-environment", default=None, metavar="NAME",
                    help=f"run only the frameworks this environment owns (default ${ENVIRONMENT_VARIABLE}; "
                         "unset: every framework, non-importable ones skipped)")
    group.addoption("--freeze-matrix-every-round-trip", action="store_true",
                    help="every cell runs its own save -> load round trip, none cites its round-trip group's (slower; "
                         "shows whether a framework's [round_trip] classes still share one result)")
    group.addoption("--freeze-matrix-builtin", action="store_true",
                    help="run the built-in matrix too where the project's test files declare @freeze_case models "
                         "(without any, --freeze-matrix runs the built-in matrix)")
    group.addoption("--freeze-matrix-fail-on", default=None, metavar="SEVERITY,...",
                    help=f"which severities of your own models' cells fail the run, a known issue or not: any of "
                         f"{', '.join(FAILABLE)} (default {','.join(DEFAULT_FAIL_ON)}); the others are xfailed")
    for name, text in INI_HELP.items():
        parser.addini(name, text, default="")


def given_on_command_line(config: pytest.Config) -> list[str]:
    """The `--freeze-matrix-*` options this command line sets (ini values are a project's standing choice)."""
    names = ("select", "timeout", "world_size", "spec", "report", "environment", "fail_on")
    return [f"--freeze-matrix-{name.replace('_', '-')}" for name in names
            if config.getoption(f"freeze_matrix_{name}") not in (None, [])]


_KINDS: dict[Any, str] = {float: "a number of seconds", int: "a whole number"}


def _from_ini(config: pytest.Config, name: str) -> str | None:
    """The ini file's value, or None when it has none (read only where the command line gave nothing)."""
    return str(config.getini(name)).strip() or None


def _setting(config: pytest.Config, name: str, convert: Callable[[str], T], default: T) -> T:
    if (value := config.getoption(name)) is not None:
        return value
    if (text := _from_ini(config, name)) is None:
        return default
    try:
        return convert(text)
    except ValueError:
        where = config.inipath.name if config.inipath else "the ini file"
        raise pytest.UsageError(f"{name} = {text!r} in {where}: not {_KINDS[convert]}") from None


def _path(config: pytest.Config, name: str) -> str | None:
    """A path option: the command line's as given (relative to the cwd), the ini file's relative to that file."""
    if (value := config.getoption(name)) is not None or (text := _from_ini(config, name)) is None:
        return value
    return os.path.normpath((config.inipath.parent if config.inipath else config.rootpath) / text)


def _fail_on(config: pytest.Config) -> tuple[str, ...]:
    text = config.getoption("freeze_matrix_fail_on") or _from_ini(config, "freeze_matrix_fail_on")
    if text is None:
        return DEFAULT_FAIL_ON
    values = tuple(dict.fromkeys(v.strip() for v in text.split(",") if v.strip()))
    unknown = [v for v in values if v not in FAILABLE]
    if unknown or not values:
        raise pytest.UsageError(f"--freeze-matrix-fail-on: {unknown[0] if unknown else 'nothing'} is not a severity "
                                f"a run can fail on; give some of {', '.join(FAILABLE)}")
    return values


def resolve(config: pytest.Config) -> Options:
    """Every setting, checked: a value out of range is a `pytest.UsageError` (one line)."""
    world_size = _setting(config, "freeze_matrix_world_size", int, DEFAULT_WORLD_SIZE)
    if world_size < 1:
        raise pytest.UsageError(f"--freeze-matrix-world-size must be at least 1, got {world_size}")
    timeout_s = _setting(config, "freeze_matrix_timeout", float, DEFAULT_TIMEOUT_S)
    low, high = TIMEOUT_RANGE_S
    if not (math.isfinite(timeout_s) and low <= timeout_s <= high):
        raise pytest.UsageError(f"--freeze-matrix-timeout must be between {low:.0f} and {high:.0f} seconds, "
                                f"got {timeout_s}")
    report_dir = _path(config, "freeze_matrix_report")
    environment = (config.getoption("freeze_matrix_environment") or os.environ.get(ENVIRONMENT_VARIABLE)
                   or _from_ini(config, "freeze_matrix_environment"))
    return Options(
        matrix=config.getoption("freeze_matrix"), select=",".join(config.getoption("freeze_matrix_select")),
        timeout_s=timeout_s, world_size=world_size, spec_path=_path(config, "freeze_matrix_spec"),
        report_dir=Path(report_dir) if report_dir else config.rootpath / DEFAULT_REPORT_DIR,
        report_dir_is_default=report_dir is None, environment=environment,
        # Paths under the rootdir relative to it: a published report names no machine's folders.
        command=shlex.join(["pytest", *config.invocation_params.args]).replace(f"{config.rootpath}{os.sep}", ""),
        rootdir=config.rootpath, every_round_trip=config.getoption("freeze_matrix_every_round_trip"),
        fail_on=_fail_on(config), builtin=config.getoption("freeze_matrix_builtin"),
    )
