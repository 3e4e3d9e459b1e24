"""A registry entry explains a failure by its facts (kinds, params) or by the stack's own words, never by our verdict
messages: rewording one never unexplains a cell (#47 item 9). Pure: synthetic rows shaped as the report writes them."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path
from typing import Any

import pytest
from packaging.version import Version

from pytest_freezecompat.core.names import FAILURE_KINDS
from pytest_freezecompat.spec import known_issues, matrix

ROOT = Path(__file__).resolve().parent.parent
ENV = {"python": "3.11.7", "torch": "2.13.0+cpu", "frameworks": {"torch": "2.13.0+cpu"}, "device": "cpu"}
HEAD = '''
[[issue]]
id = "{id}"
summary = "s"
links = ["https://github.com/o/r/issues/1"]
when = {{ framework = "torch" }}
versions = {{ torch = ">=2.4" }}
'''


def registry(tmp_path, *entries: str) -> known_issues.Registry:
    path = tmp_path / "known_issues.toml"
    path.write_text("".join(HEAD.format(id=f"entry-{i}") + body for i, body in enumerate(entries)))
    return known_issues.load(path)


def row(status: str = "fail", failures: tuple[dict[str, Any], ...] = (), **extra: Any) -> dict[str, Any]:
    first = failures[0] if failures else {}
    return {"id": "tiny-gpt/torch/ddp/eager/none/embedding", "model": "tiny-gpt", "framework": "torch", "plugin": "ddp",
            "init": "eager", "checkpoint": "none", "freeze": "embedding", "clip": "clip", "environment": "torch",
            "status": status, "check": first.get("check"), "message": first.get("message", ""), "rank_details": [],
            "failures": list(failures), "world_size": 2, **extra}


def failure(check: str, kinds: list[str], params: tuple[str, ...] = ("w",), message: str = "",
            **facts: Any) -> dict[str, Any]:
    return {"check": check, "step": 0, "message": message or f"{check}: {', '.join(kinds)}", "params": list(params),
            "on_held_params": False, "kinds": kinds, **facts}


def tied(reg: known_issues.Registry, cell: dict[str, Any], environment: dict[str, Any] = ENV) -> str | None:
    found = known_issues.match(cell, environment, reg)
    return found["id"] if found and found.get("expected") else None


def test_a_kinds_selector_selects_the_failure_by_its_kinds_not_its_words(tmp_path):
    reg = registry(tmp_path, 'status = ["fail"]\ncheck = "update"\nkinds = ["held-moved"]\n')
    moved = failure("update", ["held-moved"], message="step 0: param that must stay fixed changed: w")
    assert tied(reg, row(failures=(moved,))) == "entry-0"
    assert tied(reg, row(failures=({**moved, "message": "reworded entirely"},))) == "entry-0"
    assert tied(reg, row(failures=({**moved, "kinds": ["update-differs"]},))) is None  # the words alone: not it
    assert tied(reg, row(failures=(failure("grads", ["differs"]), moved))) is None  # its check is not the cell's


def test_without_a_check_the_kinds_are_read_on_the_cells_first_failure(tmp_path):
    """The failure an entry reads is its check's, else the cell's first (the likely root cause), as predictions are."""
    reg = registry(tmp_path, 'status = ["fail"]\nkinds = ["no-grad"]\n')
    no_grad = failure("grads", ["no-grad"])
    assert tied(reg, row(failures=(no_grad,))) == "entry-0"
    assert tied(reg, row(failures=(failure("optimizer", ["tracks-unintended"]), no_grad))) is None


def test_kinds_or_the_stacks_words_either_explains(tmp_path):
    """A mixed entry: an all-zero grad (a fail), or the loss error the stack raises (an error)."""
    reg = registry(tmp_path, 'status = ["fail", "error"]\nkinds = ["zeroed"]\npattern = "loss must be a scalar"\n')
    assert tied(reg, row(failures=(failure("grads", ["zeroed"]),))) == "entry-0"
    assert tied(reg, row(failures=(failure("grads", ["differs"]),))) is None
    raised = row("error", error={"type": "AssertionError", "message": "loss must be a scalar tensor"},
                 message="AssertionError: loss must be a scalar tensor (rank 0, step 0: backward, engine.py:9 in f)")
    assert tied(reg, raised) == "entry-0"
    assert tied(reg, {**raised, "error": {"type": "RuntimeError", "message": "other"}}) is None  # our message unread
    # a grads failure whose words quote the stack's error is still judged by its kinds
    assert tied(reg, row(failures=(failure("grads", ["differs"], message="loss must be a scalar"),))) is None


def test_params_is_a_regex_over_the_names_the_failure_lists(tmp_path):
    reg = registry(tmp_path, 'status = ["fail"]\ncheck = "resume"\nkinds = ["not-saved"]\nparams = "lora_"\n',
                   'status = ["fail"]\nparams = "^blocks\\\\.2\\\\."\n')
    adapter = ("base.bias", "layers.0.q_proj.lora_A.default.weight")
    assert tied(reg, row(failures=(failure("resume", ["not-saved"], adapter),))) == "entry-0"
    assert tied(reg, row(failures=(failure("resume", ["not-saved"], ("base.bias",)),))) is None
    assert tied(reg, row(failures=(failure("resume", ["loaded-differs"], adapter),))) is None
    assert tied(reg, row(failures=(failure("optimizer", ["misses-trained"], ("blocks.2.fc1.bias",)),))) == "entry-1"
    assert tied(reg, row(failures=(failure("optimizer", ["misses-trained"], ("blocks.1.fc1.bias",)),))) is None


def test_the_stacks_words_are_its_errors_its_exits_and_a_raised_round_trip(tmp_path):
    reg = registry(tmp_path, 'status = ["crash"]\npattern = "killed by signal SIGSEGV during boost"\n',
                   'status = ["fail"]\ncheck = "resume"\npattern = "resume: save: KeyError: \\\\d+"\n',
                   'status = ["error"]\npattern = "chunk\\\\.py:\\\\d+ in optim_update"\n')
    dead = [{"rank": 0, "phase": "boost", "exit": "killed by signal SIGSEGV"}, {"rank": 1, "phase": "boost"}]
    assert tied(reg, row("crash", rank_details=dead, message="reworded")) == "entry-0"
    assert tied(reg, row("crash", rank_details=[{**dead[0], "phase": "step 0"}], message="...during boost")) is None
    raised = failure("resume", ["raised"], (), "resume: save: KeyError: 3 (rank 0, checkpoint_io.py:7 in save)",
                     raised=True)
    assert tied(reg, row(failures=(raised,))) == "entry-1"
    # a round trip that did not raise: its message is ours, never read
    assert tied(reg, row(failures=({**raised, "kinds": ["state-not-saved"], "raised": None},))) is None
    placed = [{"rank": 1, "phase": "step 0: step", "error": {"type": "RuntimeError", "message": "x",
                                                              "where": "colossalai/zero/gemini/chunk/chunk.py:12 in "
                                                                       "optim_update"}}]
    assert tied(reg, row("error", rank_details=placed, message="reworded")) == "entry-2"


@pytest.mark.parametrize(("entry", "field", "what"), [
    ('status = ["fail"]\ncheck = "update"\nkinds = ["held-moves"]\n', "kinds",
     "'held-moves' is no failure kind of check update; valid: held-moved, update-differs, steps-missing, ranks-differ; "
     "did you mean 'held-moved'?"),
    ('status = ["fail"]\ncheck = "grads"\nkinds = ["held-moved"]\n', "kinds",
     "'held-moved' is no failure kind of check grads; valid: no-grad, zeroed, spurious, partial, nonfinite, differs, "
     "ranks-differ"),
    ('status = ["fail"]\nkinds = ["zero"]\n', "kinds", "'zero' is no failure kind of any check; valid: flag-changed, "),
    ('status = ["fail"]\nkinds = "zeroed"\n', "kinds", "must be a non-empty list of failure kinds"),
    ('status = ["fail"]\nkinds = []\n', "kinds", "must be a non-empty list of failure kinds"),
    ('status = ["error"]\nkinds = ["zeroed"]\n', "kinds", "a failed check's facts: status must include \"fail\""),
    ('status = ["fail"]\nparams = "trained"\n', "params",
     "is a prediction, not a regex over the failure's param names: write predicts = { params = \"trained\" }"),
    ('status = ["fail"]\nparams = "("\n', "params", "invalid regex"),
    ('status = ["fail"]\n', "pattern", "missing: an entry says what it explains by kinds, params"),
])
def test_a_misspelt_kind_or_a_bad_selector_is_one_line_naming_file_entry_and_field(tmp_path, entry, field, what):
    with pytest.raises(known_issues.KnownIssueError) as error:
        registry(tmp_path, entry)
    message = str(error.value)
    assert message.startswith(f"{tmp_path / 'known_issues.toml'}: entry entry-0: field {field}: ") and what in message
    assert "\n" not in message


# ---- every shipped entry keeps its cells when every verdict message is reworded ------------------------------------

#: Our English for a failure of each kind, as `verdict/checks.py` writes it today ({} is the param): what a row's
#: `message` and its failures' messages hold (and what the registry once searched).
WORDS = {"flag-changed": "requires_grad changed by wrapping: {} (False->True)",
         "tracks-unintended": "optimizer tracks 1 unintended: {}", "misses-trained": "optimizer misses 1: {}",
         "no-grad": "step 0: no grad on trainable: {}",
         "zeroed": "step 0: all-zero grad where the reference has one: {}",
         "differs": "step 0: grad differs from reference: {} (max abs diff 1.00e-02)",
         "norm-differs": "step 0: grad norm 0.52 (returned by OptimizerWrapper.clip_grad_by_norm (torch.nn.utils."
                         "clip_grad_norm_ over this rank's flat-param shard)) != reference 0.73",
         "held-moved": "step 0: param that must stay fixed changed: {}",
         "not-saved": "not in the saved files: {}",
         "state-not-saved": "no optimizer state in the saved files for a param the optimizer stepped: {}",
         "loaded-differs": "after load, values differ from what was saved: {} (max abs diff 3.27e-03)",
         "resumed-grads": "resumed step 1: grad differs from the uninterrupted run: {} (max abs diff 2.00e-03)",
         "resumed-update": "resumed step 1: update differs from the uninterrupted run: {} (max abs diff 2.00e-03)"}
#: Param names a `params` regex may ask for (the first that matches is named).
NAMES = ("blocks.2.fc1.weight", "ln_f.weight", "vision.0.weight", "experts.0.up.weight",
         "decoder.layers.0.self_attention.linear_qkv.bias",
         "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight")


def _value(pattern: str, values: tuple[str, ...]) -> str:
    """A concrete axis value a glob selects: one the matrix has, else the glob's own name (a user's model)."""
    found = next((v for v in values if fnmatch.fnmatchcase(v, pattern)), pattern.replace("*", ""))
    assert fnmatch.fnmatchcase(found, pattern), pattern
    return found


def _version(specifiers: Any) -> str:
    """A release inside an entry's specifiers (one each names, or a step below or above it)."""
    for spec in specifiers:
        base = Version(spec.version)
        major, minor, micro = (*base.release, 0, 0)[:3]
        for candidate in (f"{major}.{minor}.{micro}", f"{major}.{minor}.{micro + 1}", f"{major}.{max(minor - 1, 0)}.9"):
            if specifiers.contains(candidate, prereleases=True):
                return candidate
    raise AssertionError(f"no release found inside {specifiers}")


