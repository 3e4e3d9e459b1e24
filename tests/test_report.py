import errno
import json
import re

import pytest

from pytest_freezecompat.cli import main as cli
from pytest_freezecompat.report import grid, html, markdown, merge, schema, write


def cell(plugin="ddp", freeze="none", status="pass", framework="torch", **extra):
    return {"id": f"tiny-gpt/{framework}/{plugin}/eager/none/{freeze}", "model": "tiny-gpt", "framework": framework,
            "plugin": plugin, "init": "eager", "checkpoint": "none", "freeze": freeze, "clip": "clip",
            "environment": framework, "status": status, "check": None, "message": "", "grad_access": "param.grad",
            **extra}


ENVS = {"torch": {"python": "3.11.7", "torch": "2.13.0", "frameworks": {"torch": "2.13.0"}, "device": "cpu",
                  "backend": "gloo"}}


def test_write_produces_json_and_markdown(tmp_path):
    report = write.build(ENVS, [cell(), cell(freeze="embedding", status="error", message="ValueError: x")])
    out = tmp_path / "out"
    write.write(out, report)
    statuses = {c["freeze"]: c["status"] for c in schema.load(out / "matrix.json")["cells"]}
    assert statuses == {"none": "pass", "embedding": "error"}
    md = (out / "matrix.md").read_text()
    assert "| freeze | ddp |" in md and "| embedding | 💥 |" in md
    assert "ValueError: x" in md
    assert not [p for p in out.iterdir() if p.name.startswith(".matrix")]  # no temp files left behind


def test_markdown_gives_each_checkpoint_mode_its_own_table():
    cells = [cell(status="pass", emulation=True), cell(status="fail", emulation=True, check="grads", message="no grad")]
    cells[1]["id"], cells[1]["checkpoint"] = "tiny-gpt/torch/ddp/eager/reentrant/none", "reentrant"
    md = markdown.render(write.build(ENVS, cells))
    assert "**activation checkpointing `none`** — 1 ✅\n\n| freeze | ddp |\n|---|---|\n| none | ✅ |\n" in md
    assert ("<details><summary>activation checkpointing <code>reentrant</code> — 1 ❌</summary>\n\n"
            "| freeze | ddp |\n|---|---|\n| none | ❌ |\n\n</details>") in md
    assert "every plugin here ran on CPU behind a CUDA-on-CPU shim, so the grids do not mark it" in md
    assert "- ❌ **fail** `grads` — 1 cell(s): plugin ddp · freeze none · checkpoint reentrant — no grad" in md


def test_grid_places_cells_by_their_fields_not_their_ids():
    known = {"id": "k", "link": "https://example.org/k", "expected": True}
    cells = [cell(), cell(plugin="fsdp1", freeze="lora", status="error", grad_access=None),
             cell(plugin="fsdp1", status="fail", known_issue=known, grad_access="flat view",
                  grad_norm_source="clip_grad_norm_"),
             cell(framework="megatron", freeze="lora"),
             {**cell(), "id": "an id no renderer could rebuild", "checkpoint": "reentrant"}]
    torch, megatron = grid.sections(cells)
    assert (torch.plugins, torch.checkpoints) == (("ddp", "fsdp1"), ("none", "reentrant"))
    [block] = torch.blocks
    assert (block.model, block.init) == ("tiny-gpt", "eager")
    assert [[column.slots for column in row.columns] for row in block.rows] == [
        [(cells[0], cells[4]), (cells[2], None)],  # freeze none: ddp, fsdp1
        [(None, None), (cells[1], None)],  # freeze lora
    ]
    assert [row.freeze for row in block.rows] == ["none", "lora"]
    assert dict(torch.counts) == {"pass": 2, "error": 1, "fail": 1, "known": 1} and torch.cells == 4
    assert torch.grad_access == (grid.GradAccess("ddp", "param.grad", "not exposed"),
                                 grid.GradAccess("fsdp1", "flat view", "clip_grad_norm_"))
    assert megatron.blocks[0].rows[0].columns == (grid.Column("ddp", (cells[3],)),)


def test_merge_joins_environments_and_refuses_duplicates():
    a = write.build(ENVS, [cell()])
    b = write.build({"colossalai": {**ENVS["torch"]}}, [cell(framework="colossalai", plugin="gemini")])
    merged = merge.merge([("a.json", a), ("b.json", b)])
    assert set(merged["environments"]) == {"torch", "colossalai"} and len(merged["cells"]) == 2
    with pytest.raises(schema.ReportError, match="duplicate cell"):
        merge.merge([("a.json", a), ("again.json", a)])


