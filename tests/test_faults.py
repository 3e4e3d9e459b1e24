"""Faults, end to end: real `pytest --freeze-matrix` processes with real 2-rank pools, hurt on purpose.

Each test checks what a user would: the exit code, the line they see, every finished cell in the
report, and that nothing of ours is left behind (processes found by pid through a marker in their
environment, the pool's folder by path in a TMPDIR of the test's own).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from fnmatch import fnmatch
from pathlib import Path

import pytest
from conftest import SPECS, TESTS

FAULTS = f"--freeze-matrix-spec={SPECS / 'faults.toml'}"
MARKER = "FREEZECOMPAT_TEST_MARKER"


def processes_with(marker: str) -> list[int]:
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if f"{MARKER}={marker}".encode() in environ.read_bytes():
                found.append(int(environ.parent.name))
        except OSError:
            continue
    return found


def _read(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError:
        return b""


def _parent(pid: int) -> int | None:
    fields = _read(f"/proc/{pid}/stat").rpartition(b")")[2].split()
    return int(fields[1]) if len(fields) > 1 else None


def _sigint_as_at_a_terminal() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class MatrixProcess:
    """One `pytest --freeze-matrix` of our own, in `cwd`, with its own marker and TMPDIR."""

    def __init__(self, cwd: Path, *args: str, report: str = "out") -> None:
        self.cwd, self.report_dir = cwd, cwd / report
        self.marker = f"faults-{uuid.uuid4().hex[:12]}"
        self.tmp = cwd / f"tmp-{self.marker}"
        self.tmp.mkdir()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
               MARKER: self.marker, "TMPDIR": str(self.tmp)}
        env.pop("FREEZECOMPAT_ENVIRONMENT", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pytest", "--freeze-matrix", f"--freeze-matrix-report={report}",
             "-p", "no:cacheprovider", "-p", "no:randomly", *args],
            cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
            # A user's terminal delivers Ctrl-C; a suite started in the background (`cmd &`) inherits SIGINT ignored.
            preexec_fn=_sigint_as_at_a_terminal)

    def finished_cells(self) -> int:
        """Cells on disk: the report plus the journals (what survives any kill)."""
        ids = {c["id"] for c in self.report().get("cells", [])}
        for journal in (self.report_dir / "journal").glob("*.jsonl"):
            ids |= {json.loads(line)["cell"]["id"] for line in journal.read_text().splitlines() if '"cell"' in line}
        return len(ids)

    def wait_for(self, cells: int, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while self.finished_cells() < cells:
            assert self.proc.poll() is None and time.monotonic() < deadline, self.output()
            time.sleep(0.1)

    def ranks(self) -> list[int]:
        """The ranks: children of the pool's templates (forked, they share their template's command line)."""
        ours = processes_with(self.marker)
        templates = {pid for pid in ours if b"pytest_freezecompat.rank.template" in _read(f"/proc/{pid}/cmdline")}
        return [pid for pid in ours if _parent(pid) in templates]

    def output(self, timeout_s: float = 180) -> str:
        return self.proc.communicate(timeout=timeout_s)[0].decode()

    def report(self) -> dict:
        path = self.report_dir / "matrix.json"
        return json.loads(path.read_text()) if path.exists() else {}

    def statuses(self) -> dict[str, str]:
        return {c["plugin"]: c["status"] for c in self.report().get("cells", [])}

    def leftovers(self, wait_s: float = 10) -> list[str]:
        """Our processes still alive and our folders in TMPDIR (the pool's), after up to `wait_s`.
        (torch's own caches there, e.g. torchinductor_<user>, are torch's and meant to persist.)"""
        deadline = time.monotonic() + wait_s
        while True:
            left = [f"pid {pid}" for pid in processes_with(self.marker)]
            left += [str(path) for path in self.tmp.glob("freezecompat-*")]
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.2)


def run(tmp_path: Path, *args: str, timeout_s: float = 300, **kwargs: str) -> tuple[MatrixProcess, str]:
    matrix = MatrixProcess(tmp_path, FAULTS, *args, **kwargs)
    return matrix, matrix.output(timeout_s)


def test_hang_crash_one_rank_error_and_death_while_leaving_do_not_take_the_run_down(tmp_path):
    matrix, output = run(tmp_path, "--freeze-matrix-timeout=30")
    assert matrix.proc.returncode == 1
    cells = {c["plugin"]: c for c in matrix.report()["cells"]}
    assert {p: c["status"] for p, c in cells.items()} == {
        "ok": "pass", "hang": "timeout", "ok-after-hang": "pass", "crash": "crash", "ok-after-crash": "pass",
        "raise-on-rank-1": "error", "ok-after-raise": "pass", "die-while-tidying": "pass", "ok-after-tidying": "pass",
        "pollute": "pass", "ok-after-pollute": "pass", "stray-collective": "pass", "ok-after-stray": "pass"}
    hang = cells["hang"]
    assert [r["phase"] for r in hang["rank_details"]] == ["misbehave: hang"] * 2
    assert all("wait_for_ever_in_sleep" in r["stack"] for r in hang["rank_details"])  # every rank's stack
    crash = cells["crash"]
    assert "rank 1 killed by signal SIGSEGV" in crash["message"]
    survivor = crash["rank_details"][0]  # its stack, or the error it raised when its peer went (if that came first)
    assert (("Current thread" in survivor.get("stack", "") and "rank/main.py" in survivor["stack"])
            or "error" in survivor)
    raised = cells["raise-on-rank-1"]
    assert "deliberate failure on rank 1 (rank 1" in raised["message"]
    assert raised["rank_details"][1]["error"]["type"] == "RuntimeError"
    # Rank 1 dies (where torch < 2.8 settles groups with a barrier, rank 0's tidy then fails too: named as well).
    [died] = cells["die-while-tidying"]["notes"]
    assert "rank 1 exited with code 3 while tidying the cell away" in died
    assert died.endswith("; the ranks were replaced before the next cell")
    # A clean cell that left a group, float64 as the default dtype and grad mode off behind: the next cell runs on
    # the kept group, tidied, and gets the verdict of a cell on fresh ranks.
    verdict = ("status", "check", "message", "failures")
    assert cells["ok-after-pollute"]["group_kept"] and "group_kept" not in cells["ok"]
    assert {k: cells["ok-after-pollute"][k] for k in verdict} == {k: cells["ok"][k] for k in verdict}
    # One collective more on rank 0: the ranks disagree, so they are replaced; the next cell starts afresh.
    stray = re.fullmatch(r"the ranks ran different numbers of collectives on process group 0 \(rank 0: (\d+), "
                         r"rank 1: (\d+)\); the ranks were replaced before the next cell",
                         "".join(cells["stray-collective"]["notes"]))
    assert stray and int(stray[1]) == int(stray[2]) + 1
    assert "group_kept" not in cells["ok-after-stray"]
    assert {k: cells["ok-after-stray"][k] for k in verdict} == {k: cells["ok"][k] for k in verdict}
    assert "REFUSED (timeout): no result within 30 s" in output
    assert "REFUSED (crash): rank 1 killed by signal SIGSEGV" in output
    assert not matrix.leftovers()


def test_a_recorded_error_outranks_the_timeout_it_led_to(tmp_path):
    """Rank 1 raises, rank 0 waits for it in a barrier until the cell's deadline: the error is the story."""
    matrix, output = run(tmp_path, "--freeze-matrix-select=plugin=raise-on-rank-1", "--freeze-matrix-timeout=2")
    assert matrix.proc.returncode == 1
    assert matrix.statuses() == {"raise-on-rank-1": "error"}
    assert "REFUSED (error): RuntimeError: deliberate failure on rank 1 (rank 1" in output
    assert not matrix.leftovers()


@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT"])
def test_sigterm_and_ctrl_c_keep_every_finished_cell_and_leave_nothing(tmp_path, how):
    matrix = MatrixProcess(tmp_path, FAULTS, "--freeze-matrix-select=plugin=ok,plugin=hang",
                           "--freeze-matrix-timeout=300")
    matrix.wait_for(cells=1)
    time.sleep(1.0)  # the second cell (hang) is under way
    if how == "SIGTERM":
        matrix.proc.send_signal(signal.SIGTERM)  # pytest alone, as `timeout` or a scheduler does
    else:
        os.killpg(matrix.proc.pid, signal.SIGINT)  # Ctrl-C reaches the terminal's foreground group
    output = matrix.output(60)
    assert matrix.proc.returncode == 2, output
    assert ("SIGTERM received: stopping as for Ctrl-C" if how == "SIGTERM" else "KeyboardInterrupt") in output
    assert matrix.statuses() == {"ok": "pass"}
    assert not list((matrix.report_dir / "journal").iterdir())  # folded into matrix.json
    assert not matrix.leftovers()


def test_sigterm_while_plugins_still_configure_ends_pytest_without_a_traceback(tmp_path):
    """Before the session starts no cell has run and no rank exists: SIGTERM's default death loses nothing. Our handler,
    taken that early, raised inside other plugins' imports: on a GPU machine (pytest 9.1.1, a plugin importing
    hypothesis) that escaped pytest as a traceback wall."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "sigterm_while_configuring", "-p", "no:cacheprovider",
                           "--freeze-matrix", FAULTS, f"--freeze-matrix-report={tmp_path / 'report'}"],
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), *sys.path])},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGTERM, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr


def test_sigkill_of_pytest_ends_its_ranks_and_the_next_run_keeps_its_cells(tmp_path):
    matrix = MatrixProcess(tmp_path, FAULTS, "--freeze-matrix-select=plugin=ok,plugin=hang",
                           "--freeze-matrix-timeout=300")
    matrix.wait_for(cells=1)
    time.sleep(1.0)
    ranks = matrix.ranks()
    assert len(ranks) == 2
    matrix.proc.kill()
    matrix.proc.wait()
    assert not matrix.leftovers(), "ranks outlived a SIGKILLed controller"  # they end themselves (watchdog)
    again, output = run(tmp_path, "--freeze-matrix-select=plugin=ok-after-hang")
    assert again.proc.returncode == 0, output
    assert again.statuses() == {"ok": "pass", "ok-after-hang": "pass"}
    assert "2 cells in the report, 1 from this run; 1 kept from earlier or concurrent runs" in output
    assert not again.leftovers()


def test_kill_9_of_a_rank_is_a_crash_cell_and_the_run_goes_on(tmp_path):
    matrix = MatrixProcess(tmp_path, FAULTS, "--freeze-matrix-select=plugin=hang,plugin=ok-after-hang",
                           "--freeze-matrix-timeout=120")
    deadline = time.monotonic() + 120
    while len(matrix.ranks()) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(8.0)  # past imports and into the hanging cell
    os.kill(matrix.ranks()[-1], signal.SIGKILL)
    output = matrix.output()
    assert matrix.proc.returncode == 1
    assert matrix.statuses() == {"hang": "crash", "ok-after-hang": "pass"}
    assert "killed by signal SIGKILL" in output
    assert not matrix.leftovers()


def test_xdist_workers_share_the_cells_and_leave_nothing(tmp_path):
    matrix, _ = run(tmp_path, "-n", "2", "--freeze-matrix-select=plugin=ok,plugin=crash,plugin=ok-after-crash")
    assert matrix.proc.returncode == 1
    assert matrix.statuses() == {"ok": "pass", "crash": "crash", "ok-after-crash": "pass"}
    assert not matrix.leftovers()


def test_two_runs_at_once_into_one_report_both_land(tmp_path):
    first = MatrixProcess(tmp_path, FAULTS, "--freeze-matrix-select=plugin=ok")
    second = MatrixProcess(tmp_path, FAULTS, "--freeze-matrix-select=plugin=ok-after-raise")
    outputs = [first.output(), second.output()]
    assert (first.proc.returncode, second.proc.returncode) == (0, 0), outputs
    assert first.statuses() == {"ok": "pass", "ok-after-raise": "pass"}
    assert any("1 kept from earlier or concurrent runs" in out for out in outputs)
    assert not first.leftovers() and not second.leftovers()


@pytest.mark.parametrize("option, line", [
    ("--freeze-matrix-report=afile", "ERROR: --freeze-matrix-report: afile: */afile is a file, not a directory"),
    ("--freeze-matrix-report=afile/sub", "ERROR: --freeze-matrix-report: afile/sub: */afile is a file, not a dir*"),
    ("--freeze-matrix-report=/proc/1/report", "ERROR: --freeze-matrix-report: /proc/1/report: cannot write there*"),
    ("--freeze-matrix-timeout=nan", "ERROR: --freeze-matrix-timeout must be between 1 and 86400 seconds, got nan"),
    ("--freeze-matrix-timeout=inf", "ERROR: --freeze-matrix-timeout must be between 1 and 86400 seconds, got inf"),
    ("--freeze-matrix-timeout=0.2", "ERROR: --freeze-matrix-timeout must be between 1 and 86400 seconds, got 0.2"),
])
def test_bad_options_are_one_line_and_nothing_runs(tmp_path, option, line):
    (tmp_path / "afile").write_text("")
    matrix, output = run(tmp_path, option, timeout_s=60)
    assert matrix.proc.returncode == 4
    lines = output.strip().splitlines()
    assert len(lines) == 1 and fnmatch(lines[0], line), output  # one line, no traceback
    assert (tmp_path / "afile").read_text() == ""
    assert not matrix.report_dir.exists() and not matrix.leftovers()


def test_an_environment_whose_framework_is_missing_says_so_in_one_line(tmp_path):
    from pytest_freezecompat.spec.plan import why_not_importable

    if why_not_importable("colossalai") is None:
        pytest.skip("colossalai is importable here")
    matrix = MatrixProcess(tmp_path, "--freeze-matrix-environment=colossalai", "-q")
    output = matrix.output()
    assert matrix.proc.returncode == 0
    assert [line for line in output.splitlines() if line.startswith("skipped: ")] == [
        "skipped: colossalai is not importable in this environment (ModuleNotFoundError: No module named "
        "'colossalai'); its environment is 'colossalai'"]
    assert not matrix.leftovers()
