"""The verdict logic on hand-made records: each check must be able to fail."""

import numpy as np
import pytest

from pytest_freezecompat.core.cell import Cell, CellKey
from pytest_freezecompat.core.freeze import FreezePattern
from pytest_freezecompat.core.records import CellRun, Outcome, PlanFacts, RankError, RankRecord, RankState, StepFacts
from pytest_freezecompat.verdict import checks

NAMES = ["emb", "w", "b"]


def arr(*values):
    return np.array(values, dtype=np.float32)


def base_record(rank=0):
    """Two params train (w, b), emb is frozen; the framework saw exactly what the reference saw."""
    initial = {"emb": arr(1, 1), "w": arr(1, 2), "b": arr(0.5)}
    grads = {"emb": None, "w": arr(0.1, -0.2), "b": arr(0.3)}
    params = {"emb": arr(1, 1), "w": arr(0.99, 2.01), "b": arr(0.49)}
    return RankRecord(
        rank=rank, requires_grad={"emb": False, "w": True, "b": True}, tracked=("w", "b"),
        plan=PlanFacts(tuple(NAMES), ("w", "b"), ("w", "b"), ()), initial=initial,
        steps=[StepFacts(dict(grads), 0.374, "returned", dict(params))],
        reference=[StepFacts(dict(grads), 0.374, None, dict(params))],
    )


def judge(record, may_refuse=False):
    return checks.judge_records([record], "fp32", may_refuse)


def test_identical_to_reference_passes():
    assert judge(base_record()).status == "pass"


def test_wrapping_that_flips_requires_grad_fails_that_check():
    record = base_record()
    record.requires_grad["emb"] = True
    verdict = judge(record)
    assert (verdict.status, verdict.check) == ("fail", "requires_grad")
    assert "emb (False->True)" in verdict.message


def test_optimizer_tracking_more_than_intended_fails():
    record = base_record()
    record.tracked += ("emb",)
    verdict = judge(record)
    assert (verdict.status, verdict.check) == ("fail", "optimizer")
    assert "tracks 1 unintended: emb" in verdict.message


def test_tracked_names_are_the_union_over_ranks():
    lead, other = base_record(0), base_record(1)
    lead.tracked, other.tracked = ("w",), ("b",)
    assert checks.judge_records([lead, other], "fp32").status == "pass"


def test_missing_grad_on_a_trainable_param_is_a_silent_failure_caught():
    record = base_record()
    record.steps[0].grads = {**record.steps[0].grads, "w": None}
    verdict = judge(record)
    assert (verdict.status, verdict.check) == ("fail", "grads")
    assert "no grad on trainable: w" in verdict.message


def test_grad_that_differs_from_reference_fails():
    record = base_record()
    record.steps[0].grads = {**record.steps[0].grads, "w": arr(0.2, -0.2)}
    assert judge(record).check == "grads"


def test_zero_filled_grad_on_frozen_param_is_only_noted():
    record = base_record()
    record.steps[0].grads = {**record.steps[0].grads, "emb": arr(0, 0)}
    verdict = judge(record)
    assert verdict.status == "pass"
    assert any("zero-filled grad" in n and "emb" in n for n in verdict.notes)


def test_grad_norm_mismatch_fails_and_missing_norm_is_noted():
    record = base_record()
    record.steps[0].norm = 0.5
    assert judge(record).check == "grad_norm"
    record.steps[0].norm, record.steps[0].norm_source = None, "plugin exposes no norm"
    verdict = judge(record)
    assert verdict.status == "pass" and any("not verified: plugin exposes no norm" in n for n in verdict.notes)


def test_a_cell_that_never_clips_has_no_norm_to_compare_but_grads_and_updates_still_count():
    record = base_record()
    record.steps[0].norm, record.steps[0].norm_source = None, None
    unclipped = checks.judge_records([record], "fp32", clips=False)
    assert unclipped.status == "pass" and not any("norm" in n for n in unclipped.notes)
    record.steps[0].grads["w"] = arr(0.1, -0.3)
    assert checks.judge_records([record], "fp32", clips=False).check == "grads"


def test_frozen_param_that_moves_by_one_ulp_fails():
    record = base_record()
    moved = np.nextafter(arr(1, 1), np.float32(2))
    record.steps[0].params = {**record.steps[0].params, "emb": moved}
    verdict = judge(record)
    assert (verdict.status, verdict.check) == ("fail", "update")
    assert "must stay fixed changed: emb" in verdict.message


