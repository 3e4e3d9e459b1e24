"""Optimizer-subset cells under every correct loop: what reaches no weight passes as `differs`, harm still fails."""

import numpy as np

from pytest_freezecompat.core.names import CANONICAL_LOOP, CLIP_OPTIMIZED_LOOP, MODEL_ZERO_GRAD_LOOP
from pytest_freezecompat.core.records import PlanFacts, RankRecord, StepFacts
from pytest_freezecompat.verdict import checks


def arr(*values):
    return np.array(values, dtype=np.float32)


def subset_record():
    """`w` trains in the optimizer; `h` requires grad but is left out of it (held); one step, clipped.
    The canonical reference clips over both grads (norm 0.5), the optimizer-only loop over `w`'s (0.3)."""
    initial = {"w": arr(1.0), "h": arr(2.0)}
    grads = {"w": arr(0.3), "h": arr(0.4)}
    canonical = StepFacts(dict(grads), 0.5, None, {"w": arr(0.99), "h": arr(2.0)})
    optimizer_only = StepFacts(dict(grads), 0.3, None, {"w": arr(0.989), "h": arr(2.0)})
    return RankRecord(
        rank=0, requires_grad={"w": True, "h": True}, tracked=("w",),
        plan=PlanFacts(("w", "h"), ("w", "h"), ("w",), ()), initial=initial,
        steps=[StepFacts(dict(grads), 0.5, "returned", {"w": arr(0.99), "h": arr(2.0)})],
        reference=[canonical],
        reference_conventions={MODEL_ZERO_GRAD_LOOP: [canonical], CLIP_OPTIMIZED_LOOP: [optimizer_only]})


def judge(record):
    return checks.judge_records([record], "fp32")


def test_the_canonical_loop_passes_clean():
    verdict = judge(subset_record())
    assert (verdict.status, verdict.convention, verdict.differences) == ("pass", CANONICAL_LOOP, [])


def test_a_stack_clipping_over_its_optimizer_params_passes_as_differs_naming_that_loop():
    record = subset_record()
    record.steps[0] = StepFacts({"w": arr(0.3), "h": None}, 0.3, "returned", {"w": arr(0.989), "h": arr(2.0)})
    verdict = judge(record)
    assert (verdict.status, verdict.convention) == ("pass", CLIP_OPTIMIZED_LOOP)
    assert any(CLIP_OPTIMIZED_LOOP in d for d in verdict.differences)
    assert any("no grad on trainable: h" in d and "reach no weight" in d for d in verdict.differences)


def test_rank_local_grads_of_params_outside_the_optimizer_are_a_difference_not_a_failure():
    record = subset_record()
    record.steps[0].grads = {"w": arr(0.3), "h": arr(0.2)}
    verdict = judge(record)
    assert verdict.status == "pass"
    assert any("grad differs from reference: h" in d for d in verdict.differences)


def test_a_held_param_that_moves_fails_under_every_loop():
    record = subset_record()
    record.steps[0].params = {"w": arr(0.99), "h": arr(1.99)}
    verdict = judge(record)
    assert (verdict.status, verdict.check) == ("fail", "update")
    assert "must stay fixed changed: h" in verdict.message
    assert any("closest of the 3 correct loops" in n for n in verdict.notes)


def test_a_wrong_update_of_an_optimizer_param_fails():
    record = subset_record()
    record.steps[0].params = {"w": arr(0.95), "h": arr(2.0)}
    assert judge(record).status == "fail"


def test_a_norm_no_loop_gives_fails():
    record = subset_record()
    record.steps[0].norm = 0.7
    verdict = judge(record)
    assert (verdict.status, verdict.check) == ("fail", "grad_norm")


def test_without_alternatives_nothing_names_a_loop():
    record = subset_record()
    record.reference_conventions = None
    verdict = judge(record)
    assert (verdict.status, verdict.convention) == ("pass", None)
