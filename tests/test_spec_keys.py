"""Every table of a matrix file declares its keys: a misspelt one is a one-line load error naming the file and line,
the table (and its entry), the key, the keys allowed and the nearest of them, never a key the planner reads past."""

import re
from pathlib import Path

import pytest

from pytest_freezecompat.core.declaration import load_declaration
from pytest_freezecompat.spec import matrix as spec
from pytest_freezecompat.spec.plan import Selection, plan

GOOD = """schema = 1
[models.m]
description = "a model"
[models.m.groups]
embedding = ["tok_emb.*"]
[freeze.none]
[freeze.embedding]
frozen = ["embedding"]
[frameworks.torch]
adapter = "pytest_freezecompat.adapters.torch_native"
models = ["m"]
plugins = ["ddp"]
init = ["eager"]
checkpoint = ["none", "reentrant"]
freeze = ["none", "embedding"]
"""
ENVIRONMENT = '[[frameworks.torch.environment]]\nname = "torch"\nrelease = "2.13.0"\ninstall = ["torch==2.13.0"]\n'
RULE = '[[frameworks.torch.rule]]\nwhen = { plugin = "ddp" }\nexclude = "x"\n'
RULE_KEYS = "device, emulation, exclude, known_issue, options, own_round_trip, precision, skip, when"
WHEN_AXES = "checkpoint, clip, framework, freeze, init, model, plugin, release"
FRAMEWORK_KEYS = ("adapter, checkpoint, clip, environment, framework, freeze, import, init, models, package, plugins, "
                  "releases, round_trip, rule, user_models")


def refused(path: Path, line_with: str, message: str) -> None:
    """Loading `path` is the one-line `path:line: message`, the line the first (from the end) to hold `line_with`."""
    lines = path.read_text().splitlines()
    line = max(n for n, text in enumerate(lines, 1) if line_with in text)
    with pytest.raises(spec.SpecError) as caught:
        spec.load(path)
    assert "\n" not in str(caught.value)
    assert re.fullmatch(rf"{re.escape(str(path))}:{line}: {message}", str(caught.value)), str(caught.value)


#: (what the good matrix becomes, the misspelt key's line, the message after `file:line: `): one per table kind.
TABLES = {
    "matrix": (GOOD.replace("schema = 1", "schema = 1\nschem = 1"), "schem =",
               r"matrix: unknown key 'schem'; valid: frameworks, freeze, models, schema; did you mean 'schema'\?"),
    "models": (GOOD.replace('description = "a model"', 'descripton = "a model"'), "descripton",
               r"models\.m: unknown key 'descripton'; valid: description, groups; did you mean 'description'\?"),
    "freeze": (GOOD.replace('frozen = ["embedding"]', 'frozn = ["embedding"]'), "frozn",
               r"freeze\.embedding: unknown key 'frozn'; valid: buffers, description, eval, features, frozen, "
               r"may_refuse, optimizer, rows, trainable, unused; did you mean 'frozen'\?"),
    "framework": (GOOD + "user_model = true\n", "user_model",
                  rf"framework torch: unknown key 'user_model'; valid: {FRAMEWORK_KEYS}; did you mean 'user_models'\?"),
    "environment": (GOOD + ENVIRONMENT.replace("install =", "instal ="), "instal =",
                    r"framework torch environment torch: unknown key 'instal'; valid: first_run, install, name, "
                    r"python, release; did you mean 'install'\?"),
    "environment-name": (GOOD + ENVIRONMENT.replace("name =", "nmae ="), "nmae",
                         r"framework torch environment #1: unknown key 'nmae'; valid: first_run, install, name, "
                         r"python, release; did you mean 'name'\?"),
    "releases": (GOOD + '[frameworks.torch.releases]\ninstal = ["torch=={release}"]\n', "instal",
                 r"framework torch: \[releases\]: unknown key 'instal'; valid: install, watch; "
                 r"did you mean 'install'\?"),
    "round_trip": (GOOD + '[frameworks.torch.round_trip]\nchekpoint = [["none", "reentrant"]]\n', "chekpoint",
                   r"framework torch: \[round_trip\]: unknown axis 'chekpoint'; valid: checkpoint, clip, init; "
                   r"did you mean 'checkpoint'\?"),
    "rule": (GOOD + RULE.replace("exclude =", "exlude ="), "exlude",
             rf"torch rule 1: unknown key 'exlude'; valid: {RULE_KEYS}; did you mean 'exclude'\?"),
    "rule-when": (GOOD + RULE.replace('plugin = "ddp"', 'plugins = "ddp"'), "plugins =",
                  rf"torch rule 1: `when`: unknown axis 'plugins'; valid: {WHEN_AXES}; did you mean 'plugin'\?"),
    "rule-options": (GOOD + RULE + "options = { find_unused = true }\n", "find_unused",
                     r"torch rule 1: options \(adapter pytest_freezecompat\.adapters\.torch_native\): unknown key "
                     r"'find_unused'; valid: \(none\)"),
}


