import json

import pytest

from pytest_freezecompat.cli import main as cli
from pytest_freezecompat.report import diff, write

ENVS = {"torch": {"python": "3.11.7", "torch": "2.13.0", "frameworks": {"torch": "2.13.0"}, "device": "cpu",
                  "backend": "gloo"}}
KNOWN = {"id": "torch-fsdp1-uniform-requires-grad", "link": "https://github.com/pytorch/pytorch/issues/91167",
         "summary": "uniform"}


def cell(freeze, status="pass", plugin="ddp", **extra):
    return {"id": f"tiny-gpt/torch/{plugin}/eager/none/{freeze}", "model": "tiny-gpt", "framework": "torch",
            "plugin": plugin, "init": "eager", "checkpoint": "none", "freeze": freeze, "environment": "torch",
            "status": status, "check": None, "message": "", **extra}


def reports():
    old = write.build(ENVS, [
        cell("none"), cell("embedding"), cell("lora", "error", "fsdp1", known_issue={**KNOWN, "expected": True}),
        cell("output", "fail", check="grads", message="no grad"), cell("decoder"), cell("bias-only", "error"),
        cell("all", "error", "fsdp1", known_issue={**KNOWN, "expected": True}),
    ])
    new = write.build(ENVS, [
        cell("none"),                                                             # unchanged
        cell("embedding", "fail", check="grads", message="step 0: no grad on trainable: blocks.0.fc1.weight"),
        cell("lora", "error", "fsdp1", message="RuntimeError: a different failure"),  # known -> red
        cell("output"),                                                           # fixed: not a regression
        cell("bias-only", "fail", check="update"),                                # changed form, still red
        cell("all", "pass", "fsdp1", known_issue={**KNOWN, "fixed": True}),       # fixed?: stale entry
        cell("unused-branch", "error"),                                           # new cell
    ])                                                                            # decoder: missing
    return old, new


def test_regressions_come_first_with_the_reason():
    old, new = reports()
    changes = diff.diff(old, new)
    assert [(c.id.split("/", 2)[2], c.regression) for c in changes] == [
        ("ddp/eager/none/decoder", True),
        ("ddp/eager/none/embedding", True),
        ("fsdp1/eager/none/lora", True),
        ("ddp/eager/none/bias-only", False),
        ("ddp/eager/none/output", False),
        ("fsdp1/eager/none/all", False),
        ("ddp/eager/none/unused-branch", False),
    ]
    lines = diff.render(changes, "old.json", "new.json", len(new["cells"])).splitlines()
    assert lines[0] == ("REGRESSION tiny-gpt/torch/ddp/eager/none/decoder: pass -> (absent) (missing from the new "
                        "report)")
    assert lines[1].startswith("REGRESSION tiny-gpt/torch/ddp/eager/none/embedding: pass -> fail (passed, now does "
                               "not): [grads] step 0: no grad on trainable")
    assert lines[2].startswith("REGRESSION tiny-gpt/torch/fsdp1/eager/none/lora: known "
                               "torch-fsdp1-uniform-requires-grad (error) -> error (known issue "
                               "torch-fsdp1-uniform-requires-grad no longer explains its failure)")
    assert "fixed? torch-fsdp1-uniform-requires-grad (pass) (fixed? a known issue expects it to fail)" in lines[5]
    assert lines[6].startswith("added      tiny-gpt/torch/ddp/eager/none/unused-branch: (absent) -> error (new cell)")
    assert lines[-1] == "3 regression(s), 4 other change(s) over 7 cells (old.json -> new.json)"


def test_identical_reports_have_no_change():
    old, _ = reports()
    assert diff.diff(old, old) == []


def _write(tmp_path, name, report):
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(report))
    return str(path)


def test_cli_exit_codes(tmp_path, capsys):
    old, new = reports()
    assert cli(["diff", _write(tmp_path, "old", old), _write(tmp_path, "new", new)]) == 1
    out = capsys.readouterr().out
    assert out.index("REGRESSION") < out.index("changed") < out.index("added")
    only_fixes = write.build(ENVS, [c if c["freeze"] != "output" else cell("output") for c in old["cells"]])
    assert cli(["diff", _write(tmp_path, "old", old), _write(tmp_path, "fixes", only_fixes)]) == 0
    assert "0 regression(s), 1 other change(s)" in capsys.readouterr().out
    assert cli(["diff", _write(tmp_path, "same", old), _write(tmp_path, "same2", old)]) == 0


@pytest.mark.parametrize(("content", "message"), [
    ('{"schema": 2, "cells": [], "environments": {}}', "report schema 2, this tool reads schema 1"),
    ("{not json", "not a matrix report (invalid JSON"),
    ('{"schema": 1, "cells": [{"id": "x"}], "environments": {}}', "corrupt report (cell x: field model: missing)"),
    ('{"schema": 1, "cells": [], "environments": {}, "workarounds": 3}', "corrupt report (workarounds must be a list)"),
    ('{"schema": 1, "cells": [], "environments": {}, "workarounds": [{"entry": "e"}]}',
     "corrupt report (workarounds[0]: field workaround: missing)"),
])
def test_cli_refuses_foreign_and_corrupt_reports_in_one_line(tmp_path, capsys, content, message):
    old, _ = reports()
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    for argv in (["diff", _write(tmp_path, "old", old), str(bad)], ["diff", str(bad), _write(tmp_path, "old", old)]):
        assert cli(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"freezecompat: {bad}: ") and message in err and err.count("\n") == 1


