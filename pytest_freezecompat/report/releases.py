"""The same cell across a framework's releases: which cells change status between releases, and where.

Pure: report rows (and the bisections `freezecompat bisect` recorded) in, the table both reports render out.
A change between two releases the matrix ran is placed as the runs allow: "fixed in 0.24.0" where a bisection
found the first release with the new status, else "fixed after 0.23.5, by 0.32.1" (the runs say no more). What
broke comes first: a step is named by what it does to the user (`verdict.severity`), so refused -> silent is
"worse", not merely "changed".
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

from packaging.version import InvalidVersion, Version

from ..core.cell import CellKey
from ..core.names import HARMFUL, SEVERITIES
from ..core.records import FAILING, display_status
from ..verdict.severity import recorded


@dataclass(frozen=True)
class Change:
    """One cell (its id without the release) whose status differs across releases."""

    cell: str
    statuses: dict[str, str]  # release -> displayed status (`known`, `fixed?`, or the raw one)
    label: str  # "fixed in 0.24.0", "broke after 2.7.1, by 2.13.0", ...
    known_issue: str | None  # the registry entry on the red side, if any
    #: A step to a newer release made it worse for the user (broke, or a harm turned worse, e.g. refused -> silent).
    regression: bool = False


@dataclass(frozen=True)
class FrameworkReleases:
    framework: str
    releases: list[str]  # oldest first
    cells: int  # cells run on every release
    changes: list[Change]


def release_order(release: str) -> tuple[int, Version | str]:
    """Sort key for releases: versions as versions (2.13.0 after 2.9.0), anything unparsable after them."""
    try:
        return 0, Version(release)
    except InvalidVersion:
        return 1, release


def red(status: str) -> bool:
    return status in (*FAILING, "known")


def _verb(old: str, new: str) -> str:
    """What a step from severity `old` to `new` does to the user (nothing is claimed across an unproven side: a
    release whose deciding check did not run neither broke nor fixed anything by the runs)."""
    if "unproven" in (old, new):
        return "changed (one side unproven)"
    if (old in HARMFUL) != (new in HARMFUL):
        return "broke" if new in HARMFUL else "fixed"
    if old in HARMFUL and old != new:
        return "worse" if SEVERITIES.index(new) < SEVERITIES.index(old) else "better"
    return "changed"


def _label(before: tuple[str, str], after: tuple[str, str], bisected: str | None) -> str:
    (older, old_severity), (newer, new_severity) = before, after
    verb = _verb(old_severity, new_severity)
    return f"{verb} in {bisected} (bisected)" if bisected else f"{verb} after {older}, by {newer}"


def first_changed(bisections: Iterable[dict[str, Any]], cell: str) -> str | None:
    """The release a recorded bisection found for this cell (its id without the release), if any."""
    for found in bisections:
        if cell in found.get("cells", ()) and found.get("first_changed"):
            return str(found["first_changed"])
    return None


def across_releases(cells: Iterable[dict[str, Any]], bisections: Iterable[dict[str, Any]] = ()
                    ) -> list[FrameworkReleases]:
    """Per framework run on two or more releases: the cells whose displayed status differs between them, what broke
    or got worse first (a fix or a break where red turns safe or back, "worse" / "better" where one harm becomes
    another, "changed" where it fails another way to the same effect: `known` -> `error`)."""
    bisections = list(bisections)
    by_framework: dict[str, dict[str, dict[str, dict[str, Any]]]] = {}
    for row in cells:
        if not row.get("release"):
            continue
        same = CellKey.parse(row["id"]).across_releases
        by_framework.setdefault(row["framework"], {}).setdefault(same, {})[row["release"]] = row
    tables = []
    for framework, rows in by_framework.items():
        releases = sorted({r for per in rows.values() for r in per}, key=release_order)
        if len(releases) < 2:
            continue
        changes = []
        common = 0
        for same, per in sorted(rows.items()):
            statuses = {r: display_status(per[r]) for r in releases if r in per and per[r]["status"] != "skip"}
            common += len(statuses) == len(releases)
            ordered = [(r, statuses[r]) for r in releases if r in statuses]
            harm = {r: recorded(per[r]) for r in statuses}
            steps = [((a, harm[a]), (b, harm[b])) for (a, was), (b, now) in pairwise(ordered) if was != now]
            if not steps:
                continue
            bisected = first_changed(bisections, same)
            label = "; ".join(_label(a, b, bisected if len(steps) == 1 else None) for a, b in steps)
            known = next((per[r]["known_issue"]["id"] for r, s in ordered
                          if red(s) and (per[r].get("known_issue") or {}).get("id")), None)
            regression = any(_verb(a[1], b[1]) in ("broke", "worse") for a, b in steps)
            changes.append(Change(same, statuses, label, known, regression))
        changes.sort(key=lambda change: not change.regression)  # stable: by cell within each group
        tables.append(FrameworkReleases(framework, releases, common, changes))
    return tables
