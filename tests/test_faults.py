"""Real 2-rank runs of cells that hang, crash a rank, or raise on one rank only.

Each bad cell must end as timeout / crash / error with every rank's story, and the
healthy cell after it must still pass on the restarted pool.
"""

from conftest import SPECS


def test_hang_crash_and_one_rank_error_do_not_take_the_run_down(run_matrix):
    result, report = run_matrix(f"--freeze-matrix-spec={SPECS / 'faults.toml'}", "--freeze-matrix-timeout=30")
    cells = {c["plugin"]: c for c in report["cells"]}
    assert {p: c["status"] for p, c in cells.items()} == {
        "ok": "pass", "hang": "timeout", "ok-after-hang": "pass", "crash": "crash", "ok-after-crash": "pass",
        "raise-on-rank-1": "error", "ok-after-raise": "pass"}
    hang = cells["hang"]
    assert [r["phase"] for r in hang["rank_details"]] == ["misbehave: hang"] * 2
    assert all("wait_for_ever_in_sleep" in r["stack"] for r in hang["rank_details"])  # every rank's stack
    crash = cells["crash"]
    assert "rank 1 killed by signal SIGSEGV" in crash["message"]
    survivor = crash["rank_details"][0]
    assert survivor["stack"].startswith("Current thread") and "rank/main.py" in survivor["stack"]  # survivor
    raised = cells["raise-on-rank-1"]
    assert "deliberate failure on rank 1 (rank 1" in raised["message"]
    assert raised["rank_details"][1]["error"]["type"] == "RuntimeError"
    result.stdout.fnmatch_lines(["*TIMEOUT: no result within 30 s*", "*CRASH: rank 1 killed by signal SIGSEGV*"])
