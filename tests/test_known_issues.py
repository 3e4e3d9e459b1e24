from pathlib import Path

import pytest
import tomllib

from pytest_freezecompat.core.names import kind_words
from pytest_freezecompat.core.records import display_status
from pytest_freezecompat.report import grid, markdown, write
from pytest_freezecompat.spec import known_issues, matrix

ROOT = Path(__file__).resolve().parent.parent
ENV = {"python": "3.11.7", "torch": "2.13.0+cpu", "frameworks": {"torch": "2.13.0+cpu", "composer": "0.32.1"},
       "device": "cpu", "backend": "gloo"}
ENTRY = '''
[[issue]]
id = "fsdp1-uniform"
summary = "FlatParameter must be uniform"
links = ["https://github.com/pytorch/pytorch/issues/91167", "https://github.com/pytorch/pytorch/pull/104427"]
when = { framework = "torch", plugin = "fsdp1*", freeze = ["embedding", "lora"] }
versions = { torch = ">=2.4" }
status = ["error"]
pattern = "uniform `requires_grad`"

[[issue]]
id = "composer-old"
summary = "fixed in 0.24"
links = ["https://github.com/mosaicml/composer/issues/3493"]
when = { framework = "composer", freeze = "optimizer-subset" }
versions = { composer = "<0.24" }
status = ["fail"]
check = "optimizer"
kinds = ["tracks-unintended"]

[[issue]]
id = "gemini-hook"
summary = "param-op hook asserts"
links = ["https://github.com/hpcaitech/ColossalAI/issues/5290"]
when = { framework = "colossalai", plugin = "gemini", device = "cuda" }
versions = { colossalai = "<=0.5.0" }
status = ["error", "crash"]
pattern = "AssertionError"
'''


def registry(tmp_path, text=ENTRY):
    path = tmp_path / "known_issues.toml"
    path.write_text(text)
    return known_issues.load(path)


def cell(framework="torch", plugin="fsdp1", freeze="embedding", status="error", message="", **extra):
    return {"id": f"tiny-gpt/{framework}/{plugin}/eager/none/{freeze}", "model": "tiny-gpt", "framework": framework,
            "plugin": plugin, "init": "eager", "checkpoint": "none", "freeze": freeze, "environment": framework,
            "status": status, "check": None, "message": message, "rank_details": [], **extra}


UNIFORM = "ValueError: Must flatten tensors with uniform `requires_grad` when `use_orig_params=False` (rank 0, wrap)"
#: An error row: our message, and the stack's own words (`error`), which is what a pattern reads.
REFUSED = {"message": UNIFORM, "error": {
    "type": "ValueError", "message": "Must flatten tensors with uniform `requires_grad` when `use_orig_params=False`"}}


def test_a_failure_the_entry_explains_is_expected(tmp_path):
    found = known_issues.match(cell(**REFUSED), ENV, registry(tmp_path))
    assert found == {"id": "fsdp1-uniform", "link": "https://github.com/pytorch/pytorch/issues/91167",
                     "links": ["https://github.com/pytorch/pytorch/issues/91167",
                               "https://github.com/pytorch/pytorch/pull/104427"],
                     "summary": "FlatParameter must be uniform", "versions": {"torch": ">=2.4"}, "expected": True}


def test_the_pattern_also_reads_each_ranks_own_error(tmp_path):
    ranks = [{"rank": 1, "phase": "wrap", "error": {"type": "ValueError", "message": "uniform `requires_grad`"}}]
    found = known_issues.match(cell(message="rank 0 left waiting", rank_details=ranks), ENV, registry(tmp_path))
    assert found["expected"]


def test_a_pass_the_entry_expects_to_break_is_fixed(tmp_path):
    found = known_issues.match(cell(status="pass"), ENV, registry(tmp_path))
    assert found["id"] == "fsdp1-uniform" and found["fixed"] and "expected" not in found


