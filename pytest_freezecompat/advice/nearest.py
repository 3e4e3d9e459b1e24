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

from ..core.names import HARMFUL, SAFE
from ..verdict.severity import recorded as severity

Row = dict[str, Any]

#: What the user may change, cheapest first: a checkpoint mode before a plugin, a plugin before a framework release
#: (`freeze` only to a recipe of the cell's explaining entry).
CHANGEABLE = ("checkpoint", "clip", "freeze", "init", "plugin", "release")
#: What hurts the user (silent or refused): red in every table, and what an alternative is sought for.
RED = HARMFUL
#: The order `select` narrows a setup in: the model before the release (its newest is the default) and before the
#: patterns (a model's own), so an unknown value is named beside the values held for what was named before it.
SETUP_AXES = ("framework", "model", "release", "plugin", "freeze", "checkpoint", "init", "clip")
#: How a question names the axes it has narrowed, framework and release first: `hf 1.10.1 model=tiny-llama-lora`.
SHOWN_AXES = ("framework", "release", "model", "plugin", "freeze", "checkpoint", "init", "clip")
#: Axes a question may leave open: then it is about every setup the report ran of them (a guide box), every model.
OPEN_AXES = ("model", "checkpoint", "init", "clip")
#: Where an axis's values are listed per another axis's value: a release or plugin is a framework's, a freeze pattern
#: its model's.
LISTED_PER = {"release": "framework", "plugin": "framework", "freeze": "model"}
#: How many held values an error names, nearest first: one line, not the whole axis.
NEAREST_SHOWN = 8


@dataclass(frozen=True)
class Alternative:
    """A safe cell: what to change to reach it, as (axis, from, to) in `CHANGEABLE` order, and its severity."""

    cell: str
    changes: tuple[tuple[str, str, str], ...]
    severity: str


class NotInReport(ValueError):
    """A setup the report does not hold; the message is one line naming the values it holds instead."""


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


def describe(named: dict[str, str]) -> str:
    """`hf 1.10.1 model=tiny-llama-lora plugin=ddp`: what a question has named so far, in `SHOWN_AXES` order."""
    return " ".join(named[axis] if axis in ("framework", "release") else f"{axis}={named[axis]}"
                    for axis in SHOWN_AXES if axis in named)


def _not_held(cells: list[Row], rows: list[Row], axis: str, value: str, named: dict[str, str]) -> NotInReport:
    """The one-line error for a value the narrowed rows lack: the nearest values they hold, and which of the values
    named before it the value is held with instead on the same framework (`freeze=x is held with model=y`)."""
    held = sorted({row[axis] for row in rows})
    nearest = difflib.get_close_matches(value, held, n=len(held) or 1, cutoff=0) or ["nothing"]
    more = (f" (and {len(nearest) - NEAREST_SHOWN} more: leave out --plugin or --freeze to list every value)"
            if len(nearest) > NEAREST_SHOWN else "")
    text = (f"no {axis} {value!r}{' for ' if named else ''}{describe(named)}; "
            f"it has: {', '.join(nearest[:NEAREST_SHOWN])}{more}")
    framework = named.get("framework")  # the user's stack stays: another framework's values are no hint
    elsewhere = [row for row in cells if row[axis] == value and framework in (None, row["framework"])]
    instead = []
    for other, wanted in named.items():
        matching = [row for row in elsewhere if row[other] == wanted]
        if elsewhere and not matching:
            instead.append(f"{other}={'/'.join(sorted({row[other] for row in elsewhere})[:3])}")
        elsewhere = matching or elsewhere
    if instead:
        text += f"; {axis}={value} is held with {' '.join(instead)}"
    return NotInReport(text)


def select(cells: list[Row], setup: dict[str, str | None], answering: bool = True) -> list[Row]:
    """The rows holding each value `setup` names, of every model (the examples' and a user's too) unless it names
    one. `answering` one question: the release left None is the newest, an axis outside `OPEN_AXES` left None must
    hold one value; else (a listing) None leaves any axis open. A value the rows do not hold raises NotInReport."""
    rows = cells
    named: dict[str, str] = {}
    for axis in SETUP_AXES:
        held = sorted({row[axis] for row in rows})
        value = setup.get(axis)
        if value is None and answering and axis == "release":
            value = newest(held)
        elif value is None and (not answering or axis in OPEN_AXES or len(held) == 1):
            continue
        elif value is None:
            raise NotInReport(f"{describe(named)} has several {axis}s ({', '.join(held)}): name one with --{axis}")
        if value not in held:
            raise _not_held(cells, rows, axis, value, named)
        rows = [row for row in rows if row[axis] == value]
        named[axis] = value
    return rows


def held(rows: list[Row]) -> dict[str, dict[str, list[str]]]:
    """Per axis, the values the rows hold, per owner value where `LISTED_PER` has one (a model's freeze patterns);
    releases newest first: what `advise` lists."""
    found: dict[str, dict[str, list[str]]] = {}
    for axis in SETUP_AXES:
        owner = LISTED_PER.get(axis)
        grouped: dict[str, set[str]] = defaultdict(set)
        for row in rows:
            grouped[row[owner] if owner else ""].add(row[axis])
        order = (lambda value: tuple(-part for part in release_key(value))) if axis == "release" else None
        found[axis] = {key: sorted(values, key=order) for key, values in sorted(grouped.items())}
    return found
