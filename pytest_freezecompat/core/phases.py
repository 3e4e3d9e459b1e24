"""Where a cell's time goes: the free-text phases ranks report, sorted into a few kinds.

A rank reports phases as it goes (`Probe.phase`, shown on a hang); the time between one phase and the
next is charged to the first one's kind. The controller adds what only it sees. The benchmark and the
README's performance table read these per-cell sums (`phases_s` in a report row).
"""

from __future__ import annotations

import re

from .messages import RENDEZVOUS_PHASE

#: Kinds in the order a cell meets them.
#: - `restart`: new ranks forked (the first cell, or after a bad one); `join`: the default group (0 when kept);
#: - `prepare`: data, adapter import, shim; `groups`: a framework's parallel state (Megatron's, 0 when kept);
#: - `tidy`: after a clean cell; `dispatch`: the pipe both ways and what the rank does outside its phases
#:   (the controller's wall time minus rank 0's phases); `judge`: the verdict.
#: - `resume`: the model-checkpoint round trip (save, tear down, rebuild, load, the resumed steps and their reads).
KINDS = ("restart", "join", "prepare", "groups", "build", "wrap", "steps", "probes", "resume", "reference", "tidy",
         "dispatch", "judge")

_RULES: tuple[tuple[str, re.Pattern[str]], ...] = tuple((kind, re.compile(pattern)) for kind, pattern in (
    ("join", re.escape(RENDEZVOUS_PHASE)),
    ("resume", r"^resume"),
    ("prepare", r"process group ready|setup$"),
    ("groups", r"initialize_model_parallel"),
    ("build", r"build model|LazyInitContext"),
    ("wrap", r"wrap \(|boost \(|build optimizer|Trainer init"),
    ("probes", r"read state|step \d+: read "),
    ("steps", r"step \d+: "),
    ("reference", r"reference"),
))


def kind_of(phase: str) -> str:
    """The kind a rank's phase text belongs to (`other` for an adapter's phase no rule knows)."""
    return next((kind for kind, pattern in _RULES if pattern.search(phase)), "other")
