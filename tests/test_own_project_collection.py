"""`pytest --freeze-matrix` in a user's project runs their `@freeze_case` models, not the 3785 built-in cells (those
only with --freeze-matrix-builtin), and none of their ordinary tests (pytester, real 2-rank runs)."""

import json

import pytest
from test_user_cases import case

SELECT = "--freeze-matrix-select=framework=torch,plugin=ddp,init=eager,checkpoint=none,clip=clip,freeze=none"


@pytest.fixture
def project(pytester, monkeypatch):
    monkeypatch.delenv("FREEZECOMPAT_ENVIRONMENT", raising=False)
    pytester.makepyfile(test_mine=case('{"head-only": {"trainable": ["head.*"]}}'),
                        test_other="def test_unrelated():\n    assert True\n")

    def run(*args):
        return pytester.runpytest_subprocess("--freeze-matrix", "--freeze-matrix-report=report", "-p",
                                             "no:cacheprovider", SELECT, *args)

    return run


def test_the_projects_own_models_run_and_nothing_else(project):
    result = project()
    # Run: the model's control cell. Deselected: test_mine's ordinary test; tiny-gpt's built-in cell is not collected;
    # test_other, which declares no model, is not even imported.
    result.assert_outcomes(passed=1, deselected=1)
    result.stdout.fnmatch_lines(["collected 2 items / 1 deselected / 1 selected",
                                 "freeze-matrix cells: 1 of your @freeze_case models"])
    assert "built-in matrix: not run (your @freeze_case models ran; --freeze-matrix-builtin adds it)" in (
        result.stdout.str())


def test_the_built_in_matrix_runs_beside_them_when_asked(project):
    result = project("--freeze-matrix-builtin")
    result.assert_outcomes(passed=2, deselected=1)  # tiny-gpt's and the model's control cells
    result.stdout.fnmatch_lines(["freeze-matrix cells: 1 of your @freeze_case models, 1 of the built-in matrix"])
    assert "built-in matrix: not run" not in result.stdout.str()


def test_a_framework_not_installed_is_said_once_and_leaves_no_cells(pytester, monkeypatch):
    pytest.importorskip("torch")
    if __import__("importlib").util.find_spec("deepspeed") is not None:
        pytest.skip("DeepSpeed is installed here")
    monkeypatch.delenv("FREEZECOMPAT_ENVIRONMENT", raising=False)
    pytester.makepyfile(test_mine=case('{"head-only": {"trainable": ["head.*"]}}', frameworks='["torch", "deepspeed"]',
                                       plugins='["ddp", "zero2"]'))
    result = pytester.runpytest_subprocess("--freeze-matrix", "--freeze-matrix-report=report", "-p", "no:cacheprovider",
                                           "-k", "none")
    cells = json.loads((pytester.path / "report" / "matrix.json").read_text())["cells"]
    assert cells and {cell["framework"] for cell in cells} == {"torch"}
    assert result.stdout.str().count("skipped: deepspeed is not importable") == 1


def test_a_case_file_that_fails_to_import_is_a_collection_error_and_nothing_runs(pytester, monkeypatch):
    """Its cases are unknown, so the built-in matrix does not stand in for them (it did: 4255 cells collected)."""
    monkeypatch.delenv("FREEZECOMPAT_ENVIRONMENT", raising=False)
    pytester.makepyfile(test_mine="import not_a_module_here\nfrom pytest_freezecompat import freeze_case\n")
    for extra in ((), ("--continue-on-collection-errors",)):
        result = pytester.runpytest_subprocess("--freeze-matrix", "--freeze-matrix-report=report", "-p",
                                               "no:cacheprovider", *extra)
        assert result.ret == (pytest.ExitCode.INTERRUPTED if not extra else pytest.ExitCode.TESTS_FAILED)
        result.assert_outcomes(errors=1)
        result.stdout.fnmatch_lines(["collected 0 items / 1 error", "freeze-matrix cells: none",
                                     "*ERROR collecting test_mine.py*",
                                     "E   ModuleNotFoundError: No module named 'not_a_module_here'"])