def test_update_beyond_tolerance_fails_within_tolerance_passes():
    record = base_record()
    record.steps[0].params = {**record.steps[0].params, "w": arr(0.99 + 5e-4, 2.01)}
    assert judge(record).status == "pass"
    record.steps[0].params = {**record.steps[0].params, "w": arr(0.98, 2.01)}
    assert judge(record).check == "update"


def error_record(rank, phase, at, message="boom", step=None):
    return RankRecord(rank=rank, error=RankError("RuntimeError", message, message, rank, "x.py:1 in f", phase, "...",
                                                 at, step))


def test_an_error_is_reported_from_the_rank_that_raised_first():
    verdict = checks.judge_records([error_record(0, "step 0: forward/backward", 2.0, "echo", 0),
                                    error_record(1, "step 0: forward/backward", 1.0, "cause", 0)], "fp32")
    assert verdict.status == "error" and "cause (rank 1" in verdict.message


@pytest.mark.parametrize(("phase", "step", "status"), [("wrap (ddp)", None, "pass"),
                                                       ("step 0: forward/backward", 0, "error")])
def test_a_pattern_that_may_be_refused_passes_only_when_refused_before_the_first_step(phase, step, status):
    verdict = checks.judge_records([error_record(0, phase, 1.0, step=step)], "fp32", may_refuse=True)
    assert verdict.status == status
    assert checks.judge_records([error_record(0, phase, 1.0, step=step)], "fp32").status == "error"


def cell(freeze="none"):
    key = CellKey("tiny-gpt", "torch", "ddp", "eager", "none", freeze)
    return Cell(key=key, environment="torch", adapter="x:Y", world_size=2, device="cpu",
                pattern=FreezePattern(freeze), groups={})


def test_timeout_and_crash_verdicts_name_every_rank():
    ranks = [RankState(0, phase="step 1: clip"), RankState(1, phase="wrap", exit="killed by signal SIGSEGV")]
    crash = checks.judge(CellRun(Outcome.CRASH, ranks), cell(), 30)
    assert crash.status == "crash" and "rank 1 killed by signal SIGSEGV during wrap" in crash.message
    hang = checks.judge(CellRun(Outcome.TIMEOUT, ranks), cell(), 30)
    assert hang.status == "timeout" and "rank 0: step 1: clip; rank 1: wrap" in hang.message


def test_all_zero_grad_where_the_reference_has_one_is_named_as_such():
    record = base_record()
    record.steps[0].grads = {**record.steps[0].grads, "w": arr(0, 0)}
    verdict = judge(record)
    assert verdict.check == "grads" and "all-zero grad where the reference has one: w" in verdict.message


def test_the_same_error_on_every_rank_names_the_lowest_rank():
    verdict = checks.judge_records([error_record(1, "wrap", 1.0, "same"), error_record(0, "wrap", 1.1, "same")],
                                   "fp32")
    assert "same (rank 0" in verdict.message


def test_an_element_whose_reference_grad_is_noise_may_flip_but_a_real_one_may_not():
    record = base_record()
    record.reference[0].grads["w"] = arr(1e-9, -0.2)  # w[0]: grad under the tolerance
    record.steps[0].grads["w"] = arr(1e-9, -0.2)
    flipped = arr(0.99 + 0.015, 2.01)  # 1.5 lr the other way, on the noise element
    record.steps[0].params = {**record.steps[0].params, "w": flipped}
    assert judge(record).status == "pass"
    record.steps[0].params = {**record.steps[0].params, "w": arr(0.99, 2.01 + 0.015)}  # real grad
    assert judge(record).check == "update"


def test_the_earliest_step_names_the_failed_check():
    record = base_record()
    record.steps[0].norm = 0.5  # step 0: grad norm
    record.steps.append(StepFacts({**record.steps[0].grads, "w": None}, 0.374, "returned", record.steps[0].params))
    record.reference.append(record.reference[0])
    assert judge(record).check == "grad_norm"


def drifted_record():
    """Two steps; after step 0 the stack's w sits within tolerance of the reference's (Adam's reaction to rounding),
    and its step-1 grads are those the reference takes at the stack's own params, not along its own path."""
    record = base_record()
    record.steps[0].params = {**record.steps[0].params, "w": arr(0.99 + 4e-5, 2.01)}
    record.reference.append(StepFacts({"emb": None, "w": arr(0.005, -0.1), "b": arr(0.2)}, 0.22366, None,
                                      {"emb": arr(1, 1), "w": arr(0.98, 2.02), "b": arr(0.48)}))
    at_own = StepFacts({"emb": None, "w": arr(0.005 + 3e-6, -0.1), "b": arr(0.2)}, 0.22366)
    record.steps.append(StepFacts(dict(at_own.grads), at_own.norm, "returned", dict(record.reference[1].params)))
    record.reference_at_own_params = [None, at_own]
    return record