@pytest.mark.parametrize(("content", "message"), [
    ("{not json", "invalid JSON"),
    ('{"cells": []}', "no schema field"),
    ('{"schema": 99, "cells": [], "environments": {}}', "report schema 99, this tool reads schema 1"),
    ('{"schema": 1, "cells": [{"id": "x"}], "environments": {}}', "(cell x: field model: missing)"),
    ('{"schema": 1, "cells": [[]], "environments": {}}', "(cells[0]: expected a table, got a list)"),
    ('{"schema": 1, "cells": [], "environments": {"torch": "2.13"}}',
     "(environment 'torch': expected a table, got a string)"),
    ('{"schema": 1, "cells": [], "environments": {"torch": {"frameworks": ["torch"]}}}',
     "(environment 'torch': field frameworks: expected a table, got a list)"),
    (json.dumps(write.build(ENVS, [cell(status="passed")])),
     "field status: 'passed' is not one of pass, fail, error, timeout, crash, skip)"),
    (json.dumps(write.build(ENVS, [cell(rank_details=[{"rank": 0, "error": {"type": None}}])])),
     "field rank_details[0].error.type: expected a string, got null)"),
])
def test_loader_refuses_corrupt_and_foreign_reports(tmp_path, content, message):
    path = tmp_path / "m.json"
    path.write_text(content)
    with pytest.raises(schema.ReportError, match=re.escape(message)):
        schema.load(path)


def test_loader_ignores_fields_it_does_not_know_and_accepts_null_optional_ones(tmp_path):
    """Schema 1: a new field is optional, and a reader ignores what it does not know."""
    path = tmp_path / "m.json"
    path.write_text(json.dumps(write.build(ENVS, [cell(check=None, known_issue=None, future={"any": [1]})])))
    assert schema.load(path)["cells"][0]["future"] == {"any": [1]}


def test_a_report_from_before_the_clip_axis_loads_with_every_cell_clipped(tmp_path):
    path = tmp_path / "m.json"
    row = cell()
    del row["clip"]
    path.write_text(json.dumps(write.build(ENVS, [row])))
    assert schema.load(path)["cells"][0]["clip"] == "clip"


def test_cells_that_never_clip_get_a_block_of_their_own_in_both_reports():
    unclipped = {**cell(freeze="embedding"), "clip": "no-clip", "id": "tiny-gpt/torch/ddp/eager/none/embedding/no-clip"}
    cells = [cell(), cell(freeze="embedding"), unclipped]
    [torch] = grid.sections(cells)
    assert [(b.clip, [r.freeze for r in b.rows]) for b in torch.blocks] == [("clip", ["none", "embedding"]),
                                                                          ("no-clip", ["embedding"])]
    report = write.build(ENVS, cells)
    assert "#### tiny-gpt · init `eager` · `no-clip` (never clipped)" in markdown.render(report)
    assert "init <code>eager</code>, <code>no-clip</code> (never clipped)" in html.render(report)


