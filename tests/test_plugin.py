"""The plugin end to end, through pytester subprocesses and real 2-rank runs (torch DDP on gloo)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import SPECS, TESTS

SMALL = f"--freeze-matrix-spec={SPECS / 'small.toml'}"
UNUSED = "freeze-matrix::tiny-gpt/torch/ddp/eager/none/unused-branch"


def statuses(report):
    return {c["freeze"]: c["status"] for c in report["cells"]}


def test_matrix_runs_real_cells_and_writes_the_report(run_matrix):
    result, report = run_matrix(SMALL)
    result.assert_outcomes(passed=2, failed=1)
    assert statuses(report) == {"none": "pass", "embedding": "pass", "unused-branch": "error"}
    error = next(c for c in report["cells"] if c["status"] == "error")
    assert "find_unused_parameters=True" in error["message"] and "step 1" in error["message"]  # unused branch
    assert report["environments"]["torch"]["backend"] == "gloo"
    result.stdout.fnmatch_lines(["collected 3 items",
                                 "reproduce: pytest --freeze-matrix --freeze-matrix-select model=tiny-gpt,"
                                 "framework=torch,plugin=ddp,init=eager,checkpoint=none,freeze=unused-branch "
                                 f"--freeze-matrix-spec {SPECS / 'small.toml'}",
                                 "*freeze matrix*", "torch/ddp*2*0*1*0*0*0", "report: *matrix.json*"])


def test_collect_only_lists_one_item_per_cell_and_runs_nothing(run_matrix):
    result, report = run_matrix(SMALL, "--collect-only", "-q")
    result.stdout.fnmatch_lines([UNUSED, "freeze-matrix::tiny-gpt/torch/ddp/eager/none/none",
                                 "freeze-matrix::tiny-gpt/torch/ddp/eager/none/embedding", "3 tests collected*"])
    assert report is None


def test_keyword_selection_and_exit_on_first_failure(run_matrix):
    result, _ = run_matrix(SMALL, "-k", "embedding or none and not unused")
    result.assert_outcomes(passed=2, deselected=1)
    result, report = run_matrix(SMALL, "-x")
    result.assert_outcomes(failed=1)
    assert statuses(report) == {"unused-branch": "error"}


def test_select_option_narrows_and_rejects_unknown_values_in_one_line(run_matrix):
    result, report = run_matrix(SMALL, "--freeze-matrix-select", "freeze=none")
    result.assert_outcomes(passed=1)
    assert statuses(report) == {"none": "pass"}
    result, _ = run_matrix(SMALL, "--freeze-matrix-select", "freeze=bogus")
    assert result.ret == 4
    assert result.stderr.lines[0].startswith("ERROR: --freeze-matrix-select: unknown freeze 'bogus'; valid: "
                                             "unused-branch, none, embedding")
    assert "Traceback" not in result.stderr.str()


def test_malformed_matrix_file_is_a_usage_error_naming_file_and_line(run_matrix, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text((SPECS / "small.toml").read_text().replace('plugins = ["ddp"]', 'plugins = "ddp" "x"'))
    result, _ = run_matrix(f"--freeze-matrix-spec={bad}")
    assert result.ret == 4
    assert f"ERROR: {bad}:" in result.stderr.str() and "invalid TOML" in result.stderr.str()


def test_last_failed_reruns_only_the_failed_cell(run_matrix):
    run_matrix(SMALL, cache=True)
    result, report = run_matrix(SMALL, "--lf", cache=True)
    result.assert_outcomes(failed=1, deselected=2)
    assert statuses(report) == {"unused-branch": "error"}


def test_xdist_controller_writes_one_report_with_every_cell(run_matrix):
    result, report = run_matrix(SMALL, "-n", "2")
    result.assert_outcomes(passed=2, failed=1)
    assert statuses(report) == {"none": "pass", "embedding": "pass", "unused-branch": "error"}


def test_interrupted_run_still_writes_the_cells_that_finished(tmp_path):
    """Ctrl-C while a cell hangs: the report keeps the finished cell, and no rank outlives the run."""
    marker = f"interrupt-test-{os.getpid()}"  # ranks inherit it: how we find this run's processes
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
           "FREEZECOMPAT_TEST_MARKER": marker}
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", "--freeze-matrix", f"--freeze-matrix-spec={SPECS / 'faults.toml'}",
         "--freeze-matrix-select", "plugin=ok,plugin=hang", "--freeze-matrix-timeout=300",
         "--freeze-matrix-report=out", "-p", "no:cacheprovider", "-p", "no:randomly"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    report = tmp_path / "out" / "matrix.json"
    deadline = time.monotonic() + 120
    while not report.exists() and time.monotonic() < deadline:  # the first cell's record lands at once
        time.sleep(0.2)
    assert report.exists(), proc.stdout.read().decode()
    time.sleep(1.0)  # the second cell (hang) is now under way
    os.killpg(proc.pid, signal.SIGINT)
    output = proc.communicate(timeout=60)[0].decode()
    assert "KeyboardInterrupt" in output
    cells = json.loads(report.read_text())["cells"]
    assert [(c["plugin"], c["status"]) for c in cells] == [("ok", "pass")]
    assert not processes_with(marker)


def processes_with(marker: str) -> list[int]:
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if f"FREEZECOMPAT_TEST_MARKER={marker}".encode() in environ.read_bytes():
                found.append(int(environ.parent.name))
        except OSError:
            continue
    return found


def test_a_cell_that_fails_several_checks_reports_every_one(run_matrix):
    """Reentrant checkpointing over a frozen embedding: no grads on the blocks, so their updates differ too."""
    result, report = run_matrix("--freeze-matrix-select=framework=torch,plugin=fsdp2,init=eager,"
                                "checkpoint=reentrant,freeze=embedding,freeze=none", "--runxfail")
    cells = {c["freeze"]: c for c in report["cells"]}
    failed = cells["embedding"]
    assert failed["status"] == "fail" and failed["check"] == "grads"
    checks = [f["check"] for f in failed["failures"]]
    assert checks[0] == "grads" and "update" in checks, checks
    assert all(f["params"] for f in failed["failures"] if f["check"] in ("grads", "update"))
    assert failed["cause"] == "freeze" and cells["none"]["status"] == "pass"  # the control trains fine
    result.stdout.fnmatch_lines(["FAIL [[]grads[]]: step 0: no grad on trainable*", "also [[]update[]]: step 0:*"])
