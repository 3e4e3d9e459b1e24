"""matrix.md as a GitHub reader sees it: summaries first, narrow one-mark grids, notes only where to look."""

import re

from pytest_freezecompat.core.cell import CellKey
from pytest_freezecompat.core.names import clip
from pytest_freezecompat.report import html, markdown, write

ENV = {"python": "3.11.7", "torch": "2.13.0", "frameworks": {"torch": "2.13.0"}, "device": "cpu", "backend": "gloo"}
#: The shipped matrix's shape: its longest plugin names, 11 plugins in one framework, four checkpoint modes.
PLUGINS = {
    "megatron": [f"{stack}-{layout}" for stack in ("megatron-ddp-distopt", "megatron-ddp", "torch-ddp")
                 for layout in ("pp2", "tp1", "tp2")],
    "colossalai": ["gemini", "hybrid-parallel-zero-1", "hybrid-parallel", "low-level-zero-1", "low-level-zero-2",
                   "torch-ddp-find-unused", "torch-ddp", "torch-fsdp"],
    "composer": ["ddp-default-optimizer", "ddp", "fsdp1-default-optimizer", "fsdp1-orig-params-default-optimizer",
                 "fsdp1-orig-params", "fsdp1-shard-grad-op-default-optimizer", "fsdp1-shard-grad-op", "fsdp1",
                 "fsdp2-default-optimizer", "fsdp2-no-avg-shim", "fsdp2"],
    "torch": ["ddp-find-unused", "ddp", "fsdp1-orig-params", "fsdp1", "fsdp2"],
}
FREEZES = ("none", "all", "all-but-last", "bias-only", "decoder", "decoder-after-wrap", "embedding", "lora",
           "optimizer-subset", "output", "unused-branch")
CHECKPOINTS = ("none", "reentrant", "non-reentrant", "framework")
KNOWN = {"id": "torch-fsdp1-uniform-requires-grad", "link": "https://github.com/pytorch/pytorch/issues/91167",
         "links": ["https://github.com/pytorch/pytorch/issues/91167", "https://github.com/pytorch/pytorch/pull/98221"],
         "summary": "FlatParameter must be all frozen or all trainable", "expected": True}
SYMBOLS = tuple(markdown.SYMBOLS.values())


def cell(framework="torch", plugin="ddp", freeze="none", checkpoint="none", init="eager", status="pass", clip="clip",
         **extra):
    key = CellKey("tiny-gpt", framework, plugin, init, checkpoint, freeze, clip)
    return {"id": key.id, **key.as_dict(), "environment": framework, "status": status, "check": None, "message": "",
            **extra}


def real_size():
    """~2900 cells over four frameworks: every status, causes, known issues, emulated plugins, pass notes."""
    cells = []
    for framework, plugins in PLUGINS.items():
        for p, plugin in enumerate(plugins):
            for f, freeze in enumerate(FREEZES):
                for c, checkpoint in enumerate(CHECKPOINTS):
                    for init in ("eager", "meta"):
                        turn = (p + 3 * f + 5 * c) % 9
                        status = ("pass", "pass", "pass", "fail", "error", "crash", "timeout", "skip", "pass")[turn]
                        extra = {"emulation": framework == "megatron" or plugin.startswith("fsdp1-"),
                                 "notes": ["zero-filled grad where the reference has none"]}
                        if status in ("fail", "error", "crash", "timeout"):
                            extra |= {"cause": ("freeze", "stack", "both", "harness")[p % 4],
                                      "message": f"step {c}: grad differs from reference: w (max abs diff 1.{f}e-02)"}
                            if turn == 4:
                                extra["known_issue"] = KNOWN
                        cells.append(cell(framework, plugin, freeze, checkpoint, init, status, **extra))
    return write.build({name: {**ENV, "axes": {"checkpoint": list(CHECKPOINTS)}} for name in PLUGINS}, cells)


def grid_rows(md):
    """Each grid table's data cells (after the freeze column), by table."""
    tables, rows = [], None
    for line in md.splitlines():
        if line.startswith("| freeze |"):
            rows = []
            tables.append(rows)
        elif rows is not None and line.startswith("|") and not line.startswith("|---"):
            rows.append([part.strip() for part in line.strip("|").split(" | ")][1:])
        elif not line.startswith("|"):
            rows = None
    return tables


