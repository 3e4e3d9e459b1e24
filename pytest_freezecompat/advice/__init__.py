"""Advice over a report's rows: the nearest safe setup of each red cell, and each known issue's workarounds proved
by the run. Pure functions of the rows; imports no process code."""

from __future__ import annotations

from typing import Any

from ..core.records import with_later_axes
from . import nearest, workarounds


def annotate(report: dict[str, Any], limit: int = 2) -> dict[str, Any]:
    """In place: each red cell's `instead` (its `limit` nearest safe setups; [] says there is none in the report),
    each explained red cell's `workarounds` (its entry's, each with the cell it leads to and whether that cell is
    ok), and the report's `workarounds` table (`workarounds.summary`). Every written report carries them."""
    for cell in report["cells"]:  # rows written before an axis existed read at its one value then
        with_later_axes(cell)
    safe = nearest.safe_by_group(report["cells"])
    found = workarounds.proofs(report["cells"])
    proofs: dict[str, list[dict[str, Any]]] = {}
    for proof in found:
        proofs.setdefault(proof.cell, []).append({"workaround": proof.workaround, "says": proof.says,
                                                  "proof": proof.proof, "holds": proof.holds,
                                                  "severity": proof.severity, "blocked_by": proof.blocked_by})
    for cell in report["cells"]:
        cell.pop("instead", None)
        cell.pop("workarounds", None)
        if cell["id"] in proofs:
            cell["workarounds"] = proofs[cell["id"]]
        if nearest.severity(cell) not in nearest.RED:
            continue
        cell["instead"] = [{"cell": found.cell, "severity": found.severity,
                            "changes": [list(change) for change in found.changes]}
                           for found in nearest.nearest_safe(cell, safe[nearest.group(cell)], limit)]
    report["workarounds"] = workarounds.summary(found)
    return report
