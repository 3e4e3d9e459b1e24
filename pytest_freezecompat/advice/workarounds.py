"""Workarounds, proved by the run: each red cell an entry explains leads, through each of the entry's workarounds,
to another cell of the report; the workaround holds there if that cell's weights are right (`ok`; or, said apart,
`differs`: right under another correct loop, or `costly`: right, at a cost in memory or compute).

An entry's workarounds are another value of an axis (`change`), or its `fixed_in` release. A cell it leads to that
is red for *another* entry's reason does not break it (it avoided this issue and met another: the user needs both
fixes, and that cell names the second); one red for this entry's reason, or unexplained, or costly, does. Per
release (environment) of the cells it is for: `verified` where some cell it leads to holds and none breaks it
(`qualified` where some hold only under another correct loop or at a cost), `broken` where none holds and some break it,
`partly` where both, `blocked` where every cell it leads to meets another issue, `unproven` where the report holds
none of them (not run, skipped) or only cells a deciding check did not run on (severity `unproven`).
Rows are report rows as `report.schema.load` gives them; everything here is pure.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..core.names import KEY_AXES
from .nearest import Row, newest, release_key, severity

#: Where a workaround's cell is judged: the one state per (entry, workaround, release), from its cells' states.
STATES = ("verified", "qualified", "partly", "broken", "blocked", "unproven")
#: A proving cell holds where the weights are right: `ok`, `differs` (only what reaches no weight differs from the
#: canonical loop) or `costly` (the optimizer pays for frozen params): the last two qualify it, and are said.
HOLDING = ("ok", "differs", "costly")


@dataclass(frozen=True)
class Proof:
    """One red cell of an entry, one of the entry's workarounds, and the cell it leads to (None: not in the report)."""

    entry: str
    workaround: str
    says: str
    cell: str
    release: str
    proof: str | None
    holds: bool | None  # None: no cell to judge
    severity: str | None = None  # the proving cell's: `differs` / `costly` qualify a hold
    blocked_by: str | None = None  # the other entry that explains the red cell it leads to


#: What a workaround did on one red cell, in the words `advise` and the HTML panel both use (`outcome`).
OUTCOMES = {"holds": "holds here",
            "another loop": "holds here under another correct loop (differs)",
            "at a cost": "holds here at a cost (costly: right weights, but frozen params in the optimizer or grads no "
                         "optimizer steps)",
            "blocked": "avoids this issue, but meets {blocked_by} there",
            "broken": "does NOT hold here",
            "unproved": "not proved here (the matrix has no such cell)",
            "unproven": "not proved here (that cell is unproven: a check that decides it did not run there)"}


def outcome(proof: dict[str, Any]) -> str:
    """A cell's workaround as annotated (`advice.annotate`), as a sentence from `OUTCOMES`."""
    if proof.get("blocked_by"):
        return OUTCOMES["blocked"].format(blocked_by=proof["blocked_by"])
    if proof["holds"] is None and proof.get("severity") == "unproven":
        return OUTCOMES["unproven"]
    if proof["holds"] is None:
        return OUTCOMES["unproved"]
    if not proof["holds"]:
        return OUTCOMES["broken"]
    return OUTCOMES[{"differs": "another loop", "costly": "at a cost"}.get(proof.get("severity") or "", "holds")]


def label(workaround: dict[str, Any]) -> str:
    """`plugin=fsdp2` or `release>=0.24.0`: a workaround's name in tables and in `advise`."""
    return ", ".join(f"{axis}={value}" for axis, value in sorted(workaround["change"].items()))


def of_entry(known: dict[str, Any], framework: str) -> list[dict[str, Any]]:
    """An explaining entry's workarounds as report rows carry them, its fixed-in release (this framework's) last."""
    found = [{**item, "label": label(item)} for item in known.get("workarounds") or []]
    fixed = (known.get("fixed_in") or {}).get(framework)
    if fixed:
        found.append({"change": {"release": fixed}, "says": f"upgrade {framework} to {fixed} or later",
                      "label": f"release>={fixed}"})
    return found


def _key(row: Row, **change: str) -> tuple[str, ...]:
    return tuple(change.get(axis, row[axis]) for axis in KEY_AXES)