def section(md, heading):
    """From `heading` to the next heading of its level or above."""
    start = md.index(heading + "\n")
    end = re.compile(rf"\n#{{1,{heading.index(' ')}}} ").search(md, start + len(heading))
    return md[start:end.start() if end else len(md)]


def test_one_mark_per_grid_cell_and_one_table_per_checkpoint_mode():
    md = markdown.render(real_size())
    tables = grid_rows(md)
    assert len(tables) == 4 * 2 * 4  # frameworks x init modes x checkpoint modes
    for rows in tables:
        for row in rows:
            for mark in row:
                assert sum(mark.count(s) for s in SYMBOLS) + (mark == markdown.ABSENT) == 1, mark
    composer = section(md, "### composer grids")
    assert "**activation checkpointing `none`**" in composer  # the first mode open, the others folded
    assert composer.count("<details><summary>activation checkpointing <code>") == 2 * 3


def test_tables_stay_narrow_at_real_size():
    report = real_size()
    assert len(report["cells"]) > 2281
    md = markdown.render(report)
    table_lines = [line for line in md.splitlines() if line.startswith("|")]
    assert max(map(len, table_lines)) <= markdown.TABLE_WIDTH
    composer = section(md, "### composer grids")  # 11 long names: letters and a key
    assert "Columns: **A** ddp-default-optimizer · **B** ddp · **Cᴱ** fsdp1-default-optimizer" in composer
    assert "| freeze | ddp-find-unused | ddp | fsdp1-orig-" in md  # torch's names fit


def test_emulation_is_stated_once_not_per_cell():
    md = markdown.render(real_size())
    grid_marks = [mark for rows in grid_rows(md) for row in rows for mark in row]
    assert not any(markdown.EMULATION_MARK in mark for mark in grid_marks)
    megatron = section(md, "### megatron")  # every plugin emulated: said in the heading, not in the grid
    assert "ᴱ **Emulation**: every plugin here ran on CPU behind a CUDA-on-CPU shim" in megatron
    assert "| freeze | A | B | C |" in section(md, "### megatron grids")
    torch = section(md, "### torch grids")  # one plugin emulated: its column head carries it
    assert "| freeze | ddp-find-unused | ddp | fsdp1-orig-paramsᴱ | fsdp1 | fsdp2 |" in torch


def test_emulation_counts_where_the_shim_engaged_in_only_some_cells():
    cells = [cell(plugin="fsdp2", freeze=f, emulation=f != "all") for f in ("none", "all", "lora")]
    md = markdown.render(write.build({"torch": ENV}, [*cells, cell(freeze="lora")]))
    assert ("`fsdp2` (2/3) ran on CPU behind a CUDA-on-CPU shim (n/m: it engaged in n of the m cells that ran); "
            "the grids mark these plugins ᴱ.") in md
    assert "| freeze | ddp | fsdp2ᴱ |" in md and "| lora | ✅ | ✅ |" in md


def test_notes_only_for_red_or_surprising_cells():
    fixed = {**KNOWN, "expected": False, "fixed": True}
    cells = [cell(freeze="decoder", notes=["zero-filled grad where the reference has none"]),
             cell(freeze="embedding", status="error", cause="freeze", known_issue=KNOWN,
                  message="ValueError: Must flatten tensors with uniform requires_grad"),
             cell(freeze="lora", status="fail", cause="freeze", check="grads",
                  message="step 0: no grad on trainable: w"),
             cell(freeze="bias-only", status="error", cause="harness", message="FreezeCaseError: bad case"),
             cell(freeze="output", known_issue=fixed),
             cell(freeze="all", status="skip", message="needs CUDA")]
    md = markdown.render(write.build({"torch": ENV}, cells))
    notes = section(md, "## Notes")
    assert "zero-filled" not in notes and "Must flatten" not in notes  # a pass; a red cell a known issue explains
    assert "- ❌❄ **fail** `grads` — 1 cell(s): plugin ddp · freeze lora — step 0: no grad on trainable: w" in notes
    assert "- 💥ʰ **error** — 1 cell(s): plugin ddp · freeze bias-only — FreezeCaseError: bad case" in notes
    assert f"- ✅ᶠ **fixed?** ([torch-fsdp1-uniform-requires-grad]({KNOWN['link']})) — 1 cell(s)" in notes
    assert "- ⏭️ **skip** — 1 cell(s): plugin ddp · freeze all — needs CUDA" in notes
    assert "**torch-fsdp1-uniform-requires-grad** (1 fixed?, 1 known)" in section(md, "## Known issues")