def test_grads_after_a_step_are_judged_at_the_params_the_stack_held():
    record = drifted_record()
    assert judge(record).status == "pass"
    record.reference_at_own_params = None  # along the reference's own path, 3e-6 is beyond the grad tolerance
    assert judge(record).check == "grads"


def test_grads_at_the_stacks_own_params_must_still_match():
    record = drifted_record()
    record.steps[1].grads["w"] = arr(0.01, -0.2)  # twice the reference's, at either params
    verdict = judge(record)
    assert (verdict.status, verdict.check, verdict.failures[0].step) == ("fail", "grads", 1)


def test_only_params_that_held_are_a_stacks_own_for_its_next_grads():
    record = drifted_record()
    record.steps[0].params["w"] = arr(0.9, 2.01)  # step 0 moved w by 10 lr too far: its update failed
    verdict = judge(record)
    assert [(f.check, f.step) for f in verdict.failures] == [("update", 0), ("grads", 1)]


def low_precision_record(mixed_w_grad, mixed_w_param=None):
    """A bf16 cell whose mixed-precision reference differs from the fp32 one on w (the precision's spread)."""
    record = base_record()
    mixed = StepFacts(dict(record.reference[0].grads), 0.374, None, dict(record.reference[0].params))
    mixed.grads["w"] = mixed_w_grad
    if mixed_w_param is not None:
        mixed.params["w"] = mixed_w_param
    record.reference_mixed = [mixed]
    return record


def test_a_low_precision_cell_may_sit_twice_its_measured_spread_from_the_fp32_reference():
    record = low_precision_record(arr(0.1, -0.2 * 1.01))  # the precision moves w's grad by 1% of its scale
    record.steps[0].grads["w"] = arr(0.1, -0.2 * 1.015)
    verdict = checks.judge_records([record], "bf16")
    assert verdict.status == "pass"
    assert "2x its measured spread (widest relative grad spread 1.00e-02" in " ".join(verdict.notes)
    assert checks.judge_records([record], "fp32").check == "grads"  # an fp32 cell gets no such room
    record.steps[0].grads["w"] = arr(0.1, -0.2 * 1.03)  # 3x the spread
    assert checks.judge_records([record], "bf16").check == "grads"


def test_a_low_precision_grad_of_the_wrong_scale_fails_whatever_the_spread():
    record = low_precision_record(arr(0.1 * 1.05, -0.2))
    record.steps[0].grads["b"] = arr(0.6)  # 2x: room for b is 2 * 5% of its scale
    assert checks.judge_records([record], "bf16").check == "grads"


def test_a_flipped_noise_element_of_a_low_precision_param_may_also_be_rounded():
    """bf16 working params: a noise-level grad flips (2 lr) and the stored param is rounded on top of it."""
    record = low_precision_record(arr(1e-9, -0.2), mixed_w_param=arr(0.99 + 0.002, 2.01))  # rounding seen: 2e-3
    record.reference[0].grads["w"] = arr(1e-9, -0.2)
    record.steps[0].grads["w"] = arr(-1e-9, -0.2)
    rounded_flip = arr(0.99 + 0.023, 2.01)  # 2 lr + 3e-3 of rounding (within 2x the spread seen, plus fp32's 1e-3)
    record.steps[0].params = {**record.steps[0].params, "w": rounded_flip}
    assert checks.judge_records([record], "bf16").status == "pass"
    assert checks.judge_records([record], "fp32").check == "update"  # fp32 stores no such rounding


def test_grads_that_are_one_multiple_of_the_reference_carry_that_scale():
    record = base_record()
    record.steps[0].grads = {"emb": None, "w": arr(0.2, -0.4), "b": arr(0.6)}
    failure = judge(record).failures[0]
    assert (failure.check, failure.scale, failure.params_kind) == ("grads", 2.0, "trained")
    record.steps[0].grads["b"] = arr(0.9)  # w is 2x, b 3x: no one factor
    assert judge(record).failures[0].scale is None


def test_a_norm_that_is_each_ranks_shard_norm_says_so():
    lead, other = base_record(0), base_record(1)
    lead.steps[0].norm, other.steps[0].norm = 0.3, (0.374 ** 2 - 0.3 ** 2) ** 0.5  # L2 parts of 0.374
    failure = checks.judge_records([lead, other], "fp32").failures[0]
    assert (failure.check, failure.ranks_combine) == ("grad_norm", "l2")
    other.steps[0].norm = 0.3
    assert checks.judge_records([lead, other], "fp32").failures[0].ranks_combine is None