def _cell_and_environment(entry: known_issues.Entry, spec: matrix.Spec) -> tuple[dict[str, Any], dict[str, Any]]:
    when = entry.when[0]
    frameworks = when.get("framework", ("*",))
    named = [name for name in entry.versions if name in spec.frameworks]
    fw = next(fw for fw in sorted(spec.frameworks.values(), key=lambda fw: fw.name not in named)
              if any(fnmatch.fnmatchcase(fw.name, p) for p in frameworks))
    axes = {axis: _value(when[axis][0], fw.axes[axis]) if axis in when else fw.axes[axis][0]
            for axis in ("model", "plugin", "init", "checkpoint", "freeze", "clip")}
    environment = {"python": "3.11.7", "torch": "2.9.0", "frameworks": {fw.name: "0.0"},
                   "device": when.get("device", ("cpu",))[0]}
    for package, specifiers in entry.versions.items():
        if package in ("python", "torch"):
            environment[package] = _version(specifiers)
        else:
            environment["frameworks"][package] = _version(specifiers)
    cell = {"id": "/".join([axes["model"], fw.name, *(axes[a] for a in ("plugin", "init", "checkpoint", "freeze"))]),
            **axes, "framework": fw.name, "environment": fw.name, "world_size": 2, "rank_details": [],
            "user_model": axes["model"] not in fw.axes["model"]}
    return cell, environment