@pytest.mark.parametrize(("changed", "why"), [
    ({"error": {"type": "RuntimeError", "message": "something else"}}, "pattern does not match"),
    ({"message": UNIFORM}, "the pattern reads the stack's words, not our message"),
    ({**REFUSED, "status": "fail"}, "status not listed"),
    ({**REFUSED, "freeze": "decoder"}, "selector does not select"),
    ({**REFUSED, "plugin": "ddp"}, "glob does not match"),
])
def test_a_failure_nobody_explains_stays_red(tmp_path, changed, why):
    assert known_issues.match(cell(**changed), ENV, registry(tmp_path)) is None, why


def test_versions_decide_whether_an_entry_applies(tmp_path):
    reg = registry(tmp_path)
    old_torch = {**ENV, "torch": "2.3.1"}
    # the failure it describes, on a release its range leaves out: flagged, still red
    outside = known_issues.match(cell(**REFUSED), old_torch, reg)
    assert outside["range_too_narrow"] and not outside.get("expected") and display_status(
        {"status": "error", "known_issue": outside}) == "error"
    assert known_issues.match(cell(status="pass"), old_torch, reg) is None  # not `fixed?` either
    subset = cell(framework="composer", plugin="fsdp1", freeze="optimizer-subset", status="fail", check="optimizer",
                  message="optimizer tracks 4 unintended: tok_emb.weight",
                  failures=[failed("optimizer", "optimizer tracks 4 unintended", ["tracks-unintended"])])
    assert known_issues.match(subset, ENV, reg)["range_too_narrow"]  # composer 0.32.1, where the fix shipped
    assert known_issues.match(subset, {**ENV, "frameworks": {"composer": "0.23.5"}}, reg)["expected"]
    assert known_issues.match({**subset, "check": "grads"}, {**ENV, "frameworks": {"composer": "0.23.5"}}, reg) is None
    assert known_issues.match(subset, {**ENV, "frameworks": {}}, reg) is None  # version unknown: does not apply


def test_device_selector_and_a_skip_tied_to_an_entry_by_a_rule(tmp_path):
    reg = registry(tmp_path)
    gpu = {**ENV, "device": "cuda", "frameworks": {"colossalai": "0.5.0"}}
    crashed = cell(framework="colossalai", plugin="gemini", status="crash", message="rank 0 killed by signal SIGABRT",
                   rank_details=[{"rank": 1, "phase": "step 0: backward", "error": {
                       "type": "AssertionError", "message": "", "where": "param_hook.py:41 in hook"}}])
    assert known_issues.match(crashed, gpu, reg)["expected"]
    assert known_issues.match(crashed, {**gpu, "device": "cpu"}, reg) is None
    skipped = cell(framework="colossalai", plugin="gemini", status="skip", message="needs CUDA",
                   rule_known_issue="gemini-hook")
    assert known_issues.match(skipped, {**gpu, "device": "cpu"}, reg) == {
        "id": "gemini-hook", "link": "https://github.com/hpcaitech/ColossalAI/issues/5290",
        "links": ["https://github.com/hpcaitech/ColossalAI/issues/5290"], "summary": "param-op hook asserts",
        "versions": {"colossalai": "<=0.5.0"}}
    with pytest.raises(known_issues.KnownIssueError, match="entry nope: field id: no such entry"):
        known_issues.match({**skipped, "rule_known_issue": "nope"}, gpu, reg)
    with pytest.raises(known_issues.KnownIssueError, match="entry nope"):
        reg.require(["gemini-hook", "nope"])


def test_an_entry_named_by_a_rule_explains_failures_outside_its_selector_but_flags_no_pass(tmp_path):
    named = cell(plugin="ddp", freeze="decoder", **REFUSED, rule_known_issue="fsdp1-uniform")
    assert known_issues.match(named, ENV, registry(tmp_path))["expected"]
    assert known_issues.match({**named, "status": "pass"}, ENV, registry(tmp_path)) is None


