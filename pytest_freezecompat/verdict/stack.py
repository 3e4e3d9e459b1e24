"""Whether the stack that ran is the one the cell's name promises.

A cell named `zero2` whose engine ran stage 3, or a row of an FSDP1 cell that ran DDP, would lend its verdict to a
setup it never tested. The ranks report what they read from the objects the framework built (`Probe.observed`); the
cell carries what its name promises (`AdapterDeclaration.promised`). A difference is a harness state with what was
seen, never a verdict about the stack.
"""

from __future__ import annotations

from ..core import dtypes
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
    refusal may come before it). An fp32 cell of a model that holds its own bf16/fp16 params promises to run it as
    held: a cast is `casts`' note on a judged row, not another stack.
    """
    problems = []
    for record in records:
        wrapped = record.requires_grad is not None
        for fact in dict.fromkeys((*cell.observes, *cell.promised_stack)):
            seen = record.observed.get(fact)
            want = None if fact == "precision" and as_held(cell, record) else cell.promised_stack.get(fact)
            if seen is None:
                if wrapped:
                    problems.append(f"rank {record.rank} did not observe {fact}")
            elif want is not None and seen != want:
                problems.append(f"{fact} is {seen} on rank {record.rank}, the cell's name promises {want}")
    if not problems:
        return None
    return "the stack that ran is not the cell's: " + "; ".join(dict.fromkeys(problems))


def as_held(cell: Cell, record: RankRecord) -> bool:
    """The cell's precision config casts nothing (fp32) and the model holds its own low-precision params."""
    return cell.precision == "fp32" and dtypes.own_low_precision(record.dtypes)


def casts(cell: Cell, records: list[RankRecord]) -> str | None:
    """Where a stack that promised to run the model as held shows params in other dtypes than the model held: the
    row's note, one line (judged against the model as held, so what the cast costs shows in the verdict)."""
    held = {record.rank: dtypes.precision(record.dtypes) for record in records}
    seen = {record.observed["precision"] for record in records
            if as_held(cell, record) and record.observed.get("precision", held[record.rank]) != held[record.rank]}
    if not seen:
        return None
    return (f"the stack holds the model's params as {', '.join(sorted(seen))}; the model held {held[records[0].rank]} "
            f"({records[0].observed.get('model_dtypes', '')}): judged against the model as held")