def _by_facts(entry: known_issues.Entry, cell: dict[str, Any]) -> list[dict[str, Any]]:
    """A failed cell per kind the entry names (a failure of any kind where it names params alone)."""
    selector = entry.failure
    name = next((n for n in NAMES if selector.params.search(n)), None) if selector.params else "blocks.0.fc1.weight"
    assert name, f"{entry.id}: no name in NAMES matches params {selector.params.pattern!r}"
    rows = []
    for kind in selector.kinds or ("misses-trained",):
        check = entry.check or next(check for check, kinds in FAILURE_KINDS.items() if kind in kinds)
        facts = {"params_kind": entry.predicts.get("params", "trained"), "in_optimizer": True}
        if "scale" in entry.predicts:
            facts["scale"] = float(cell["world_size"])
        if "ranks_combine" in entry.predicts:
            facts["ranks_combine"] = entry.predicts["ranks_combine"]
        words = WORDS.get(kind, kind + ": {}").format(name)
        failed = {"check": check, "step": -1 if check in ("requires_grad", "optimizer") else 0, "message": words,
                  "params": [name], "on_held_params": False, "kinds": [kind], **facts}
        rows.append({**cell, "status": "fail", "check": check, "message": words, "failures": [failed]})
    return rows


def _by_the_stacks_words(entry: known_issues.Entry, cell: dict[str, Any]) -> list[dict[str, Any]]:
    """An error row (and a round trip that raised) per plain-text alternative of the entry's pattern."""
    if entry.failure.pattern is None:
        return []
    rows = []
    for alternative in entry.failure.pattern.pattern.split("|"):
        text = re.sub(r"\\(.)", r"\1", alternative)  # its words, where the alternative is plain words
        if not entry.failure.pattern.search(text):
            continue  # a regex, not words: the shards' cells show those
        if "error" in entry.statuses:
            said = f"RuntimeError: {text} (rank 0, step 0: backward, torch/autograd/__init__.py:251 in backward)"
            rows.append({**cell, "status": "error", "check": None, "message": said, "failures": [],
                         "raised_in": entry.predicts.get("raised_in", "training"),
                         "error": {"type": "RuntimeError", "message": text},
                         "rank_details": [{"rank": 0, "phase": "step 0: backward", "error": {
                             "type": "RuntimeError", "message": text, "phase": "step 0: backward",
                             "where": "torch/autograd/__init__.py:251 in backward"}}]})
        if entry.check == "resume" and "fail" in entry.statuses:
            said = f"resume: load: RuntimeError: {text} (rank 0, torch/serialization.py:1 in load)"
            failed = {"check": "resume", "step": 1, "message": said, "params": [], "on_held_params": False,
                      "kinds": ["raised"], "raised": True}
            rows.append({**cell, "status": "fail", "check": "resume", "message": said, "failures": [failed]})
    return rows


