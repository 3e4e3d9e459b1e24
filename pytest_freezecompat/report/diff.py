"""`freezecompat diff OLD.json NEW.json`: what changed between two runs, regressions first.

A regression is what a nightly job must fail on: a cell that passed and now does not (a failure a
known issue explains included: a release broke it), a cell a known issue explained whose failure
that issue no longer explains, or a cell missing from the new report. Everything else that changed
(a fix, a failure that changed form, a new cell) is listed after them and does not fail the job. A cell whose
raw status held but whose severity or cause changed (a verdict rule, a check that now runs or no longer does) is
listed too, with both: a severity that turns harmful (`costly` -> `silent`) is a regression.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from packaging.version import InvalidVersion, Version

from ..core.cell import CellKey
from ..core.names import HARMFUL, not_checked
from ..core.records import display_status
from ..verdict.severity import recorded

MESSAGE_CHARS = 160


@dataclass(frozen=True)
class Change:
    id: str
    old: str | None  # display status (`known`, `fixed?` or the raw status); None: not in that report
    new: str | None
    regression: bool
    why: str
    detail: str

    def line(self) -> str:
        kind = "REGRESSION" if self.regression else ("added" if self.old is None else "changed")
        text = f"{kind:<10} {self.id}: {self.old or '(absent)'} -> {self.new or '(absent)'} ({self.why})"
        return text + (f": {self.detail}" if self.detail else "")


def _label(cell: dict[str, Any]) -> str:
    shown = display_status(cell)
    if shown in ("known", "fixed?"):
        return f"{shown} {cell['known_issue']['id']} ({cell['status']})"
    return shown


def _detail(cell: dict[str, Any]) -> str:
    text = (f"[{cell['check']}] " if cell.get("check") else "") + " ".join((cell.get("message") or "").split())
    return text if len(text) <= MESSAGE_CHARS else text[:MESSAGE_CHARS] + "…"


def _compare(old: dict[str, Any], new: dict[str, Any]) -> Change | None:
    before, after = display_status(old), display_status(new)
    known_before = old["known_issue"]["id"] if before in ("known", "fixed?") else None
    known_after = new["known_issue"]["id"] if after in ("known", "fixed?") else None
    if before == after and old["status"] == new["status"] and known_before == known_after:
        return _judged_otherwise(old, new)
    detail = _detail(new)
    if old["status"] == "pass" and new["status"] != "pass":
        return Change(new["id"], _label(old), _label(new), True, "passed, now does not", detail)
    if before == "known" and after != "known" and new["status"] != "pass":
        return Change(new["id"], _label(old), _label(new), True, f"known issue {known_before} no longer explains "
                      "its failure", detail)
    if new["status"] == "pass":
        if after == "fixed?":
            why = "fixed? a known issue expects it to fail"
        else:
            why = "now passes" if old["status"] != "pass" else "no known issue expects it to fail any more"
    elif old["status"] == new["status"]:
        why = "explained by another known issue" if known_before else "now explained by a known issue"
    else:
        why = "status changed"
    return Change(new["id"], _label(old), _label(new), False, why, detail)


def _judged_otherwise(old: dict[str, Any], new: dict[str, Any]) -> Change | None:
    """The same raw status, judged otherwise: its severity or its cause changed."""
    was, now = recorded(old), recorded(new)
    parts = [f"severity {was} -> {now}"] if was != now else []
    if old.get("cause") != new.get("cause"):
        parts.append(f"cause {old.get('cause') or 'none'} -> {new.get('cause') or 'none'}")
    if not parts:
        return None
    unchecked = not_checked(new.get("unchecked") or ())
    detail = f"not checked: {'; '.join(unchecked)}" if now == "unproven" and unchecked else _detail(new)
    return Change(new["id"], _label(old), _label(new), now in HARMFUL and was not in HARMFUL, ", ".join(parts),
                  detail)


def _newest(cells: list[dict[str, Any]]) -> dict[str, Any]:
    def version(cell: dict[str, Any]) -> tuple[int, Version | str]:
        try:
            return 1, Version(cell.get("release") or "")
        except InvalidVersion:
            return 0, cell.get("release") or ""
    return max(cells, key=version)


def moved_releases(before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]]) -> dict[str, str]:
    """Old id -> new id, for a cell whose framework moved to another release (or whose old report recorded none):
    the same cell, so a nightly that bumps a pin still sees what the bump broke. The newest new release is taken."""
    unmatched: dict[str, list[dict[str, Any]]] = {}
    for cell_id, cell in after.items():
        if cell_id not in before:
            unmatched.setdefault(CellKey.parse(cell_id).across_releases, []).append(cell)
    moved = {}
    for cell_id in before.keys() - after.keys():
        candidates = unmatched.get(CellKey.parse(cell_id).across_releases)
        if candidates:
            moved[cell_id] = _newest(candidates)["id"]
    return moved


def diff(old: dict[str, Any], new: dict[str, Any]) -> list[Change]:
    """Every cell whose status changed, regressions first (each group by cell id)."""
    before = {c["id"]: c for c in old["cells"]}
    after = {c["id"]: c for c in new["cells"]}
    moved = moved_releases(before, after)
    changes = [Change(i, _label(c), None, True, "missing from the new report", "")
               for i, c in before.items() if i not in after and i not in moved]
    changes += [Change(i, None, _label(c), False, "new cell", _detail(c)) for i, c in after.items()
                if i not in before and i not in moved.values()]
    changes += [found for i in before.keys() & after.keys() if (found := _compare(before[i], after[i]))]
    for old_id, new_id in moved.items():
        found = _compare(before[old_id], after[new_id])
        if found:
            was = before[old_id].get("release") or "an unrecorded release"
            changes.append(dataclasses.replace(found, why=f"{found.why}; was {old_id} ({was})"))
    return sorted(changes, key=lambda c: (not c.regression, c.old is None, c.id))


def render(changes: list[Change], old_name: str, new_name: str, cells: int) -> str:
    regressions = sum(c.regression for c in changes)
    lines = [c.line() for c in changes]
    lines.append(f"{regressions} regression(s), {len(changes) - regressions} other change(s) over {cells} cells "
                 f"({old_name} -> {new_name})")
    return "\n".join(lines) + "\n"
