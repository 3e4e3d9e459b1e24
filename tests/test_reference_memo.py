"""Rank 0's reference memo: cells that differ only in how the stack ran share one reference; any change to what a
reference reads (values, plan, batches, hyperparameters, variant) computes a new one, equal to a fresh run."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from slices import matrix_cell

from pytest_freezecompat import models
from pytest_freezecompat.core.cell import Cell
from pytest_freezecompat.core.freeze import resolve
from pytest_freezecompat.core.names import import_ref
from pytest_freezecompat.core.records import RankRecord, StepFacts
from pytest_freezecompat.rank import reference, scenario


def test_digest_reads_tensor_bytes_dtype_and_shape_and_ignores_mapping_and_set_order():
    t = torch.arange(6, dtype=torch.float32)
    assert reference.digest({"a": t, "b": 1}) == reference.digest({"b": 1, "a": t.clone()})
    assert reference.digest(frozenset({"x", "y", "z"})) == reference.digest(frozenset({"z", "y", "x"}))
    nudged = t.clone()
    nudged[3] = torch.nextafter(nudged[3], torch.tensor(10.0))
    assert reference.digest(t) != reference.digest(nudged)
    assert reference.digest(t) != reference.digest(t.double())
    assert reference.digest(t) != reference.digest(t.reshape(2, 3))
    assert reference.digest(t.to(torch.bfloat16)) != reference.digest(t.to(torch.float16))
    assert reference.digest(None, 1) != reference.digest(1, None)


def test_memo_computes_a_key_once_and_forgets_the_least_recently_used():
    memo: reference.Memo[int] = reference.Memo(size=2)
    calls: list[str] = []

    def compute(key: str) -> int:
        calls.append(key)
        return len(calls)

    assert [memo.get(k, lambda k=k: compute(k)) for k in ("a", "b", "a", "c", "b")] == [1, 2, 1, 3, 4]
    assert calls == ["a", "b", "c", "b"] and memo.hits == 1  # c pushed b out (a was used after b)


def torch_cell(**axes: str) -> Cell:
    return matrix_cell("torch", model="tiny-gpt", clip="clip", **axes)


def _reference_of(cell: Cell, nudge: float = 0.0) -> RankRecord:
    """Rank 0's reference for `cell` from the model's eager values (plus `nudge` on one weight)."""
    model = models.build(cell.key.model, seed=cell.hyper.seed, features=cell.pattern.features)
    plan = resolve(cell.pattern, cell.groups, [n for n, _ in model.named_parameters()])
    initial = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    first = next(iter(initial))
    initial[first] = initial[first] + nudge
    batches, loss = scenario._data(cell)
    record = RankRecord(rank=0)
    scenario._reference(cell, import_ref(cell.adapter)(), plan, initial, None, batches, loss, record)
    return record


@pytest.fixture
def runs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The references actually computed (by cell id) with a fresh memo."""
    monkeypatch.setattr(scenario, "_REFERENCES", reference.Memo())
    computed: list[str] = []
    real = reference.run

    def counted(cell: Cell, *args: object, **kwargs: object) -> list[reference.ReferenceStep]:
        computed.append(cell.id)
        return real(cell, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(reference, "run", counted)
    return computed


def _same(a: RankRecord, b: RankRecord) -> bool:
    def flat(record: RankRecord) -> list[np.ndarray]:
        return [v for step in record.reference or [] for part in (step.grads, step.params)
                for v in part.values() if v is not None]

    return len(flat(a)) == len(flat(b)) > 0 and all(np.array_equal(x, y) for x, y in zip(flat(a), flat(b)))


def test_cells_that_differ_in_stack_only_share_one_reference(runs: list[str]):
    ddp = torch_cell(plugin="ddp", init="eager", checkpoint="none", freeze="embedding")
    fsdp2 = torch_cell(plugin="fsdp2", init="meta", checkpoint="reentrant", freeze="embedding")
    first, second = _reference_of(ddp), _reference_of(fsdp2)
    assert runs == [ddp.id] and _same(first, second)


@pytest.mark.parametrize("change", ["initial value", "freeze pattern", "optimizer set", "clip", "steps"])
def test_a_change_to_what_the_reference_reads_computes_it_again_as_a_fresh_run_would(runs: list[str], change: str):
    cell = torch_cell(plugin="ddp", init="eager", checkpoint="none",
                      freeze="none" if change == "optimizer set" else "embedding")
    _reference_of(cell)
    other, nudge = cell, 0.0
    if change == "initial value":
        nudge = 1e-3
    elif change == "freeze pattern":
        other = torch_cell(plugin="ddp", init="eager", checkpoint="none", freeze="decoder")
    elif change == "optimizer set":  # the same params train; the optimizer holds fewer
        other = torch_cell(plugin="ddp", init="eager", checkpoint="none", freeze="optimizer-subset")
    elif change == "clip":
        other = dataclasses.replace(cell, hyper=dataclasses.replace(cell.hyper, max_norm=0.0))
    else:
        other = dataclasses.replace(cell, hyper=dataclasses.replace(cell.hyper, steps=3))
    memoized = _reference_of(other, nudge)
    assert len(runs) >= 2
    scenario._REFERENCES = reference.Memo()  # the fixture's monkeypatch puts the real memo back
    assert _same(memoized, _reference_of(other, nudge))


def test_the_next_step_is_taken_again_at_the_stacks_own_params_only_where_they_are_not_the_references():
    cell = torch_cell(plugin="ddp", init="eager", checkpoint="none", freeze="embedding")
    model = models.build(cell.key.model, seed=cell.hyper.seed)
    plan = resolve(cell.pattern, cell.groups, [n for n, _ in model.named_parameters()])
    initial = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    batches, loss = scenario._data(cell)
    along = reference.run(cell, plan, initial, batches, model, loss)

    def judged_with(stack_params: dict[str, np.ndarray]) -> RankRecord:
        record = RankRecord(rank=0)
        record.steps = [StepFacts(params=stack_params), StepFacts()]
        scenario._reference(cell, import_ref(cell.adapter)(), plan, initial, None, batches, loss, record)
        return record

    same = judged_with(scenario.to_numpy(along[0].params))
    assert same.reference_at_own_params == [None, None]
    drifted = scenario.to_numpy(along[0].params)
    drifted["head.weight"][0, 0] += 1e-4  # within the param tolerance
    [_, taken] = judged_with(drifted).reference_at_own_params or []
    fresh = reference.run(cell, plan, {n: torch.from_numpy(v) for n, v in drifted.items()}, batches[1:],
                          models.build(cell.key.model, seed=cell.hyper.seed), loss)[0]
    assert taken is not None and taken.norm == fresh.norm
    assert all(np.array_equal(taken.grads[n], v.numpy()) for n, v in fresh.grads.items() if v is not None)
    assert not np.array_equal(taken.grads["head.weight"], scenario.to_numpy(along[1].grads)["head.weight"])


def test_a_mixed_precision_and_a_subset_optimizer_cell_get_every_reference_variant(runs: list[str]):
    """optimizer-subset under clipping runs the loop's other conventions; each variant is its own entry."""
    cell = torch_cell(plugin="ddp", init="eager", checkpoint="none", freeze="optimizer-subset")
    record = _reference_of(cell)
    assert record.reference_conventions and len(runs) == 1 + len(record.reference_conventions)
    _reference_of(torch_cell(plugin="fsdp1", init="eager", checkpoint="none", freeze="optimizer-subset"))
    assert len(runs) == 1 + len(record.reference_conventions)


def test_the_reference_after_a_round_trip_is_charged_to_reference_not_resume():
    recorder = scenario.Recorder(0, lambda text: None)
    recorder.phase("step 0: forward/backward")
    recorder.resuming("tear down")
    recorder.phase("load")
    assert recorder.record.phase == "resume: load"
    recorder.run_ended()
    recorder.phase("reference")
    recorder.finished()
    assert recorder.record.phase == "reference" and {"steps", "resume", "reference"} <= set(recorder.record.phases_s)
