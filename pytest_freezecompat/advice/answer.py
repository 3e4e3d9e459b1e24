"""One setup's answer, as `freezecompat advise` prints it: the verdict, why, the entry that explains it (fixed in),
what its workarounds do on this very cell, and the nearest safe setups. Lines of text from an annotated report."""

from __future__ import annotations

from collections import Counter

from ..core.names import SEVERITIES, SEVERITY_MEANING
from .nearest import RED, SAFE, Row, severity
from .workarounds import outcome

#: A terminal line: longer messages are cut, matrix.json has them whole.
WIDTH = 160


def _cut(text: str) -> str:
    return text if len(text) <= WIDTH else text[:WIDTH - 4] + " ..."


def why(cell: Row) -> str:
    """The first failing step of a cell's message (steps are joined by " | "), one line."""
    return cell["message"].strip().splitlines()[0].split(" | ")[0] if cell["message"].strip() else ""


def change_text(changes: list[list[str]] | tuple[tuple[str, str, str], ...]) -> str:
    return ", ".join(f"{axis} {old or '-'} -> {new}" for axis, old, new in changes)


def lines(cell: Row) -> list[str]:
    """What `advise` prints for one cell of an annotated report (`advice.annotate`)."""
    verdict = severity(cell)
    out = [f"{cell['id']}: {verdict.upper()} ({cell['status']}): {SEVERITY_MEANING[verdict]}"]
    if why(cell):
        out.append(f"  why         {_cut(why(cell))}")
    known = cell.get("known_issue") or {}
    if known.get("expected"):
        kind = "finding" if known.get("kind") == "finding" else "upstream"
        pointer = (known.get("links") or [known.get("link") or known.get("reproducer")])[0]
        fixed = ", ".join(f"{framework} {release}" for framework, release in (known.get("fixed_in") or {}).items())
        out.append(f"  known       {known['id']} ({kind})" + (f" {pointer}" if pointer else ""))
        out.append(f"  fixed in    {fixed or 'no release yet'}")
        if known.get("no_workaround"):
            out.append(f"  workaround  none known: {_cut(known['no_workaround'])}")
    elif verdict in RED:
        out.append("  known       no known issue or finding explains it")
    if verdict in SAFE:
        return out
    for index, proof in enumerate(cell.get("workarounds") or []):
        state = outcome(proof)
        where = f": {proof['proof']}" if proof.get("proof") else ""
        out.append(f"  {'workaround' if index == 0 else '':10}  {proof['workaround']} ({proof['says']}): "
                   f"{state}{where}")
    alternatives = cell.get("instead")
    if alternatives and len(alternatives[0]["changes"]) > 1:  # said outright: one change will not do
        out.append(f"  instead     no safe setup one change away; the nearest take {len(alternatives[0]['changes'])}:")
    for index, found in enumerate(alternatives or []):
        out.append(f"  {'instead' if index == 0 and len(found['changes']) == 1 else '':10}  "
                   f"{change_text(found['changes'])}: {found['cell']} ({found['severity']})")
    if alternatives == []:
        out.append(f"  instead     no safe setup of {cell['model']} with {cell['freeze']} frozen on "
                   f"{cell['framework']} in this report")
    return out


def worst_first(cell: Row) -> tuple[int, str]:
    return SEVERITIES.index(severity(cell)), cell["id"]


def overview(cells: list[Row]) -> str:
    """One line over the setups of one question: how many of each severity, and what the bad ones share."""
    counts = Counter(severity(cell) for cell in cells)
    bad = [cell for cell in cells if severity(cell) in RED]
    shared = [f"{axis}={next(iter(values))}" for axis in ("checkpoint", "init", "clip")
              if len(values := {cell[axis] for cell in bad}) == 1 and len({cell[axis] for cell in cells}) > 1]
    first = cells[0]
    tally = ", ".join(f"{n} {name}" for name, n in sorted(counts.items(), key=lambda item: SEVERITIES.index(item[0])))
    return (f"{first['framework']} {first['release']} · {first['plugin']} · freeze {first['freeze']}: "
            f"{len(cells)} setups: {tally}" + (f"; the bad ones all have {', '.join(shared)}" if shared else "")
            + ("; each bad one below" if bad else "; every one is safe" if counts.keys() <= set(SAFE) else ""))


def setup(cell: Row) -> str:
    """What tells a cell from the others of its question: `checkpoint=none init=lazy clip=no-clip`."""
    return " ".join(f"{axis}={cell[axis]}" for axis in ("checkpoint", "init", "clip"))


def alike(cells: list[Row]) -> list[list[Row]]:
    """Bad cells that go wrong the same way (severity and explaining entry), worst first: `advise` shows one of each
    in full and names the setups of the rest."""
    groups: dict[tuple[str, str], list[Row]] = {}
    for cell in sorted(cells, key=worst_first):
        known = cell.get("known_issue") or {}
        how = known.get("id", "") if known.get("expected") else why(cell)
        groups.setdefault((severity(cell), how), []).append(cell)
    return list(groups.values())
