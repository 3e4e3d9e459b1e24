"""One setup's answer, as `freezecompat advise` prints it: the verdict, why, the entry that explains it (fixed in),
what its workarounds do on this very cell, and the nearest safe setups; or, for a question not yet narrowed to one
setup, the values the report holds. Lines of text from an annotated report."""

from __future__ import annotations

import textwrap
from collections import Counter

from ..core.names import SEVERITIES, SEVERITY_MEANING, cpu_only, fixed_in_words, kind_words, not_checked
from .nearest import RED, SAFE, Row, describe, held, severity
from .workarounds import outcome

#: A terminal line: longer texts wrap onto lines of their own, indented under their label.
WIDTH = 120
#: The axes that tell the setups of one question apart (`setup`), the model first where a question spans several.
VARYING_AXES = ("model", "checkpoint", "init", "clip")


def _wrapped(label: str, text: str) -> list[str]:
    """`  why         text...` wrapped at `WIDTH`, whole: a reader must never be handed half a reason."""
    return textwrap.wrap(text, WIDTH, initial_indent=f"  {label:10}  ", subsequent_indent=" " * 14,
                         break_long_words=False, break_on_hyphens=False)


def why(cell: Row) -> str:
    """The first failing step of a cell's message (steps are joined by " | "), one line."""
    return cell["message"].strip().splitlines()[0].split(" | ")[0] if cell["message"].strip() else ""


def change_text(changes: list[list[str]] | tuple[tuple[str, str, str], ...]) -> str:
    return ", ".join(f"{axis} {old or '-'} -> {new}" for axis, old, new in changes)


def lines(cell: Row) -> list[str]:
    """What `advise` prints for one cell of an annotated report (`advice.annotate`)."""
    verdict = severity(cell)
    on_resume = " on resume" if verdict in RED and cell.get("check") == "resume" else ""
    out = [f"{cell['id']}: {verdict.upper()}{on_resume} ({cell['status']}): {SEVERITY_MEANING[verdict]}"]
    out += [f"  not checked {what}" for what in not_checked(cell.get("unchecked") or ())]
    if why(cell):
        out += _wrapped("why", why(cell))
    known = cell.get("known_issue") or {}
    if known.get("expected"):
        pointer = (known.get("links") or [known.get("link") or known.get("reproducer")])[0]
        out.append(f"  known       {known['id']} ({kind_words(known, upstream='upstream')})"
                   + (f" {pointer}" if pointer else ""))
        out.append(f"  fixed in    {fixed_in_words(known) or 'no release yet'}")
        if cpu_only(known):
            out += _wrapped("where", f"{cpu_only(known)}; the workarounds below are for CPU runs")
        if known.get("no_workaround"):
            out += _wrapped("workaround", f"none known: {known['no_workaround']}")
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
    """One line over the setups of one question: its model(s), how many of each severity, what the bad ones share."""
    counts = Counter(severity(cell) for cell in cells)
    bad = [cell for cell in cells if severity(cell) in RED]
    shared = [f"{axis}={next(iter(values))}" for axis in VARYING_AXES
              if len(values := {cell[axis] for cell in bad}) == 1 and len({cell[axis] for cell in cells}) > 1]
    first = cells[0]
    models = sorted({cell["model"] for cell in cells})
    tally = ", ".join(f"{n} {name}" for name, n in sorted(counts.items(), key=lambda item: SEVERITIES.index(item[0])))
    ending = ("each bad one below" if bad else "every one is safe" if counts.keys() <= set(SAFE)
              else "each one not safe below")
    return (f"{first['framework']} {first['release']} · {first['plugin']} · freeze {first['freeze']} · "
            f"model{'s' if len(models) > 1 else ''} {', '.join(models)}: {len(cells)} setups: {tally}"
            + (f"; the bad ones all have {', '.join(shared)}" if shared else "") + f"; {ending}")


def setup(cell: Row, axes: tuple[str, ...]) -> str:
    """What tells a cell from the others of its question: `checkpoint=none init=lazy clip=no-clip`."""
    return " ".join(f"{axis}={cell[axis]}" for axis in axes)


def alike(cells: list[Row]) -> list[list[Row]]:
    """Cells that go wrong the same way (severity and explaining entry, or what went unchecked), worst first: `advise`
    shows one of each in full and names the setups of the rest."""
    groups: dict[tuple[str, str], list[Row]] = {}
    for cell in sorted(cells, key=worst_first):
        known = cell.get("known_issue") or {}
        how = known.get("id", "") if known.get("expected") else why(cell) or " ".join(cell.get("unchecked") or [])
        groups.setdefault((severity(cell), how), []).append(cell)
    return list(groups.values())


def answer(cells: list[Row]) -> list[str]:
    """What `advise` prints for the setups of one question (`nearest.select`): one setup in full; else the overview,
    then one of each way of not being safe in full and the setups of the rest of its kind."""
    if len(cells) == 1:
        return lines(cells[0])
    axes = tuple(axis for axis in VARYING_AXES if len({cell[axis] for cell in cells}) > 1)
    out = [overview(cells)]
    for group in alike([cell for cell in cells if severity(cell) not in SAFE]):
        out += lines(group[0])
        if len(group) > 1:
            out.append(f"  same in     {', '.join(setup(cell, axes) for cell in group[1:])}")
    return out


def listing(rows: list[Row], named: dict[str, str]) -> list[str]:
    """The values the rows hold per axis (a framework's releases and plugins, a model's freeze patterns apart where
    there are several): what `advise` prints for a question that names no single setup yet."""
    out = [f"{describe(named) or 'the report'} holds (name --framework, --plugin and --freeze to ask about one setup; "
           "--release, --model, --checkpoint, --init, --clip narrow it):"]
    for axis, per_owner in held(rows).items():
        if len(per_owner) == 1:
            text = ", ".join(next(iter(per_owner.values())))
        else:
            text = " · ".join(f"{owner}: {', '.join(values)}" for owner, values in per_owner.items())
        out.append(f"  {axis:10}  {text}")
    return out


#: What may tell apart the cells of one run that go wrong alike (`not_safe`'s `same in`).
RUN_AXES = ("model", "framework", "release", "plugin", "init", "checkpoint", "freeze", "clip")


def not_safe(cells: list[Row]) -> list[str]:
    """What a run's end says of a user's own models, worst first: `advise`'s answer for one cell of each way of going
    wrong, and the setups of the rest of its kind by what tells them apart (120 cells refused alike would otherwise
    fill pages with the same why and workaround)."""
    out = []
    bad = [cell for cell in cells if severity(cell) not in (*SAFE, "skipped")]
    models = {model: [cell for cell in bad if cell["model"] == model] for model in dict.fromkeys(
        cell["model"] for cell in sorted(bad, key=worst_first))}  # a model's cells together, worst model first
    for group in (group for mine in models.values() for group in alike(mine)):
        out += lines(group[0])
        axes = tuple(axis for axis in RUN_AXES if len({cell.get(axis) for cell in group}) > 1)
        if len(group) > 1:
            out += _wrapped("same in", ", ".join(setup(cell, axes) for cell in group[1:]))
    return out