@pytest.mark.parametrize(("mutation", "field", "what"), [
    ({"id": "Bad Id"}, "id", "lowercase"),
    ({"links": ["http://example.com"]}, "links", "https://"),
    ({"links": []}, "links", "non-empty"),
    ({"when": {"plugins": "ddp"}}, "when", "unknown axis 'plugins'"),
    ({"when": {}}, "when", "non-empty"),
    ({"versions": {"torch": "2.4+"}}, "versions", "not a version specifier"),
    ({"status": ["pass"]}, "status", "one or more of fail, error, crash, timeout"),
    ({"check": "grad"}, "check", "must be one of"),
    ({"pattern": "("}, "pattern", "invalid regex"),
    ({"colour": "red"}, "colour", "unknown field"),
    ({"summary": None}, "summary", "missing"),
    ({"when": [{"plugin": "ddp"}, {}]}, "when", "or a list of such tables"),
    ({"when": [{"plugin": "ddp"}, {"plugins": "x"}]}, "when", "unknown axis 'plugins'"),
    ({"when": {"device": "gpu"}}, "when", "device 'gpu' matches none of cpu, cuda"),
    ({"predicts": {"raised": "wrapping"}}, "predicts", "unknown prediction 'raised'"),
    ({"predicts": {"raised_in": "boost"}}, "predicts", "raised_in must be one of wrapping, training, not 'boost'"),
    ({"predicts": {"scale": "2"}}, "predicts", "scale must be one of world_size"),
    ({"fixed_in": {"torch": "2.5"}}, "fixed_in", "torch 2.5 is inside the entry's own range"),
    ({"fixed_in": {"composer": "0.24.0"}}, "fixed_in", "composer: not among the entry's versions"),
    ({"fixed_in": {"torch": "soon"}}, "fixed_in", "'soon' is not a version"),
    ({"kind": "bug"}, "kind", "must be one of upstream, finding, by-design, misuse, not 'bug'"),
    ({"kind": "by-design", "links": []}, "links", "must be a non-empty list of https:// URLs"),  # where it was chosen
    ({"about_freezing": "no"}, "about_freezing", "must be true or false"),
    ({"kind": "finding"}, "reproducer", "a finding ships a standalone reproducer"),
    ({"kind": "finding", "reproducer": "repro.py"}, "reproducer", "must be a path findings/<name>.py"),
    ({"kind": "finding", "reproducer": "findings/x.py", "links": ["ftp://x"]}, "links", "(or [] for a finding)"),
])
def test_a_malformed_entry_is_one_line_naming_file_entry_and_field(tmp_path, mutation, field, what):
    body = {"id": "x-issue", "summary": "s", "links": ["https://github.com/o/r/issues/1"],
            "when": {"plugin": "ddp"}, "versions": {"torch": ">=2.4"}, "status": ["error"], "pattern": "boom"}
    body.update(mutation)
    body = {k: v for k, v in body.items() if v is not None}
    lines = ["[[issue]]"] + [f"{k} = {_toml(v)}" for k, v in body.items()]
    path = tmp_path / "known_issues.toml"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(known_issues.KnownIssueError) as error:
        known_issues.load(path)
    message = str(error.value)
    name = body["id"] if isinstance(body.get("id"), str) else "#1"
    assert message.startswith(f"{path}: entry {name}: field {field}: ") and what in message and "\n" not in message


def test_a_finding_needs_no_thread_but_ships_a_reproducer_the_report_names(tmp_path):
    text = ENTRY.replace('id = "gemini-hook"', 'id = "gemini-hook"\nkind = "finding"\nreproducer = "findings/g.py"')
    text = text.replace('links = ["https://github.com/hpcaitech/ColossalAI/issues/5290"]', "links = []")
    entry = registry(tmp_path, text).get("gemini-hook")
    assert (entry.kind, entry.reproducer, entry.links) == ("finding", "findings/g.py", ())
    described = entry.describe()
    assert described["kind"] == "finding" and described["reproducer"] == "findings/g.py" and "link" not in described


