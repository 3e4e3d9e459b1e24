"""What the Composer test modules share: the adapter, what the installed release is known to do, and a cell of the
built-in matrix run and judged with each rank's record."""

from __future__ import annotations

import composer
import pytest
import slices
from packaging.version import Version

from pytest_freezecompat.adapters.composer import DECLARATION, compat
from pytest_freezecompat.controller.pool import RankPool
from pytest_freezecompat.core.cell import Cell
from pytest_freezecompat.core.records import RankRecord
from pytest_freezecompat.verdict import checks

ADAPTER = DECLARATION.implementation_module
#: Before 0.24 Composer's FSDP path re-created the optimizer over every param (C7, composer-fsdp-optimizer-recreated).
RECREATES_OPTIMIZER = Version(composer.__version__) < Version("0.24")
#: torch 2.3 (Composer 0.23's pin): loading the optimizer applies AdamW's weight decay once more (see compat).
LOAD_DECAYS_PARAMS = compat.optimizer_load_decays_params()
needs_fsdp2 = pytest.mark.skipif(compat.fsdp2_config_class() is None,
                                 reason=f"Composer {compat.composer_version()} has no FSDP2 (from {compat.FSDP2_FROM})")


def cell(plugin: str, freeze: str, init: str = "eager", checkpoint: str = "none") -> Cell:
    return slices.matrix_cell("composer", plugin=plugin, init=init, checkpoint=checkpoint, freeze=freeze, clip="clip")


def run(pool: RankPool, c: Cell) -> tuple[checks.Verdict, list[RankRecord]]:
    verdict, ranks = slices.judged(pool, c)
    return verdict, [r.record for r in ranks]
