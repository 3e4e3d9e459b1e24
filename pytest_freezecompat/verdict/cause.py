"""Why a cell is red: freezing, the stack, both, or our own harness (a differential verdict).

Every cell is compared with its column's control: the cell of the same model, framework release, plugin, init,
checkpoint and clip with nothing frozen (`none`). Pure and stdlib-only, on report rows: it runs where a report
is written (the run) and where shards are merged (`freezecompat merge`).

  freeze   the control passes; or the cell fails on requires_grad, on the optimizer set, or on a param
           the pattern holds fixed (frozen, or outside the optimizer)
  stack    the control fails the same way on the same params: freezing is not the problem
  both     the control fails too, but differently, or the cell adds a freeze-specific failure
  harness  our own code raised (probes, reference, setup): the cell says nothing about the stack
A red cell with no control to compare with and no freeze-specific failure has no cause (`None`).
"""

from __future__ import annotations

from typing import Any

from ..core.records import FAILING, with_later_axes

CAUSES = ("freeze", "stack", "both", "harness")
CONTROL = "none"
FREEZE_CHECKS = ("requires_grad", "optimizer")
_COLUMN = ("model", "framework", "release", "plugin", "init", "checkpoint", "clip")

Row = dict[str, Any]


def _freeze_specific(row: Row) -> bool:
    return row["status"] == "fail" and any(f["check"] in FREEZE_CHECKS or f.get("on_held_params")
                                           for f in row.get("failures", []))


def _error_text(row: Row) -> str:
    """What the stack raised, in its own words, without the rank, phase and place (which differ between echoes of
    one failure); a row written before the verdict recorded `error` has it only inside its message."""
    if "error" in row:
        return f"{row['error']['type']}: {row['error']['message']}"
    return row["message"].split(" (rank ", 1)[0]


def _fails_like(row: Row, control: Row) -> bool:
    """The control fails the same way: same status, and for a fail every check on (at least) the same params."""
    if row["status"] != control["status"]:
        return False
    if row["status"] == "error":
        return _error_text(row) == _error_text(control)
    if row["status"] != "fail":
        return True  # timeout, crash
    theirs = {f["check"]: set(f["params"]) for f in control.get("failures", [])}
    return all(f["check"] in theirs and set(f["params"]) <= theirs[f["check"]] for f in row.get("failures", []))


def cause_of(row: Row, control: Row | None) -> str | None:
    if row["status"] not in FAILING:
        return None
    if row.get("cause") == "harness":
        return "harness"
    if row["freeze"] == CONTROL:
        return "stack"
    specific = _freeze_specific(row)
    if control is None or control["status"] not in (*FAILING, "pass") or control.get("cause") == "harness":
        return "freeze" if specific else None
    if control["status"] == "pass":
        return "freeze"
    return "both" if specific or not _fails_like(row, control) else "stack"


def assign(rows: list[Row]) -> list[Row]:
    """Set each row's `cause` (in place; `harness`, decided by the verdict, is kept); returns the rows."""
    rows = [with_later_axes(row) for row in rows]
    controls = {tuple(r[f] for f in _COLUMN): r for r in rows if r["freeze"] == CONTROL}
    for row in rows:
        cause = cause_of(row, controls.get(tuple(row[f] for f in _COLUMN)))
        if cause is None:
            row.pop("cause", None)
        else:
            row["cause"] = cause
    return rows
