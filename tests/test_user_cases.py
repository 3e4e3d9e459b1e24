"""`@freeze_case`: a user's own model, frozen their way, through plain `pytest` (pytester, real 2-rank runs)."""

import importlib.metadata

import pytest
from own_project import TOKEN_DATA

#: The torch release this environment runs: user cells of the torch row carry it in their ids.
TORCH = importlib.metadata.version("torch").partition("+")[0]

MODEL = '''
import torch
from torch import nn

from pytest_freezecompat import freeze_case


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.body = nn.Linear(8, 8)
        self.head = nn.Linear(8, 32)

    def forward(self, tokens):
        return self.head(torch.relu(self.body(self.embed(tokens))))

''' + TOKEN_DATA + '''


def body_only(name):
    return name.startswith("body.")
'''


def case(patterns: str, **narrow: str) -> str:
    args = ", ".join(f"{k}={v}" for k, v in {"plugins": '["ddp"]', "init": '["eager"]', **narrow}.items())
    return MODEL + f'''

@freeze_case(batch=batch, loss=loss, patterns={patterns}, {args})
def small_net():
    return Net()


def test_ordinary():
    pass
'''


def test_declared_cells_run_with_plain_pytest_and_land_in_the_report(pytester, run_user):
    pytester.makepyfile(test_mine=case('{"head-only": {"trainable": ["head.*"]}, "body-only": body_only}'))
    result, report = run_user()
    result.assert_outcomes(passed=4)  # two cells, their nothing-frozen control and the ordinary test
    assert sorted(c["id"] for c in report["cells"]) == [f"small-net/torch@{TORCH}/ddp/eager/none/body-only",
                                                        f"small-net/torch@{TORCH}/ddp/eager/none/head-only",
                                                        f"small-net/torch@{TORCH}/ddp/eager/none/none"]
    assert {c["status"] for c in report["cells"]} == {"pass"}
    assert report["cells"][0]["repro"].startswith(f"pytest test_mine.py::small_net::small-net/torch@{TORCH}/ddp")


def test_keyword_selection_reaches_user_cells(pytester, run_user):
    pytester.makepyfile(test_mine=case('{"head-only": {"trainable": ["head.*"]}, "body-only": body_only}'))
    result, _ = run_user("-k", "body")
    result.assert_outcomes(passed=1, deselected=3)


def test_the_matrix_selection_narrows_user_cells_too(pytester, run_user):
    pytester.makepyfile(test_mine=case('{"head-only": {"trainable": ["head.*"]}, "body-only": body_only}'))
    result, report = run_user("--freeze-matrix-select", "freeze=none")
    result.assert_outcomes(passed=2)  # the control and the ordinary test
    assert [c["id"] for c in report["cells"]] == [f"small-net/torch@{TORCH}/ddp/eager/none/none"]


@pytest.mark.parametrize(("patterns", "narrow", "message"), [
    ('{"oops": {"trainable": ["nothing.*"]}}', {}, "glob 'nothing.*' of group 'oops.trainable' matches no parameter"),
    ('{"x": {"trainable": ["head.*"]}}', {"plugins": '["zero-9"]'}, "unknown plugin 'zero-9' for user models; valid:"),
    ('{"x": {"trainable": ["head.*"]}}', {"checkpoint": '["reentrant"]'}, "Net has no activation-checkpointing switch"),
    ('{"Bad_Id": {"trainable": ["head.*"]}}', {}, "pattern id 'Bad_Id' must use lowercase letters"),
    ('{"x": lambda name: True}', {}, "must be a module-level function or class"),
])
def test_a_bad_declaration_is_a_one_line_collection_error(pytester, run_user, patterns, narrow, message):
    pytester.makepyfile(test_mine=case(patterns, **narrow))
    result, report = run_user("--collect-only")
    assert result.ret == 2 and report is None
    result.stdout.fnmatch_lines([f"*test_mine.py: freeze_case small_net: *{message}*"])


def test_a_factory_that_returns_no_module(pytester, run_user):
    pytester.makepyfile(test_mine=case('{"x": {"trainable": ["head.*"]}}').replace("return Net()", "return 42"))
    result, _ = run_user("--collect-only")
    result.stdout.fnmatch_lines(["*freeze_case small_net: the model factory returned int, not a torch.nn.Module*"])


@pytest.mark.parametrize("body, got", [("return None", "NoneType"),
                                       ("return model(b['tokens']).sum(-1)", "a tensor of shape (2, 4)")])
def test_a_loss_that_is_not_a_scalar_blames_the_declaration_in_one_line(pytester, run_user, body, got):
    source = case('{"head-only": {"trainable": ["head.*"]}}').replace(
        "@freeze_case(batch=batch, loss=loss,", f"def bad_loss(model, b):\n    {body}\n\n\n"
                                                  "@freeze_case(batch=batch, loss=bad_loss,")
    pytester.makepyfile(test_mine=source)
    result, report = run_user()
    result.assert_outcomes(failed=2, passed=1)  # the cell and its control; the ordinary test passes
    line = (f"HARNESS (error): FreezeCaseError: freeze_case loss test_mine:bad_loss returned {got}; "
            "it must return a scalar tensor (rank 0, step 0: forward/backward*")
    result.stdout.fnmatch_lines([line, line])
    assert {(c["status"], c["cause"]) for c in report["cells"]} == {("error", "harness")}  # the user's, not the stack's
