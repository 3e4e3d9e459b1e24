"""`matrix.json`, schema 1: what a cell record holds, and a loader that refuses what it can't read.

New fields are optional under schema 1; a reader ignores what it does not know.
"""

from __future__ import annotations

import json
import platform
import subprocess
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any, TypeAlias

from ..core.names import LATER_AXES
from ..core.records import STATUSES, with_later_axes

SCHEMA = 1

#: A field's accepted JSON types: a scalar's name (`_SCALARS`), a `ListOf`, a `Table`, or a tuple of these (any one).
Kind: TypeAlias = "str | ListOf | Table | tuple[Kind, ...]"
#: Scalars by name, as `json` decodes them (exact types: a boolean is no integer).
_SCALARS: dict[str, tuple[type, ...]] = {"string": (str,), "integer": (int,), "number": (int, float),
                                         "boolean": (bool,), "null": (type(None),)}
_JSON_NAMES = {str: "string", int: "integer", float: "number", bool: "boolean", type(None): "null", list: "list",
               dict: "table"}


@dataclass(frozen=True)
class ListOf:
    """A JSON list whose every item is of one kind."""

    item: Kind


@dataclass(frozen=True)
class Table:
    """A JSON object: required fields must be there, optional ones are checked where present, others ignored."""

    required: dict[str, Kind] = field(default_factory=dict)
    optional: dict[str, Kind] = field(default_factory=dict)


# What a cell may hold (`CellRecord.to_json`), typed as the records type it (`X | None`: X or null).
# Required: what readers index (`cell["..."]`) in every row, e.g. `message` for `verdict.cause`.
STRINGS = ListOf("string")
STRING_OR_NULL = ("string", "null")
KNOWN_ISSUE = Table(required={"id": "string"},
                    optional={"link": "string", "links": STRINGS, "summary": "string", "expected": "boolean",
                              "fixed": "boolean", "range_too_narrow": "boolean", "versions": Table(),
                              "fixed_in": Table(), "kind": "string", "reproducer": "string",
                              "workarounds": ListOf(Table(required={"change": Table(), "says": "string"})),
                              "no_workaround": "string", "only_on": Table(), "about_freezing": "boolean"})
#: A red cell's nearest safe setups (`advice.annotate`): the cell, its severity, and each (axis, from, to).
INSTEAD = Table(required={"cell": "string", "severity": "string", "changes": ListOf(ListOf("string"))})
#: An explained red cell's workarounds (`advice.annotate`): the cell each leads to (null: not in the report) and
#: whether it is ok there (null: nothing to judge).
PROOF = Table(required={"workaround": "string", "says": "string"},
              optional={"proof": STRING_OR_NULL, "holds": ("boolean", "null"), "severity": STRING_OR_NULL,
                        "blocked_by": STRING_OR_NULL})
FAILURE = Table(required={"check": "string", "params": STRINGS},
                optional={"step": "integer", "message": "string", "on_held_params": "boolean",
                          "params_kind": STRING_OR_NULL, "scale": ("number", "null"), "ranks_combine": STRING_OR_NULL,
                          "raised": "boolean", "kinds": STRINGS, "in_optimizer": "boolean"})
RANK_ERROR = Table(optional=dict.fromkeys(("type", "message", "where", "phase"), "string"))
RANK_DETAIL = Table(optional={"rank": "integer", "phase": "string", "error": (RANK_ERROR, "null"), "exit": "string",
                              "traceback": "string", "stack": "string", "log_tail": "string", "emulated": STRINGS})
