"""Verdicts: pure functions of what the ranks saw; imports no process code."""

from __future__ import annotations

from typing import Any

from . import cause, severity


def classify(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each report row's `cause` (against its column's control) and then its `severity` (which reads a harness
    cause), in place: where a run folds its report and where shards are merged."""
    return severity.assign(cause.assign(rows))
