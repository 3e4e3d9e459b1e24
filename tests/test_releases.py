"""Releases as an axis: which release a run plans, rules by version range, the change across releases, bisection."""

import json
import subprocess
from pathlib import Path

import pytest

from pytest_freezecompat import bisect
from pytest_freezecompat.report import releases
from pytest_freezecompat.spec import matrix as spec
from pytest_freezecompat.spec.plan import Selection, SelectionError, plan

MATRIX = """
schema = 1
[models.m.groups]
embedding = ["tok_emb.*"]
[freeze.none]
[freeze.embedding]
frozen = ["embedding"]
[frameworks.alpha]
adapter = "toy_adapters:ALPHA"
import = "json"
package = "alpha-dist"
models = ["m"]
plugins = ["p1", "p2"]
init = ["eager"]
checkpoint = ["none"]
freeze = ["none", "embedding"]
[[frameworks.alpha.environment]]
name = "alpha"
release = "0.32.1"
install = ["alpha==0.32.1"]
[[frameworks.alpha.environment]]
name = "alpha-0.23"
release = "0.23.5"
install = ["alpha==0.23.5"]
[frameworks.alpha.releases]
install = ["alpha=={release} torch"]
[[frameworks.alpha.rule]]
when = {plugin = "p2", release = "<0.31"}
exclude = "p2 arrived in 0.31"
"""


@pytest.fixture
def matrix(tmp_path: Path) -> spec.Spec:
    path = tmp_path / "matrix.toml"
    path.write_text(MATRIX)
    return spec.load(path)


def cells_with(matrix, installed, environment=None):
    return plan(matrix, Selection({}), world_size=2, device="cpu", environment=environment,
                installed=lambda package: installed if package == "alpha-dist" else None)


def test_a_run_plans_the_installed_release_and_rules_select_by_version_range(matrix):
    old = cells_with(matrix, "0.23.5")
    assert {c.environment for c in old} == {"alpha-0.23"} and {c.key.release for c in old} == {"0.23.5"}
    assert [c.id for c in old] == ["m/alpha@0.23.5/p1/eager/none/none", "m/alpha@0.23.5/p1/eager/none/embedding"]
    new = cells_with(matrix, "0.32.1+local")  # a local tag is the same release
    assert len(new) == 4 and {c.environment for c in new} == {"alpha"}


def test_an_undeclared_installed_release_runs_as_itself(matrix):
    """"Does freezing work on my version?": a release the file does not list gets its own ids and environment."""
    mine = cells_with(matrix, "0.28.0")
    assert {c.environment for c in mine} == {"alpha@0.28.0"} and len(mine) == 2  # p2 excluded below 0.31
    assert cells_with(matrix, "0.28.0", environment="alpha@0.28.0")[0].id == "m/alpha@0.28.0/p1/eager/none/none"


def test_a_named_environment_must_hold_its_release(matrix):
    with pytest.raises(SelectionError, match=r"alpha-0.23 runs alpha-dist 0.23.5, but 0.32.1 is installed here"):
        cells_with(matrix, "0.32.1", environment="alpha-0.23")
    assert cells_with(matrix, "0.32.1", environment="beta-0.1") == []  # another framework's environment


def test_the_environment_listing_and_the_any_release_rule(matrix):
    alpha = matrix.frameworks["alpha"]
    assert [r.version for r in alpha.releases] == ["0.32.1", "0.23.5"] and alpha.environment == "alpha"
    assert list(matrix.environments) == ["alpha", "alpha-0.23"] and alpha.any_release == ("alpha=={release} torch",)
    assert matrix.values("release") == ["0.32.1", "0.23.5"]
    assert [env.python for env in matrix.environments.values()] == ["", ""]


def test_an_environment_may_name_its_python(tmp_path):
    path = tmp_path / "matrix.toml"
    path.write_text(MATRIX.replace('name = "alpha-0.23"\n', 'name = "alpha-0.23"\npython = "3.10"\n'))
    assert spec.load(path).environments["alpha-0.23"].python == "3.10"