CELL = Table(
    required=dict.fromkeys(("id", "model", "framework", "plugin", "init", "checkpoint", "freeze", "environment",
                            "status", "message"), "string"),
    optional={"world_size": "integer", "precision": "string", "emulation": "boolean", "repro": "string",
              "check": STRING_OR_NULL, "failures": ListOf(FAILURE), "notes": STRINGS, "grad_access": STRING_OR_NULL,
              "grad_norm_source": STRING_OR_NULL, "rank_details": ListOf(RANK_DETAIL), "duration_s": "number",
              "emulated": (STRINGS, "null"), "pool_start_s": ("number", "null"), "raised_in": STRING_OR_NULL,
              "cause": STRING_OR_NULL, "rule_known_issue": STRING_OR_NULL, "known_issue": (KNOWN_ISSUE, "null"),
              "finished_at": "string", "rendezvous_retries": "integer",
              "phases_s": Table(), "group_kept": "boolean", "user_model": "boolean", "resume_api": "string",
              "round_trip_of": "string", "convention": "string", "differences": STRINGS, "severity": "string",
              "instead": ListOf(INSTEAD), "workarounds": ListOf(PROOF), "unchecked": STRINGS, "tolerance": Table(),
              "error": Table(required={"type": "string", "message": "string"}),
              "commit": "string", "observed": Table(), "versions": Table(), "tied": STRINGS,
              **dict.fromkeys(LATER_AXES, "string")})
#: An `environments` value (`environment_info`).
#: `run`: who made these cells (plugin version, the checkout's commit, when, the command line); `axes`: every axis's
#: values in the matrix file's order, so tables follow the file rather than the order cells happened to run in.
#: `words`: plain words per axis value (plugins, inits, checkpoint modes, freeze patterns) for this environment.
RUN = Table(optional={"plugin": STRING_OR_NULL, "commit": STRING_OR_NULL, "date": "string", "command": "string"})
#: The report's `workarounds` table (`advice.workarounds.summary`): one row per entry, workaround and release.
WORKAROUND_ROW = Table(required={"entry": "string", "workaround": "string", "release": "string", "state": "string",
                                 "proof": STRINGS},
                       optional={"says": "string",
                                 **dict.fromkeys(("held", "not_held", "blocked", "unjudged", "cells"), "integer")})
#: `lock`: the environment's lock (`spec.locks.state`): its file under matrix/, its sha256, and each way what the run
#: had installed differs from it (empty: built from it).
LOCK = Table(required={"file": "string", "sha256": "string", "differs": STRINGS})
ENVIRONMENT = Table(optional={"python": "string", "torch": STRING_OR_NULL, "frameworks": Table(), "device": "string",
                              "backend": "string", "platform": "string", "run": RUN, "axes": Table(),
                              "words": Table(), "lock": LOCK})


class ReportError(ValueError):
    """A report file we cannot use; the message is one line naming the file."""


def distribution_version(module: str) -> str | None:
    """Version of the distribution that provides top-level `module` (e.g. colossalai, megatron)."""
    top = module.split(".")[0]
    for dist in metadata.packages_distributions().get(top, []):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def environment_info(frameworks: dict[str, str], device: str, backend: str, *,
                     run: dict[str, Any] | None = None, axes: dict[str, list[str]] | None = None,
                     words: dict[str, dict[str, str]] | None = None,
                     lock: dict[str, Any] | None = None) -> dict[str, Any]:
    """Versions that decide the results (python, torch, each framework this environment runs), and optionally
    the run's metadata, the matrix file's axis order and the environment's lock."""
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": distribution_version("torch"),
        "frameworks": {name: distribution_version(module) for name, module in frameworks.items()},
        "device": device,
        "backend": backend,
        "platform": platform.platform(terse=True),
    }
    if run is not None:
        info["run"] = run
    if axes is not None:
        info["axes"] = axes
    if words is not None:
        info["words"] = words
    if lock is not None:
        info["lock"] = lock
    return info


def plugin_version() -> str | None:
    try:
        return metadata.version("pytest-freezecompat")
    except metadata.PackageNotFoundError:  # imported from a source tree that was never installed
        return None


def checkout_commit(directory: Path) -> str | None:
    """The git commit `directory` is checked out at (`-dirty` when tracked files changed), or None outside git."""
    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", *args], cwd=directory, capture_output=True, text=True, timeout=10,
                                  check=False)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if not commit:
        return None
    return commit + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def run_info(command: str, directory: Path) -> dict[str, Any]:
    """What a reader of a published table asks first: which code, which commit, when, by which command."""
    return {"plugin": plugin_version(), "commit": checkout_commit(directory),
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), "command": command}


