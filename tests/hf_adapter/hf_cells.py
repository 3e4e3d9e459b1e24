"""What the Hugging Face test modules share: the adapter and a cell of the built-in matrix run and judged."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import slices

from pytest_freezecompat.adapters.hf import DECLARATION
from pytest_freezecompat.controller.pool import RankPool
from pytest_freezecompat.core.cell import Cell
from pytest_freezecompat.core.records import RankRecord
from pytest_freezecompat.verdict import checks

ADAPTER = DECLARATION.implementation_module
#: The examples' folder: rank processes import the user models' factories from it (the pool passes sys.path on).
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def examples_pool() -> Iterator[RankPool]:
    """A rank pool whose ranks import from examples/ (a module-scoped fixture's body)."""
    sys.path.insert(0, str(EXAMPLES))
    try:
        yield from slices.rank_pool(ADAPTER)
    finally:
        sys.path.remove(str(EXAMPLES))


def cell(plugin: str, freeze: str, checkpoint: str = "none", clip: str = "clip") -> Cell:
    return slices.matrix_cell("hf", plugin=plugin, init="eager", checkpoint=checkpoint, freeze=freeze, clip=clip)


def run(pool: RankPool, c: Cell) -> tuple[checks.Verdict, list[RankRecord]]:
    verdict, ranks = slices.judged(pool, c)
    return verdict, [r.record for r in ranks]