def test_a_moved_param_the_reference_gives_no_grad_is_of_kind_no_grad():
    record = base_record()
    record.reference[0].grads["b"] = None
    record.reference[0].params["b"] = arr(0.5)  # unused: the reference leaves it alone
    record.steps[0].grads["b"] = arr(0.0)  # zero-filled, and the optimizer moved it
    failure = judge(record).failures[0]
    assert (failure.check, failure.params_kind, failure.on_held_params) == ("update", "no-grad", False)


def test_an_error_says_whether_it_was_raised_while_wrapping_or_training():
    assert checks.judge_records([error_record(0, "boost", 1.0, "boom")], "fp32").raised_in == "wrapping"
    training = error_record(0, "step 0: forward/backward", 1.0, "boom")
    training.error.step = 0
    assert checks.judge_records([training], "fp32").raised_in == "training"
    assert checks.stage_of_phases(["boost (torch-ddp)", "step 1: clip"]) == "training"
    assert checks.stage_of_phases(["boost (torch-ddp)"]) == "wrapping"


def test_close_answers_as_numpy_allclose_does():
    """Random float32 pairs near and beyond the tolerance, with infinities and NaNs on either side."""
    rng = np.random.default_rng(0)
    specials = [np.inf, -np.inf, np.nan, 0.0]
    for trial in range(3000):
        want = rng.standard_normal(8).astype(np.float32)
        have = (want + rng.standard_normal(8).astype(np.float32) * 10.0 ** rng.integers(-9, -3)).astype(np.float32)
        if trial % 5 == 0:
            have[rng.integers(8)] = want[rng.integers(8)] = specials[rng.integers(4)]
        if trial % 7 == 0:
            have[rng.integers(8)] = specials[rng.integers(4)]
        rtol, atol = 10.0 ** rng.integers(-7, -3), 10.0 ** rng.integers(-8, -4)
        assert checks.close(have, want, rtol, atol) == np.allclose(have, want, rtol=rtol, atol=atol), (have, want)


def test_a_refusal_of_a_pattern_with_nothing_to_train_is_a_pass_that_says_training_never_ran():
    record = base_record()
    record.error = RankError("ValueError", "optimizer got an empty parameter list", "", 0, "x.py:1", "wrap", "", 0.0)
    verdict = judge(record, may_refuse=True)
    assert (verdict.status, verdict.unchecked) == ("pass", ["training"])


def test_a_pass_lists_each_deciding_check_that_did_not_run():
    record = base_record()
    assert judge(record).unchecked == ["resume"]  # no round trip reported
    record.steps[0].norm = None  # the stack reports no clip norm
    assert judge(record).unchecked == ["grad_norm", "resume"]
    assert checks.judge_records([record], "fp32", clips=False).unchecked == ["resume"]  # nothing to clip


def test_every_failure_carries_its_kinds_and_whether_the_optimizer_holds_what_it_names():
    record = base_record()
    record.requires_grad["emb"] = True
    record.steps[0].grads = {**record.steps[0].grads, "emb": arr(0.5, 0.5)}  # a grad on the frozen param
    verdict = judge(record)
    by_check = {f.check: f for f in verdict.failures}
    assert by_check["requires_grad"].kinds == ("flag-changed",)
    assert (by_check["grads"].kinds, by_check["grads"].in_optimizer) == (("spurious",), False)
    record.tracked += ("emb",)
    by_check = {f.check: f for f in judge(record).failures}
    assert by_check["optimizer"].kinds == ("tracks-unintended",)
    assert by_check["grads"].in_optimizer is True


def test_every_judged_row_states_its_tolerance_and_how_much_of_it_was_used():
    stated = judge(base_record()).tolerance
    assert stated == {"precision": "fp32", **{f: getattr(checks.FP32, f) for f in (
        "grad_rtol", "grad_atol", "param_rtol", "param_atol", "norm_rtol")}, "used": {"grads": 0.0, "params": 0.0}}
    record = base_record()
    record.steps[0].grads = {**record.steps[0].grads, "w": arr(0.1, -0.2 + 1.05e-5)}  # half its tolerance
    used = judge(record).tolerance["used"]["grads"]
    assert 0.4 < used < 0.6


