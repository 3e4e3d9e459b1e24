"""The `resume` check on hand-made records: the round trip against the uninterrupted run, each part able to fail."""

import copy

import numpy as np
import pytest

from pytest_freezecompat.core.cell import Cell, CellKey
from pytest_freezecompat.core.freeze import FreezePattern
from pytest_freezecompat.core.records import (
    CellRun,
    Outcome,
    PlanFacts,
    RankError,
    RankRecord,
    RankState,
    ResumeFacts,
    StepFacts,
)
from pytest_freezecompat.verdict import checks

NAMES = ("emb", "w", "b")


def arr(*values):
    return np.array(values, dtype=np.float32)


def two_steps():
    """emb frozen; w and b train for two steps."""
    initial = {"emb": arr(1, 1), "w": arr(1, 2), "b": arr(0.5)}
    step0 = StepFacts({"emb": None, "w": arr(0.1, -0.2), "b": arr(0.3)}, 0.374, "returned",
                      {"emb": arr(1, 1), "w": arr(0.99, 2.01), "b": arr(0.49)})
    step1 = StepFacts({"emb": None, "w": arr(0.2, -0.1), "b": arr(0.1)}, 0.245, "returned",
                      {"emb": arr(1, 1), "w": arr(0.98, 2.02), "b": arr(0.48)})
    return initial, step0, step1


def record(rank=0, resumed=True):
    """A cell whose round trip gave back exactly the uninterrupted run."""
    initial, step0, step1 = two_steps()
    resume = ResumeFacts(api="torch.save", saved_after=0, saved_params=NAMES, saved_state=("b", "w"),
                         requires_grad={"emb": False, "w": True, "b": True}, tracked=("b", "w"),
                         loaded=copy.deepcopy(step0.params), steps=[StepFacts(), copy.deepcopy(step1)])
    return RankRecord(rank=rank, requires_grad={"emb": False, "w": True, "b": True}, tracked=("w", "b"),
                      plan=PlanFacts(NAMES, ("w", "b"), ("w", "b"), ()), initial=initial,
                      steps=[step0, step1], reference=copy.deepcopy([step0, step1]),
                      resume=resume if resumed else None)


def resume_failure(verdict):
    (failure,) = [f for f in verdict.failures if f.check == "resume"]
    return failure


def test_a_faithful_round_trip_passes():
    assert checks.judge_records([record(0), record(1)], "fp32").status == "pass"


def test_a_cell_without_a_round_trip_is_judged_as_before():
    assert checks.judge_records([record(resumed=False)], "fp32").status == "pass"


def test_a_param_left_at_its_fresh_value_by_the_load_fails_resume_and_is_named():
    lead = record()
    lead.resume.loaded["w"] = arr(1, 2)  # the fresh model's value: the load skipped it
    lead.resume.steps[1].params["w"] = arr(0.99, 2.01)
    verdict = checks.judge_records([lead], "fp32")
    assert (verdict.status, verdict.check) == ("fail", "resume")
    failure = resume_failure(verdict)
    assert "after load, values differ from what was saved: w" in failure.message
    assert failure.step == 1 and "w" in failure.params and not failure.on_held_params


def test_a_frozen_param_changed_by_the_load_is_a_failure_on_a_held_param():
    lead = record()
    lead.resume.loaded["emb"] = arr(1, 1.0000001)  # frozen: must come back bit-identical
    failure = resume_failure(checks.judge_records([lead], "fp32"))
    assert "emb" in failure.message and failure.on_held_params


def test_a_load_that_unfreezes_a_param_fails_on_any_rank():
    lead, other = record(0), record(1)
    other.resume.requires_grad["emb"] = True
    failure = resume_failure(checks.judge_records([lead, other], "fp32"))
    assert "requires_grad after load differs from the freeze pattern: emb" in failure.message


def test_a_resumed_optimizer_over_another_set_fails():
    lead = record()
    lead.resume.tracked = ("b", "emb", "w")
    message = resume_failure(checks.judge_records([lead], "fp32")).message
    assert "the resumed optimizer tracks what it did not before the save: emb" in message


def test_saved_files_without_a_frozen_param_or_without_a_stepped_params_state_fail():
    lead = record()
    lead.resume.saved_params = ("b", "w")
    lead.resume.saved_state = ("w",)
    message = resume_failure(checks.judge_records([lead], "fp32")).message
    assert "not in the saved files: emb" in message
    assert "no optimizer state in the saved files for a param the optimizer stepped: b" in message


def test_optimizer_state_saved_for_a_frozen_param_is_a_note_not_a_failure():
    lead = record()
    lead.resume.saved_state = ("b", "emb", "w")
    verdict = checks.judge_records([lead], "fp32")
    assert verdict.status == "pass"
    assert any("optimizer state for frozen params: emb" in note for note in verdict.notes)


