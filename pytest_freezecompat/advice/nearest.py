"""The nearest safe setup: the safe cells a user reaches from a cell by changing the fewest axes, cheapest first.

A user keeps their model, what they freeze and their framework; they may change how they checkpoint activations,
clip, initialize, wrap (the plugin) or which release they run, each a bigger change than the one before it. What
they freeze changes only by a recipe the explaining entry names as a workaround (e.g. freeze the idle branch while
it gets no input), ranked after clipping. Rows are report rows as `report.schema.load` gives them (every axis
present).
"""

from __future__ import annotations

import difflib
import functools
import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from ..core.names import HARMFUL
from ..verdict.severity import severity_of

Row = dict[str, Any]

#: What the user may change, cheapest first: a checkpoint mode before a plugin, a plugin before a framework release
#: (`freeze` only to a recipe of the cell's explaining entry).
CHANGEABLE = ("checkpoint", "clip", "freeze", "init", "plugin", "release")
#: Safe to train: every weight right (`differs`: only what reaches no weight differs from the canonical loop).
SAFE = ("ok", "differs")
#: What hurts the user (silent or refused): red in every table, and what an alternative is sought for.
RED = HARMFUL
#: The order `select` narrows a setup in, so that an unknown value is named beside the values held for the rest.
SETUP_AXES = ("framework", "release", "plugin", "freeze", "checkpoint", "init", "clip", "model")
#: Axes a question may leave open: then it is about every setup the report ran of them (a guide box).
OPEN_AXES = ("checkpoint", "init", "clip")


@dataclass(frozen=True)
class Alternative:
    """A safe cell: what to change to reach it, as (axis, from, to) in `CHANGEABLE` order, and its severity."""

    cell: str
    changes: tuple[tuple[str, str, str], ...]
    severity: str


class NotInReport(ValueError):
    """A setup the report does not hold; the message is one line naming the values it holds instead."""


def severity(row: Row) -> str:
    """The row's severity; rows written before severity was recorded get it computed."""
    return row.get("severity") or severity_of(row)


@functools.cache  # a report holds a few releases; coverage asks about each hundreds of thousands of times
def release_key(release: str) -> tuple[int, ...]:
    """Sort key for a release (2.13.0 after 2.9.0) without a non-stdlib version parser."""
    return tuple(int(part) for part in re.findall(r"\d+", release))


def newest(releases: list[str]) -> str:
    return max(releases, key=release_key)


def group(row: Row) -> tuple[str, ...]:
    """Where a row's alternatives are searched: its model and framework, a user's model apart from the matrix's
    whatever its name (the pattern is checked per candidate)."""
    return row["model"], row["framework"], str(bool(row.get("user_model")))


def recipes(row: Row) -> frozenset[str]:
    """The patterns the row's explaining entry names as workarounds: the only other freeze a user is offered."""
    known = row.get("known_issue") or {}
    return frozenset(w["change"]["freeze"] for w in known.get("workarounds") or [] if "freeze" in w["change"])


def _cost(alternative: Alternative) -> tuple[Any, ...]:
    """Fewer axes first, then the cheaper axes, then the newer release, then the id (stable output)."""
    release = next((to for axis, _, to in alternative.changes if axis == "release"), "")
    return (len(alternative.changes), tuple(CHANGEABLE.index(axis) for axis, _, _ in alternative.changes),
            tuple(-part for part in release_key(release)), alternative.cell)


def nearest_safe(cell: Row, cells: list[Row], limit: int = 2) -> list[Alternative]:
    """The `limit` best safe cells of `cell`'s model, freeze pattern (or its entry's recipes) and framework: a
    user's model (`freeze_case`) is searched among its own cells like the matrix's."""
    allowed = {cell["freeze"], *recipes(cell)}
    found = []
    for row in cells:
        if (group(row) != group(cell) or row["freeze"] not in allowed
                or severity(row) not in SAFE):
            continue
        changes = tuple((axis, cell[axis], row[axis]) for axis in CHANGEABLE if row[axis] != cell[axis])
        if changes:
            found.append(Alternative(row["id"], changes, severity(row)))
    return sorted(found, key=_cost)[:limit]


def safe_by_group(cells: list[Row]) -> dict[tuple[str, ...], list[Row]]:
    """The safe rows per model and framework: what `nearest_safe` searches for each red cell of a whole report."""
    safe: dict[tuple[str, ...], list[Row]] = defaultdict(list)
    for row in cells:
        if severity(row) in SAFE:
            safe[group(row)].append(row)
    return safe


def coverage(cells: list[Row]) -> tuple[int, int]:
    """(red cells with a safe alternative one axis away, red cells): the share a reader finds one change away."""
    safe = safe_by_group(cells)
    red = [row for row in cells if severity(row) in RED]
    near = sum(any(len(found.changes) == 1 for found in nearest_safe(row, safe[group(row)], 1)) for row in red)
    return near, len(red)


def select(cells: list[Row], setup: dict[str, str | None]) -> list[Row]:
    """The rows of one setup (user models aside). An axis left None takes the one value held, or the newest release,
    or (`OPEN_AXES`) every value held; a value the report does not hold raises NotInReport naming the values it holds
    there, nearest first."""
    rows = [row for row in cells if not row.get("user_model")]
    where: list[str] = []
    for axis in SETUP_AXES:
        held = sorted({row[axis] for row in rows})
        value = setup.get(axis)
        if value is None and axis == "release":
            value = newest(held)
        elif value is None and len(held) == 1:
            value = held[0]
        elif value is None and axis in OPEN_AXES:
            continue
        elif value is None:
            raise NotInReport(f"{' '.join(where)} has several {axis}s ({', '.join(held)}): name one with --{axis}")
        if value not in held:
            nearest = difflib.get_close_matches(value, held, n=len(held) or 1, cutoff=0) or ["nothing"]
            raise NotInReport(f"no {axis} {value!r}{' for ' if where else ''}{' '.join(where)}; "
                              f"it has: {', '.join(nearest)}")
        rows = [row for row in rows if row[axis] == value]
        where.append(value if axis in ("framework", "release") else f"{axis}={value}")
    return rows
