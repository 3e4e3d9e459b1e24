"""Branches only some ranks use (issue #67) under ZeRO, real 2-rank cells of the built-in matrix: stage 2 pairs one
expert's grad with the other's without a word, stage 3 refuses within the cell's timeout; both named by the
registry."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

ROOT = Path(__file__).parent.parent.parent
#: Seconds a cell may take here: a hung collective would run into it (a cold DeepSpeed start takes ~10 s).
TIMEOUT_S = 90


def test_zero2_is_silent_and_zero3_refuses_within_the_timeout(run_matrix, monkeypatch) -> None:
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    _, report = run_matrix("--freeze-matrix-builtin", f"--freeze-matrix-timeout={TIMEOUT_S}",
                           "--freeze-matrix-select=framework=deepspeed,plugin=zero2,plugin=zero3,init=eager,"
                           "checkpoint=none,clip=clip,freeze=rank-divergent")
    cells = {cell["plugin"]: cell for cell in report["cells"]}
    mixed, refused = cells["zero2"], cells["zero3"]
    assert (mixed["status"], mixed["severity"], mixed["check"]) == ("fail", "silent", "grads")
    assert mixed["known_issue"]["id"] == "deepspeed-zero12-rank-divergent-grads-mixed"
    assert (refused["status"], refused["severity"]) == ("error", "refused")
    assert "Detected a disagreement on list contents" in refused["message"]
    assert refused["known_issue"]["id"] == "deepspeed-zero3-rank-divergent-disagreement"
    assert refused["duration_s"] < TIMEOUT_S
