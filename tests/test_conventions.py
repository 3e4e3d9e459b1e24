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


def drifted_subset_record(h_at_step_1):
    """Two steps of the canonical loop: h's grads add up (0.004, then 0.004 + 0.0025). After step 0 the stack's `w`
    sits a rounding away from the reference's, and its step-1 grads are those taken at its own params (+3e-6; for h,
    the reference's sum moved by as much)."""
    record = subset_record()
    record.reference_conventions = None
    record.steps[0].grads = {"w": arr(0.3), "h": arr(0.004)}
    record.reference[0].grads = {"w": arr(0.3), "h": arr(0.004)}
    record.steps[0].params = {"w": arr(0.99 + 4e-5), "h": arr(2.0)}
    at_own = StepFacts({"w": arr(0.005 + 3e-6), "h": arr(0.0065 + 3e-6)}, 0.0077)
    record.reference.append(StepFacts({"w": arr(0.005), "h": arr(0.0065)}, 0.0077, None,
                                      {"w": arr(0.98), "h": arr(2.0)}))
    record.steps.append(StepFacts({"w": at_own.grads["w"], "h": h_at_step_1}, 0.0077, "returned",
                                  {"w": arr(0.98), "h": arr(2.0)}))
    record.reference_at_own_params = [None, at_own]
    return record


def test_grads_outside_the_optimizer_add_up_from_the_stacks_own_params():
    verdict = judge(drifted_subset_record(arr(0.004 + 0.0025 + 3e-6)))
    assert (verdict.status, verdict.differences) == ("pass", [])


def test_grads_outside_the_optimizer_that_do_not_add_up_are_still_a_difference():
    verdict = judge(drifted_subset_record(arr(0.0025 + 3e-6)))  # zeroed every step: rank-local, not accumulated
    assert verdict.status == "pass"
    assert any("step 1: grad differs from reference: h (max abs diff 4.00e-03)" in d for d in verdict.differences)


def test_a_loop_that_matches_along_its_own_path_is_named_before_any_matches_at_the_stacks_params():
    """The norm is unverifiable; the step-1 grads still tell the loops apart: the optimizer-only loop matches them
    exactly, the canonical one only at the stack's own params."""
    record = drifted_subset_record(arr(0.004 + 0.0025 + 3e-6))
    for step in record.steps:
        step.norm = None
    canonical = record.reference
    along_its_path = StepFacts({**canonical[1].grads, "w": record.steps[1].grads["w"]}, 0.0077, None,
                               dict(canonical[1].params))
    record.reference_conventions = {CLIP_OPTIMIZED_LOOP: [canonical[0], along_its_path]}
    verdict = judge(record)
    assert (verdict.status, verdict.convention) == ("pass", CLIP_OPTIMIZED_LOOP)
    record.reference_conventions = None
    assert judge(record).status == "pass"  # the canonical loop alone, at the stack's params