def test_a_misuse_needs_no_thread_and_an_entry_may_say_it_is_not_about_freezing(tmp_path):
    text = ENTRY.replace('id = "gemini-hook"', 'id = "gemini-hook"\nkind = "misuse"\nabout_freezing = false')
    text = text.replace('links = ["https://github.com/hpcaitech/ColossalAI/issues/5290"]', "links = []")
    described = registry(tmp_path, text).get("gemini-hook").describe()
    assert (described["kind"], described["about_freezing"]) == ("misuse", False)
    assert kind_words(described) == "an unsupported use; not about freezing: the nothing-frozen control fails alike"
    assert kind_words({"id": "x"}) == "" and "about_freezing" not in registry(tmp_path).get("gemini-hook").describe()


@pytest.mark.parametrize(("about_freezing", "causes", "problem"), [
    (False, ["stack", "both"], None),
    (False, ["stack", "freeze"], "says it is not about freezing, yet the nothing-frozen control passes where 1 of"),
    (True, ["stack", "stack"], "every one of its 2 red cells' nothing-frozen control fails alike: not about freezing?"),
    (True, ["stack", "freeze"], None),
])
def test_an_entrys_word_on_freezing_is_held_against_its_cells_causes(about_freezing, causes, problem):
    known = {"id": "x"} if about_freezing else {"id": "x", "about_freezing": False}
    cells = [{"severity": "refused", "cause": cause} for cause in causes] + [{"severity": "ok", "cause": None}]
    found = grid.framing_problem(known, cells)
    assert (found or "").startswith(problem or "") and bool(found) == bool(problem)


def test_every_shipped_finding_has_its_reproducer_and_states_where_in_the_source():
    for entry in known_issues.load(ROOT / "matrix" / "known_issues.toml").entries:
        if entry.kind == "finding":
            assert entry.reproducer and (ROOT / entry.reproducer).is_file(), entry.id
            assert ".py" in entry.summary, f"{entry.id}: a finding's summary names the framework's file"


def test_duplicates_bad_toml_and_a_missing_file(tmp_path):
    twice = "\n".join([ENTRY, ENTRY.split("[[issue]]")[1].join(["[[issue]]", ""])])
    with pytest.raises(known_issues.KnownIssueError, match="entry fsdp1-uniform: field id: duplicate of entry #1"):
        registry(tmp_path, twice)
    with pytest.raises(known_issues.KnownIssueError, match="invalid TOML"):
        registry(tmp_path, "[[issue]\n")
    with pytest.raises(known_issues.KnownIssueError, match="cannot read"):
        known_issues.load(tmp_path / "absent.toml")


def _toml(value):
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + " }"
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def test_annotate_and_the_markdown_marks(tmp_path):
    report = write.build({"torch": ENV}, [cell(**REFUSED), cell(freeze="lora", status="pass"),
                                          cell(freeze="none", status="fail", message="other")])
    known_issues.annotate(report, registry(tmp_path))
    shown = {c["freeze"]: display_status(c) for c in report["cells"]}
    assert shown == {"embedding": "known", "lora": "fixed?", "none": "fail"}
    md = markdown.render(report)
    assert "💥ᴷ" in md and "✅ᶠ" in md and "| torch | 1 | 1 | 1 | 0 | 0 | 0 | 1 | 1 | 0 | 0 | 0 | 0 | 0 | 0 | 3 |" in md
    assert "**fixed?** ([fsdp1-uniform](https://github.com/pytorch/pytorch/issues/91167))" in md
    assert ("**fsdp1-uniform** (1 fixed?, 1 known) under `fsdp1` — "
            "[pytorch#91167](https://github.com/pytorch/pytorch/issues/91167)") in md
    assert "## Known issues" in md and "**fsdp1-uniform** (1 fixed?, 1 known)" in md


def test_the_shipped_registry_loads_and_covers_every_rule_that_names_an_entry():
    reg = known_issues.load(ROOT / "matrix" / "known_issues.toml")
    named = set()
    for path in (ROOT / "matrix" / "frameworks").glob("*.toml"):
        for rule in tomllib.loads(path.read_text()).get("rule", []):
            if "known_issue" in rule:
                named.add(rule["known_issue"])
    reg.require(named)
    reg.check_against(matrix.load())  # every selector value names a cell of the shipped matrix (or a user case)
    assert known_issues.default_path().is_file()  # beside the default matrix, packaged or in the checkout


