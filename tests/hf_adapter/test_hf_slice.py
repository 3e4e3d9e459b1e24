"""Real 2-rank Accelerate cells on gloo through the engine's warm RankPool, judged by the engine's checks.

The ranks are warm: cells run one after another in the same processes, so what one cell leaves in Accelerate's
environment variables or shared state would reach the next (the trap `state.fresh` prevents).
"""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("accelerate.state")  # a module of the real package, not a namespace folder

import accelerate
import slices
from hf_cells import ADAPTER, cell, run
from packaging.version import Version

from pytest_freezecompat.adapters.emulation import fsdp1_cpu_offload_patches
from pytest_freezecompat.adapters.hf import emulation
from pytest_freezecompat.controller.pool import RankPool

#: See test_hf_sharded_optimizer_load: FSDP2's sharded optimizer load fills a fresh optimizer from 1.13.0 (PR #3904).
FSDP2_LOADS_OPTIMIZER = Version(accelerate.__version__) >= Version("1.13.0")


@pytest.fixture(scope="module")
def pool(shared_pools: slices.SharedPools) -> RankPool:
    return shared_pools.get(ADAPTER)


def test_ddp_runs_without_the_shim_and_trains_like_the_reference(pool: RankPool) -> None:
    verdict, records = run(pool, cell("accelerate-ddp", "embedding"))
    assert verdict.status == "pass", verdict.message
    steps = records[0].steps
    assert steps[0].grads["tok_emb.weight"] is None and steps[0].grads["head.weight"] is not None
    assert steps[0].norm_source == "returned by accelerator.clip_grad_norm_"
    assert not records[0].emulated and records[0].resume is not None and records[0].resume.error is None
    # what Accelerate built, read back from it (the row's `observed`): DDP's distributed type is the device's
    assert all(r.observed == {"wrapper": "DistributedDataParallel", "precision": "fp32", "driver": "accelerate",
                              "distributed_type": "MULTI_CPU"} for r in records), records[0].observed


def test_fsdp2_runs_behind_the_labelled_shim_with_dtensor_grads(pool: RankPool) -> None:
    c = cell("accelerate-fsdp2", "all-but-last")
    assert c.emulation
    verdict, records = run(pool, c)
    if FSDP2_LOADS_OPTIMIZER:
        assert verdict.status == "pass", verdict.message
    else:  # 1.10.1 loads a sharded optimizer into a fresh one's empty template (test_hf_sharded_optimizer_load)
        assert [f.check for f in verdict.failures] == ["resume"], verdict.message
        assert any("optimizer holds state for 0 of" in n for n in records[0].notes), records[0].notes
    assert records[0].emulated == [emulation.BACKEND]
    assert "DTensor" in records[0].grad_access
    assert records[0].observed == c.promised_stack, records[0].observed  # what Accelerate built, read back from it


def test_a_cell_after_an_fsdp_cell_gets_its_own_stack(pool: RankPool) -> None:
    """The trap in warm ranks: after FSDP cells, a flat-param FSDP1 cell must still flatten (it refuses a frozen
    embedding in a mixed unit, loudly), and a DDP cell must run DDP, unshimmed, and pass."""
    verdict, _ = run(pool, cell("accelerate-fsdp1-orig-params", "embedding"))
    assert verdict.check != "optimizer", verdict.message
    verdict, records = run(pool, cell("accelerate-fsdp1", "embedding"))
    assert verdict.status == "error" and "uniform `requires_grad`" in verdict.message, verdict.message
    run(pool, cell("accelerate-fsdp2", "none"))
    verdict, records = run(pool, cell("accelerate-ddp", "none"))
    assert verdict.status == "pass", verdict.message
    assert records[0].grad_access == "param.grad" and not records[0].emulated


def test_fsdp1_flat_params_track_every_param_through_fqns(pool: RankPool) -> None:
    """Built as Accelerate's FSDP1 recipe says (the model prepared first, then the optimizer over its flat params),
    the optimizer holds every param of the nothing-frozen control by name."""
    _, records = run(pool, cell("accelerate-fsdp1", "none"))
    assert records[0].tracked == tuple(sorted(records[0].plan.names))
    assert "_fqns" in records[0].grad_access
    assert [f for f in records[0].steps if f.grads is None] == []


def test_without_the_shim_an_fsdp_cell_refuses_accelerates_silent_fallback_by_name(pool: RankPool) -> None:
    """Asked for FSDP on CPU without `cpu=True`, Accelerate 1.15.0 leaves each rank alone (distributed_type NO, one
    process, no wrapper) and 1.10.1 wraps in DDP (MULTI_CPU), both without a word: the stack check turns either
    silent fallback into the cell's error."""
    marked = cell("accelerate-fsdp2", "none")
    verdict, records = run(pool, dataclasses.replace(marked, emulation=False, shim=None))
    assert verdict.status == "error" and records[0].error.type == "StackMismatch", verdict.message
    assert "asked for distributed_type=FSDP, num_processes=2, wrapper fsdp2" in records[0].error.message
    message = records[0].error.message
    assert ("gave distributed_type=NO, num_processes=1, wrapper TinyGPT" in message
            or "gave distributed_type=MULTI_CPU, num_processes=2, wrapper ddp" in message), message
    assert not records[0].emulated


def test_fsdp1_full_state_dict_round_trip_restores_the_moments_behind_the_offload_patches(pool: RankPool) -> None:
    """Accelerate's FSDP1 default save (full), on CPU behind the shim's two FSDP1 offload patches: the nothing-frozen
    control passes the round trip that its sharded twin fails (Accelerate's sharded optimizer load)."""
    verdict, records = run(pool, cell("accelerate-fsdp1-orig-params-full-state-dict", "none"))
    assert verdict.status == "pass", verdict.message
    offload = {patch.what for patch in fsdp1_cpu_offload_patches("Accelerate's full state dict")}
    assert offload <= set(records[0].emulated)
    verdict, records = run(pool, cell("accelerate-fsdp1-orig-params", "none"))
    assert [f.check for f in verdict.failures] == ["resume"], verdict.message
    assert any("optimizer holds state for 0 of" in n for n in records[0].notes), records[0].notes
