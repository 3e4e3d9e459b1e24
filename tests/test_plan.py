from pathlib import Path

import pytest

from pytest_freezecompat.core.cell import UserModel
from pytest_freezecompat.core.freeze import FreezePattern
from pytest_freezecompat.spec import matrix as spec
from pytest_freezecompat.spec.plan import Selection, SelectionError, UserCase, plan, user_cells, why_not_importable

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


NEEDY = """
schema = 1
[models.m.groups]
body = ["body.*"]
[freeze.none]
[frameworks.needy]
adapter = "toy_adapters:NEEDY"
import = "json"
models = ["m"]
plugins = ["plain", "ddp", "zero"]
init = ["eager"]
checkpoint = ["none"]
freeze = ["none"]
user_models = true
[[frameworks.needy.rule]]
when = {plugin = "zero"}
skip = "a rule's own reason"
"""


def only(*modules):
    """`importable` as planning asks it, where only `modules` (and the framework, json) are installed."""
    return lambda module: None if module in (*modules, "json") else f"No module named {module!r}"


@pytest.fixture
def needy(tmp_path: Path) -> spec.Spec:
    path = tmp_path / "matrix.toml"
    path.write_text(NEEDY)
    return spec.load(path)


def test_a_plugin_whose_package_is_missing_is_skipped_with_what_installs_it(needy):
    skips = {c.key.plugin: c.skip for c in plan(needy, Selection({}), world_size=2, device="cpu",
                                                importable=only())}
    assert skips == {"plain": None, "ddp": "plugin ddp needs `extra_mod`: pip install extra-pkg",
                     "zero": "plugin zero needs `extra_mod` and `engine_mod`: pip install extra-pkg engine"}
    partly = {c.key.plugin: c.skip for c in plan(needy, Selection({}), world_size=2, device="cpu",
                                                 importable=only("extra_mod"))}
    assert partly == {"plain": None, "ddp": None, "zero": "plugin zero needs `engine_mod`: pip install engine"}
    installed = {c.key.plugin: c.skip for c in plan(needy, Selection({}), world_size=2, device="cpu",
                                                    importable=only("extra_mod", "engine_mod"))}
    assert installed == {"plain": None, "ddp": None, "zero": "a rule's own reason"}


def test_a_missing_framework_is_the_reason_before_its_plugins_packages(needy):
    cells = plan(needy, Selection({}), world_size=2, device="cpu", importable=lambda module: "not here")
    assert all(c.skip.startswith("needy is not importable") for c in cells) and len(cells) == 3


def test_a_users_case_skips_the_same_way(needy):
    case = UserCase("mine", UserModel("m:build", "m:batch", "m:loss"), {"none": FreezePattern("none")}, {})
    skips = {c.key.plugin: c.skip for c in user_cells(needy, case, world_size=2, device="cpu", importable=only())}
    assert skips["plain"] is None and skips["ddp"] == "plugin ddp needs `extra_mod`: pip install extra-pkg"


def test_needs_of_a_plugin_the_adapter_does_not_offer_is_refused_at_load(tmp_path):
    path = tmp_path / "matrix.toml"
    path.write_text(NEEDY.replace("toy_adapters:NEEDY", "toy_adapters:UNKNOWN_NEED")
                    .replace('["plain", "ddp", "zero"]', '["p"]').split("[[frameworks")[0])
    with pytest.raises(spec.SpecError, match=r"adapter 'toy_adapters:UNKNOWN_NEED': needs names plugin 'q', which it "
                                             r"does not offer; valid: p$"):
        spec.load(path)


def test_the_hf_and_lightning_rows_skip_trl_and_deepspeed_plugins_where_those_are_missing():
    """The shipped declarations: with accelerate, transformers, peft and lightning but neither TRL nor DeepSpeed,
    exactly the plugins that import them are skipped, each saying what to install."""
    matrix = spec.load(spec.default_spec_path())
    cells = plan(matrix, Selection.parse("framework=hf,framework=lightning", matrix), world_size=2, device="cuda",
                 importable=only("accelerate", "transformers", "peft", "lightning"))
    skipped = {(c.key.framework, c.key.plugin): c.skip for c in cells if c.skip and "pip install" in c.skip}
    assert skipped == {
        **{("hf", p): f"plugin {p} needs `deepspeed`: pip install deepspeed"
           for p in ("accelerate-zero2", "accelerate-zero3", "trainer-zero2", "trainer-zero3")},
        **{("lightning", p): f"plugin {p} needs `deepspeed`: pip install deepspeed"
           for d in ("trainer", "fabric") for p in (f"{d}-deepspeed", f"{d}-deepspeed-stage-3",
                                                    f"{d}-deepspeed-exclude-frozen")}}
    case = UserCase("mine", UserModel("m:build", "m:batch", "m:loss"), {"adapter": FreezePattern("adapter")}, {},
                    frameworks=("hf",), plugins=("trl-sft-ddp", "trl-sft-ddp-peft-config", "trl-sft-zero3"))
    own = {c.key.plugin: c.skip for c in user_cells(matrix, case, world_size=2, device="cuda",
                                                    importable=only("accelerate", "transformers", "peft"))}
    assert own == {"trl-sft-ddp": "plugin trl-sft-ddp needs `trl`: pip install trl",
                   "trl-sft-ddp-peft-config": "plugin trl-sft-ddp-peft-config needs `trl`: pip install trl",
                   "trl-sft-zero3": "plugin trl-sft-zero3 needs `trl` and `deepspeed`: pip install trl deepspeed"}


def test_a_trl_plugin_given_a_plain_module_is_a_skip_that_says_why():
    """SFTTrainer reads model.config: a plain nn.Module is no cell of TRL's (not a refusal); a transformers model or
    a PeftModel is planned as any other."""
    matrix = spec.load(spec.default_spec_path())
    plugins = ("trainer-ddp", "trl-sft-ddp", "trl-sft-ddp-peft-config")

    def skips(classes):
        case = UserCase("mine", UserModel("m:build", "m:batch", "m:loss"), {"adapter": FreezePattern("adapter")}, {},
                        frameworks=("hf",), plugins=plugins, classes=classes)
        return {c.key.plugin: c.skip for c in user_cells(matrix, case, world_size=2, device="cpu",
                                                         importable=lambda module: None)}

    assert skips(("TinyConvNet", "Module", "object")) == {
        "trainer-ddp": None,
        "trl-sft-ddp": "plugin trl-sft-ddp takes a PreTrainedModel or a PeftModel (trl.SFTTrainer reads model.config); "
                       "TinyConvNet is not one: not run",
        "trl-sft-ddp-peft-config": "plugin trl-sft-ddp-peft-config takes a PreTrainedModel or a PeftModel "
                                   "(trl.SFTTrainer reads model.config); TinyConvNet is not one: not run"}
    assert skips(("LlamaForCausalLM", "LlamaPreTrainedModel", "PreTrainedModel", "Module")) == dict.fromkeys(plugins)
    assert skips(("PeftModelForCausalLM", "PeftModel", "Module")) == dict.fromkeys(plugins)