def test_cli_merge_and_its_one_line_error(tmp_path, capsys):
    for name, fw in (("a", "torch"), ("b", "megatron")):
        (tmp_path / name).mkdir()
        write.write(tmp_path / name, write.build(ENVS, [cell(framework=fw)]))
    assert cli(["merge", str(tmp_path / "a/matrix.json"), str(tmp_path / "b/matrix.json"), "-o",
                str(tmp_path / "all")]) == 0
    assert len(json.loads((tmp_path / "all/matrix.json").read_text())["cells"]) == 2
    (tmp_path / "bad.json").write_text("[]")
    assert cli(["merge", str(tmp_path / "bad.json"), "-o", str(tmp_path / "x")]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_cli_merge_refuses_an_output_it_cannot_write_before_reading_a_shard(tmp_path, capsys):
    shard = str(tmp_path / "absent.json")  # never read: the output is checked first
    existing = tmp_path / "matrix.md"
    existing.write_text("a file, not a directory\n")
    assert cli(["merge", shard, "-o", str(existing)]) == 2
    assert capsys.readouterr().err == f"freezecompat: {existing}: not a directory (-o names the report directory)\n"
    assert cli(["merge", shard, "-o", str(existing / "out")]) == 2
    assert capsys.readouterr().err == (f"freezecompat: {existing / 'out'}: cannot create it ({existing} is not a "
                                       "directory)\n")


def test_cli_merge_reports_a_failed_write_in_one_line(tmp_path, capsys, monkeypatch):
    (tmp_path / "a").mkdir()
    write.write(tmp_path / "a", write.build(ENVS, [cell()]))

    def disk_full(directory, report):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(write, "write", disk_full)
    assert cli(["merge", str(tmp_path / "a/matrix.json"), "-o", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == (f"freezecompat: {tmp_path / 'out'}: cannot write the report (No space left on "
                                       "device)\n")


def test_merge_gives_each_red_cell_its_cause_and_the_tables_show_it(tmp_path):
    """The control may sit in another shard: causes are decided on the merged report."""
    grads = {"check": "grads", "step": 0, "message": "...", "params": ["w"], "on_held_params": False}
    rows = {"a": [cell(freeze="none", status="pass"), cell(plugin="fsdp2", freeze="none", status="fail",
                                                           failures=[grads])],
            "b": [cell(freeze="embedding", status="fail", check="grads", failures=[grads]),
                  cell(plugin="fsdp2", freeze="embedding", status="fail", check="grads", failures=[grads])]}
    for name, shard in rows.items():
        (tmp_path / name).mkdir()
        write.write(tmp_path / name, write.build(ENVS, shard))
    assert cli(["merge", str(tmp_path / "a/matrix.json"), str(tmp_path / "b/matrix.json"), "-o",
                str(tmp_path / "all")]) == 0
    merged = {c["id"]: c.get("cause") for c in json.loads((tmp_path / "all/matrix.json").read_text())["cells"]}
    assert merged == {"tiny-gpt/torch/ddp/eager/none/none": None, "tiny-gpt/torch/ddp/eager/none/embedding": "freeze",
                      "tiny-gpt/torch/fsdp2/eager/none/none": "stack",
                      "tiny-gpt/torch/fsdp2/eager/none/embedding": "stack"}
    md = (tmp_path / "all/matrix.md").read_text()
    # red by freeze, stack, both, harness; then round trips failed, held (these rows have none)
    assert "❌❄" in md and "❌ˢ" in md and "| 1 | 2 | 0 | 0 | 0 | 0 | 4 |" in md
    html = (tmp_path / "all/matrix.html").read_text()
    assert 'data-cause="freeze"' in html and 'id="filter-cause"' in html


def test_the_report_counts_cells_that_needed_a_rendezvous_retry():
    cells = [cell(), cell(freeze="embedding", rendezvous_retries=1)]
    md = markdown.render(write.build(ENVS, cells))
    assert ("Rendezvous retries (harness): 1 cell(s) were rerun because joining their fresh process group hung: "
            "`tiny-gpt/torch/ddp/eager/none/embedding`.") in md


def test_tables_follow_the_matrix_files_axis_order_and_append_what_it_does_not_list():
    from pytest_freezecompat.report import grid

    cells = [{"framework": fw, "model": "m", "init": "eager", "freeze": fr, "plugin": "p", "checkpoint": "none",
              "clip": "clip", "status": "pass"} for fw in ("b", "a") for fr in ("z", "user-pattern", "y")]
    report = {"environments": {"one": {"axes": {"framework": ["a", "b"], "freeze": ["y", "z"]}},
                               "two": {"axes": {"framework": ["c", "a"]}}}, "cells": cells}
    order = grid.axis_order(report)
    assert order["framework"] == ["a", "b", "c"]
    assert grid.distinct(cells, "freeze", order) == ("y", "z", "user-pattern")
    assert [s.framework for s in grid.sections(cells, order)] == ["a", "b"]
    assert grid.distinct(cells, "framework") == ("b", "a")  # no order known: as the cells come


def test_run_metadata_names_plugin_commit_date_and_command(tmp_path):
    import subprocess

    from pytest_freezecompat.report import schema

    assert schema.run_info("pytest --freeze-matrix", tmp_path)["commit"] is None  # not a checkout
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "f").write_text("x")
    subprocess.run(["git", "-C", str(tmp_path), "add", "f"], check=True)
    subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "m"],
                   check=True)
    info = schema.run_info("pytest --freeze-matrix", tmp_path)
    assert len(info["commit"]) == 40 and info["command"] == "pytest --freeze-matrix"
    assert info["date"].endswith("Z") and info["plugin"]
    (tmp_path / "f").write_text("changed")
    assert schema.run_info("", tmp_path)["commit"].endswith("-dirty")
