"""The plugin end to end, through pytester subprocesses and real 2-rank runs (torch DDP on gloo)."""


from conftest import SPECS

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
                                 "reproduce: pytest --freeze-matrix --freeze-matrix-select=model=tiny-gpt,"
                                 "framework=torch,plugin=ddp,init=eager,checkpoint=none,freeze=unused-branch,clip=clip "
                                 f"--freeze-matrix-spec={SPECS / 'small.toml'}",
                                 "*freeze matrix*", "torch/ddp*2*0*1*0*0*0", "report: 3 cells in the report*",
                                 "  */matrix.json", "  */matrix.md", "  */matrix.html"])


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
    # A partial run updates the cells it ran and keeps the others, and says so.
    assert statuses(report) == {"none": "pass", "embedding": "pass", "unused-branch": "error"}
    result.stdout.fnmatch_lines(["report: 3 cells in the report, 1 from this run; "
                                 "2 kept from earlier or concurrent runs"])


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
    assert statuses(report) == {"none": "pass", "embedding": "pass", "unused-branch": "error"}
    finished = {c["freeze"]: c["finished_at"] for c in report["cells"]}
    assert finished["unused-branch"] > max(finished["none"], finished["embedding"])  # rerun; the others kept


def test_xdist_controller_writes_one_report_with_every_cell(run_matrix):
    result, report = run_matrix(SMALL, "-n", "2")
    result.assert_outcomes(passed=2, failed=1)
    assert statuses(report) == {"none": "pass", "embedding": "pass", "unused-branch": "error"}


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
    result.stdout.fnmatch_lines(["SILENT (fail) [[]grads[]]: step 0: no grad on trainable*",
                                 "also [[]update[]]: step 0:*"])
    assert failed["severity"] == "silent"
    result.stdout.fnmatch_lines(["how bad: 2 silent · 2 ok"])


def test_cells_of_one_round_trip_group_cite_the_first_ones_round_trip(run_matrix):
    """The default matrix's torch row shares a round trip across clip (`[round_trip]`): of one box's two cells the
    first runs it and the second names it; `--freeze-matrix-every-round-trip` runs each, with the same statuses."""
    select = "--freeze-matrix-select=plugin=ddp,init=eager,checkpoint=none,freeze=embedding"
    _, shared = run_matrix(select)
    by_clip = {c["clip"]: c for c in shared["cells"]}
    assert set(by_clip) == {"clip", "no-clip"}
    assert "round_trip_of" not in by_clip["clip"] and by_clip["no-clip"]["round_trip_of"] == by_clip["clip"]["id"]
    assert by_clip["no-clip"]["resume_api"] == by_clip["clip"]["resume_api"]
    _, each = run_matrix(select, "--freeze-matrix-every-round-trip", report_dir="each")
    assert not any(c.get("round_trip_of") for c in each["cells"])
    assert {c["id"]: c["status"] for c in each["cells"]} == {c["id"]: c["status"] for c in shared["cells"]}
