"""The plugin as a pytest user expects it: header, summary, ini options, repeated and misplaced options, junitxml,
known issues on user cells, the README's own snippet (pytester subprocesses, real 2-rank runs on gloo)."""

from __future__ import annotations

import importlib.metadata
import re
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from conftest import SPECS

from pytest_freezecompat import cli

#: The torch release this environment runs: user cells of the torch row carry it in their ids.
TORCH = importlib.metadata.version("torch").partition("+")[0]

SMALL = f"--freeze-matrix-spec={SPECS / 'small.toml'}"
ROOT = Path(__file__).parents[1]


def test_header_names_what_decides_the_results(run_matrix):
    result, _ = run_matrix(SMALL, "--collect-only", "--freeze-matrix-timeout=30")
    result.stdout.fnmatch_lines(["freeze-matrix: every framework installed here, cpu/gloo, world size 2, timeout 30 "
                                 f"s, spec {SPECS / 'small.toml'}",
                                 "freeze-matrix stacks: torch 2.*; frameworks: torch 2.*",
                                 "*",
                                 "freeze-matrix cells: 3 of the built-in matrix"])


def test_summary_is_aligned_and_names_all_three_report_files(run_matrix):
    result, _ = run_matrix(SMALL)
    lines = result.stdout.lines
    start = next(i for i, line in enumerate(lines) if "freeze matrix" in line and "=" in line)
    header, row = lines[start + 1], lines[start + 2]
    assert header.split()[:2] == ["framework/plugin", "pass"] and row.split()[0] == "torch/ddp"
    # every column's number ends under its heading's last character
    ends = [m.end() for m in re.finditer(r"\S+", header)][1:]
    assert [m.end() for m in re.finditer(r"\S+", row)][1:] == ends
    result.stdout.fnmatch_lines(["report: 3 cells in the report, 3 from this run", "  *report/matrix.json",
                                 "  *report/matrix.md", "  *report/matrix.html"])


def test_ini_options_configure_the_matrix_and_the_command_line_wins(run_matrix, pytester: pytest.Pytester):
    pytester.makeini("""
        [pytest]
        freeze_matrix_spec = specs/small.toml
        freeze_matrix_timeout = 45
        freeze_matrix_world_size = 1
        """)
    shutil.copytree(SPECS, pytester.path / "specs")
    result, report = run_matrix("--freeze-matrix-select=freeze=none")
    result.stdout.fnmatch_lines(["freeze-matrix: *world size 1, timeout 45 s, spec */specs/small.toml"])
    assert report["cells"][0]["world_size"] == 1
    command = report["environments"]["torch"]["run"]["command"]  # no machine's folders in a published report
    assert command == "pytest --basetemp=runpytest-0 --freeze-matrix --freeze-matrix-report=report " \
                      "-p no:cacheprovider --freeze-matrix-select=freeze=none" and str(pytester.path) not in command
    result, _ = run_matrix("--freeze-matrix-select=freeze=none", "--freeze-matrix-world-size=2", "--co")
    result.stdout.fnmatch_lines(["freeze-matrix: *world size 2, timeout 45 s*"])


def test_a_malformed_ini_value_is_one_line(run_matrix, pytester: pytest.Pytester):
    pytester.makeini("[pytest]\nfreeze_matrix_timeout = soon\n")
    result, _ = run_matrix(SMALL)
    assert result.ret == 4
    assert result.stderr.lines[0] == "ERROR: freeze_matrix_timeout = 'soon' in tox.ini: not a number of seconds"


def test_select_given_twice_appends(run_matrix):
    result, _ = run_matrix(SMALL, "--freeze-matrix-select=freeze=none", "--freeze-matrix-select=freeze=embedding",
                           "--co", "-q")
    result.stdout.fnmatch_lines(["*/none", "*/embedding", "2 tests collected*"])


def test_a_matrix_option_without_the_matrix_is_a_usage_hint(pytester: pytest.Pytester):
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--freeze-matrix-select=framework=torch")
    assert result.ret == 4
    assert result.stderr.lines[0] == ("ERROR: --freeze-matrix-select does nothing without --freeze-matrix (the "
                                      "built-in matrix) or a test file with @freeze_case cases: add --freeze-matrix")


