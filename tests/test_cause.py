"""The differential verdict: is a red cell red because of freezing, or because the stack fails anyway?"""

import pytest

from pytest_freezecompat.verdict import cause


def row(freeze="embedding", status="fail", failures=(), message="", **extra):
    return {"model": "m", "framework": "fw", "plugin": "p", "init": "eager", "checkpoint": "none", "freeze": freeze,
            "status": status, "message": message, "failures": [dict(f) for f in failures], **extra}


def failure(check, *params, held=False):
    return {"check": check, "step": 0, "message": "...", "params": list(params), "on_held_params": held}


GRADS_W = failure("grads", "w")


@pytest.mark.parametrize(("cell", "control", "expected"), [
    (row(failures=[GRADS_W]), row("none", "pass"), "freeze"),  # the control passes
    (row(failures=[GRADS_W]), row("none", failures=[failure("grads", "w", "b")]), "stack"),  # same check, same params
    (row(failures=[failure("grads", "w", "emb")]), row("none", failures=[GRADS_W]), "both"),  # more params than it
    (row(failures=[failure("update", "emb", held=True)]), row("none", failures=[failure("update", "emb")]), "both"),
    (row(failures=[failure("optimizer", "emb")]), row("none", "pass"), "freeze"),
    (row(status="error", message="RuntimeError: x (rank 1, wrap, a.py:1)"),
     row("none", "error", message="RuntimeError: x (rank 0, wrap, a.py:1)"), "stack"),  # the same error on any rank
    (row(status="error", message="ValueError: uniform requires_grad (rank 0, wrap, a.py:1)"),
     row("none", "error", message="RuntimeError: x (rank 0, wrap, a.py:1)"), "both"),
    (row(status="crash"), row("none", "crash"), "stack"),
    (row(failures=[GRADS_W]), None, None),  # no control, nothing freeze-specific: no cause claimed
    (row(failures=[failure("requires_grad", "emb")]), None, "freeze"),
    (row(status="pass"), row("none", "error", message="x"), None),
])
def test_a_red_cell_is_judged_against_its_nothing_frozen_control(cell, control, expected):
    assert cause.cause_of(cell, control) == expected


def test_assign_finds_controls_by_column_keeps_harness_and_marks_red_controls_as_the_stacks():
    control = row("none", "error", message="E: boom (rank 0, wrap, x)")
    rows = [row(failures=[GRADS_W]), control, row("decoder", "error", message="E: boom (rank 1, wrap, x)"),
            row("output", "error", cause="harness"), row("lora", "pass", cause="stale")]
    cause.assign(rows)
    assert [r.get("cause") for r in rows] == ["both", "stack", "stack", "harness", None]


def test_a_cell_is_compared_with_the_control_of_its_own_release():
    """Two releases in one report: each red cell against its own release's control, whichever comes last."""
    rows = [row(failures=[GRADS_W], release="1.0"), row("none", failures=[GRADS_W], release="1.0"),
            row(failures=[GRADS_W], release="2.0"), row("none", "pass", release="2.0")]
    cause.assign(rows)
    assert [r.get("cause") for r in rows] == ["stack", "stack", "freeze", None]
    cause.assign(rows[2:] + rows[:2])
    assert [r.get("cause") for r in rows] == ["stack", "stack", "freeze", None]


def test_errors_are_compared_in_the_stacks_words_not_ours():
    """The verdict's message is ours to reword: the stack's own error decides whether the control fails alike."""
    same = {"type": "RuntimeError", "message": "x"}
    cell = row(status="error", message="reworded one way", error=same)
    control = row("none", "error", message="worded quite otherwise", error=dict(same))
    assert cause.cause_of(cell, control) == "stack"
    assert cause.cause_of(cell, row("none", "error", message="reworded one way",
                                    error={"type": "ValueError", "message": "x"})) == "both"