@pytest.mark.parametrize(("change", "message"), [
    ('name = "alpha-0.23"\nrelease = "0.23.5"', "release is named twice"),
    ('name = "alpha-0.23"\nrelease = "soon"', "release 'soon' is not a version"),
    ('name = "alpha-0.23"', "needs `release`"),
    ('name = "Alpha 0.23"\nrelease = "0.23.4"', "is not lowercase letters"),
    ('name = "alpha-0.23"\nrelease = "0.23.5"\npython = "3"', "python '3' is not 3.<minor>"),
])
def test_bad_environment_tables_are_one_line(tmp_path, change, message):
    text = MATRIX.replace('name = "alpha-0.23"\nrelease = "0.23.5"', change, 1)
    if "twice" in message:
        text = text.replace('name = "alpha"\nrelease = "0.32.1"', 'name = "alpha"\nrelease = "0.23.5"')
    path = tmp_path / "matrix.toml"
    path.write_text(text)
    with pytest.raises(spec.SpecError, match=message):
        spec.load(path)


def test_a_rule_release_that_is_no_specifier_is_refused(tmp_path):
    path = tmp_path / "matrix.toml"
    path.write_text(MATRIX.replace('release = "<0.31"', 'release = "<<0.31"'))
    with pytest.raises(spec.SpecError, match="is not a version specifier"):
        spec.load(path)


def row(release, status, known=None, plugin="fsdp1", **extra):
    cell_id = f"m/composer@{release}/{plugin}/eager/none/optimizer-subset"
    return {"id": cell_id, "framework": "composer", "release": release, "status": status,
            **({"known_issue": {"id": known, "expected": True}} if known else {}), **extra}


def test_the_change_across_releases_is_placed_between_the_runs_or_where_a_bisection_found_it():
    rows = [row("0.23.5", "fail", "composer-old"), row("0.32.1", "pass"), row("0.23.5", "pass", plugin="ddp"),
            row("0.32.1", "pass", plugin="ddp")]
    (table,) = releases.across_releases(rows)
    assert table.releases == ["0.23.5", "0.32.1"] and table.cells == 2
    (change,) = table.changes  # ddp passes on both: not listed
    assert change.statuses == {"0.23.5": "known", "0.32.1": "pass"} and change.known_issue == "composer-old"
    assert change.label == "fixed after 0.23.5, by 0.32.1"
    found = [{"cells": ["m/composer/fsdp1/eager/none/optimizer-subset"], "first_changed": "0.24.0"}]
    assert releases.across_releases(rows, found)[0].changes[0].label == "fixed in 0.24.0 (bisected)"
    broke = releases.across_releases([row("2.7.1", "pass"), row("2.13.0", "error")])[0].changes[0]
    assert broke.label == "broke after 2.7.1, by 2.13.0"  # versions compare as versions, not strings
    other = releases.across_releases([row("0.23.5", "error", "old-refusal"), row("0.32.1", "error")])[0].changes[0]
    assert other.label == "changed after 0.23.5, by 0.32.1"  # still red, another way: `known` -> `error`


def test_what_got_worse_across_releases_is_named_so_and_listed_first():
    """Megatron's full recompute + all-but-last: refused on 0.8.0, silent on 0.16.1, a regression, not a change."""
    moved = [{"check": "update", "params": ["w"], "kinds": ["update-differs"]}]
    rows = [row("0.8.0", "pass", plugin="a"), row("0.16.1", "pass", plugin="a", unchecked=["training"]),
            row("0.8.0", "fail", plugin="b", failures=moved), row("0.16.1", "pass", plugin="b"),
            row("0.8.0", "error", plugin="c"), row("0.16.1", "fail", plugin="c", failures=moved)]
    (table,) = releases.across_releases(rows)
    assert [(c.cell.split("/")[2], c.label, c.regression) for c in table.changes] == [
        ("c", "worse after 0.8.0, by 0.16.1", True), ("b", "fixed after 0.8.0, by 0.16.1", False)]
    unchecked_before = [row("0.8.0", "pass", unchecked=["resume"]), row("0.16.1", "fail", failures=moved)]
    (change,) = releases.across_releases(unchecked_before)[0].changes
    assert (change.label, change.regression) == ("changed (one side unproven) after 0.8.0, by 0.16.1", False)