def test_notes_group_cells_that_failed_the_same_way_numbers_aside():
    md = markdown.render(real_size())
    notes = section(md, "### torch notes")
    items = [line for line in notes.splitlines() if line.startswith("- ")]
    assert len(items) < 20 and "e.g. step" in notes
    assert sum(int(re.search(r"— (\d+) cell\(s\)", line)[1]) for line in items) == sum(
        1 for c in real_size()["cells"] if c["framework"] == "torch" and c["status"] != "pass"
        and not c.get("known_issue"))


def test_messages_are_cut_at_a_sentence_or_field_boundary():
    first = "RuntimeError: Expected to have finished reduction in the prior iteration before starting a new one."
    assert clip(f"{first} This error indicates that your module has parameters that were not used, "
                            "in producing loss; enable find_unused_parameters", 160) == first + " …"
    fields = "step 0: no grad on trainable: " + ", ".join(f"blocks.{i}.fc1.weight" for i in range(9))
    assert clip(f"{fields} | {fields}", 300) == fields + " …"
    listed = "optimizer tracks 28 unintended: " + ", ".join(f"blocks.{i}.fc1.bias" for i in range(30))
    cut = clip(listed, 100)
    assert len(cut) <= 100 and cut.endswith(", blocks.2.fc1.bias …")
    assert clip("short\nmessage", 20) == "short message"
    cells = [cell(status="fail", check="grads", message=listed * 3)]
    [note] = [line for line in section(markdown.render(write.build({"torch": ENV}, cells)), "## Notes").splitlines()
              if line.startswith("- ")]
    assert note.endswith(".fc1.bias …") and len(note) < markdown.MESSAGE_CHARS + 100


def test_known_issue_links_in_the_summary_and_the_known_issues():
    md = markdown.render(real_size())
    links = "[pytorch#91167](https://github.com/pytorch/pytorch/issues/91167) · " \
            "[pytorch#98221](https://github.com/pytorch/pytorch/pull/98221)"
    summary = section(md, "### torch")
    assert re.search(r"\*\*torch-fsdp1-uniform-requires-grad\*\* \(\d+ known\) under .* — " + re.escape(links),
                     summary)
    known = section(md, "## Known issues")
    assert "FlatParameter must be all frozen or all trainable — " + links in known


def test_run_metadata_is_shown_when_the_report_has_it():
    run = {"plugin": "0.4.0", "commit": "0a6052f1e2d3-dirty", "date": "2026-05-01T12:00:00Z",
           "command": "pytest --freeze-matrix"}
    md = markdown.render(write.build({"torch": {**ENV, "run": run}}, [cell()]))
    assert ("Environment `torch`: torch 2.13.0 · python 3.11.7 · cpu (gloo) · run 2026-05-01T12:00:00Z · commit "
            "`0a6052f1e2d3-dirty` · pytest-freezecompat 0.4.0 · `pytest --freeze-matrix`") in md
    older = markdown.render(write.build({"torch": ENV}, [cell()]))
    assert "Environment `torch`: torch 2.13.0 · python 3.11.7 · cpu (gloo)  \n" in older and "commit" not in older


