"""The guide and `advise` answer over every model the report holds (the examples' and a user's `@freeze_case` models
too), never show an unproven cell as safe, and open with silent / refused / safe counts per pattern and release."""

import json
from pathlib import Path

import pytest

from pytest_freezecompat import advice
from pytest_freezecompat.cli import main as cli
from pytest_freezecompat.report import guide, schema, write

ROOT = Path(__file__).resolve().parent.parent
PUBLISHED = ROOT / "reports" / "matrix.json"
AXES = ("model", "framework", "release", "plugin", "init", "checkpoint", "freeze", "clip")
PLUGIN = "trainer-fsdp2-full-state-dict"
ADAPTER_ONLY = {"id": "accelerate-fsdp2-peft-full-state-dict-adapter-only-rank0-shard", "expected": True,
                "fixed_in": {"hf": "1.15.0"}, "links": ["https://github.com/huggingface/accelerate/pull/4206"],
                "summary": "A PEFT adapter saved under FSDP2 FULL_STATE_DICT keeps only rank 0's shard. More."}
REENTRANT = {"id": "torch-reentrant-checkpoint-frozen-inputs", "expected": True,
             "summary": "Reentrant checkpointing gives no grads when its inputs are frozen. More.",
             "workarounds": [{"change": {"checkpoint": "non-reentrant"}, "says": "use_reentrant=False"}]}
ENVIRONMENTS = {"hf-1.10": {"frameworks": {"hf": "1.10.1"}}, "hf": {"frameworks": {"hf": "1.15.0"}}}


def row(severity="ok", known=None, user=False, check=None, **axes):
    values = {"model": "tiny-gpt", "framework": "hf", "release": "1.10.1", "plugin": PLUGIN, "init": "eager",
              "checkpoint": "none", "freeze": "lora", "clip": "clip", **axes}
    values["id"] = "/".join(values[axis] for axis in AXES)
    status = {"silent": "fail", "refused": "error", "costly": "fail", "skipped": "skip"}.get(severity, "pass")
    return {**values, "status": status, "severity": severity, "check": check, "message": "",
            "environment": "hf-1.10" if values["release"] == "1.10.1" else "hf",
            **({"known_issue": known} if known else {}), **({"user_model": True} if user else {})}


def peft(severity="ok", **axes):
    """A cell of the example PEFT model (`tiny-llama-lora`), a `@freeze_case` of the examples."""
    known = ADAPTER_ONLY if severity == "silent" else REENTRANT if severity == "refused" else None
    return row(severity, known, True, "resume" if severity == "silent" else None, model="tiny-llama-lora", **axes)


def false_safe_report():
    """hf 1.10.1's Trainer + FSDP2 full state dict with LoRA: the matrix's own model only refuses under reentrant
    checkpointing, the real PEFT model silently loses its adapter on resume (fixed in 1.15.0)."""
    cells = [row(), row(checkpoint="non-reentrant"), row("refused", REENTRANT, checkpoint="reentrant"),
             peft("silent"), peft("silent", checkpoint="non-reentrant"), peft("refused", checkpoint="reentrant"),
             peft(release="1.15.0"), peft(release="1.15.0", checkpoint="non-reentrant"),
             peft(plugin="accelerate-ddp"), peft(plugin="accelerate-ddp", checkpoint="non-reentrant"),
             peft(freeze="none"), row(release="1.15.0"),
             row(model="tiny-llama-lora-modules-to-save", freeze="lora-modules-to-save", user=True)]
    return advice.annotate(write.build(ENVIRONMENTS, cells))


def table_row(text, heading, freeze):
    """The cells of one row of one release's table in the guide."""
    section = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    line = next(line for line in section.splitlines() if line.startswith(f"| `{freeze}` |"))
    return [box.strip() for box in line.strip("|").split("|")[1:]]


