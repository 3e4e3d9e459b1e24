"""The nearest safe setup: which cells are offered instead of a red one, in which order, and how many red cells
have one a single change away."""

import pytest

from pytest_freezecompat.advice.nearest import Alternative, NotInReport, coverage, nearest_safe, select

SETUP = {"model": "tiny-gpt", "framework": "colossalai", "release": "0.4.7", "plugin": "gemini", "init": "eager",
         "checkpoint": "none", "freeze": "lora", "clip": "clip"}


def row(status="pass", severity=None, **axes):
    values = {**SETUP, **axes}
    values["id"] = "/".join(values[axis] for axis in ("model", "framework", "release", "plugin", "init", "checkpoint",
                                                      "freeze", "clip"))
    extra = {"severity": severity} if severity else {}
    return {**values, "status": status, "message": "", **extra}


RED = row("error", "refused")


def ids(found):
    return [alternative.cell for alternative in found]


def test_one_axis_before_two():
    two = row(plugin="gemini-auto", checkpoint="reentrant")
    one = row(release="0.3.4")
    assert nearest_safe(RED, [two, one]) == [
        Alternative(one["id"], (("release", "0.4.7", "0.3.4"),), "ok"),
        Alternative(two["id"], (("checkpoint", "none", "reentrant"), ("plugin", "gemini", "gemini-auto")), "ok")]


def test_checkpoint_before_clip_init_plugin_release():
    cells = [row(release="0.5.0"), row(plugin="gemini-auto"), row(init="lazy"), row(clip="no-clip"),
             row(checkpoint="reentrant")]
    assert [a.changes[0][0] for a in nearest_safe(RED, cells, limit=5)] == ["checkpoint", "clip", "init", "plugin",
                                                                           "release"]


def test_newer_release_first():
    assert ids(nearest_safe(RED, [row(release="0.3.4"), row(release="0.10.0"), row(release="0.5.0")])) == [
        row(release="0.10.0")["id"], row(release="0.5.0")["id"]]


def test_only_the_same_model_pattern_and_framework_and_a_user_model_apart():
    other = [row(framework="torch", release="2.9.0"), row(model="tiny-llama", plugin="gemini-auto"),
             row(freeze="decoder", plugin="gemini-auto"), {**row(plugin="gemini-auto"), "user_model": True}]
    assert nearest_safe(RED, other) == []


def test_only_safe_cells_are_offered():
    cells = [row("fail", "silent", plugin="a"), row("error", "refused", plugin="b"), row("fail", "costly", plugin="c"),
             row("skip", "skipped", plugin="d"), row(severity="differs", plugin="e"), RED]
    assert nearest_safe(RED, cells) == [Alternative(row(plugin="e")["id"], (("plugin", "gemini", "e"),), "differs")]


def test_severity_is_computed_where_a_row_lacks_it():
    silent = {**row("fail", plugin="a"), "failures": [{"check": "grads", "params": ["w"]}]}
    assert ids(nearest_safe(RED, [silent, row(plugin="b")])) == [row(plugin="b")["id"]]


def test_coverage_counts_red_cells_with_a_safe_cell_one_axis_away():
    cells = [RED, row(checkpoint="reentrant"),                                     # red, one axis away: covered
             row("fail", "silent", freeze="decoder"), row(freeze="decoder", plugin="x", init="lazy"),  # two away
             row("error", "refused", freeze="output"),                            # nothing safe at all
             row("fail", "costly", freeze="bias-only"),                           # not red
             {**row("error", "refused", freeze="all"), "user_model": True},       # a user's: counted, nothing safe
             {**row("error", "refused", freeze="lora"), "user_model": True},      # its only alternative is
             {**row(freeze="lora", plugin="ddp"), "user_model": True}]            # ... a user cell: covered
    assert coverage(cells) == (2, 5)


def test_select_defaults_to_the_newest_release_and_every_model_a_user_model_too():
    user = {**row(model="tiny-llama", release="0.10.0"), "user_model": True}
    cells = [row(release="0.4.7"), row(release="0.10.0"), user, {**row(model="tiny-llama"), "user_model": True}]
    setup = {"framework": "colossalai", "plugin": "gemini", "freeze": "lora", "checkpoint": "none", "init": "eager",
             "clip": "clip"}
    assert select(cells, setup) == [row(release="0.10.0"), user]
    assert select(cells, {**setup, "model": "tiny-llama", "release": "0.4.7"}) == [cells[-1]]


def test_select_names_the_nearest_values_held():
    cells = [row(plugin="torch-ddp"), row(plugin="gemini-auto"), row(plugin="gemini")]
    with pytest.raises(NotInReport, match=r"^no plugin 'gemni' for colossalai 0.4.7 model=tiny-gpt; it has: gemini, "
                                          r"gemini-auto, torch-ddp$"):
        select(cells, {**SETUP, "plugin": "gemni"})
    with pytest.raises(NotInReport, match=r"several plugins \(a, b\): name one with --plugin"):
        select([row(plugin="a"), row(plugin="b")], {**SETUP, "plugin": None})


def test_a_runs_end_shows_each_way_of_going_wrong_once_and_names_the_rest():
    """Silent first; cells refused by one entry: the first in full, the others by what tells them apart."""
    from pytest_freezecompat.advice.answer import not_safe

    known = {"id": "fsdp1-uniform", "expected": True, "links": ["https://github.com/o/r/issues/1"]}
    refused = [{**row("error", "refused", plugin="fsdp1", init=init, freeze=freeze), "known_issue": known}
               for init in ("eager", "meta") for freeze in ("lora", "head-only")]
    silent = row("fail", "silent", plugin="ddp", checkpoint="reentrant")
    text = not_safe([*refused, silent, row(plugin="ddp")])
    headers = [line for line in text if not line.startswith(" ")]
    assert headers == [f"{silent['id']}: SILENT (fail): " + headers[0].split(": ", 2)[2], headers[1]]
    shown = headers[1].split(": REFUSED (error)")[0]
    assert shown in {cell["id"] for cell in refused}
    named = [line.strip() for line in text if line.startswith("  same in")]
    rest = {f"init={cell['init']} freeze={cell['freeze']}" for cell in refused if cell["id"] != shown}
    assert len(named) == 1 and set(named[0].removeprefix("same in").strip().split(", ")) == rest
