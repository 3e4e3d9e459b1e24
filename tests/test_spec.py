from pathlib import Path

import pytest

from pytest_freezecompat.spec import matrix as spec


def write(tmp_path: Path, text: str, name: str = "matrix.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


GOOD = """
schema = 1
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
checkpoint = ["none"]
freeze = ["none", "embedding"]
"""


def test_default_matrix_loads_with_the_torch_row():
    loaded = spec.load()
    assert "torch" in loaded.frameworks
    torch_row = loaded.frameworks["torch"]
    assert torch_row.axes["plugin"] == ("ddp", "ddp-find-unused", "fsdp1", "fsdp1-orig-params", "fsdp2",
                                        "fsdp2-reduce-unused")
    assert set(loaded.patterns) >= {"none", "embedding", "decoder", "output", "all-but-last", "bias-only", "lora",
                                    "unused-branch", "optimizer-subset", "all"}
    assert loaded.environments["torch"].install[0] == "torch==2.13.0"


def test_one_file_matrix(tmp_path):
    loaded = spec.load(write(tmp_path, GOOD))
    assert loaded.values("freeze") == ["none", "embedding"]


def test_toml_syntax_error_names_file_and_line(tmp_path):
    path = write(tmp_path, GOOD.replace("[freeze.none]", "[freeze.none]\noops here"))
    with pytest.raises(spec.SpecError, match=rf"^{path}:6: invalid TOML"):
        spec.load(path)


def test_unknown_pattern_key_points_at_its_line(tmp_path):
    path = write(tmp_path, GOOD.replace('frozen = ["embedding"]', 'frozen = ["embedding"]\nfrozn = []'))
    with pytest.raises(spec.SpecError, match=rf"^{path}:8: freeze.embedding: unknown key 'frozn'"):
        spec.load(path)


def test_framework_naming_an_undefined_pattern(tmp_path):
    path = write(tmp_path, GOOD.replace('freeze = ["none", "embedding"]', 'freeze = ["none", "lora"]'))
    with pytest.raises(spec.SpecError, match="freeze pattern 'lora' is not defined; known: none, embedding"):
        spec.load(path)


def test_pattern_naming_a_group_the_model_lacks(tmp_path):
    path = write(tmp_path, GOOD.replace('frozen = ["embedding"]', 'frozen = ["vision"]'))
    with pytest.raises(spec.SpecError, match="names group 'vision', which model 'm' does not define"):
        spec.load(path)


def test_a_pattern_may_train_some_rows_of_a_group(tmp_path):
    text = GOOD.replace('[freeze.none]', '[freeze.rows]\ntrainable = ["embedding"]\nrows = { embedding = "-4:" }\n'
                        '[freeze.none]').replace('freeze = ["none", "embedding"]', 'freeze = ["none", "rows"]')
    assert spec.load(write(tmp_path, text)).patterns["rows"].rows == {"embedding": "-4:"}
    with pytest.raises(spec.SpecError, match=r"freeze\.rows\.rows\.embedding: rows '4' is not a row range"):
        spec.load(write(tmp_path, text.replace('"-4:"', '"4"')))
    with pytest.raises(spec.SpecError, match="names group 'vision', which model 'm' does not define"):
        spec.load(write(tmp_path, text.replace("rows = { embedding", "rows = { vision")))


def test_axis_values_may_not_contain_the_id_separator(tmp_path):
    path = write(tmp_path, GOOD.replace('plugins = ["ddp"]', 'plugins = ["ddp/x"]'))
    with pytest.raises(spec.SpecError, match="'ddp/x' is not a valid axis value"):
        spec.load(path)


def test_rule_with_unknown_effect(tmp_path):
    path = write(tmp_path, GOOD + '[[frameworks.torch.rule]]\nwhen = {plugin = "ddp"}\nskipp = "x"\n')
    with pytest.raises(spec.SpecError, match="rule 1: unknown key 'skipp'"):
        spec.load(path)


def test_wrong_schema_is_refused(tmp_path):
    with pytest.raises(spec.SpecError, match="schema 2 is not supported"):
        spec.load(write(tmp_path, GOOD.replace("schema = 1", "schema = 2")))


def test_missing_file_is_one_line(tmp_path):
    with pytest.raises(spec.SpecError, match="cannot read matrix file"):
        spec.load(tmp_path / "nope.toml")


def test_framework_files_beside_the_matrix_may_define_their_own_model(tmp_path):
    base = GOOD.split("[frameworks.torch]")[0]
    write(tmp_path, base)
    (tmp_path / "frameworks").mkdir()
    write(tmp_path / "frameworks", """
framework = "mega"
adapter = "toy_adapters:MEGA"
plugins = ["p"]
init = ["eager"]
checkpoint = ["none"]
freeze = ["none", "embedding"]
[environment]
name = "mega-env"
install = ["torch==2.13.0", "megatron-core==0.16.1"]
[models.mcore.groups]
embedding = ["embedding.*"]
""", "mega.toml")
    loaded = spec.load(tmp_path / "matrix.toml")
    assert loaded.frameworks["mega"].axes["model"] == ("mcore",)
    assert loaded.models["mcore"] == {"embedding": ("embedding.*",)}
    assert loaded.environments["mega-env"].frameworks == ("mega",)


@pytest.mark.parametrize(("axis", "line", "value"), [("plugin", 'plugins = ["ddp"]', "ddpp"),
                                                      ("init", 'init = ["eager"]', "lazy"),
                                                      ("checkpoint", 'checkpoint = ["none"]', "framework")])
def test_a_value_the_adapter_does_not_declare_is_refused_at_load_time(tmp_path, axis, line, value):
    path = write(tmp_path, GOOD.replace(line, line.replace('"]', f'", "{value}"]')))
    with pytest.raises(spec.SpecError, match=rf"^{path}:\d+: framework torch: {axis} '{value}' is not offered by "
                                             r"adapter pytest_freezecompat.adapters.torch_native; valid: "):
        spec.load(path)


def test_an_adapter_without_a_declaration_is_one_line(tmp_path):
    path = write(tmp_path, GOOD.replace('"pytest_freezecompat.adapters.torch_native"', '"no_such_adapter_pkg"'))
    with pytest.raises(spec.SpecError, match=r"framework torch: adapter 'no_such_adapter_pkg' cannot be imported"):
        spec.load(path)
    path = write(tmp_path, GOOD.replace('"pytest_freezecompat.adapters.torch_native"', '"json"'))
    with pytest.raises(spec.SpecError, match=r"adapter 'json' has no DECLARATION"):
        spec.load(path)


@pytest.mark.parametrize(("when", "what"), [
    ('{plugin = "dpp"}', "plugin 'dpp' matches none of ddp"),
    ('{plugin = "ddp", model = "n"}', "model 'n' matches none of m"),
    ('{freeze = ["none", "embeding"]}', "freeze 'embeding' matches none of none, embedding"),
    ('{init = "lazy*"}', "init 'lazy\\*' matches none of eager"),  # a glob must match a value too
    ('{framework = "trch"}', "framework 'trch' matches none of torch"),
    ('{checkpoint = []}', "checkpoint lists no values"),
])
def test_a_rule_whose_when_matches_no_value_is_a_typo(tmp_path, when, what):
    path = write(tmp_path, GOOD + f'[[frameworks.torch.rule]]\nwhen = {when}\nskip = "x"\n')
    with pytest.raises(spec.SpecError, match=rf"^{path}:16: torch rule 1: `when` {what}$"):
        spec.load(path)


def test_a_user_models_rule_may_name_a_freeze_case_but_not_a_near_miss(tmp_path):
    """A `freeze_case`'s names are unknown at load time; one a letter off a matrix name is taken for a typo."""
    takes_users = GOOD.replace("[frameworks.torch]", "[frameworks.torch]\nuser_models = true")
    rule = ('[[frameworks.torch.rule]]\nwhen = {model = "my-vlm", freeze = ["embedding", "frozen-vision*"]}\n'
            'skip = "x"\n')
    assert spec.load(write(tmp_path, takes_users + rule)).frameworks["torch"].rules[0].when["model"] == ("my-vlm",)
    path = write(tmp_path, takes_users + rule.replace("frozen-vision*", "embeding"))
    with pytest.raises(spec.SpecError, match=r"freeze 'embeding' matches none of none, embedding; did you mean "
                                             r"'embedding'\? \(too close to it to be a freeze_case's own name\)"):
        spec.load(path)
    path = write(tmp_path, takes_users.replace("models.m.", "models.tiny-gpt.").replace('["m"]', '["tiny-gpt"]')
                 + rule.replace("my-vlm", "tiny-gtp"))
    with pytest.raises(spec.SpecError, match=r"model 'tiny-gtp' matches none of tiny-gpt; did you mean 'tiny-gpt'"):
        spec.load(path)


def test_a_top_level_rule_or_key_in_the_matrix_is_refused(tmp_path):
    path = write(tmp_path, GOOD + '[[rule]]\nwhen = {plugin = "ddp"}\nskip = "x"\n')
    with pytest.raises(spec.SpecError, match=rf"^{path}:15: a top-level \[\[rule\]\] belongs to no framework"):
        spec.load(path)
    path = write(tmp_path, "rules = []\n" + GOOD)
    with pytest.raises(spec.SpecError, match=r"matrix: unknown key 'rules'; valid: frameworks, freeze, models, schema"):
        spec.load(path)


def test_emulation_needs_a_declared_shim(tmp_path):
    path = write(tmp_path, GOOD + '[[frameworks.torch.rule]]\nwhen = {plugin = "ddp"}\nemulation = true\n')
    with pytest.raises(spec.SpecError, match=r"`emulation = true`, but the adapter declares no shim"):
        spec.load(path)


def test_a_pattern_may_say_that_a_stack_may_refuse_it(tmp_path):
    loaded = spec.load(write(tmp_path, GOOD.replace("[freeze.none]", "[freeze.none]\nmay_refuse = true")))
    assert loaded.patterns["none"].may_refuse and not loaded.patterns["embedding"].may_refuse
    with pytest.raises(spec.SpecError, match=r"freeze\.none\.may_refuse must be true or false"):
        spec.load(write(tmp_path, GOOD.replace("[freeze.none]", '[freeze.none]\nmay_refuse = "yes"')))


def test_clip_is_an_optional_axis_of_known_values(tmp_path):
    assert spec.load(write(tmp_path, GOOD)).frameworks["torch"].axes["clip"] == ("clip",)  # unsaid: every cell clips
    both = spec.load(write(tmp_path, GOOD + 'clip = ["clip", "no-clip"]\n'))
    assert both.frameworks["torch"].axes["clip"] == ("clip", "no-clip") and both.values("clip") == ["clip", "no-clip"]
    path = write(tmp_path, GOOD + 'clip = ["off"]\n')
    with pytest.raises(spec.SpecError, match=rf"^{path}:\d+: framework torch: clip 'off' is not one of clip, no-clip$"):
        spec.load(path)


def test_every_framework_of_the_default_matrix_runs_without_clipping_where_the_path_differs():
    from pytest_freezecompat.spec.plan import Selection, plan

    loaded = spec.load()
    cells = plan(loaded, Selection({}), world_size=2, device="cpu", importable=lambda module: None)
    for framework in loaded.frameworks:
        unclipped = {c.key.freeze for c in cells if c.key.framework == framework and c.key.clip == "no-clip"}
        assert {"none", "embedding", "all-but-last"} <= unclipped <= {
            "none", "embedding", "all-but-last", "unused-branch", "unused-branch-frozen", "rank-divergent"}, framework
    assert all(c.hyper.max_norm == 0 and not c.hyper.clips for c in cells if c.key.clip == "no-clip")
    assert all(c.hyper.clips for c in cells if c.key.clip == "clip")


def test_round_trip_classes_group_cells_that_take_one_save_and_load_path(tmp_path):
    from pytest_freezecompat.spec.plan import Selection, plan

    text = GOOD.replace('checkpoint = ["none"]', 'checkpoint = ["none", "reentrant", "non-reentrant"]')
    text += 'clip = ["clip", "no-clip"]\n[frameworks.torch.round_trip]\ncheckpoint = [["none", "non-reentrant"]]\n'
    loaded = spec.load(write(tmp_path, text))
    cells = plan(loaded, Selection({}), world_size=2, device="cpu", importable=lambda module: None)
    groups = {}
    for c in cells:
        groups.setdefault(c.round_trip, set()).add((c.key.checkpoint, c.key.clip, c.key.freeze))
    # none and non-reentrant share; reentrant, each clip value and each pattern keep their own
    assert sorted(map(sorted, groups.values())) == sorted(
        [sorted({("none", clip, freeze), ("non-reentrant", clip, freeze)}) for clip in ("clip", "no-clip")
         for freeze in ("none", "embedding")] + [[("reentrant", clip, freeze)] for clip in ("clip", "no-clip")
                                                  for freeze in ("none", "embedding")])


def test_a_rule_keeps_the_round_trip_of_the_cells_it_picks_out_of_their_class(tmp_path):
    from pytest_freezecompat.spec.plan import Selection, plan

    text = GOOD.replace('checkpoint = ["none"]', 'checkpoint = ["none", "reentrant", "non-reentrant"]')
    text += ('[frameworks.torch.round_trip]\ncheckpoint = [["none", "non-reentrant", "reentrant"]]\n'
             '[[frameworks.torch.rule]]\nwhen = {checkpoint = "reentrant", freeze = "embedding"}\n'
             'own_round_trip = "its resumed step raises"\n')
    cells = plan(spec.load(write(tmp_path, text)), Selection({}), world_size=2, device="cpu",
                 importable=lambda module: None)
    groups = {}
    for c in cells:
        groups.setdefault(c.round_trip, set()).add((c.key.checkpoint, c.key.freeze))
    assert sorted(map(sorted, groups.values())) == sorted([
        sorted({("none", "none"), ("non-reentrant", "none"), ("reentrant", "none")}),
        sorted({("none", "embedding"), ("non-reentrant", "embedding")}), [("reentrant", "embedding")]])


def test_an_empty_own_round_trip_reason_is_one_line(tmp_path):
    path = write(tmp_path, GOOD + '[[frameworks.torch.rule]]\nwhen = {freeze = "embedding"}\nown_round_trip = " "\n')
    with pytest.raises(spec.SpecError, match=rf"^{path}:\d+: torch rule 1: own_round_trip is the reason, a non-empty "):
        spec.load(path)


@pytest.mark.parametrize(("table", "message"), [
    ('plugin = [["ddp", "ddp"]]', r"round_trip.plugin: only init, checkpoint, clip may share a round trip"),
    ('checkpoint = [["none", "full"]]', r"round_trip.checkpoint: 'full' is not one of its checkpoint values"),
    ('checkpoint = ["none"]', r"round_trip.checkpoint is a list of lists of two or more values"),
    ('checkpoint = [["none", "reentrant"], ["reentrant", "non-reentrant"]]',
     r"round_trip.checkpoint: 'reentrant' is in two classes"),
])
def test_a_bad_round_trip_class_is_one_line(tmp_path, table, message):
    text = GOOD.replace('checkpoint = ["none"]', 'checkpoint = ["none", "reentrant", "non-reentrant"]')
    path = write(tmp_path, text + f"[frameworks.torch.round_trip]\n{table}\n")
    with pytest.raises(spec.SpecError, match=rf"^{path}:\d+: framework torch: {message}"):
        spec.load(path)
