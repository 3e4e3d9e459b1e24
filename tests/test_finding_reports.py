"""`freezecompat finding`: the list of entries with a reproducer, and one report printed whole as the repository
holds it; an unknown id or a missing report is one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from pytest_freezecompat import cli
from pytest_freezecompat.report import findings
from pytest_freezecompat.spec import known_issues


@pytest.fixture
def reports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(findings, "findings_dir", lambda: tmp_path)
    return tmp_path


def test_a_report_prints_whole_and_the_list_names_its_title(reports: Path, capsys: pytest.CaptureFixture[str]):
    entries = [entry for entry in known_issues.load().entries if entry.reproducer]
    text = "# [BUG] stack 1.0: a title\n\nThe body, as a maintainer reads it.\n"
    (reports / f"{entries[0].id}.md").write_text(text)
    assert cli.main(["finding", entries[0].id]) == 0
    assert capsys.readouterr().out == text
    assert cli.main(["finding"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"{entries[0].id} [{entries[0].kind}]: [BUG] stack 1.0: a title"
    assert [line.split(" ")[0] for line in lines] == [entry.id for entry in entries]
    assert all(line.endswith("no upstream report yet") for line in lines[1:])


def test_an_unknown_id_or_a_missing_report_is_one_line(reports: Path, capsys: pytest.CaptureFixture[str]):
    assert cli.main(["finding", "no-such-entry"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("freezecompat: no finding 'no-such-entry'; the entries with a reproducer: ")
    assert err.count("\n") == 1
    entry = next(entry for entry in known_issues.load().entries if entry.reproducer)
    assert cli.main(["finding", entry.id]) == 2
    assert capsys.readouterr().err == (f"freezecompat: {entry.id} has no upstream report yet ({entry.id}.md); its "
                                       f"reproducer: {entry.reproducer}\n")


REPORTS = sorted(path for path in findings.findings_dir().glob("*.md") if path.name != "README.md")


@pytest.mark.parametrize("path", REPORTS, ids=lambda path: path.stem)
def test_a_report_inlines_its_reproducer_as_the_repository_holds_it(path: Path):
    """A maintainer runs what the report shows: the inlined script is the file the tests run, byte for byte."""
    entry = known_issues.load().get(path.stem)
    reproducer = findings.findings_dir().parent / entry.reproducer if entry.reproducer else None
    assert reproducer is not None and reproducer.is_file(), f"{path.stem}: no reproducer"
    inlined = path.read_text().split("```python\n", 1)[1].split("\n```", 1)[0] + "\n"
    assert inlined == reproducer.read_text()
