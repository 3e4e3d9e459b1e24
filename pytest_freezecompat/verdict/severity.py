"""How bad a cell is for the user who trains it: what reaches the weights, not which check tripped.

Pure and stdlib-only, on report rows (like `cause`): assigned where a row is made and again where shards are
merged, so an older report gets it too. It reads the facts the verdict writes (each failure's `kinds`, whether a
param it names is `in_optimizer`, a pass's `unchecked`), never a message. A registry entry never changes it: a
`silent` cell an upstream issue explains is still silent.

  silent    no error, yet the weights are wrong: a held param moves, a trained one gets no or a wrong grad or
            update, the clip norm is wrong, a trained param is missing from the optimizer, a resume loses or
            alters weights or optimizer state
  refused   the stack raised (at wrap, in training, in a save or load), crashed or hung: loud, the user knows
  costly    the weights are right, but the stack pays for what is frozen: its optimizer holds params nothing
            steps (their state, masters, buffers), grads land on params no optimizer holds, or a flag changed
            without reaching a weight
  unproven  nothing failed, but a check that decides the verdict did not run on this cell (`unchecked`)
  differs   a pass where only what reaches no weight differs from the canonical loop, under another correct
            loop (`core.names.LOOP_CONVENTIONS`): grads of params no optimizer steps, the clip norm's domain
  harness   our own code failed: the cell says nothing about the stack
  ok        a clean pass: every check ran and held
  skipped   not run (planning decided)
Order is severity order (`core.names.SEVERITIES`): tables list them so, silent first.
"""

from __future__ import annotations

import re
from typing import Any

#: Kinds of a failure that change no weight: a flag, a tie split (what its copies then learn is the grads and update
#: checks' business), an optimizer that holds more than it should (it costs memory; a held param it then moves fails
#: the update check), the same after a resume.
WITHOUT_HARM = {"requires_grad": {"flag-changed", "untied"}, "optimizer": {"tracks-unintended"},
                "resume": {"flag-after-load", "tracks-more-after-load"}}
#: Checks whose failure reaches the weights only through an optimizer that holds a param it names.
THROUGH_THE_OPTIMIZER = ("grads",)

Row = dict[str, Any]


def _kinds(failure: Row) -> set[str]:
    """The failure's kinds; a row written before the verdict recorded them is read the old way (`_legacy_kinds`)."""
    return set(failure["kinds"]) if "kinds" in failure else _legacy_kinds(failure)


#: How a round trip that raised reads in rows written before the verdict marked it: `<phase>: <Type>: ...`.
_LEGACY_RAISED = re.compile(r"^(resume: [a-z ]+|step \d+: [a-z/ ]+): [A-Za-z_][\w.]*: ")
_LEGACY_RESUME = {"requires_grad after load differs": "flag-after-load",
                  "the resumed optimizer tracks what it did not": "tracks-more-after-load"}


def _legacy_kinds(failure: Row) -> set[str]:
    """Kinds for a failure of a report written before #47 (no `kinds`): the published report until it is rerun."""
    check, message = failure["check"], failure.get("message", "")
    if check == "optimizer":
        return {"misses-trained"} if "optimizer misses" in message else {"tracks-unintended"}
    if check == "resume":
        if failure.get("raised") or ("raised" not in failure and _LEGACY_RAISED.match(message)):
            return {"raised"}
        return {next((kind for start, kind in _LEGACY_RESUME.items() if part.startswith(start)), "resumed-update")
                for part in message.split("; ")}
    return {"flag-changed"} if check == "requires_grad" else {f"{check}-failed"}


def _raised(failure: Row) -> bool:
    """A round trip that raised (a save or load refused, or a resumed step): loud."""
    return failure["check"] == "resume" and "raised" in _kinds(failure)


def _reaches_weights(failure: Row, norm_checked: bool) -> bool:
    """A failed check whose finding changes what the weights become (or became after a resume) in the loop that ran.
    `norm_checked`: the clip norm was compared (or the cell does not clip): grads on params no optimizer holds can
    then reach no weight; where it was not, they may have scaled every trained grad through clipping."""
    check, kinds = failure["check"], _kinds(failure)
    if _raised(failure):
        return False
    if check in THROUGH_THE_OPTIMIZER and failure.get("in_optimizer") is False and norm_checked:
        return False  # grads on params no optimizer holds, and the clip norm held: nothing steps them
    return bool(kinds - WITHOUT_HARM.get(check, set()))


def severity_of(row: Row) -> str:
    status = row["status"]
    if status == "skip":
        return "skipped"
    if row.get("cause") == "harness":
        return "harness"
    if status in ("error", "crash", "timeout"):
        return "refused"
    if status == "pass":
        return "unproven" if row.get("unchecked") else "differs" if row.get("differences") else "ok"
    failures = row.get("failures") or []
    norm_checked = "grad_norm" not in (row.get("unchecked") or ())
    # A fail that names no check: the worst case.
    if not failures or any(_reaches_weights(f, norm_checked) for f in failures):
        return "silent"
    if any(_raised(f) for f in failures):
        return "refused"
    return "costly"


def recorded(row: Row) -> str:
    """The row's severity as written; a row of a report written before severity was recorded is judged now."""
    return row.get("severity") or severity_of(row)


def fails_run(row: Row, fail_on: tuple[str, ...]) -> bool:
    """Whether a cell of a user's own model fails their pytest run: our own failure always (nothing was judged), else
    a severity the project fails on (`--freeze-matrix-fail-on`), whichever registry entry explains it."""
    return recorded(row) == "harness" or recorded(row) in fail_on


def assign(rows: list[Row]) -> list[Row]:
    """Set each row's `severity` in place; returns the rows."""
    for row in rows:
        row["severity"] = severity_of(row)
    return rows