def test_one_noisy_tensor_no_longer_widens_every_other_tensors_low_precision_room():
    """Room per tensor: `b`'s bf16 spread is 40% of its scale, `w`'s 0.1%; a 10% error on `w` was within the old
    shared room (2 x 40% of w's scale) and is beyond its own (2 x max(0.1%, one bf16 epsilon))."""
    ref = StepFacts({"w": arr(1.0, -2.0), "b": arr(0.5)}, 1.0, None, {})
    mixed = StepFacts({"w": arr(1.002, -2.0), "b": arr(0.7)}, 1.0, None, {})
    room = checks.measured_room(ref, mixed)
    assert room.grad("b") == pytest.approx(2 * 0.4 * 0.5)
    assert room.grad("w") == pytest.approx(2 * checks.LOW_PRECISION_FLOOR * 2.0)
    ten_percent_off = arr(1.2, -2.0)
    assert not checks.close(ten_percent_off, ref.grads["w"], rtol=1e-4, atol=1e-6 + room.grad("w"))


def test_an_error_keeps_what_the_stack_raised_in_its_own_words():
    record = base_record()
    record.error = RankError("RuntimeError", "boom", "", 1, "x.py:1", "step 0: forward/backward", "", 0.0, step=0)
    assert judge(record).error == {"type": "RuntimeError", "message": "boom"}


def test_a_rank_whose_params_drift_from_rank_0s_fails_though_rank_0_matches_the_reference():
    lead, other = base_record(0), base_record(1)
    assert checks.judge_records([lead, other], "fp32").status == "pass"
    other.steps[0].params = {**other.steps[0].params, "w": arr(0.9, 2.01)}  # rank 1 alone stepped differently
    verdict = checks.judge_records([lead, other], "fp32")
    assert (verdict.status, verdict.check) == ("fail", "update")
    assert verdict.failures[0].kinds == ("ranks-differ",)
    assert "rank 1's params differ from rank 0's: w" in verdict.message


def test_a_rank_whose_grads_drift_fails_but_rank_local_grads_outside_the_optimizer_may_differ():
    lead, other = base_record(0), base_record(1)
    other.steps[0].grads = {**other.steps[0].grads, "b": arr(0.6)}
    assert checks.judge_records([lead, other], "fp32").check == "grads"
    for record in (lead, other):  # b requires grad but no optimizer holds it: its grad may stay rank-local
        record.plan = PlanFacts(tuple(NAMES), ("w", "b"), ("w",), ())
        record.tracked = ("w",)
    lead.steps[0].params["b"] = other.steps[0].params["b"] = lead.initial["b"]
    lead.reference[0].params["b"] = lead.initial["b"]
    assert checks.judge_records([lead, other], "fp32").status == "pass"


def test_a_rank_whose_tensors_were_not_read_leaves_the_cell_unproven_on_every_rank():
    lead, other = base_record(0), base_record(1)
    other.steps[0].params = other.steps[0].grads = None
    assert checks.judge_records([lead, other], "fp32").unchecked == ["resume", "ranks"]


def test_a_grad_zero_in_theory_and_tiny_in_bf16_is_no_failure_but_a_real_grad_there_is():
    """The zero3-bf16 control of a user's model: a grad exactly zero in the reference, 4.2e-6 under bf16 (rounding of
    terms the size of the step's other grads), was silent; a grad the size of those terms still fails."""
    ref = StepFacts({"w": arr(0.5, -0.25), "zero": arr(0.0, 0.0)}, 1.0, None, {})
    mixed = StepFacts({"w": arr(0.5, -0.25), "zero": arr(0.0, 0.0)}, 1.0, None, {})
    room = checks.measured_room(ref, mixed)
    assert checks.close(arr(4.2e-6, 0.0), ref.grads["zero"], rtol=1e-4, atol=1e-6 + room.grad("zero"))
    assert not checks.close(arr(0.05, 0.0), ref.grads["zero"], rtol=1e-4, atol=1e-6 + room.grad("zero"))


def test_a_failure_both_ways_does_not_keep_a_trained_grad_that_matches_at_the_stacks_own_params():
    """ColossalAI 0.3.4's lazy init: the frozen emb gets a grad at every step (both ways); w's step-1 grad matches at
    the params the stack held, not along the reference's path. The failure names emb alone (costly), not w."""
    record = drifted_record()
    for step in record.steps:
        step.grads["emb"] = arr(0.5, 0.5)
    verdict = judge(record)
    grads = next(f for f in verdict.failures if f.check == "grads")
    assert grads.params == ("emb",) and "differs" not in grads.kinds