def test_the_guide_counts_the_example_models_cells_in_each_box():
    text = guide.render(false_safe_report())
    header = text.split("\n## hf 1.10.1\n", 1)[1].splitlines()[1]
    lora = table_row(text, "hf 1.10.1", "lora")[header.strip("|").split("|")[1:].index(f" `{PLUGIN}` ")]
    assert "✅" not in lora and lora.startswith("🟥 2 silent + 🟧 2 refused of 6")
    why = next(line for line in text.splitlines() if ADAPTER_ONLY["id"] in line)
    assert "**2 silent** on save → load" in why and "`tiny-llama-lora`" in why and "**fixed in hf 1.15.0**" in why
    assert "`lora-modules-to-save`" in text  # a pattern only a user's model has gets its row


def test_advise_answers_the_peft_model_in_one_call(tmp_path, capsys):
    path = tmp_path / "matrix.json"
    path.write_text(json.dumps(false_safe_report()))
    assert cli(["advise", "--model", "tiny-llama-lora", "--framework", "hf", "--plugin", PLUGIN, "--freeze", "lora",
                "--release", "1.10.1", "--report", str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"hf 1.10.1 · {PLUGIN} · freeze lora · model tiny-llama-lora: 3 setups: 2 silent, "
                             "1 refused")
    assert (f"tiny-llama-lora/hf/1.10.1/{PLUGIN}/eager/non-reentrant/lora/clip: SILENT on resume (fail): no error, "
            "yet the weights are wrong (a held param moves, a trained one learns wrongly or not at all, a resume "
            "loses state)") in out
    assert "  fixed in    hf 1.15.0" in out
    assert (f"  workaround  release>=1.15.0 (upgrade hf to 1.15.0 or later): holds here: "
            f"tiny-llama-lora/hf/1.15.0/{PLUGIN}/eager/non-reentrant/lora/clip") in out
    assert "  same in     checkpoint=none" in out


def test_advise_counts_every_model_when_none_is_named(tmp_path, capsys):
    path = tmp_path / "matrix.json"
    path.write_text(json.dumps(false_safe_report()))
    assert cli(["advise", "--framework", "hf", "--plugin", PLUGIN, "--freeze", "lora", "--release", "1.10.1",
                "--report", str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"hf 1.10.1 · {PLUGIN} · freeze lora · models tiny-gpt, tiny-llama-lora: 6 setups: "
                             "2 silent, 2 refused, 2 ok")
    assert any(line.startswith("tiny-llama-lora/") and "SILENT" in line for line in out)


def test_advise_reaches_a_pattern_only_a_user_model_has(tmp_path, capsys):
    path = tmp_path / "matrix.json"
    path.write_text(json.dumps(false_safe_report()))
    assert cli(["advise", "--framework", "hf", "--plugin", PLUGIN, "--freeze", "lora-modules-to-save",
                "--release", "1.10.1", "--report", str(path)]) == 0
    assert capsys.readouterr().out.startswith(f"tiny-llama-lora-modules-to-save/hf/1.10.1/{PLUGIN}/eager/none/")


def test_an_error_names_the_nearest_values_and_where_the_value_is_held(tmp_path, capsys):
    path = tmp_path / "matrix.json"
    path.write_text(json.dumps(false_safe_report()))
    assert cli(["advise", "--model", "tiny-llama-lora", "--framework", "hf", "--plugin", PLUGIN, "--freeze",
                "lora-modules-to-save", "--release", "1.10.1", "--report", str(path)]) == 2
    assert capsys.readouterr().err == (
        f"freezecompat: {path}: no freeze 'lora-modules-to-save' for hf 1.10.1 model=tiny-llama-lora plugin={PLUGIN}; "
        "it has: lora, none; freeze=lora-modules-to-save is held with model=tiny-llama-lora-modules-to-save\n")


def test_advise_help_says_how_to_list_and_a_bare_advise_lists_the_values_held(tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli(["advise", "--help"])
    assert "leave out --framework, --plugin or --freeze to list" in " ".join(capsys.readouterr().out.lower().split())
    path = tmp_path / "matrix.json"
    path.write_text(json.dumps(false_safe_report()))
    assert cli(["advise", "--framework", "hf", "--report", str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "  release     1.15.0, 1.10.1" in out
    assert "  model       tiny-gpt, tiny-llama-lora, tiny-llama-lora-modules-to-save" in out
    assert f"  plugin      accelerate-ddp, {PLUGIN}" in out
    assert ("  freeze      tiny-gpt: lora · tiny-llama-lora: lora, none · tiny-llama-lora-modules-to-save: "
            "lora-modules-to-save") in out


def unproven_report():
    """Every check that ran passed, but no save -> load ran on the fsdp2 cells: unproven, never safe."""
    cells = [{**row("unproven", plugin="fsdp2", checkpoint=checkpoint), "unchecked": ["resume"]}
             for checkpoint in ("none", "non-reentrant")]
    cells += [row(plugin="ddp"), row("differs", plugin="ddp", checkpoint="non-reentrant")]
    return advice.annotate(write.build(ENVIRONMENTS, cells))


def test_an_unproven_box_has_its_own_mark_and_says_what_was_not_checked():
    text = guide.render(unproven_report())
    assert table_row(text, "hf 1.10.1", "lora") == ["✅ safe", "❔ unproven [1]"]
    assert ("1. **2 unproven**, in `lora` × `fsdp2`: nothing failed, but not checked: resume: no save -> load round "
            "trip ran on this cell") in text
    assert "❔ unproven: nothing failed, but a check that decides the verdict did not run" in text  # the legend
    assert "| `lora` | 🟥 0 · 🟧 0 · ❔ 2 · ✅ 2 |" in text  # the overview counts it apart


def test_advise_never_calls_an_unproven_setup_safe(tmp_path, capsys):
    path = tmp_path / "matrix.json"
    path.write_text(json.dumps(unproven_report()))
    assert cli(["advise", "--framework", "hf", "--plugin", "fsdp2", "--freeze", "lora", "--release", "1.10.1",
                "--report", str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "hf 1.10.1 · fsdp2 · freeze lora · model tiny-gpt: 2 setups: 2 unproven; each one not safe below"
    assert out[1:3] == [
        "tiny-gpt/hf/1.10.1/fsdp2/eager/non-reentrant/lora/clip: UNPROVEN (pass): nothing failed, but a check that "
        "decides the verdict did not run on this cell (it says which): not safe until it does",
        "  not checked resume: no save -> load round trip ran on this cell"]
    assert out[-1] == "  same in     checkpoint=none"


def test_the_overview_counts_silent_refused_and_safe_per_pattern_and_release():
    text = guide.render(false_safe_report())
    overview = text.split("## Overview", 1)[1].split("\n## ", 1)[0]
    assert overview.index("| you freeze ↓ · release → | [1.15.0](#hf-1150) | [1.10.1](#hf-1101) |") > 0
    assert "| `lora` | 🟥 0 · 🟧 0 · ✅ 3 | 🟥 2 · 🟧 2 · ✅ 4 |" in overview
    assert "| `lora-modules-to-save` | · | 🟥 0 · 🟧 0 · ✅ 1 |" in overview
    assert text.index("## Overview") < text.index("## hf 1.15.0")


@pytest.mark.skipif(not PUBLISHED.is_file(), reason="no published report here (the sdist ships none)")
def test_the_published_report_shows_the_peft_adapter_loss_on_hf_1_10_1(capsys):
    """The false safe of issue #47: the guide's box and `advise` both say the PEFT adapter is lost on resume."""
    assert cli(["advise", "--model", "tiny-llama-lora", "--framework", "hf", "--plugin", PLUGIN, "--freeze", "lora",
                "--release", "1.10.1", "--report", str(PUBLISHED)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"hf 1.10.1 · {PLUGIN} · freeze lora · model tiny-llama-lora: 3 setups: 2 silent")
    assert (f"  known       {ADAPTER_ONLY['id']} (upstream; not about freezing: the nothing-frozen control fails "
            "alike) https://github.com/huggingface/accelerate/pull/4206") in lines
    assert "  fixed in    hf 1.15.0" in lines
    text = guide.render(schema.load(PUBLISHED))
    header = text.split("\n## hf 1.10.1\n", 1)[1].splitlines()[1].strip("|").split("|")[1:]
    box = table_row(text, "hf 1.10.1", "lora")[header.index(f" `{PLUGIN}` ")]
    assert "✅" not in box and "silent" in box