BAD = "tiny-gpt/torch/ddp/eager/none/none"


@pytest.mark.parametrize(("field", "value", "problem"), [
    ("known_issue", KNOWN["id"], f"cell {BAD}: field known_issue: expected a table or null, got a string"),
    ("id", [BAD], "cells[0]: field id: expected a string, got a list"),
    ("message", 3, f"cell {BAD}: field message: expected a string, got an integer"),
    ("known_issue", {"expected": True}, f"cell {BAD}: field known_issue.id: missing"),
    ("failures", [{"check": "grads", "params": "w"}], f"cell {BAD}: field failures[0].params: expected a list, "
                                                      "got a string"),
])
def test_cli_names_the_file_cell_and_field_of_a_bad_cell(tmp_path, capsys, field, value, problem):
    """A bad cell is a file we cannot use (exit 2), never a traceback, nor a `diff` regression (exit 1)."""
    old, _ = reports()
    bad = _write(tmp_path, "bad", write.build(ENVS, [cell("none", **{field: value})]))
    for argv in (["diff", _write(tmp_path, "old", old), bad], ["merge", bad, "-o", str(tmp_path / "out")]):
        assert cli(argv) == 2
        assert capsys.readouterr().err == f"freezecompat: {bad}: corrupt report ({problem})\n"


def test_cli_refuses_a_report_that_is_not_utf8(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_bytes(b'{"schema": 1, "cells": [], "environments": {}, "note": "caf\xe9"}')
    old, _ = reports()
    assert cli(["diff", _write(tmp_path, "old", old), str(bad)]) == 2
    assert capsys.readouterr().err == f"freezecompat: {bad}: not a matrix report (not UTF-8 text at byte 59)\n"


def test_cli_merge_applies_a_known_issue_registry(tmp_path, capsys):
    registry = tmp_path / "known.toml"
    registry.write_text('[[issue]]\nid = "ddp-x"\nsummary = "s"\nlinks = ["https://github.com/o/r/issues/1"]\n'
                        'when = { plugin = "ddp" }\nversions = { torch = ">=2.2" }\nstatus = ["error"]\n'
                        'pattern = "boom"\n')
    shard = _write(tmp_path, "shard", write.build(ENVS, [cell("none", "error", message="RuntimeError: boom",
                                                              error={"type": "RuntimeError", "message": "boom"})]))
    assert cli(["merge", shard, "-o", str(tmp_path / "out"), "--known-issues", str(registry)]) == 0
    merged = json.loads((tmp_path / "out" / "matrix.json").read_text())
    assert merged["cells"][0]["known_issue"]["expected"] is True
    assert (tmp_path / "out" / "matrix.html").read_text().count('data-display="known"') == 1
    registry.write_text("[[issue]]\nid = 1\n")
    assert cli(["merge", shard, "-o", str(tmp_path / "out2"), "--known-issues", str(registry)]) == 2
    assert "entry #1: field summary: missing" in capsys.readouterr().err


def test_a_cell_whose_framework_moved_release_is_compared_with_itself():
    """A nightly that bumps a pin must still see what the bump broke; a report before releases were recorded
    too."""
    from pytest_freezecompat.report import diff as diff_module

    def row(cell_id, status, release=""):
        return {"id": cell_id, "status": status, "release": release, "message": ""}

    old = {"cells": [row("m/composer/ddp/eager/none/none", "pass"),
                     row("m/composer@0.32.1/fsdp1/eager/none/none", "pass", "0.32.1")]}
    new = {"cells": [row("m/composer@0.33.0/ddp/eager/none/none", "pass", "0.33.0"),
                     row("m/composer@0.23.5/ddp/eager/none/none", "error", "0.23.5"),
                     row("m/composer@0.33.0/fsdp1/eager/none/none", "error", "0.33.0")]}
    changes = {c.id: c for c in diff_module.diff(old, new)}
    assert changes["m/composer@0.33.0/fsdp1/eager/none/none"].regression
    assert "was m/composer@0.32.1/fsdp1/eager/none/none (0.32.1)" in changes[
        "m/composer@0.33.0/fsdp1/eager/none/none"].why
    assert changes["m/composer@0.23.5/ddp/eager/none/none"].why == "new cell"  # an older release added beside
    assert "m/composer/ddp/eager/none/none" not in changes and len(changes) == 2


def test_the_same_status_judged_otherwise_is_listed_with_what_changed():
    grads_off_optimizer = [{"check": "grads", "params": ["emb"], "kinds": ["spurious"], "in_optimizer": False}]
    old = write.build(ENVS, [cell("all"), cell("output", "fail", failures=grads_off_optimizer, severity="silent"),
                             cell("decoder", "fail", failures=grads_off_optimizer)])
    new = write.build(ENVS, [cell("all", unchecked=["training"]),
                             cell("output", "fail", failures=grads_off_optimizer),
                             cell("decoder", "fail", failures=[{**grads_off_optimizer[0], "in_optimizer": True}])])
    changes = {c.id.split("/")[-1]: c for c in diff.diff(old, new)}
    assert changes["all"].why == "severity ok -> unproven" and not changes["all"].regression
    assert changes["all"].detail.startswith("not checked: training")
    assert changes["output"].why == "severity silent -> costly" and not changes["output"].regression
    assert changes["decoder"].why == "severity costly -> silent" and changes["decoder"].regression