def test_the_environment_line_names_its_lock_and_what_the_run_had_otherwise():
    lock = {"file": "locks/torch.txt", "sha256": "9123b724f8903a4cde67e811", "differs": []}
    md = markdown.render(write.build({"torch": {**ENV, "lock": lock}}, [cell()]))
    assert "cpu (gloo) · lock `matrix/locks/torch.txt` (sha256 9123b724f890)  \n" in md
    drifted = {**lock, "differs": ["numpy 2.4.6 (lock 2.4.5)", "+ extra 1.0"]}
    md = markdown.render(write.build({"torch": {**ENV, "lock": drifted}}, [cell()]))
    assert ("lock `matrix/locks/torch.txt` (sha256 9123b724f890), **not as locked**: numpy 2.4.6 (lock 2.4.5), "
            "+ extra 1.0") in md
    html_page = html.render(write.build({"torch": {**ENV, "lock": drifted}}, [cell()]))
    assert "matrix/locks/torch.txt (9123b724f890), not as locked: numpy 2.4.6 (lock 2.4.5), + extra 1.0" in html_page


def test_order_follows_the_matrix_files_axes():
    axes = {"framework": ["torch", "colossalai"], "plugin": ["fsdp2", "ddp"], "freeze": ["none", "lora", "embedding"],
            "checkpoint": ["none", "reentrant"]}
    cells = [cell(framework=fw, plugin=p, freeze=f, checkpoint=ck) for fw in ("colossalai", "torch")
             for p in ("ddp", "fsdp2") for f in ("embedding", "lora", "none") for ck in ("reentrant", "none")]
    md = markdown.render(write.build({"torch": {**ENV, "axes": axes}}, cells))
    assert md.index("### torch\n") < md.index("### colossalai\n") < md.index("### torch grids")
    torch = section(md, "### torch grids")
    assert torch.index("**activation checkpointing `none`**") < torch.index(
        "<details><summary>activation checkpointing <code>reentrant</code>")
    assert "| freeze | fsdp2 | ddp |\n|---|---|---|\n| none | ✅ | ✅ |\n| lora | ✅ | ✅ |\n| embedding |" in torch


def test_the_report_opens_with_how_bad_per_release_silent_first():
    harm = [{"check": "update", "params": ["w"], "message": "step 0: param that must stay fixed changed: w"}]
    cells = [cell(freeze="lora", status="fail", failures=harm), cell(freeze="embedding", status="error"),
             cell(freeze="output", status="fail", failures=harm, known_issue={"id": "x", "expected": True}),
             cell()]
    md = markdown.render(write.build({"torch": ENV}, cells))
    assert md.index("[guide.md](guide.md)") < md.index("## How bad, per framework release") < md.index(
        "## Raw statuses and causes")
    table = section(md, "## How bad, per framework release")
    assert "| framework release | silent | refused | costly | unproven | differs | harness | ok | skipped |" in table
    assert "| torch | 2 | 1 | 0 | 0 | 0 | 0 | 1 | 0 | 2 | 4 |" in table  # the known silent cell is still silent


def test_an_unproven_pass_is_never_drawn_as_a_pass_and_says_what_did_not_run():
    proven = cell(status="pass")
    unproven = {**cell(status="pass", freeze="all"), "id": "tiny-gpt/torch/ddp/eager/none/all",
                "unchecked": ["training"]}
    md = markdown.render(write.build({"torch": ENV}, [proven, unproven]))
    assert "| none | ✅ |" in md and "| all | ❔ |" in md
    assert "1 ✅ · 1 ❔" in md
    not_proven = section(md, "## Not proven")
    assert "| torch | training: the stack never ran a step" in not_proven
    assert "`tiny-gpt/torch/ddp/eager/none/all`" in not_proven


def test_the_share_of_tolerance_passing_rows_used_is_tabled_per_precision():
    tolerance = {"precision": "fp32", "grad_rtol": 1e-4, "grad_atol": 1e-6, "param_rtol": 1e-4, "param_atol": 1e-3,
                 "norm_rtol": 1e-4}
    rows = [cell(freeze=freeze, tolerance={**tolerance, "used": {"grads": share, "params": share / 2}})
            for freeze, share in (("none", 0.1), ("embedding", 0.2), ("lora", 0.9))]
    text = markdown.render(write.build({"torch": ENV}, rows))
    section = text.split("## How close passes came to their tolerance", 1)[1]
    assert "| fp32 | grads | 3 | 0.2 | 0.9 | 0.9 | 0.9 |" in section
    assert "| fp32 | params | 3 | 0.1 | 0.45 | 0.45 | 0.45 |" in section