def applies(row: Row, workaround: dict[str, Any], held: dict[tuple[str, str], set[str]]) -> bool:
    """Whether the row's framework has the values a workaround changes to (an entry spanning frameworks names each
    one's plugin): a workaround for another framework's cells is no alternative here, proved or not; nor is one the
    cell already follows (it changes nothing)."""
    if all(row[axis] == value for axis, value in workaround["change"].items()):
        return False
    return all(value in held[(row["framework"], axis)] for axis, value in workaround["change"].items()
               if axis != "release")


def _target(row: Row, workaround: dict[str, Any], releases: dict[str, list[str]]) -> tuple[str, ...] | None:
    """The cell a workaround leads to: the change applied; a fixed-in release is the newest held at or after it."""
    change = dict(workaround["change"])
    if "release" in change:
        later = [r for r in releases.get(row["framework"], []) if release_key(r) >= release_key(change["release"])]
        if not later:
            return None
        change["release"] = newest(later)
    return _key(row, **change)


def proofs(cells: list[Row]) -> list[Proof]:
    """Every (explained red cell, workaround) pair of the report, and how the cell it leads to ended."""
    by_key = {_key(row): row for row in cells}
    held: dict[tuple[str, str], set[str]] = defaultdict(set)
    for row in cells:
        for axis in KEY_AXES:
            held[(row["framework"], axis)].add(row[axis])
    releases = {framework: sorted(values) for (framework, axis), values in held.items() if axis == "release"}
    found = []
    for row in cells:
        known = row.get("known_issue") or {}
        if not known.get("expected") or severity(row) not in ("silent", "refused"):
            continue
        for workaround in of_entry(known, row["framework"]):
            if not applies(row, workaround, held):
                continue
            target = _target(row, workaround, releases)
            proof = by_key.get(target) if target else None
            if proof is not None and severity(proof) == "skipped":
                proof = None
            other = (proof.get("known_issue") or {}) if proof else {}
            blocked = (other["id"] if proof and severity(proof) in ("silent", "refused") and other.get("expected")
                       and other["id"] != known["id"] else None)
            judged = proof is not None and severity(proof) != "unproven"  # it ran, but what decides did not
            found.append(Proof(known["id"], workaround["label"], workaround["says"], row["id"],
                               f"{row['framework']}@{row['release']}", proof["id"] if proof else None,
                               severity(proof) in HOLDING if proof and judged else None,
                               severity(proof) if proof else None, blocked))
    return found


def state(holds: list[bool | None], severities: Sequence[str | None] = (),
          blocked: Sequence[str | None] = ()) -> str:
    """One release's state from its cells' (`STATES`): holds per cell, the proving cells' severities, and the other
    entry each blocked one met."""
    others = [bool(b) for b in blocked] or [False] * len(holds)
    held = sum(h is True for h in holds)
    broken = sum(h is False and not other for h, other in zip(holds, others, strict=True))
    if held and not broken:
        return "qualified" if {"differs", "costly"} & set(severities) else "verified"
    if held:
        return "partly"
    if broken:
        return "broken"
    return "blocked" if any(others) else "unproven"


def summary(found: list[Proof]) -> list[dict[str, Any]]:
    """Per entry, workaround and release (from `proofs`): what it says, its state, how many cells held / not / met
    another issue / could not be judged, and up to three proving cells (holding ones first): what the report's
    `workarounds` table holds."""
    grouped: dict[tuple[str, str, str], list[Proof]] = defaultdict(list)
    for proof in found:
        grouped[(proof.entry, proof.workaround, proof.release)].append(proof)
    table = []
    for (entry, workaround, release), group in sorted(grouped.items()):
        holds = [p.holds for p in group]
        proving = sorted({p.proof for p in group if p.proof}, key=lambda i: (not any(
            p.proof == i and p.holds for p in group), i))
        table.append({"entry": entry, "workaround": workaround, "release": release, "says": group[0].says,
                      "state": state(holds, [p.severity for p in group], [p.blocked_by for p in group]),
                      "held": holds.count(True), "not_held": sum(p.holds is False and not p.blocked_by for p in group),
                      "blocked": sum(bool(p.blocked_by) for p in group), "unjudged": holds.count(None),
                      "cells": len(group), "proof": proving[:3]})
    return table
