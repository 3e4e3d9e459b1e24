"""Whether the stack that ran is the one the cell's name promises.

A cell named `zero2` whose engine ran stage 3, or a row of an FSDP1 cell that ran DDP, would lend its verdict to a
setup it never tested. The ranks report what they read from the objects the framework built (`Probe.observed`); the
cell carries what its name promises (`AdapterDeclaration.promised`). A difference is a harness state with what was
seen, never a verdict about the stack.
"""

from __future__ import annotations

from ..core.cell import Cell
from ..core.records import RankRecord


def observed_stack(records: list[RankRecord]) -> dict[str, str]:
    """The row's `observed`: rank 0's facts; a fact the ranks saw differently reads `rank 0: a; rank 1: b`."""
    facts = dict.fromkeys(fact for record in records for fact in record.observed)
    joined = {}
    for fact in facts:
        seen = {record.rank: record.observed.get(fact, "not observed") for record in records}
        values = set(seen.values())
        joined[fact] = (next(iter(values)) if len(values) == 1
                        else "; ".join(f"rank {rank}: {value}" for rank, value in sorted(seen.items())))
    return joined


def row_versions(records: list[RankRecord]) -> dict[str, str]:
    """The installed versions the ranks imported (they share one environment; rank 0's where they differ)."""
    versions: dict[str, str] = {}
    for record in reversed(records):
        versions.update(record.versions)
    return versions


def mismatch(cell: Cell, records: list[RankRecord]) -> str | None:
    """What makes the run another stack than the cell's, in one line; None where it is the cell's.

    A promised fact seen with another value, on any rank, is a mismatch wherever it was seen. A fact the cell
    promises or its adapter always observes but that was never reported counts only on a rank that wrapped (a
    refusal may come before it).
    """
    problems = []
    for record in records:
        wrapped = record.requires_grad is not None
        for fact in dict.fromkeys((*cell.observes, *cell.promised_stack)):
            seen = record.observed.get(fact)
            want = cell.promised_stack.get(fact)
            if seen is None:
                if wrapped:
                    problems.append(f"rank {record.rank} did not observe {fact}")
            elif want is not None and seen != want:
                problems.append(f"{fact} is {seen} on rank {record.rank}, the cell's name promises {want}")
    if not problems:
        return None
    return "the stack that ran is not the cell's: " + "; ".join(dict.fromkeys(problems))
