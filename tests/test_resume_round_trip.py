"""Real 2-rank round trips through PyTorch's own checkpoint APIs on gloo, judged by the engine's checks."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import slices
from slices import TIMEOUT_S

from pytest_freezecompat.adapters.loop import FOLDER_PREFIX
from pytest_freezecompat.controller.pool import RankPool
from pytest_freezecompat.core.cell import Cell
from pytest_freezecompat.verdict import checks

ADAPTER = "pytest_freezecompat.adapters.torch_native.adapter"


@pytest.fixture(scope="module")
def pool(shared_pools: slices.SharedPools) -> RankPool:
    return shared_pools.get(ADAPTER)


def cell(plugin: str, freeze: str) -> Cell:
    return slices.matrix_cell("torch", model="tiny-gpt", plugin=plugin, init="eager", checkpoint="none",
                              freeze=freeze, clip="clip")


def folders(pool: RankPool) -> set[Path]:
    """The round trips' folders the pool's ranks have (each rank's TMPDIR is inside the pool's folder)."""
    return set(pool._workdir.rglob(FOLDER_PREFIX + "*"))


@pytest.mark.parametrize(("plugin", "api"), [("ddp", "torch.save"), ("fsdp1", "FULL_STATE_DICT"),
                                             ("fsdp1-orig-params", "SHARDED_STATE_DICT"), ("fsdp2", "get_state_dict")])
def test_each_save_api_round_trips_a_frozen_embedding(pool: RankPool, plugin: str, api: str) -> None:
    c = cell(plugin, "embedding" if plugin != "fsdp1" else "decoder")  # flat params refuse a mixed unit
    before = folders(pool)
    result = pool.run(c, TIMEOUT_S)
    verdict = checks.judge(result, c, TIMEOUT_S)
    assert verdict.status == "pass", verdict.message
    resume = result.ranks[0].record.resume
    assert api in resume.api
    assert set(result.ranks[0].record.plan.names) <= set(resume.saved_params)  # frozen ones saved too
    assert resume.steps[1].params is not None and resume.loaded is not None
    assert folders(pool) == before  # the cell's folder is gone with it
    assert any(pool._workdir.glob("*.tmp")), "no rank TMPDIR in the pool's folder: the check looks elsewhere"


@pytest.mark.parametrize("plugin", ["ddp", "fsdp1", "fsdp1-orig-params", "fsdp2"])
def test_a_load_that_leaves_one_param_behind_is_caught_as_resume(pool: RankPool, plugin: str) -> None:
    c = dataclasses.replace(cell(plugin, "none"), break_load="head.weight")
    verdict = checks.judge(pool.run(c, TIMEOUT_S), c, TIMEOUT_S)
    assert (verdict.status, verdict.check) == ("fail", "resume")
    assert "after load, values differ from what was saved: head.weight" in verdict.message


def test_a_round_trip_that_raises_leaves_its_folder_to_the_next_cell(pool: RankPool) -> None:
    """A load that raises on rank 0 keeps the cell's folder (a peer may still be reading it: it must meet its own
    failure, not a missing file) without rank 0 waiting for anyone; rank 0's next cell removes it."""
    before = folders(pool)
    c = cell("fsdp2", "unused-branch")  # the sharded optimizer load raises on both ranks (torch-fsdp2-...)
    verdict = checks.judge(pool.run(c, TIMEOUT_S), c, TIMEOUT_S)
    assert (verdict.status, verdict.check) == ("fail", "resume") and "resume: load" in verdict.message
    assert len(folders(pool) - before) == 1
    assert checks.judge(pool.run(cell("ddp", "embedding"), TIMEOUT_S), cell("ddp", "embedding"), TIMEOUT_S
                        ).status == "pass"
    assert folders(pool) == before


def test_a_sharded_load_restores_each_ranks_own_shard(pool: RankPool) -> None:
    """FSDP2 shards every param by rows across the two ranks: rank 1's rows of a trained weight differ from
    rank 0's, so a load that gave every rank rank 0's shard (or none) would show in the gathered values."""
    c = cell("fsdp2", "embedding")
    result = pool.run(c, TIMEOUT_S)
    loaded = result.ranks[0].record.resume.loaded["head.weight"]
    half = loaded.shape[0] // 2
    assert not (loaded[:half] == loaded[half:2 * half]).all()
    assert checks.judge(result, c, TIMEOUT_S).status == "pass"


def test_a_cell_that_cites_its_groups_round_trip_runs_none_and_takes_its_result(pool: RankPool) -> None:
    """The first cell of a round-trip group runs and judges the round trip (here one that leaves a param behind); a
    cell of the same group that cites it saves and loads nothing, yet fails `resume` with the same finding."""
    first = dataclasses.replace(cell("ddp", "embedding"), break_load="head.weight")
    ran = pool.run(first, TIMEOUT_S)
    judged = checks.judge(ran, first, TIMEOUT_S)
    assert judged.round_trip is not None and judged.round_trip.problem is not None and judged.round_trip_of is None
    trip = dataclasses.replace(judged.round_trip, cell=first.key.id)
    later = dataclasses.replace(cell("ddp", "embedding"), key=dataclasses.replace(first.key, clip="no-clip"),
                                round_trip_of=first.key.id)
    before = folders(pool)
    result = pool.run(later, TIMEOUT_S)
    assert result.ranks[0].record.resume is None and folders(pool) == before  # no save, no load, no folder
    verdict = checks.judge(result, later, TIMEOUT_S, trip)
    assert (verdict.status, verdict.check, verdict.round_trip_of) == ("fail", "resume", first.key.id)
    assert verdict.round_trip is None  # a cited round trip is not cited again as this cell's
    assert "after load, values differ from what was saved: head.weight" in verdict.message
    held = dataclasses.replace(trip, problem=None)
    assert checks.judge(result, later, TIMEOUT_S, held).status == "pass"