@pytest.mark.parametrize("table", TABLES)
def test_a_misspelt_key_is_a_one_line_error_that_names_it_and_the_nearest_allowed(tmp_path, table):
    text, line_with, message = TABLES[table]
    path = tmp_path / "matrix.toml"
    path.write_text(text)
    refused(path, line_with, message)


DEEPSPEED = GOOD.replace("pytest_freezecompat.adapters.torch_native", "pytest_freezecompat.adapters.deepspeed").replace(
    'plugins = ["ddp"]', 'plugins = ["zero0"]') + '[[frameworks.torch.rule]]\nwhen = { init = "eager" }\n'


def test_a_rule_sets_only_the_options_its_adapter_reads_each_of_its_kind(tmp_path):
    path = tmp_path / "matrix.toml"
    path.write_text(DEEPSPEED + "options = { exclude_frozen_parameters = true }\n")
    assert spec.load(path).frameworks["torch"].rules[0].effects["options"] == {"exclude_frozen_parameters": True}
    path.write_text(DEEPSPEED + "options = { exclude_frozen_paramters = true }\n")
    refused(path, "exclude_frozen_paramters", r"torch rule 1: options \(adapter pytest_freezecompat\.adapters\."
                                              r"deepspeed\): unknown key 'exclude_frozen_paramters'; valid: "
                                              r"exclude_frozen_parameters; did you mean 'exclude_frozen_parameters'\?")
    path.write_text(DEEPSPEED + 'options = { exclude_frozen_parameters = "false" }\n')  # bool("false") is True
    refused(path, "exclude_frozen_parameters", r"torch rule 1: options\.exclude_frozen_parameters must be true or "
                                               r"false")


def test_a_misspelt_key_in_a_framework_file_names_that_file_and_rule(tmp_path):
    (tmp_path / "matrix.toml").write_text(GOOD.split("[frameworks.torch]")[0])
    (tmp_path / "frameworks").mkdir()
    framework = tmp_path / "frameworks" / "torch.toml"
    body = GOOD.split("[frameworks.torch]\n")[1]
    framework.write_text(f'{body}[[rule]]\nwhen = {{ plugin = "ddp" }}\nskip = "x"\n'
                         f'[[rule]]\nwhen = {{ plugin = "ddp", init = "eager" }}\nskipp = "y"\n')
    with pytest.raises(spec.SpecError) as caught:
        spec.load(tmp_path / "matrix.toml")
    assert str(caught.value) == (f"{framework}:12: torch rule 2: unknown key 'skipp'; valid: {RULE_KEYS}; "
                                 "did you mean 'skip'?")


def test_user_models_is_true_or_false(tmp_path):
    path = tmp_path / "matrix.toml"
    path.write_text(GOOD + 'user_models = "false"\n')  # was taken for true
    refused(path, "user_models", "framework torch: user_models must be true or false")


def test_every_option_a_rule_of_the_real_matrix_sets_is_one_its_adapter_declares_and_reads():
    loaded = spec.load()
    cells = plan(loaded, Selection({}), world_size=2, device="cpu", importable=lambda module: None)
    assert any(cell.options for cell in cells)
    declarations = {fw.adapter: load_declaration(fw.adapter) for fw in loaded.frameworks.values()}
    for fw in loaded.frameworks.values():
        for rule in fw.rules:
            assert set(rule.effects.get("options", {})) <= set(declarations[fw.adapter].options), rule.where
    adapters = Path(spec.__file__).resolve().parents[1] / "adapters"
    for adapter, declaration in declarations.items():  # the declaration names what the adapter's code reads
        if adapter.endswith(".colossalai"):  # keywords of ColossalAI's plugins, passed through as they are
            continue
        source = "".join(f.read_text() for f in (adapters / adapter.rpartition(".")[2]).rglob("*.py"))
        assert all(f'"{option}"' in source for option in declaration.options), adapter
