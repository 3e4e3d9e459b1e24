"""The release watch on recorded index answers: what is new, the candidate environments, the framework files they are
written into, and a planted regression in a new release that fails the watch, named."""

from __future__ import annotations

import copy
import json
import re
import shutil
from pathlib import Path

import pytest
from packaging.version import Version

from pytest_freezecompat import cli
from pytest_freezecompat.spec import watch
from pytest_freezecompat.spec.matrix import default_spec_path, load

ROOT = Path(__file__).resolve().parents[1]
ANSWERS = Path(__file__).parent / "index_answers"
PUBLISHED = ROOT / "reports" / "matrix.json"


def answer(*versions: str, yanked: tuple[str, ...] = ()) -> dict:
    return {"releases": {v: [{"upload_time_iso_8601": "2026-11-01T00:00:00Z", "yanked": v in yanked}]
                         for v in versions}}


def test_newer_releases_leave_out_older_yanked_and_pre_releases_unless_asked() -> None:
    index = answer("2.12.0", "2.13.0", "2.14.0", "2.14.1", "2.15.0rc1", "2.15.0", "2.16.0", yanked=("2.16.0",))
    assert watch.newer(index, "2.13.0") == ["2.15.0", "2.14.1", "2.14.0"]
    assert watch.newer(index, "2.13.0", pre=True) == ["2.15.0", "2.15.0rc1", "2.14.1", "2.14.0"]
    assert watch.newer(answer("2.13.0"), "2.13.0") == []


#: A release newer than any the matrix will hold, planted into the recorded answers of torch and transformers.
PLANTED = "99.0.0"


@pytest.fixture
def index(tmp_path: Path) -> Path:
    """The recorded answers, a release `PLANTED` added to torch's and transformers'."""
    folder = tmp_path / "index"
    shutil.copytree(ANSWERS, folder)
    for package in ("torch", "transformers"):
        answer_file = folder / package / "json"
        data = json.loads(answer_file.read_text())
        data["releases"][PLANTED] = [{"upload_time_iso_8601": "2099-01-01T00:00:00Z", "yanked": False}]
        answer_file.write_text(json.dumps(data))
    return folder


def answers(folder: Path) -> dict:
    return watch.ask(folder.as_uri(), [package for _, package, _ in watch.watched(load(default_spec_path()))])


def test_the_recorded_answers_list_what_is_newer_than_the_matrix_holds() -> None:
    spec = load(default_spec_path())
    found, made = watch.candidates(spec, answers(ANSWERS))
    assert {f.package for f in found} >= {"torch", "transformers", "peft", "accelerate", "deepspeed", "colossalai"}
    for release in found:
        assert all(Version(v) > Version(release.held) for v in release.newer), release
    assert {c.package for c in made} == {f.package for f in found if f.newer}


def test_a_planted_release_gives_a_torch_column_and_a_transformers_bump(index: Path) -> None:
    spec = load(default_spec_path())
    found, made = watch.candidates(spec, answers(index))
    assert {f.package: f.newer[0] for f in found if f.package in ("torch", "transformers")} == {
        "torch": PLANTED, "transformers": PLANTED}
    by_package = {c.package: c for c in made}
    torch = by_package["torch"]
    newest = spec.frameworks["torch"].environment
    assert (torch.environment, torch.base, torch.column) == ("torch-99.0", newest, True)
    assert torch.install == tuple(line.replace("{release}", PLANTED) for line in spec.frameworks["torch"].any_release)
    transformers = by_package["transformers"]
    held = watch.pinned(spec.environments["hf"].install, "transformers")
    assert (transformers.environment, transformers.base, transformers.column, transformers.held) == (
        "hf", "hf", False, held)
    assert transformers.install[0] == spec.environments["hf"].install[0].replace(f"transformers=={held}",
                                                                                  f"transformers=={PLANTED}")


