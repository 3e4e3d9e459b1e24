"""Which failure a registry entry explains, read from the facts a report row records, never from our messages.

An entry (`matrix/known_issues.toml`) names the failure it explains in two ways, either of which explains a cell:

  kinds    the failure's kinds (`core.names.FAILURE_KINDS`): one of them is among the failure's `kinds`
  params   a regex searched in each param the failure names (`params`): one of them matches
           (kinds and params are one selector: each given must hold; params alone: a failure of any kind)
  pattern  a regex over the stack's own words (`stack_words`): the row's `error`, each rank's error and exit, and
           the message of a `resume` failure that raised (it quotes the stack's exception)

The failure read is the one the entry's `check` names, else the cell's first (its likely root cause): the one its
predictions read too. Our verdict messages are never read, so they can be reworded freely.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..core.names import FAILURE_KINDS

#: The fields an entry's failure selector is written with.
FIELDS = ("kinds", "params", "pattern")

Row = dict[str, Any]


def judged_failure(cell: Row, check: str | None) -> Row:
    """The failure an entry reads: its `check`'s, else the cell's first ({} where the cell has none)."""
    failures = cell.get("failures") or []
    return next((f for f in failures if f["check"] == check), failures[0] if failures else {})


def stack_words(cell: Row, failure: Row) -> str:
    """The stack's own words on a row, one per line: its `error` (`Type: message`), each rank's error (`Type: message
    (rank N, phase, file:line in function)`) and exit (`rank N killed by signal SIGSEGV during boost`), and the
    message of `failure` where it is a round trip that raised (`resume: save: Type: message (rank N, place)`)."""
    lines = []
    error = cell.get("error") or {}
    if error:
        lines.append(f"{error.get('type', '')}: {error.get('message', '')}")
    for rank in cell.get("rank_details") or []:
        error = rank.get("error") or {}
        if error:
            lines.append(f"{error.get('type', '')}: {error.get('message', '')} (rank {rank.get('rank')}, "
                         f"{error.get('phase', '')}, {error.get('where', '')})")
        if rank.get("exit"):
            lines.append(f"rank {rank.get('rank')} {rank['exit']} during {rank.get('phase', '')}")
    if failure.get("check") == "resume" and "raised" in (failure.get("kinds") or ()):
        lines.append(failure.get("message") or "")
    return "\n".join(lines)


@dataclass(frozen=True)
class FailureSelector:
    kinds: tuple[str, ...] = ()
    params: re.Pattern[str] | None = None
    pattern: re.Pattern[str] | None = None

    def holds(self, cell: Row, failure: Row) -> bool:
        """Whether the cell's failure (`judged_failure`) is the one selected: by its facts, or by the stack's words."""
        return self.by_facts(failure) or (self.pattern is not None and
                                          self.pattern.search(stack_words(cell, failure)) is not None)

    def by_facts(self, failure: Row) -> bool:
        if not (self.kinds or self.params) or not failure:
            return False
        if self.kinds and not set(self.kinds) & set(failure.get("kinds") or ()):
            return False
        return self.params is None or any(self.params.search(name) for name in failure.get("params") or ())


def parse(body: dict[str, Any], check: str | None, statuses: tuple[str, ...],
          error: Callable[[str, str], Exception]) -> FailureSelector:
    """An entry's `kinds`, `params` and `pattern`, checked: at least one; a kind is one of its check's (any check's
    where it names none); kinds and params need a `fail` status (only a failed check has them)."""
    if not any(field in body for field in FIELDS):
        raise error("pattern", "missing: an entry says what it explains by kinds, params (a failed check's facts) "
                               "or pattern (the stack's own words)")
    kinds = body.get("kinds", ["-"])
    if not isinstance(kinds, list) or not kinds or not all(isinstance(kind, str) and kind for kind in kinds):
        raise error("kinds", "must be a non-empty list of failure kinds (e.g. [\"held-moved\"])")
    kinds = kinds if "kinds" in body else []
    valid = list(FAILURE_KINDS[check] if check else dict.fromkeys(k for ks in FAILURE_KINDS.values() for k in ks))
    for kind in kinds:
        if kind not in valid:
            near = difflib.get_close_matches(kind, valid, n=1)
            owner = f"of check {check}" if check else "of any check"
            raise error("kinds", f"{kind!r} is no failure kind {owner}; valid: {', '.join(valid)}"
                                 + (f"; did you mean {near[0]!r}?" if near else ""))
    if (kinds or "params" in body) and "fail" not in statuses:
        raise error("kinds" if kinds else "params", "selects a failed check's facts: status must include \"fail\"")
    return FailureSelector(tuple(kinds), _regex(body, "params", error), _regex(body, "pattern", error))


def _regex(body: dict[str, Any], field: str, error: Callable[[str, str], Exception]) -> re.Pattern[str] | None:
    if field not in body:
        return None
    if not isinstance(body[field], str) or not body[field]:
        raise error(field, "must be a non-empty regex")
    try:
        return re.compile(body[field])
    except re.error as exc:
        raise error(field, f"invalid regex ({exc})") from None