def test_a_previous_annotation_does_not_name_an_entry(tmp_path):
    """Re-matching a report against a registry whose entry no longer selects a cell gives what a fresh run would."""
    reg = registry(tmp_path)
    annotated = cell(plugin="ddp", freeze="decoder", **REFUSED,
                     known_issue={"id": "fsdp1-uniform", "link": "https://x", "expected": True})
    assert known_issues.match(annotated, ENV, reg) is None
    report = {"environments": {"torch": ENV}, "cells": [{**annotated, "environment": "torch"}]}
    assert "known_issue" not in known_issues.annotate(report, reg)["cells"][0]


PREDICTING = ENTRY + '''
[[issue]]
id = "gloo-sum"
summary = "grads summed, not averaged"
links = ["https://github.com/pytorch/pytorch/issues/162338"]
when = [{ framework = "torch", plugin = "fsdp2", freeze = "none" },
        { framework = "torch", plugin = "ddp", freeze = "lora" }]
versions = { torch = ">=2.7" }
status = ["fail"]
check = "grads"
kinds = ["differs"]
predicts = { scale = "world_size" }

[[issue]]
id = "shard-norm"
summary = "each rank clips by its own shard's norm"
links = ["https://github.com/pytorch/pytorch/issues/72548"]
when = { framework = "torch", plugin = "fsdp2", freeze = "output" }
versions = { torch = ">=2.7" }
status = ["fail"]
check = "grad_norm"
kinds = ["norm-differs"]
predicts = { ranks_combine = "l2" }

[[issue]]
id = "zeros-move-unused"
summary = "zero-filled grads move params the reference leaves alone"
links = ["https://github.com/pytorch/pytorch/pull/87308"]
when = { framework = "torch", plugin = "fsdp2", freeze = "unused-branch" }
versions = { torch = ">=2.7" }
status = ["fail"]
check = "update"
kinds = ["held-moved"]
predicts = { params = "no-grad" }
'''


def failed(check, message, kinds, **facts):
    return {"check": check, "step": 0, "message": message, "params": ["w"], "on_held_params": False, "kinds": kinds,
            **facts}


@pytest.mark.parametrize(("plugin", "freeze", "failure", "explained"), [
    ("fsdp2", "none", failed("grads", "grad differs from reference", ["differs"], scale=2.0), True),
    ("ddp", "lora", failed("grads", "grad differs from reference", ["differs"], scale=2.0), True),  # second selector
    ("fsdp2", "none", failed("grads", "grad differs", ["differs"], scale=1.5), False),  # another shape: stays red
    ("fsdp2", "none", failed("grads", "grad differs from reference", ["differs"]), False),  # no uniform factor
    ("fsdp2", "output", failed("grad_norm", "grad norm 0.5 != reference 0.7", ["norm-differs"], ranks_combine="l2"),
     True),
    ("fsdp2", "output", failed("grad_norm", "grad norm 0.5 != reference 0.7", ["norm-differs"]), False),
    ("fsdp2", "unused-branch", failed("update", "param that must stay fixed changed", ["held-moved"],
                                      params_kind="no-grad"), True),
    ("fsdp2", "unused-branch", failed("update", "param that must stay fixed changed", ["held-moved"],
                                      params_kind="held"), False),
])
def test_an_entry_explains_only_failures_that_look_as_it_predicts(tmp_path, plugin, freeze, failure, explained):
    row = cell(plugin=plugin, freeze=freeze, status="fail", message=failure["message"], check=failure["check"],
               failures=[failure], world_size=2)
    found = known_issues.match(row, ENV, registry(tmp_path, PREDICTING))
    assert (found is not None and found.get("expected", False)) == explained


def test_an_error_must_be_raised_where_the_entry_says(tmp_path):
    text = ENTRY.replace('pattern = "uniform `requires_grad`"',
                         'pattern = "uniform `requires_grad`"\npredicts = { raised_in = "wrapping" }')
    at_wrap = cell(**REFUSED, raised_in="wrapping")
    assert known_issues.match(at_wrap, ENV, registry(tmp_path, text))["expected"]
    assert known_issues.match({**at_wrap, "raised_in": "training"}, ENV, registry(tmp_path, text)) is None