def test_a_candidate_written_into_its_file_is_the_newest_release_or_the_bumped_pin(tmp_path: Path,
                                                                                   index: Path) -> None:
    matrix = tmp_path / "matrix"
    shutil.copytree(ROOT / "matrix", matrix)
    before = load(matrix / "matrix.toml")
    _, made = watch.candidates(before, answers(index))
    for candidate in made:
        file = matrix / "frameworks" / f"{candidate.framework}.toml"
        file.write_text(watch.apply(file.read_text(), candidate))
        assert watch.apply(file.read_text(), candidate) == file.read_text()  # applied twice: once
    spec = load(matrix / "matrix.toml")
    assert spec.frameworks["torch"].releases[0].version == PLANTED
    assert spec.environments["torch-99.0"].install[0] == f"torch=={PLANTED}"
    assert not spec.environments["torch-99.0"].first_run
    assert f"transformers=={PLANTED}" in spec.environments["hf"].install[0]
    assert spec.environments["hf-1.10"].install == before.environments["hf-1.10"].install  # older pins stay
    assert f"transformers=={PLANTED}" in spec.frameworks["hf"].any_release[0]


def planted(published: dict, environment: str, release: str) -> tuple[dict, str]:
    """The published cells of torch's newest environment, run again as `release` in `environment`, one ok cell
    turned silent."""
    spec = load(default_spec_path())
    base, held = spec.frameworks["torch"].environment, spec.frameworks["torch"].releases[0].version
    cells = [copy.deepcopy(c) for c in published["cells"] if c["environment"] == base]
    victim = next(c for c in cells if c["status"] == "pass" and c["severity"] == "ok")
    for cell in cells:
        cell["id"] = cell["id"].replace(f"@{held}/", f"@{release}/")
        cell.update(environment=environment, release=release)
    victim.update(status="fail", severity="silent", check="frozen_unchanged", message="a frozen param moved")
    ran = {"schema": published["schema"], "environments": {environment: published["environments"][base]},
           "cells": cells}
    return ran, victim["id"]


def test_a_planted_regression_in_a_new_release_fails_the_watch_and_is_named(
        tmp_path: Path, index: Path, capsys: pytest.CaptureFixture[str]) -> None:
    matrix = tmp_path / "matrix"
    shutil.copytree(ROOT / "matrix", matrix)
    candidates = tmp_path / "candidates.json"
    assert cli.main(["watch", "--index", index.as_uri(), "--spec", str(matrix / "matrix.toml"), "--only", "torch",
                     "--apply", "--json", str(candidates)]) == 0
    listed = capsys.readouterr().out
    assert re.search(rf"torch: torch [\d.]+ \(held\); newer on the index: {PLANTED}\b", listed)
    assert f"candidate: torch: torch {PLANTED} (new environment torch-99.0)" in listed
    published = json.loads(PUBLISHED.read_text())
    ran, victim = planted(published, "torch-99.0", PLANTED)
    (tmp_path / "ran.json").write_text(json.dumps(ran))
    code = cli.main(["watch-report", str(candidates), str(PUBLISHED), str(tmp_path / "ran.json"),
                     "-o", str(tmp_path / "watch")])
    said = capsys.readouterr().out
    assert code == cli.REGRESSION_EXIT
    assert f"torch {PLANTED}: 1 regression(s), 0 other change(s)" in said and victim in said
    page = (tmp_path / "watch" / f"torch-torch-{PLANTED}.md").read_text()
    base = load(default_spec_path()).frameworks["torch"].environment
    silent = sum(c["severity"] == "silent" for c in published["cells"] if c["environment"] == base)
    assert "**1 regression(s)**" in page and victim in page and f"silent {silent} → {silent + 1}" in page

    clean, _ = planted(published, "torch-99.0", PLANTED)
    by_id = {c["id"]: c for c in published["cells"]}
    held = load(default_spec_path()).frameworks["torch"].releases[0].version
    for cell in clean["cells"]:  # the same release without the plant: nothing changed, the watch passes
        original = by_id[cell["id"].replace(f"@{PLANTED}/", f"@{held}/")]
        cell.update(status=original["status"], severity=original["severity"])
    (tmp_path / "ran.json").write_text(json.dumps(clean))
    assert cli.main(["watch-report", str(candidates), str(PUBLISHED), str(tmp_path / "ran.json"),
                     "-o", str(tmp_path / "watch")]) == 0
    assert f"torch {PLANTED}: 0 regression(s), 0 other change(s)" in capsys.readouterr().out


