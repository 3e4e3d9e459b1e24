"""What one new release changed: its cells against the published cells of its framework's newest environment.

The release watch (`spec.watch`) finds the release and where it runs; here its cells are judged with `report.diff`
(a new column's cells matched across releases, a bumped pin's by id) and rendered as the page a pull request
carries, regressions first.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..core.candidate import Candidate
from ..core.names import SEVERITIES
from ..verdict.severity import recorded
from . import diff


@dataclass(frozen=True)
class Judgement:
    candidate: Candidate
    changes: list[diff.Change]
    before: dict[str, int]  # severity -> cells, the base environment's published cells
    after: dict[str, int]   # the same for the candidate's

    @property
    def regressions(self) -> list[diff.Change]:
        return [c for c in self.changes if c.regression]


def _severities(cells: list[dict[str, Any]]) -> dict[str, int]:
    counts = dict.fromkeys(SEVERITIES, 0)
    for cell in cells:
        counts[recorded(cell)] = counts.get(recorded(cell), 0) + 1
    return {k: v for k, v in counts.items() if v}


def judge(candidate: Candidate, published: Mapping[str, Any], ran: Mapping[str, Any]) -> Judgement:
    """The candidate's cells against the published cells of its base environment: `report.diff`'s changes, each
    cell matched across releases for a new column."""
    base_cells = [c for c in published["cells"] if c.get("environment") == candidate.base
                  and c.get("framework") == candidate.framework]
    new_cells = [c for c in ran["cells"] if c.get("environment") == candidate.environment
                 and c.get("framework") == candidate.framework]
    changes = diff.diff({"cells": base_cells}, {"cells": new_cells})
    return Judgement(candidate, changes, _severities(base_cells), _severities(new_cells))


def render(judgement: Judgement) -> str:
    """The watch's report of one release: what it is, what ran, what changed, regressions first."""
    c = judgement.candidate
    how = (f"a new release column, environment `{c.environment}` (`{' | '.join(c.install)}`)" if c.column else
           f"`{c.package}=={c.held}` bumped to `{c.version}` in environment `{c.environment}`")
    counts = " · ".join(f"{k} {judgement.before.get(k, 0)} → {judgement.after.get(k, 0)}"
                        for k in dict.fromkeys([*judgement.before, *judgement.after]))
    regressions = judgement.regressions
    lines = [f"# {c.framework}: {c.title} (the matrix held {c.held})", "",
             f"Tested as {how}; compared with the published cells of `{c.base}`.", "",
             f"Cells by severity, {c.held} → {c.version}: {counts}.", "",
             f"**{len(regressions)} regression(s)**, {len(judgement.changes) - len(regressions)} other change(s)."]
    if judgement.changes:
        lines += ["", "```", *(change.line() for change in judgement.changes), "```"]
    return "\n".join(lines) + "\n"
