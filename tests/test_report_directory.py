"""The shared report directory: a merge by cell id that no partial, concurrent or killed run can lose."""

import json

import pytest
from test_report import ENVS, cell

from pytest_freezecompat.report import schema, write
from pytest_freezecompat.report.directory import JOURNALS, ReportDirectory, ReportDirError, check_writable


def keep(rows):
    return rows


def row(freeze, status="pass", at="2026-11-23T10:00:00.000+00:00"):
    return {**cell(freeze=freeze, status=status), "finished_at": at}


def statuses(directory):
    return {c["freeze"]: c["status"] for c in schema.load(directory / "matrix.json")["cells"]}


def test_a_partial_run_updates_its_cells_and_keeps_the_others(tmp_path):
    write.write(tmp_path, write.build(ENVS, [row("none"), row("embedding", "fail")]))
    run = ReportDirectory(tmp_path)
    run.append(row("embedding", at="2026-11-23T11:00:00.000+00:00"), ENVS["torch"])
    run.append(row("lora", "error"), ENVS["torch"])
    folded = run.close(keep)
    assert statuses(tmp_path) == {"none": "pass", "embedding": "pass", "lora": "error"}
    assert (folded.cells, folded.from_other_runs) == (3, 1)
    assert not list((tmp_path / JOURNALS).iterdir())  # this run's journal is folded and gone


def test_two_runs_at_once_both_land(tmp_path):
    first, second = ReportDirectory(tmp_path), ReportDirectory(tmp_path)
    second.run_id += "-second"  # same second, same pid in this test
    first.append(row("none"), ENVS["torch"])
    second.append(row("embedding"), ENVS["torch"])
    first.append(row("lora"), ENVS["torch"])
    assert first.close(keep).from_other_runs == 1  # the other run's live journal is read, not deleted
    assert second.close(keep).cells == 3
    assert statuses(tmp_path) == {"none": "pass", "embedding": "pass", "lora": "pass"}


def test_a_killed_run_leaves_its_cells_for_the_next_fold(tmp_path):
    killed = ReportDirectory(tmp_path)
    killed.append(row("none"), ENVS["torch"])
    killed.append(row("embedding", "fail"), ENVS["torch"])
    killed._journal.write('{"cell": {"id": "cut sho')  # a kill in the middle of a line
    killed._journal.close()  # what the kernel does for a killed process: its lock is released
    nxt = ReportDirectory(tmp_path)
    nxt.run_id += "-next"
    nxt.append(row("lora"), ENVS["torch"])
    assert nxt.close(keep).from_other_runs == 2
    assert statuses(tmp_path) == {"none": "pass", "embedding": "fail", "lora": "pass"}
    assert not list((tmp_path / JOURNALS).iterdir())


def test_a_damaged_journal_line_is_left_out_and_counted_not_folded_into_the_report(tmp_path):
    run = ReportDirectory(tmp_path)
    run.append(row("none"), ENVS["torch"])
    run._journal.write('{"cell": {"status": "pass"}}\n[1, 2]\n')  # parses, but no report row
    folded = run.close(keep)
    assert (folded.cells, folded.unusable_lines) == (1, 2)
    assert statuses(tmp_path) == {"none": "pass"}  # and matrix.json still loads


def test_an_unreadable_report_is_set_aside_not_dropped(tmp_path):
    (tmp_path / "matrix.json").write_text("{ not json")
    run = ReportDirectory(tmp_path)
    run.append(row("none"), ENVS["torch"])
    folded = run.close(keep)
    assert folded.set_aside is not None and folded.set_aside.read_text() == "{ not json"
    assert statuses(tmp_path) == {"none": "pass"}


def test_the_default_directory_ignores_itself_in_git(tmp_path):
    run = ReportDirectory(tmp_path / "out", self_ignoring=True)
    run.append(row("none"), ENVS["torch"])
    run.close(keep)
    assert (tmp_path / "out" / ".gitignore").read_text().endswith("*\n")
    assert json.loads((tmp_path / "out" / "matrix.json").read_text())["environments"] == ENVS


@pytest.mark.parametrize("where, says", [("afile", "afile is a file, not a directory"),
                                         ("afile/sub", "afile is a file, not a directory"),
                                         ("/proc/freezecompat-report", "cannot write there")])
def test_a_report_path_we_cannot_write_is_refused_before_anything_runs(tmp_path, where, says):
    (tmp_path / "afile").write_text("")
    with pytest.raises(ReportDirError, match=says):
        check_writable(tmp_path / where)
    assert not (tmp_path / "afile").is_dir()


def test_a_missing_report_path_is_fine_and_not_created_by_the_check(tmp_path):
    check_writable(tmp_path / "new" / "dir")
    assert not (tmp_path / "new").exists()
