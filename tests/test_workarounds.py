"""Workarounds as data: the registry's fields, each workaround proved or not by the cell it leads to, and the guide
that shows the best one beside each unsafe box."""

import pytest

from pytest_freezecompat import advice
from pytest_freezecompat.advice.workarounds import outcome, proofs, state, summary
from pytest_freezecompat.core.declaration import load_declaration
from pytest_freezecompat.report import guide
from pytest_freezecompat.spec import known_issues, matrix

AXES = ("model", "framework", "release", "plugin", "init", "checkpoint", "freeze", "clip")
ENTRY = {"id": "fsdp1-mixed-unit", "expected": True, "summary": "FSDP1 refuses a unit with mixed requires_grad. More.",
         "workarounds": [{"change": {"plugin": "fsdp1-orig-params"}, "says": "FSDP(use_orig_params=True)"},
                         {"change": {"plugin": "torch-ddp"}, "says": "ColossalAI's TorchDDPPlugin"}]}
FIXED = {**ENTRY, "fixed_in": {"torch": "2.9.0"}}


def row(status="pass", severity="ok", known=None, **axes):
    values = {"model": "tiny-gpt", "framework": "torch", "release": "2.8.0", "plugin": "fsdp1", "init": "eager",
              "checkpoint": "none", "freeze": "lora", "clip": "clip", **axes}
    values["id"] = "/".join(values[axis] for axis in AXES)
    return {**values, "status": status, "severity": severity, "message": "", "environment": "torch",
            **({"known_issue": known} if known else {})}


def red(**axes):
    return row("error", "refused", ENTRY, **axes)


def by_label(found):
    return {(p.cell.split("/")[4], p.workaround): (p.proof, p.holds) for p in found}


def test_a_workaround_holds_only_where_the_cell_it_leads_to_is_ok():
    cells = [red(), row(plugin="fsdp1-orig-params"),
             red(checkpoint="reentrant"), row("fail", "silent", plugin="fsdp1-orig-params", checkpoint="reentrant"),
             red(init="meta"), row("pass", "differs", plugin="fsdp1-orig-params", init="meta")]
    found = {(p.cell, p.workaround): p.holds for p in proofs(cells)}
    assert found == {(red()["id"], "plugin=fsdp1-orig-params"): True,
                     (red(checkpoint="reentrant")["id"], "plugin=fsdp1-orig-params"): False,
                     (red(init="meta")["id"], "plugin=fsdp1-orig-params"): True}  # right weights, another loop
    assert [p.severity for p in proofs(cells)] == ["ok", "silent", "differs"]
    costly = [red(), row("fail", "costly", plugin="fsdp1-orig-params")]
    assert [(p.holds, p.severity) for p in proofs(costly)] == [(True, "costly")]  # right weights, at a cost
    unexplained = [red(), row("fail", "silent", plugin="fsdp1-orig-params")]
    assert [p.holds for p in proofs(unexplained)] == [False]


def test_a_value_the_framework_lacks_is_no_workaround_for_it_and_a_missing_cell_proves_nothing():
    cells = [red(), row(plugin="fsdp1-orig-params", checkpoint="reentrant")]  # only another setup ran
    assert [(p.workaround, p.proof, p.holds) for p in proofs(cells)] == [("plugin=fsdp1-orig-params", None, None)]


def test_an_unproven_cell_proves_no_workaround():
    found = proofs([red(), row("pass", "unproven", plugin="fsdp1-orig-params")])
    assert [(p.holds, p.severity) for p in found] == [(None, "unproven")]
    assert state([p.holds for p in found], [p.severity for p in found]) == "unproven"
    assert outcome({"holds": None, "severity": "unproven"}).startswith("not proved here (that cell is unproven")


def test_fixed_in_leads_to_the_newest_release_held_at_or_after_it():
    fixed = row("error", "refused", FIXED)
    cells = [fixed, row(release="2.9.0"), row("error", "refused", release="2.13.0"), row(plugin="fsdp1-orig-params")]
    release = next(p for p in proofs(cells) if p.workaround == "release>=2.9.0")
    assert (release.proof, release.holds) == (row(release="2.13.0")["id"], False)  # newest, not the first fixed
    unrun = [p for p in proofs([fixed, row(plugin="fsdp1-orig-params")]) if p.workaround.startswith("release")]
    assert [(p.proof, p.holds) for p in unrun] == [(None, None)]  # stated, but no later release in the report


def test_a_skipped_cell_proves_nothing_and_red_cells_without_an_entry_have_no_workaround():
    cells = [red(), row("skip", "skipped", plugin="fsdp1-orig-params"), row("error", "refused", init="meta")]
    assert [(p.cell, p.proof, p.holds) for p in proofs(cells)] == [(red()["id"], None, None)]


