"""Which axes a framework's save -> load round trip depends on, read off a report: the evidence for `[round_trip]`.

    python benchmarks/round_trip_axes.py reports/matrix.json

Run it on a report whose cells each ran their own round trip (`--freeze-matrix-every-round-trip`, or a report from
before round trips were shared; cells that cite another's are left out). For each framework, axis and pair of that
axis's values it counts the groups (every other axis fixed, release included) where both cells judged a round trip,
and how many of them gave the same result: held, or failed the same way (raised or differed, naming the same kind
of params). Then each class the matrix files declare, with the groups where its values disagree (the cells named):
a class is sound where there are none, or where they are a cell that flips between runs of itself. Cells an
`own_round_trip` rule keeps apart are left out of their class's check, as the planner leaves them out of its group.
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from pytest_freezecompat.core.cell import CellKey
from pytest_freezecompat.spec import matrix as spec
from pytest_freezecompat.spec.plan import rule_matches

AXES = ("model", "framework", "release", "plugin", "init", "checkpoint", "freeze", "clip")


def result(cell: dict[str, Any]) -> tuple[Any, ...] | None:
    """What the cell's round trip found, at the grain that decides its status and severity; None: none judged."""
    if cell.get("round_trip_of"):
        return None
    failed = [f for f in cell.get("failures") or () if f["check"] == "resume"]
    if failed:
        return ("raised" if failed[0].get("raised") else "differs", failed[0].get("params_kind"),
                failed[0].get("on_held_params"))
    return ("held",) if cell["status"] in ("pass", "fail") and cell.get("resume_api") else None


def groups(cells: list[dict[str, Any]], axis: str) -> dict[str, list[dict[str, tuple[str, tuple[Any, ...]]]]]:
    """framework -> its groups (every axis but `axis` fixed): `axis` value -> (cell id, round-trip result)."""
    found: dict[str, dict[tuple[str, ...], dict[str, tuple[str, tuple[Any, ...]]]]] = defaultdict(dict)
    for cell in cells:
        if (judged := result(cell)) is not None:
            key = tuple(cell.get(a, "") for a in AXES if a != axis)
            found[cell["framework"]].setdefault(key, {})[cell[axis]] = (cell["id"], judged)
    return {fw: list(by_key.values()) for fw, by_key in found.items()}


def kept_apart(cells: list[dict[str, Any]], frameworks: dict[str, spec.Framework]) -> set[str]:
    """Ids of the cells an `own_round_trip` rule keeps out of their class: the planner never shares theirs."""
    apart = set()
    for cell in cells:
        fw = frameworks.get(cell["framework"])
        key = CellKey(**{a: cell[a] for a in AXES})
        if fw and any("own_round_trip" in r.effects and rule_matches(r, key, cell.get("device") or "cpu")
                      for r in fw.rules):
            apart.add(cell["id"])
    return apart


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("report", type=Path)
    args = parser.parse_args()
    cells = json.loads(args.report.read_text())["cells"]
    frameworks = spec.load().frameworks
    apart_ids = kept_apart(cells, frameworks)
    for axis in spec.ROUND_TRIP_AXES:
        print(f"## {axis}\n\n| framework | values | same result / groups |\n|---|---|---:|")
        by_framework = groups(cells, axis)
        for fw, found in sorted(by_framework.items()):
            values = sorted({v for group in found for v in group})
            for a, b in itertools.combinations(values, 2):
                both = [g for g in found if a in g and b in g]
                same = sum(g[a][1] == g[b][1] for g in both)
                print(f"| {fw} | {a} = {b} | {same} / {len(both)} |")
        print()
        for fw, found in sorted(by_framework.items()):
            for shared in frameworks[fw].round_trip.get(axis, ()) if fw in frameworks else ():
                apart = [g for g in found if len({g[v][1] for v in shared if v in g and g[v][0] not in apart_ids}) > 1]
                print(f"declared {fw} {axis} {' = '.join(shared)}: {len(apart)} group(s) disagree")
                for group in apart[:6]:
                    print("    " + "; ".join(f"{group[v][0]}: {' '.join(map(str, group[v][1]))}"
                                            for v in shared if v in group and group[v][0] not in apart_ids))
        print()


if __name__ == "__main__":
    main()
