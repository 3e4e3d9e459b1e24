"""Severity from report rows: what reaches the weights decides, not which check tripped."""

import pytest

from pytest_freezecompat.core.names import SEVERITIES
from pytest_freezecompat.verdict import classify, severity


def row(status="fail", failures=(), **extra):
    return {"id": "m/f/p/eager/none/embedding", "model": "m", "framework": "f", "plugin": "p", "init": "eager",
            "checkpoint": "none", "freeze": "embedding", "clip": "clip", "status": status, "message": "",
            "failures": list(failures), **extra}


def failure(check, message="", **extra):
    return {"check": check, "params": [], "message": message, **extra}


@pytest.mark.parametrize(("failures", "want"), [
    ([failure("update", "step 0: param that must stay fixed changed: emb")], "silent"),
    ([failure("grads", "step 0: no grad on trainable: w")], "silent"),
    ([failure("grad_norm", "step 0: grad norm 1 != reference 2")], "silent"),
    ([failure("optimizer", "optimizer tracks 2 unintended: emb, pos")], "costly"),
    ([failure("optimizer", "optimizer misses 1: w")], "silent"),
    ([failure("requires_grad", "requires_grad changed by wrapping: emb (False->True)")], "costly"),
    ([failure("resume", "resume: load: KeyError: 'w' (rank 0, x.py:1 in f)", raised=True)], "refused"),
    ([failure("resume", "resume: save: KeyError: 'w' (rank 0, x.py:1 in f)")], "refused"),  # an older row
    ([failure("resume", "not in the saved files: w")], "silent"),
    ([failure("resume", "requires_grad after load differs from the freeze pattern: emb")], "costly"),
    ([failure("optimizer", "optimizer tracks 1 unintended: emb"),
      failure("resume", "resume: load: KeyError: 'w' (rank 0)", raised=True)], "refused"),
    ([failure("optimizer", "optimizer tracks 1 unintended: emb"), failure("update", "step 1: ...")], "silent"),
])
def test_a_failed_run_is_as_bad_as_what_reaches_the_weights(failures, want):
    assert severity.severity_of(row("fail", failures)) == want


@pytest.mark.parametrize(("status", "extra", "want"), [
    ("error", {}, "refused"), ("crash", {}, "refused"), ("timeout", {}, "refused"), ("skip", {}, "skipped"),
    ("pass", {}, "ok"), ("pass", {"differences": ["step 0: grad differs: h"]}, "differs"),
    ("error", {"cause": "harness"}, "harness"),
])
def test_every_status_has_a_severity(status, extra, want):
    assert severity.severity_of(row(status, **extra)) == want


def test_a_known_issue_never_softens_silent_harm():
    known = {"id": "x", "expected": True}
    assert severity.severity_of(row("fail", [failure("update", "moved")], known_issue=known)) == "silent"


def test_classify_sets_cause_then_severity_on_every_row():
    rows = classify([row("error", message="E: boom", cause="harness"), row("pass")])
    assert [r["severity"] for r in rows] == ["harness", "ok"]
    assert all(r["severity"] in SEVERITIES for r in rows)


@pytest.mark.parametrize("unchecked", [["training"], ["grad_norm"], ["resume"], ["grad_norm", "resume"]])
def test_a_pass_with_a_deciding_check_that_did_not_run_is_unproven_never_ok(unchecked):
    assert severity.severity_of(row("pass", unchecked=unchecked)) == "unproven"
    assert severity.severity_of(row("pass", unchecked=unchecked, differences=["x"])) == "unproven"


def test_grads_on_params_no_optimizer_holds_are_costly_where_nothing_moves():
    """ColossalAI's lazy init: wrapping sets requires_grad on frozen params, which then get grads, but the optimizer
    the user built holds none of them and no weight moves."""
    lazy = [failure("requires_grad", "x", kinds=["flag-changed"]),
            failure("grads", "x", kinds=["spurious"], params=["emb"], in_optimizer=False)]
    assert severity.severity_of(row("fail", lazy)) == "costly"
    held_in_optimizer = [failure("grads", "x", kinds=["spurious"], params=["emb"], in_optimizer=True)]
    assert severity.severity_of(row("fail", held_in_optimizer)) == "silent"
    and_the_norm = [*lazy, failure("grad_norm", "x", kinds=["norm-differs"])]
    assert severity.severity_of(row("fail", and_the_norm)) == "silent"
    # where the stack reports no clip norm, those grads may have scaled every trained one through clipping
    assert severity.severity_of(row("fail", lazy, unchecked=["grad_norm"])) == "silent"


@pytest.mark.parametrize(("failures", "want"), [
    ([failure("optimizer", kinds=["tracks-unintended"])], "costly"),
    ([failure("optimizer", kinds=["misses-trained"])], "silent"),
    ([failure("resume", kinds=["raised"], raised=True)], "refused"),
    ([failure("resume", kinds=["flag-after-load", "tracks-more-after-load"])], "costly"),
    ([failure("resume", kinds=["flag-after-load", "not-saved"])], "silent"),
])
def test_severity_reads_the_kinds_not_the_words(failures, want):
    """Rewording (here: reversing) every message leaves every severity as it was."""
    reworded = [{**f, "message": "optimizer misses; resume: load: E: x"[::-1]} for f in failures]
    assert severity.severity_of(row("fail", failures)) == want
    assert severity.severity_of(row("fail", reworded)) == want
