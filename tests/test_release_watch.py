"""The release watch on recorded index answers: what is new, the candidate environments, the framework files they are
written into, and a planted regression in a new release that fails the watch, named."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest

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


def recorded() -> dict:
    return watch.ask(ANSWERS.as_uri(), [package for _, package, _ in watch.watched(load(default_spec_path()))])


def test_the_recorded_index_gives_a_torch_column_and_a_transformers_bump() -> None:
    spec = load(default_spec_path())
    found, made = watch.candidates(spec, recorded())
    news = {f.package: f.newer for f in found}
    assert news["torch"] == ("2.15.0", "2.14.1", "2.14.0") and news["transformers"] == ("5.24.0",)
    assert news["accelerate"] == () and news["deepspeed"] == ()
    by_package = {c.package: c for c in made}
    torch = by_package["torch"]
    assert (torch.environment, torch.base, torch.column) == ("torch-2.15", "torch", True)
    assert torch.install == ("torch==2.15.0", "transformers==5.23.0 peft==0.21.2")
    transformers = by_package["transformers"]
    assert (transformers.environment, transformers.base, transformers.column) == ("hf", "hf", False)
    assert transformers.install[0] == "accelerate==1.15.0 transformers==5.24.0 peft==0.21.2 torch==2.13.0"


def test_a_candidate_written_into_its_file_is_the_newest_release_or_the_bumped_pin(tmp_path: Path) -> None:
    matrix = tmp_path / "matrix"
    shutil.copytree(ROOT / "matrix", matrix)
    _, made = watch.candidates(load(matrix / "matrix.toml"), recorded())
    for candidate in made:
        file = matrix / "frameworks" / f"{candidate.framework}.toml"
        file.write_text(watch.apply(file.read_text(), candidate))
        assert watch.apply(file.read_text(), candidate) == file.read_text()  # applied twice: once
    spec = load(matrix / "matrix.toml")
    assert spec.frameworks["torch"].releases[0].version == "2.15.0"
    assert spec.environments["torch-2.15"].install == ("torch==2.15.0", "transformers==5.23.0 peft==0.21.2")
    assert not spec.environments["torch-2.15"].first_run
    assert "transformers==5.24.0" in spec.environments["hf"].install[0]
    assert "transformers==4.57.1" in spec.environments["hf-1.10"].install[0]  # an older release keeps its pins
    assert spec.frameworks["hf"].any_release[0].startswith("accelerate=={release} transformers==5.24.0")


def planted(published: dict, environment: str, release: str) -> tuple[dict, str]:
    """The published torch cells, run again as `release` in `environment`, one ok cell turned silent."""
    cells = [copy.deepcopy(c) for c in published["cells"] if c["environment"] == "torch"]
    victim = next(c for c in cells if c["status"] == "pass" and c["severity"] == "ok")
    for cell in cells:
        cell["id"] = cell["id"].replace("@2.13.0/", f"@{release}/")
        cell.update(environment=environment, release=release)
    victim.update(status="fail", severity="silent", check="frozen_unchanged", message="a frozen param moved")
    ran = {"schema": published["schema"], "environments": {environment: published["environments"]["torch"]},
           "cells": cells}
    return ran, victim["id"]


def test_a_planted_regression_in_a_new_release_fails_the_watch_and_is_named(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    matrix = tmp_path / "matrix"
    shutil.copytree(ROOT / "matrix", matrix)
    candidates = tmp_path / "candidates.json"
    assert cli.main(["watch", "--index", ANSWERS.as_uri(), "--spec", str(matrix / "matrix.toml"), "--only", "torch",
                     "--apply", "--json", str(candidates)]) == 0
    listed = capsys.readouterr().out
    assert "torch: torch 2.13.0 (held); newer on the index: 2.15.0, 2.14.1, 2.14.0" in listed
    assert "candidate: torch: torch 2.15.0 (new environment torch-2.15)" in listed
    published = json.loads(PUBLISHED.read_text())
    ran, victim = planted(published, "torch-2.15", "2.15.0")
    (tmp_path / "ran.json").write_text(json.dumps(ran))
    code = cli.main(["watch-report", str(candidates), str(PUBLISHED), str(tmp_path / "ran.json"),
                     "-o", str(tmp_path / "watch")])
    said = capsys.readouterr().out
    assert code == cli.REGRESSION_EXIT
    assert "torch 2.15.0: 1 regression(s), 0 other change(s)" in said and victim in said
    page = (tmp_path / "watch" / "torch-torch-2.15.0.md").read_text()
    silent = sum(c["severity"] == "silent" for c in published["cells"] if c["environment"] == "torch")
    assert "**1 regression(s)**" in page and victim in page and f"silent {silent} → {silent + 1}" in page

    clean, _ = planted(published, "torch-2.15", "2.15.0")
    for cell in clean["cells"]:  # the same release without the plant: nothing changed, the watch passes
        original = next(c for c in published["cells"] if c["id"] == cell["id"].replace("@2.15.0/", "@2.13.0/"))
        cell.update(status=original["status"], severity=original["severity"])
    (tmp_path / "ran.json").write_text(json.dumps(clean))
    assert cli.main(["watch-report", str(candidates), str(PUBLISHED), str(tmp_path / "ran.json"),
                     "-o", str(tmp_path / "watch")]) == 0
    assert "torch 2.15.0: 0 regression(s), 0 other change(s)" in capsys.readouterr().out


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
    column, _ = planted(published, "torch-2.15", "2.15.0")
    merged = merge([("published", published), ("bumped", bumped), ("column", column)], replace=True)
    after = {c["id"]: c for c in merged["cells"]}
    assert len(after) == len(published["cells"]) + len(column["cells"])
    assert after[hf[0]["id"]]["status"] == hf[0]["status"]  # the rerun's cell, not the published one
    assert sum(c["environment"] == "torch-2.15" for c in merged["cells"]) == len(column["cells"])
    with pytest.raises(Exception, match="duplicate cell"):  # without replace a rerun environment collides
        merge([("published", published), ("bumped", bumped)])