def _a(json_name: str) -> str:
    return json_name if json_name == "null" else ("an " if json_name[0] in "aeiou" else "a ") + json_name


def _describe(kind: Kind) -> str:
    if isinstance(kind, tuple):
        return " or ".join(map(_describe, kind))
    return _a("list" if isinstance(kind, ListOf) else "table" if isinstance(kind, Table) else kind)


def _problem(value: Any, kind: Kind) -> tuple[str, str] | None:
    """Why `value` is not of `kind`: (the field's path inside it, e.g. `failures[0].params`, what is wrong), or None.

    Readers index and iterate cells freely, so a wrong type must stop the load rather than crash a reader later.
    Paths are built only on the way out of a failure: a valid report costs no string work."""
    for option in kind if isinstance(kind, tuple) else (kind,):
        if isinstance(option, str):
            if type(value) in _SCALARS[option]:
                return None
        elif isinstance(option, Table) and type(value) is dict:
            for name in option.required:
                if name not in value:
                    return name, "missing"
            for fields in (option.required, option.optional):
                for name, inner in fields.items():
                    if name in value and (found := _problem(value[name], inner)):
                        return _path(name, found[0]), found[1]
            return None
        elif isinstance(option, ListOf) and type(value) is list:
            for index, item in enumerate(value):
                if found := _problem(item, option.item):
                    return _path(f"[{index}]", found[0]), found[1]
            return None
    return "", f"expected {_describe(kind)}, got {_a(_JSON_NAMES[type(value)])}"


def _path(head: str, tail: str) -> str:
    return head + ("." if tail and not tail.startswith("[") else "") + tail


def _say(found: tuple[str, str]) -> str:
    """`field failures[0].params: expected a list, got a string` (no field for the value itself)."""
    where, what = found
    return f"field {where}: {what}" if where else what


def cell_problem(cell: Any) -> str | None:
    """What keeps `cell` from being a report row (`field status: ...`), or None: for reports and journals alike."""
    if found := _problem(cell, CELL):
        return _say(found)
    if cell["status"] not in STATUSES:
        return f"field status: {cell['status']!r} is not one of {', '.join(STATUSES)}"
    return None


def load(path: str | Path) -> dict[str, Any]:
    """The report at `path`, every cell checked against `CELL`; a ReportError (one line) for anything else."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ReportError(f"{path}: cannot read report ({exc.strerror})") from None
    except UnicodeDecodeError as exc:
        raise ReportError(f"{path}: not a matrix report (not UTF-8 text at byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise ReportError(f"{path}: not a matrix report (invalid JSON at line {exc.lineno}: {exc.msg})") from None
    if not isinstance(data, dict) or "schema" not in data:
        raise ReportError(f"{path}: not a matrix report (no schema field)")
    if data["schema"] != SCHEMA:
        raise ReportError(f"{path}: report schema {data['schema']!r}, this tool reads schema {SCHEMA}")
    cells = data.get("cells")
    if not isinstance(cells, list) or not isinstance(data.get("environments"), dict):
        raise ReportError(f"{path}: corrupt report (cells must be a list, environments a table)")
    for name, info in data["environments"].items():
        if found := _problem(info, ENVIRONMENT):
            raise ReportError(f"{path}: corrupt report (environment {name!r}: {_say(found)})")
    if not isinstance(data.get("workarounds", []), list):
        raise ReportError(f"{path}: corrupt report (workarounds must be a list)")
    for index, row in enumerate(data.get("workarounds", [])):
        if found := _problem(row, WORKAROUND_ROW):
            raise ReportError(f"{path}: corrupt report (workarounds[{index}]: {_say(found)})")
    for index, cell in enumerate(cells):
        cell_id = cell.get("id") if type(cell) is dict else None
        label = f"cell {cell_id}" if type(cell_id) is str and cell_id.isprintable() else f"cells[{index}]"
        if problem := cell_problem(cell):
            raise ReportError(f"{path}: corrupt report ({label}: {problem})")
        with_later_axes(cell)
    return data