def test_an_index_that_does_not_answer_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["watch", "--index", (tmp_path / "nothing").as_uri(), "--only", "torch"]) == cli.USAGE_EXIT
    said = capsys.readouterr().err.strip()
    assert said.startswith("freezecompat: the package index did not answer for torch") and "\n" not in said



def test_a_new_run_of_an_environment_replaces_its_published_cells() -> None:
    from pytest_freezecompat.report.merge import merge

    published = json.loads(PUBLISHED.read_text())
    hf = [copy.deepcopy(c) for c in published["cells"] if c["environment"] == "hf"]
    hf[0]["status"] = "error" if hf[0]["status"] != "error" else "pass"
    bumped = {"schema": published["schema"], "environments": {"hf": published["environments"]["hf"]}, "cells": hf}
    column, _ = planted(published, "torch-99.0", PLANTED)
    merged = merge([("published", published), ("bumped", bumped), ("column", column)], replace=True)
    after = {c["id"]: c for c in merged["cells"]}
    assert len(after) == len(published["cells"]) + len(column["cells"])
    assert after[hf[0]["id"]]["status"] == hf[0]["status"]  # the rerun's cell, not the published one
    assert sum(c["environment"] == "torch-99.0" for c in merged["cells"]) == len(column["cells"])
    with pytest.raises(Exception, match="duplicate cell"):  # without replace a rerun environment collides
        merge([("published", published), ("bumped", bumped)])


def test_a_watched_package_the_newest_environment_does_not_pin_is_a_one_line_error(tmp_path: Path) -> None:
    from pytest_freezecompat.spec.matrix import SpecError

    matrix = tmp_path / "matrix"
    shutil.copytree(ROOT / "matrix", matrix)
    hf = matrix / "frameworks" / "hf.toml"
    hf.write_text(hf.read_text().replace('watch = ["transformers", "peft"]', 'watch = ["transformers", "datasets"]'))
    with pytest.raises(SpecError) as caught:
        load(matrix / "matrix.toml")
    said = str(caught.value)
    assert "\n" not in said and "[releases] watch names 'datasets', which its newest environment does not pin" in said


def test_a_release_that_needs_another_python_gets_an_environment_on_the_oldest_that_it_takes(tmp_path: Path,
                                                                                            index: Path) -> None:
    """megatron-core 0.19 requires Python 3.12: its column is built on 3.12, written into its block."""
    needs = {"releases": {"0.19.2": [{"requires_python": ">=3.12", "yanked": False}]}}
    assert watch.python_for(needs, "0.19.2", "3.11") == "3.12"
    assert watch.python_for(needs, "0.19.2", "3.12") == ""
    assert watch.python_for({"releases": {"1.0": [{"requires_python": None}]}}, "1.0", "3.11") == ""
    megatron = json.loads((index / "megatron-core" / "json").read_text())
    megatron["releases"][PLANTED] = [{"requires_python": ">=3.12", "yanked": False}]
    (index / "megatron-core" / "json").write_text(json.dumps(megatron))
    matrix = tmp_path / "matrix"
    shutil.copytree(ROOT / "matrix", matrix)
    _, made = watch.candidates(load(matrix / "matrix.toml"), answers(index))
    column = next(c for c in made if c.package == "megatron-core")
    assert (column.environment, column.python) == ("megatron-99.0", "3.12")
    file = matrix / "frameworks" / "megatron.toml"
    file.write_text(watch.apply(file.read_text(), column))
    assert load(matrix / "matrix.toml").environments["megatron-99.0"].python == "3.12"