def test_a_cell_red_for_another_entrys_reason_blocks_but_does_not_break():
    other = {"id": "another-issue", "expected": True}
    cells = [red(), row("error", "refused", other, plugin="fsdp1-orig-params"),
             red(checkpoint="reentrant"), row("error", "refused", ENTRY, plugin="fsdp1-orig-params",
                                              checkpoint="reentrant")]
    assert [(p.holds, p.blocked_by) for p in proofs(cells)] == [(False, "another-issue"), (False, None)]
    assert [r["state"] for r in summary(proofs(cells[:2]))] == ["blocked"]
    assert [r["state"] for r in summary(proofs(cells))] == ["broken"]
    assert [(r["not_held"], r["blocked"]) for r in summary(proofs(cells))] == [(1, 1)]


@pytest.mark.parametrize(("holds", "severities", "expected"), [
    ([True, True], ["ok", "ok"], "verified"), ([True, True], ["ok", "differs"], "qualified"),
    ([True], ["costly"], "qualified"),
    ([True, False, None], ["ok", "refused", None], "partly"), ([False], ["silent"], "broken"),
    ([None, None], [None, None], "unproven"), ([], [], "unproven")])
def test_one_state_per_release(holds, severities, expected):
    assert state(holds, severities) == expected


def test_the_summary_is_per_entry_workaround_and_release_with_its_proving_cells():
    cells = [red(), row(plugin="fsdp1-orig-params"), red(release="2.9.0"),
             row("fail", "silent", release="2.9.0", plugin="fsdp1-orig-params")]
    table = {(r["workaround"], r["release"]): r for r in summary(proofs(cells))}
    assert table[("plugin=fsdp1-orig-params", "torch@2.8.0")]["state"] == "verified"
    assert table[("plugin=fsdp1-orig-params", "torch@2.8.0")]["proof"] == [row(plugin="fsdp1-orig-params")["id"]]
    assert table[("plugin=fsdp1-orig-params", "torch@2.9.0")]["state"] == "broken"


def test_annotate_gives_red_cells_their_workarounds_and_nearest_safe_setups():
    report = {"cells": [red(), row(plugin="fsdp1-orig-params"), row("error", "refused", plugin="ddp", init="meta")],
              "environments": {}}
    advice.annotate(report)
    first, _, lonely = report["cells"]
    assert first["workarounds"] == [{"workaround": "plugin=fsdp1-orig-params", "says": "FSDP(use_orig_params=True)",
                                     "proof": row(plugin="fsdp1-orig-params")["id"], "holds": True,
                                     "severity": "ok", "blocked_by": None}]
    assert first["instead"] == [{"cell": row(plugin="fsdp1-orig-params")["id"], "severity": "ok",
                                 "changes": [["plugin", "fsdp1", "fsdp1-orig-params"]]}]
    assert "workarounds" not in lonely and lonely["instead"][0]["changes"] == [["init", "meta", "eager"],
                                                                               ["plugin", "ddp", "fsdp1-orig-params"]]
    assert [r["state"] for r in report["workarounds"]] == ["verified"]


def test_a_recipe_is_the_only_other_freeze_offered():
    recipe = {**ENTRY, "workarounds": [{"change": {"freeze": "lora-frozen-base"}, "says": "freeze the base too"}]}
    report = {"cells": [row("fail", "silent", recipe), row(freeze="lora-frozen-base", plugin="ddp"),
                        row(freeze="lora-frozen-base"), row(freeze="embedding")], "environments": {}}
    advice.annotate(report)
    assert [a["changes"] for a in report["cells"][0]["instead"]] == [[["freeze", "lora", "lora-frozen-base"]],
                                                                    [["freeze", "lora", "lora-frozen-base"],
                                                                     ["plugin", "fsdp1", "ddp"]]]


def test_the_guide_marks_each_box_and_says_what_to_do_instead():
    report = {"cells": [row("error", "refused", FIXED), row(plugin="fsdp1-orig-params"), row(checkpoint="reentrant"),
                        row("fail", "silent", None, plugin="ddp")],
              "environments": {"torch": {"frameworks": {"torch": "2.8.0"},
                                         "words": {"plugin": {"fsdp1": "FSDP(use_orig_params=False)"}}}}}
    advice.annotate(report)
    text = guide.render(report)
    assert "| `lora` | 🟧 refused 1/2 [1] | ✅ safe | 🟥 silent [2] |" in text  # worst mark, bad/ran, why-lines
    assert "Wrappers: `fsdp1` FSDP(use_orig_params=False)." in text
    assert ("1. **1 refused** when checkpoint=none, in `lora` × `fsdp1`: FSDP1 refuses a unit with mixed "
            "requires_grad [`fsdp1-mixed-unit`]; **fixed in torch 2.9.0**. **Instead**: FSDP(use_orig_params=True) "
            "(`plugin=fsdp1-orig-params`, proved: `tiny-gpt/torch/2.8.0/fsdp1-orig-params/eager/none/lora/clip`)"
            ) in text
    assert ("2. **1 silent**, in `lora` × `ddp`: no known issue or finding explains it. **Instead**: plugin ddp -> "
            "fsdp1-orig-params (proved: `tiny-gpt/torch/2.8.0/fsdp1-orig-params/eager/none/lora/clip`)") in text


