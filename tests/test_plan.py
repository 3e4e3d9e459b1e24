from pathlib import Path

import pytest

from pytest_freezecompat.spec import matrix as spec
from pytest_freezecompat.spec.plan import Selection, SelectionError, plan, why_not_importable

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
models = ["m"]
plugins = ["p1", "p2", "gem"]
init = ["eager", "lazy"]
checkpoint = ["none"]
freeze = ["none", "embedding"]
[[frameworks.alpha.rule]]
when = {plugin = "gem"}
device = "cpu"
skip = "needs CUDA"
known_issue = "gem-cuda"
[[frameworks.alpha.rule]]
when = {plugin = "p2", init = "lazy"}
exclude = "lazy init makes no sense here"
[[frameworks.alpha.rule]]
when = {plugin = "p*", freeze = "embedding"}
device = "cpu"
emulation = true
precision = "bf16"
[frameworks.beta]
adapter = "toy_adapters:BETA"
import = "surely_not_installed_module"
models = ["m"]
plugins = ["q"]
init = ["eager"]
checkpoint = ["none"]
freeze = ["none"]
[frameworks.beta.environment]
name = "beta-env"
"""


@pytest.fixture
def matrix(tmp_path: Path) -> spec.Spec:
    path = tmp_path / "matrix.toml"
    path.write_text(MATRIX)
    return spec.load(path)


def ids(cells):
    return [c.id for c in cells]


def test_cells_are_the_product_of_axes_minus_excluded(matrix):
    cells = plan(matrix, Selection.parse("framework=alpha", matrix), world_size=2, device="cpu")
    assert len(cells) == 3 * 2 * 2 - 2  # p2 + lazy excluded (2 freeze patterns)
    assert "m/alpha/p2/lazy/none/none" not in ids(cells)
    assert ids(cells) == sorted(ids(cells), key=ids(cells).index)  # stable order


def test_rules_apply_per_device(matrix):
    on_cpu = {c.id: c for c in plan(matrix, Selection({}), world_size=2, device="cpu")}
    on_gpu = {c.id: c for c in plan(matrix, Selection({}), world_size=2, device="cuda")}
    gem = "m/alpha/gem/eager/none/none"
    assert on_cpu[gem].skip == "needs CUDA" and on_cpu[gem].known_issue == "gem-cuda"
    assert on_gpu[gem].skip is None
    emulated = "m/alpha/p1/eager/none/embedding"
    assert on_cpu[emulated].emulation and on_cpu[emulated].precision == "bf16"
    assert not on_gpu[emulated].emulation and on_gpu[emulated].precision == "fp32"


def test_non_importable_framework_is_skipped_with_its_environment_named(matrix):
    cells = plan(matrix, Selection.parse("framework=beta", matrix), world_size=2, device="cpu")
    assert len(cells) == 1
    assert "not importable" in cells[0].skip and "'beta-env'" in cells[0].skip


def test_environment_runs_only_the_frameworks_it_owns(matrix):
    cells = plan(matrix, Selection({}), world_size=2, device="cpu", environment="beta-env")
    assert {c.key.framework for c in cells} == {"beta"}


def test_selection_repeats_an_axis_for_alternatives(matrix):
    selection = Selection.parse("plugin=p1,plugin=p2,freeze=none", matrix)
    cells = plan(matrix, selection, world_size=2, device="cpu")
    assert {(c.key.plugin, c.key.freeze) for c in cells} == {("p1", "none"), ("p2", "none")}


@pytest.mark.parametrize(("text", "message"), [
    ("frame=alpha", "unknown axis 'frame'; valid: model, framework, release, plugin, init, checkpoint, freeze"),
    ("plugin=p9", "unknown plugin 'p9'; valid: p1, p2, gem, q"),
    ("plugin", "'plugin' is not axis=value"),
])
def test_bad_selection_is_one_line_listing_valid_values(matrix, text, message):
    with pytest.raises(SelectionError, match=message):
        Selection.parse(text, matrix)


def test_a_folder_named_like_a_framework_is_not_the_framework(tmp_path, monkeypatch):
    (tmp_path / "fakeframework").mkdir()
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "only a namespace folder" in why_not_importable("fakeframework")
    assert why_not_importable("json") is None
