"""How bad a cell is for the user who trains it: what reaches the weights, not which check tripped.

Pure and stdlib-only, on report rows (like `cause`): assigned where a row is made and again where shards are
merged, so an older report gets it too. A registry entry never changes it: a `silent` cell an upstream issue
explains is still silent.

  silent   no error, yet the weights are wrong: a held param moves, a trained one gets no or a wrong grad or
           update, the clip norm is wrong, a trained param is missing from the optimizer, a resume loses or
           alters weights or optimizer state
  refused  the stack raised (at wrap, in training, in a save or load), crashed or hung: loud, the user knows
  costly   the weights are right, but the stack pays for what is frozen: its optimizer holds params nothing
           steps (their state, masters, buffers), or a flag changed without reaching a weight
  differs  a pass where only what reaches no weight differs from the canonical loop, under another correct
           loop (`core.names.LOOP_CONVENTIONS`): grads of params no optimizer steps, the clip norm's domain
  harness  our own code failed: the cell says nothing about the stack
  ok       a clean pass
  skipped  not run (planning decided)
Order is severity order: tables list them so, silent first.
"""

from __future__ import annotations

import re
from typing import Any

#: Parts of a `resume` failure (`checks._check_resume` joins them with "; ") that change no weight: a flag, or an
#: optimizer that holds more than it did (it costs memory; a held param it then moves fails the resumed update).
RESUME_WITHOUT_HARM = ("requires_grad after load differs", "the resumed optimizer tracks what it did not")

Row = dict[str, Any]
#: How a round trip that raised reads in rows written before the verdict marked it: `<phase>: <Type>: ...`.
RAISED_TEXT = re.compile(r"^(resume: [a-z ]+|step \d+: [a-z/ ]+): [A-Za-z_][\w.]*: ")


def _raised(failure: Row) -> bool:
    """A round trip that raised (a save or load refused, or a resumed step): the verdict marks it."""
    if failure["check"] != "resume":
        return False
    return bool(failure["raised"]) if "raised" in failure else bool(RAISED_TEXT.match(failure.get("message", "")))


def _reaches_weights(failure: Row) -> bool:
    """A failed check whose finding changes what the weights become (or became after a resume)."""
    check, message = failure["check"], failure.get("message", "")
    if check in ("grads", "grad_norm", "update"):
        return True
    if check == "optimizer":  # a trained param it misses never learns; params it tracks in excess cost memory
        return "optimizer misses" in message
    if check == "resume":
        return not _raised(failure) and any(not part.startswith(RESUME_WITHOUT_HARM) for part in message.split("; "))
    return False  # requires_grad alone: a flag changed; where it reaches a weight, grads or update fail too


def severity_of(row: Row) -> str:
    status = row["status"]
    if status == "skip":
        return "skipped"
    if row.get("cause") == "harness":
        return "harness"
    if status in ("error", "crash", "timeout"):
        return "refused"
    if status == "pass":
        return "differs" if row.get("differences") else "ok"
    failures = row.get("failures") or []
    if any(_reaches_weights(f) for f in failures):
        return "silent"
    if any(_raised(f) for f in failures):
        return "refused"
    return "costly"


def assign(rows: list[Row]) -> list[Row]:
    """Set each row's `severity` in place; returns the rows."""
    for row in rows:
        row["severity"] = severity_of(row)
    return rows