def test_the_registry_reads_workarounds_and_refuses_malformed_ones(tmp_path):
    base = ('[[issue]]\nid = "x"\nsummary = "s"\nlinks = ["https://example.org/1"]\n'
            'when = { framework = "torch", plugin = "fsdp1" }\n'
            'versions = { torch = ">=2.2" }\nstatus = ["error"]\npattern = "boom"\n')
    path = tmp_path / "known_issues.toml"
    path.write_text(base + 'workarounds = [{ change = { plugin = "fsdp2" }, says = "FSDP2" }]\n')
    entry = known_issues.load(path).entries[0]
    assert entry.describe()["workarounds"] == [{"change": {"plugin": "fsdp2"}, "says": "FSDP2"}]
    for extra, error in [
        ('workarounds = [{ change = { release = "2.9" }, says = "s" }]', "cannot change 'release'"),
        ('workarounds = [{ change = { plugin = "fsdp2" } }]', "must be a list of"),
        ('workarounds = [{ change = { plugin = "fsdp2" }, says = " " }]', "says must tell the user"),
        ('no_workaround = ""', "must say why no workaround is known"),
        ('no_workaround = "n"\nworkarounds = [{ change = { plugin = "fsdp2" }, says = "s" }]', "drop one of the two"),
    ]:
        path.write_text(base + extra + "\n")
        with pytest.raises(known_issues.KnownIssueError, match=f"^{path}: entry x: field (workarounds|no_workaround): "
                                                               f".*{error}"):
            known_issues.load(path)
    path.write_text(base + 'workarounds = [{ change = { plugin = "gemini" }, says = "s" }]\n')
    with pytest.raises(known_issues.KnownIssueError, match="field workarounds: plugin 'gemini' is no value of the "
                                                           "entry's frameworks"):
        known_issues.load(path).check_against(matrix.load())


def test_every_shipped_entry_says_what_to_do_instead():
    """A workaround, a fixed-in release, or why none is known: never silence."""
    silent = [e.id for e in known_issues.load().entries if not (e.workarounds or e.fixed_in or e.no_workaround)]
    assert silent == []


def test_every_adapter_says_each_value_it_offers_in_plain_words():
    for framework in matrix.load().frameworks.values():
        declaration = load_declaration(framework.adapter)
        unsaid = [v for axis in ("plugin", "init", "checkpoint") for v in declaration.offers(axis)
                  if not declaration.words.get(v)]
        assert unsaid == [], framework.name


def test_advise_says_outright_when_one_change_will_not_do():
    from pytest_freezecompat.advice.answer import lines

    report = {"cells": [row("error", "refused", plugin="ddp", init="meta"), row()], "environments": {}}
    advice.annotate(report)
    assert lines(report["cells"][0])[-2:] == [
        "  instead     no safe setup one change away; the nearest take 2:",
        "              init meta -> eager, plugin ddp -> fsdp1: tiny-gpt/torch/2.8.0/fsdp1/eager/none/lora/clip (ok)"]
    alone = {"cells": [row("error", "refused")], "environments": {}}
    advice.annotate(alone)
    assert lines(alone["cells"][0])[-1] == ("  instead     no safe setup of tiny-gpt with lora frozen on torch in this "
                                            "report")


def test_a_box_with_both_harms_counts_each():
    cells = (row("fail", "silent", checkpoint="reentrant"), row("error", "refused", init="meta"), row())
    assert guide.box_text(guide.Box("lora", "fsdp1", cells), [1, 2]) == "🟥 1 silent + 🟧 1 refused of 3 [1] [2]"
    assert guide.box_text(guide.Box("lora", "fsdp1", cells[:1] + cells[2:]), []) == "🟥 silent 1/2"


def test_the_guide_names_the_patterns_a_line_s_workaround_never_holds_for():
    """One line spans `lora` and `bias-only`; the workaround holds for `lora` and fails for `bias-only` (another bug
    there): a reader of the `bias-only` box must not take it for theirs."""
    report = {"cells": [red(), red(freeze="bias-only"), row(plugin="fsdp1-orig-params"),
                        row("fail", "silent", plugin="fsdp1-orig-params", freeze="bias-only")],
              "environments": {"torch": {"frameworks": {"torch": "2.8.0"}}}}
    advice.annotate(report)
    line = next(line for line in guide.render(report).splitlines() if "[`fsdp1-mixed-unit`]" in line)
    assert "proved for 1 of 2; not for `bias-only`:" in line