def representative_rows() -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(entry id, row, environment): for every shipped entry, a row it selects and explains per kind it names and
    per plain-text alternative of its pattern, built from its own when, versions, status, check and predictions."""
    spec = matrix.load()
    found = []
    for entry in known_issues.load(ROOT / "matrix" / "known_issues.toml").entries:
        cell, environment = _cell_and_environment(entry, spec)
        rows = _by_facts(entry, cell) if entry.failure.kinds or entry.failure.params else []
        found += [(entry.id, row, environment) for row in rows + _by_the_stacks_words(entry, cell)]
    return found


def reworded(row: dict[str, Any]) -> dict[str, Any]:
    """Every verdict message reversed: the row's and each failure's, but not the stack's own words (its `error`,
    each rank's, and a round trip's raised exception, which a raised resume failure quotes)."""
    failures = [f if f["check"] == "resume" and "raised" in f.get("kinds", ()) else {**f, "message": f["message"][::-1]}
                for f in row.get("failures") or []]
    return {**row, "message": (row.get("message") or "")[::-1], "failures": failures}


ROWS = representative_rows()


def test_every_entry_rewritten_to_facts_has_a_representative_row():
    shipped = known_issues.load(ROOT / "matrix" / "known_issues.toml").entries
    by_facts = {e.id for e in shipped if e.failure.kinds or e.failure.params}
    assert len(by_facts) >= 32
    assert by_facts <= {entry_id for entry_id, row, _ in ROWS if row["status"] == "fail"}


@pytest.mark.parametrize(("entry_id", "cell", "environment"), ROWS,
                         ids=[f"{entry_id}-{cell['status']}-{i}" for i, (entry_id, cell, _) in enumerate(ROWS)])
def test_rewording_every_verdict_message_keeps_every_cells_known_entry(entry_id, cell, environment):
    reg = known_issues.load(ROOT / "matrix" / "known_issues.toml")
    entry = reg.get(entry_id)
    assert entry.selects(cell, environment) and entry.applies_to(environment) and entry.explains(cell), (
        f"{entry_id}: the representative row is not the entry's")
    before = known_issues.match(cell, environment, reg)
    assert before is not None and before.get("expected")
    after = known_issues.match(reworded(cell), environment, reg)
    assert after == before
