"""The pool's rank templates, for real: warm-ups run once per template, and a template with threads never forks."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import pytest
from conftest import TESTS

from pytest_freezecompat.controller.pool import PoolError, RankPool, refused_alike
from pytest_freezecompat.core.messages import GPU_VISIBLE, RENDEZVOUS_PHASE, RunCell
from pytest_freezecompat.core.records import Outcome, RankError, RankRecord


@pytest.fixture(autouse=True)
def _templates_find_the_probes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(TESTS))  # templates get the controller's sys.path as PYTHONPATH


def test_an_adapter_modules_warm_up_runs_once_per_template_not_per_fork(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WARM_UP_DIR", str(tmp_path))
    pool = RankPool(2, ["template_probes.warms_up"])
    try:
        pool.start()
        first = [proc.pid for proc in pool._procs]
        pool.restart()
        assert [proc.pid for proc in pool._procs] != first  # fresh ranks...
        templates = {str(template.proc.pid) for template in pool._templates}
    finally:
        pool.shutdown()
    assert {path.name for path in tmp_path.iterdir()} == templates  # ...from the same two warmed templates
    assert not any(Path(f"/proc/{pid}").exists() for pid in first)


def test_a_template_left_with_a_thread_refuses_to_fork() -> None:
    pool = RankPool(2, ["template_probes.starts_a_thread"])
    try:
        with pytest.raises(PoolError, match=r"rank 0 failed to start \(runs 2 threads after its imports \([^)]+\); "
                                            r"it cannot fork ranks safely\)"):
            pool.start()
        assert not pool._templates and not pool._procs
    finally:
        pool.shutdown()
    assert not os.path.exists(pool._workdir)


@pytest.mark.parametrize("gpu_visible", ["0", "1"])
def test_a_template_takes_no_backward_where_the_controller_sees_a_gpu(monkeypatch: pytest.MonkeyPatch,
                                                                       gpu_visible: str) -> None:
    """A backward starts autograd's thread for each GPU (and CUDA's), which no fork copies: on an H200 every
    template was refused ("runs 3 threads after its imports") until the warm-up left backward to the ranks."""
    import torch

    from pytest_freezecompat.rank import template

    def no_backward(*args: object, **kwargs: object) -> None:
        raise AssertionError("the template took a backward")

    monkeypatch.setattr(torch.autograd, "backward", no_backward)
    monkeypatch.setenv(GPU_VISIBLE, gpu_visible)
    if gpu_visible == "1":
        template._warm_up()
    else:
        with pytest.raises(AssertionError, match="took a backward"):
            template._warm_up()


def test_the_pool_tells_its_templates_whether_the_controller_sees_a_gpu() -> None:
    import torch

    pool = RankPool(2, [])
    try:
        assert pool._environment()[GPU_VISIBLE] == ("1" if torch.cuda.is_available() else "0")
    finally:
        pool.shutdown()
    assert not os.path.exists(pool._workdir)


def test_a_user_module_that_starts_a_thread_is_left_to_the_ranks(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WARM_UP_DIR", str(tmp_path))
    pool = RankPool(2, ["template_probes.warms_up"], ["template_probes.user_module_with_a_thread"])
    try:
        pool.start()  # the templates are started again without the user's module, and fork
        assert pool.user_modules == [] and len(pool._procs) == 2 and pool.alive
    finally:
        pool.shutdown()
    assert len(list(tmp_path.iterdir())) == 4  # two templates, twice


def test_a_pool_keeps_its_folder_in_memory_unless_the_caller_names_a_tmpdir(monkeypatch, tmp_path):
    from pytest_freezecompat.controller import pool as pool_module

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    assert pool_module.workdir_root() is None  # tempfile then uses TMPDIR: a shared folder the caller chose
    monkeypatch.delenv("TMPDIR")
    monkeypatch.setattr(pool_module, "MEMORY_FOLDER", tmp_path)
    assert pool_module.workdir_root() == str(tmp_path)
    monkeypatch.setattr(pool_module, "MEMORY_FOLDER", tmp_path / "absent")
    assert pool_module.workdir_root() is None


def _raised(rank: int, kind: str | None, phase: str = "wrap (fsdp1)") -> RankRecord:
    error = None if kind is None else RankError(kind, "no", "no", rank, "x.py:1 in f", phase, "", 0.0)
    return RankRecord(rank=rank, error=error)


@pytest.mark.parametrize(("records", "kept"), [
    ([_raised(0, "ValueError"), _raised(1, "ValueError")], True),  # the same refusal everywhere
    ([_raised(0, "ValueError"), _raised(1, None)], False),  # one rank went on: its collectives are its own
    ([_raised(0, "ValueError"), _raised(1, "RuntimeError")], False),  # the peer failed on the first one's account
    ([_raised(0, "ValueError"), _raised(1, "ValueError", "step 0: forward/backward")], False),
    ([_raised(0, "ValueError", RENDEZVOUS_PHASE), _raised(1, "ValueError", RENDEZVOUS_PHASE)], False),  # no group
])
def test_ranks_are_kept_only_after_a_refusal_alike_on_every_rank(records: list[RankRecord], kept: bool) -> None:
    assert refused_alike(records) is kept


def test_ranks_stuck_joining_the_cells_group_are_seen_from_their_phase_boards(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each rank is sent its own cell index, so each waits in its own store prefix for a peer that never joins: the
    controller reads "init process group" on both boards, replaces the ranks, tries again, and gives up."""
    from slices import matrix_cell

    from pytest_freezecompat.controller import pool as pool_module

    indexes = itertools.count(1000)
    monkeypatch.setattr(pool_module, "RunCell", lambda index, cell: RunCell(next(indexes), cell))
    monkeypatch.setattr(pool_module, "RENDEZVOUS_TIMEOUT_S", 1.0)
    cell = matrix_cell("torch", plugin="ddp", init="eager", checkpoint="none", freeze="none", clip="clip")
    pool = RankPool(2, [cell.adapter_module])
    try:
        run = pool.run(cell, timeout_s=60.0)
    finally:
        pool.shutdown()
    assert run.outcome is Outcome.TIMEOUT and run.rendezvous_retries == 1
    assert [state.phase for state in run.ranks] == [RENDEZVOUS_PHASE] * 2
    assert "joining the cell's process group hung" in run.notes[0]
