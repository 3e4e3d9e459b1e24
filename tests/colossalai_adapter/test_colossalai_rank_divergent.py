"""Branches only some ranks use (issue #67) under ColossalAI's ZeRO plugins, real 2-rank cells of the built-in
matrix: the ranks hold ZeRO grads of different params, and the adapter reads what each holds so that the verdict
judges the cell (never harness, never a pass made up from grads no rank holds whole)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("colossalai")

ROOT = Path(__file__).parent.parent.parent


def test_low_level_zero_and_hybrid_zero_1_rank_divergent_cells_are_judged(run_matrix, monkeypatch) -> None:
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    _, report = run_matrix("--freeze-matrix-builtin",
                           "--freeze-matrix-select=framework=colossalai,plugin=low-level-zero-1,plugin=low-level-zero-2,"
                           "plugin=hybrid-parallel-zero-1,init=eager,checkpoint=none,clip=clip,freeze=rank-divergent")
    cells = {cell["plugin"]: cell for cell in report["cells"]}
    assert set(cells) == {"low-level-zero-1", "low-level-zero-2", "hybrid-parallel-zero-1"}
    assert all(cell["severity"] in ("silent", "refused") for cell in cells.values()), {
        plugin: (cell["severity"], cell["message"]) for plugin, cell in cells.items()}
    hybrid = cells["hybrid-parallel-zero-1"]
    assert (hybrid["check"], "experts.0.up.weight" in hybrid["message"]) == ("grads", True)
