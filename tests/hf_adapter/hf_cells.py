"""What the Hugging Face test modules share: the adapter and a cell of the built-in matrix run and judged."""

from __future__ import annotations

import slices

from pytest_freezecompat.adapters.hf import DECLARATION
from pytest_freezecompat.controller.pool import RankPool
from pytest_freezecompat.core.cell import Cell
from pytest_freezecompat.core.records import RankRecord
from pytest_freezecompat.verdict import checks

ADAPTER = DECLARATION.implementation_module


def cell(plugin: str, freeze: str, checkpoint: str = "none", clip: str = "clip") -> Cell:
    return slices.matrix_cell("hf", plugin=plugin, init="eager", checkpoint=checkpoint, freeze=freeze, clip=clip)


def run(pool: RankPool, c: Cell) -> tuple[checks.Verdict, list[RankRecord]]:
    verdict, ranks = slices.judged(pool, c)
    return verdict, [r.record for r in ranks]