def test_select_narrows_user_cells_and_its_errors_are_one_line(pytester: pytest.Pytester, run_user):
    shutil.copy(ROOT / "examples" / "test_own_model.py", pytester.path)
    result, _ = run_user("--freeze-matrix-select=plugin=ddp,init=eager,checkpoint=none,freeze=head-only", "--co", "-q")
    result.stdout.fnmatch_lines([f"*tiny-tagger/torch@{TORCH}/ddp/eager/none/head-only", "1 test collected*"])
    for bad, line in [("plugin=bogus", "ERROR: --freeze-matrix-select: unknown plugin 'bogus'; valid: *"),
                      ("freeze=bogus", "ERROR: --freeze-matrix-select: unknown freeze 'bogus'; valid: none, *, "
                                       "head-only*")]:
        result, _ = run_user(f"--freeze-matrix-select={bad}", "--co")
        assert result.ret == 4, bad
        result.stderr.fnmatch_lines([line])
        assert "Traceback" not in result.stdout.str() + result.stderr.str()


def test_known_issues_explain_user_cells_by_what_they_predict(pytester: pytest.Pytester, run_user):
    """FSDP1 refuses a unit with mixed requires_grad: the registry's entry names built-in patterns only, yet
    explains the user's `frozen-embedding` by stack, status, message and `raised_in`; the control is no `fixed?`."""
    shutil.copy(ROOT / "examples" / "test_own_model.py", pytester.path)
    result, report = run_user("--freeze-matrix-select=plugin=fsdp1,init=eager,checkpoint=none,"
                              "freeze=frozen-embedding,freeze=none", "-rxX")
    cells = {c["freeze"]: c for c in report["cells"]}
    assert cells["frozen-embedding"]["status"] == "error"
    assert cells["frozen-embedding"]["known_issue"]["id"] == "torch-fsdp1-uniform-requires-grad"
    assert cells["frozen-embedding"]["known_issue"]["expected"] is True
    assert cells["none"]["status"] == "pass" and "known_issue" not in cells["none"]
    result.assert_outcomes(passed=1, xfailed=1)


def test_junitxml_gets_scalar_properties_a_dashboard_can_use(run_matrix, pytester: pytest.Pytester):
    run_matrix(SMALL, "--junitxml=junit.xml")
    junit = ET.parse(pytester.path / "junit.xml")
    cases = {case.get("name").rsplit("/", 1)[-1]: case for case in junit.iter("testcase")}
    properties = {name: {p.get("name"): p.get("value") for p in case.iter("property")} for name, case in cases.items()}
    assert properties["unused-branch"]["status"] == "error" and properties["unused-branch"]["severity"] == "refused"
    assert properties["unused-branch"]["repro"].startswith("pytest --freeze-matrix --freeze-matrix-select=")
    assert properties["none"] == {"severity": "ok", "status": "pass", "repro": properties["none"]["repro"],
                                  "emulation": "False"}
    assert set().union(*properties.values()) <= {"severity", "status", "check", "cause", "convention", "known_issue",
                                                  "repro", "emulation"}


def test_a_wrapped_error_message_ends_at_a_sentence(run_matrix):
    """torch wraps DDP's unused-parameter hint over lines; the terminal shows whole sentences, never '...and by '."""
    result, report = run_matrix(SMALL, "--freeze-matrix-select=freeze=unused-branch")
    message = report["cells"][0]["message"]
    assert "and by making sure all `forward` function outputs participate in calculating loss." in message
    failure = next(line for line in result.stdout.lines if line.startswith("REFUSED (error): RuntimeError"))
    assert not failure.split(" (rank ")[0].endswith(("and by", "and by "))


def test_the_readme_snippet_runs_as_written(pytester: pytest.Pytester, run_user):
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Your own model", 1)[1]
    snippet = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    pytester.makepyfile(test_snippet=snippet)
    result, report = run_user("--freeze-matrix-select=plugin=ddp,init=eager,checkpoint=none,freeze=head-only")
    result.assert_outcomes(passed=1)
    assert report["cells"][0]["status"] == "pass"


def test_version(capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit) as stopped:
        cli.main(["--version"])
    assert stopped.value.code == 0
    assert re.fullmatch(r"freezecompat \(pytest-freezecompat\) \d+\.\d+\.\d+\n", capsys.readouterr().out)