SELECTING = """
[[issue]]
id = "ddp-embedding"
summary = "s"
links = ["https://github.com/o/r/issues/1"]
when = [{ framework = "torch", plugin = "ddp", freeze = "embedding" }, { model = "tiny-gpt", init = "eager" }]
versions = { torch = ">=2.4" }
status = ["error"]
pattern = "boom"
"""


@pytest.mark.parametrize(("old", "new", "field", "what"), [
    ('plugin = "ddp"', 'plugin = "dpp"', "when", "plugin 'dpp' matches none of ddp"),
    ('model = "tiny-gpt"', 'model = "tiny-gtp"', "when", "model 'tiny-gtp' matches none of tiny-gpt"),
    ('freeze = "embedding"', 'freeze = ["none", "embeding"]', "when",
     "freeze 'embeding' matches none of unused-branch, none, embedding"),
    ('plugin = "ddp"', 'plugin = "fsdp*"', "when", "plugin 'fsdp*' matches none of ddp"),  # a glob must match
    ('framework = "torch"', 'framework = "trch"', "when", "framework 'trch' matches none of torch"),
    ("torch = ", "torhc = ", "versions", "'torhc' is not a version a report records; valid: python, torch"),
])
def test_a_selector_value_the_matrix_lacks_is_one_line_naming_file_entry_and_value(tmp_path, old, new, field, what):
    small = matrix.load(ROOT / "tests" / "specs" / "small.toml")
    registry(tmp_path, SELECTING).check_against(small)
    reg = registry(tmp_path, SELECTING.replace(old, new))
    with pytest.raises(known_issues.KnownIssueError) as error:
        reg.check_against(small)
    assert str(error.value) == f"{tmp_path / 'known_issues.toml'}: entry ddp-embedding: field {field}: {what}"


def test_a_selector_may_name_a_freeze_case_where_user_models_run_but_not_a_near_miss(tmp_path):
    """A `freeze_case`'s names are unknown when the matrix loads; one a letter off a matrix name is a typo."""
    text = (ROOT / "tests" / "specs" / "small.toml").read_text()
    (tmp_path / "matrix.toml").write_text(text.replace("[frameworks.torch]", "[frameworks.torch]\nuser_models = true"))
    takes_users = matrix.load(tmp_path / "matrix.toml")
    user_case = SELECTING.replace('model = "tiny-gpt"', 'model = "tiny-qwen2-vl", freeze = "frozen-vision*"')
    registry(tmp_path, user_case).check_against(takes_users)
    with pytest.raises(known_issues.KnownIssueError, match=r"model 'tiny-qwen2-vl' matches none of tiny-gpt$"):
        registry(tmp_path, user_case).check_against(matrix.load(ROOT / "tests" / "specs" / "small.toml"))
    with pytest.raises(known_issues.KnownIssueError, match="model 'tiny-gtp' matches none of tiny-gpt; did you mean"):
        registry(tmp_path, user_case.replace("tiny-qwen2-vl", "tiny-gtp")).check_against(takes_users)


def test_a_user_cell_is_selected_by_its_stack_and_explained_by_its_failure(tmp_path):
    """A `@freeze_case` pattern has its own name: the entry's freeze and model names don't select it, its failure
    does; and a passing user cell is never `fixed?` (the user's pattern may be one the issue leaves alone)."""
    reg = registry(tmp_path)
    failing = cell(freeze="head-only", model="my-model", user_model=True, **REFUSED)
    assert known_issues.match(failing, ENV, reg)["id"] == "fsdp1-uniform"
    assert known_issues.match({**failing, "user_model": False}, ENV, reg) is None  # a built-in pattern: not named
    assert known_issues.match({**failing, "error": {"type": "KeyError", "message": "x"}}, ENV, reg) is None
    assert known_issues.match({**failing, "status": "pass", "message": ""}, ENV, reg) is None