def test_a_resumed_step_that_differs_fails_with_the_uninterrupted_run_as_its_yardstick():
    lead = record()
    lead.resume.steps[1].grads["w"] = arr(0.2, -0.3)
    lead.resume.steps[1].norm = 0.5
    message = resume_failure(checks.judge_records([lead], "fp32")).message
    assert "resumed step 1: grad differs from the uninterrupted run: w" in message
    assert "resumed step 1: grad norm 0.5 != uninterrupted 0.245" in message


def test_a_resumed_run_that_stops_early_fails():
    lead = record()
    lead.resume.steps = lead.resume.steps[:1]
    assert "did not reach the end of step 1" in resume_failure(checks.judge_records([lead], "fp32")).message


def test_an_error_in_the_round_trip_fails_resume_and_keeps_the_run_judged():
    lead = record()
    lead.resume.error = RankError("RuntimeError", "x is not in the optimizer state", "", 0, "f.py:1 in g",
                                  "resume: save", "", at=1.0, step=0)
    lead.steps[1].grads["w"] = arr(9, 9)  # the run itself is still judged
    verdict = checks.judge_records([lead], "fp32")
    assert [f.check for f in verdict.failures] == ["grads", "resume"]
    assert resume_failure(verdict).message.startswith("resume: save: RuntimeError: x is not in the optimizer state")


def test_a_peer_left_waiting_in_the_round_trip_still_gets_the_run_judged():
    lead = record()
    lead.resume.error = RankError("RuntimeError", "load failed", "", 0, "f.py:1 in g", "resume: load", "", at=1.0)
    run = CellRun(Outcome.STUCK_AFTER_ERROR, [RankState(0, "resume: load", lead),
                                              RankState(1, "resume: load", None)])
    cell = Cell(key=CellKey("tiny-gpt", "torch", "ddp", "eager", "none", "embedding"), environment="torch",
                adapter="x:Y", world_size=2, device="cpu", pattern=FreezePattern("embedding"), groups={})
    verdict = checks.judge(run, cell, 60)
    assert (verdict.status, verdict.check) == ("fail", "resume")
    assert verdict.message.endswith("left waiting: rank 1 (resume: load)")


def test_a_peers_raise_in_the_round_trip_fails_resume_while_the_lead_rank_waits():
    """The lead rank (it holds the reference) still waits in a collective its peer left by raising (the Trainer's
    load on a non-main rank): the peer's raise is the cell's resume failure, not a silent harness error."""
    peer = record()
    peer.resume.error = RankError("KeyError", "'base_model.model.lm_head.weight'", "", 1, "f.py:1 in g",
                                  "resume: load", "", at=1.0)
    run = CellRun(Outcome.STUCK_AFTER_ERROR, [RankState(0, "resume: load", None),
                                              RankState(1, "resume: load", peer)])
    cell = Cell(key=CellKey("tiny-gpt", "torch", "ddp", "eager", "none", "embedding"), environment="torch",
                adapter="x:Y", world_size=2, device="cpu", pattern=FreezePattern("embedding"), groups={})
    verdict = checks.judge(run, cell, 60)
    assert (verdict.status, verdict.check) == ("fail", "resume")
    assert verdict.message == ("resume: load: KeyError: 'base_model.model.lm_head.weight' (rank 1, f.py:1 in g); "
                               "left waiting: rank 0 (resume: load)")
    assert verdict.failures[0].raised


def test_resuming_without_the_grads_that_accumulated_outside_the_optimizer_is_expected():
    """With a param outside the optimizer, its grad accumulates across steps in the uninterrupted run; no
    checkpoint holds it, so the resumed run is expected to differ by what resuming changes in the reference."""
    uninterrupted = StepFacts({"x": arr(3.0), "w": arr(1.0)}, 2.0, "n", {"x": arr(5.0), "w": arr(0.5)})
    ref = StepFacts({"x": arr(3.0), "w": arr(1.0)}, 2.0, None, {"x": arr(5.0), "w": arr(0.5)})
    resumed_ref = StepFacts({"x": arr(1.0), "w": arr(1.0)}, 1.5, None, {"x": arr(5.0), "w": arr(0.6)})
    want = checks.resumed_expectation(uninterrupted, ref, resumed_ref)
    assert want.grads["x"] == arr(1.0) and want.grads["w"] == arr(1.0)
    assert want.norm == 1.5 and want.params["w"] == pytest.approx(arr(0.6))
    assert checks.resumed_expectation(uninterrupted, ref, None) is uninterrupted


def test_a_stack_that_zeroes_every_model_grad_has_nothing_for_a_checkpoint_to_lose():
    """Its uninterrupted grads already look like the resumed reference's: the expectation is the run itself."""
    uninterrupted = StepFacts({"x": arr(1.0), "w": arr(1.0)}, 1.5, "n", {"x": arr(5.0), "w": arr(0.6)})
    ref = StepFacts({"x": arr(3.0), "w": arr(1.0)}, 2.0, None, {"x": arr(5.0), "w": arr(0.5)})
    resumed_ref = StepFacts({"x": arr(1.0), "w": arr(1.0)}, 1.5, None, {"x": arr(5.0), "w": arr(0.6)})
    assert checks.resumed_expectation(uninterrupted, ref, resumed_ref) is uninterrupted