def test_final_releases_read_from_pip_index_versions():
    listing = "mosaicml (0.32.1)\nAvailable versions: 0.32.1, 0.24.0, 0.24.0rc1, 0.23.5, 0.9.0, 1.0.0.post1, x\n"
    assert [str(v) for v in bisect.final_releases(listing)] == ["0.9.0", "0.23.5", "0.24.0", "0.32.1"]
    assert bisect.final_releases("nothing here") == []


@pytest.mark.parametrize(("first_new", "broken", "expected"), [
    (1, set(), (0, 1)),
    (5, set(), (4, 5)),
    (9, set(), (8, 9)),
    (5, {4}, (3, 5)),  # the last old release cannot be built: the change lies after 3, by 5
    (5, {3, 4, 6}, (2, 5)),
])
def test_search_halves_the_range_and_steps_over_skipped_releases(first_new, broken, expected):
    names = [str(k) for k in range(10)]
    probed = []

    def probe(release):
        probed.append(int(release))
        return "skip" if int(release) in broken else "last" if int(release) >= first_new else "first"

    assert bisect.search(names, probe) == expected
    assert len(probed) <= 6 and len(set(probed)) == len(probed)  # log2(8) plus the skips, none probed twice


def test_a_bisection_probes_both_ends_then_the_middle(matrix, monkeypatch, tmp_path):
    statuses = {"0.23.5": "fail", "0.24.0": "pass", "0.24.1": "pass", "0.25.0": "pass", "0.32.1": "pass"}

    def run(self, release):
        if release == "0.25.0":
            return bisect.Probe(release, "skip", reason="cannot build: no matching torch")
        return bisect.Probe(release, "", {"m/alpha/p1/eager/none/embedding": statuses[release]})

    monkeypatch.setattr(bisect.Runner, "run", run)
    listing = "Available versions: 0.32.1, 0.25.0, 0.24.1, 0.24.0, 0.23.5, 0.23.4"
    found = bisect.bisect(matrix, "alpha", "freeze=embedding", good="0.32.1", bad="0.23.5", root=tmp_path,
                          envs=tmp_path, listing=listing, report=lambda line: None)
    assert found.first_changed == "0.24.0" and found.last_before == "0.23.5" and found.releases_between == 3
    verdicts = {p.release: p.verdict for p in found.probes}
    assert verdicts["0.23.5"] == "bad" and verdicts["0.32.1"] == "good" and verdicts.get("0.25.0", "skip") == "skip"
    assert any("0.24.0" in line for line in bisect.summary(found))
    with pytest.raises(bisect.BisectError, match="not a final release"):
        bisect.bisect(matrix, "alpha", "", good="0.99.0", bad="0.23.5", root=tmp_path, envs=tmp_path,
                      listing=listing, report=lambda line: None)


def test_a_release_environment_runs_the_adapters_setup_after_its_install(monkeypatch, tmp_path):
    """DeepSpeed's ops are built when its environment is made: a bisection's environments get them too."""
    matrix = spec.load()
    steps: list[list[str]] = []

    def run(step, **kwargs):
        steps.append(step)
        if step[1:3] == ["-m", "venv"]:
            (tmp_path / "deepspeed@0.19.5" / "bin").mkdir(parents=True)
        return subprocess.CompletedProcess(step, 0, "", "")

    monkeypatch.setattr(bisect.subprocess, "run", run)
    runner = bisect.Runner(matrix, matrix.frameworks["deepspeed"], "freeze=none", Path.cwd(), tmp_path)
    python, why = runner.environment("0.19.5")
    setup = "pytest_freezecompat.adapters.deepspeed.environment_setup"
    assert why == "" and python == tmp_path / "deepspeed@0.19.5" / "bin" / "python"
    assert ["deepspeed==0.19.5"] in [step[-1:] for step in steps] and steps[-1] == [str(python), "-m", setup]
    stamp = json.loads((tmp_path / "deepspeed@0.19.5" / "freezecompat-pins.json").read_text())
    assert stamp["setup"] == [setup]
