"""`guide.md`: the answer a fine-tuner looks up, generated with the report.

First an overview (per framework, silent / refused / safe cells per freeze pattern and release), then per framework
release one table, what you freeze (rows) × the wrapper (columns), each box the worst outcome over every model and
setup the matrix ran of it (the matrix's model, the examples' and user `@freeze_case` models; activation
checkpointing, init, clipping): ✅ only where every one of them is safe. Under it, for each box that is not safe, one
line: how bad, on which models and when, why (the explaining entry), the fixed-in release, and what to do instead,
proved by the run (the entry's workaround and its state on this release, or the nearest safe setup); an unproven box
says what was not checked. `freezecompat advise` answers one setup from the same annotated rows. Pure: an annotated
report in, text out.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ..advice.answer import change_text
from ..core.names import HARMFUL, SAFE, SEVERITIES, SEVERITY_MEANING, cpu_only, fixed_in_words, not_checked
from . import grid
from .markdown import anchor
from .releases import release_order

Row = dict[str, Any]
#: A box's mark: its worst severity. Plain words beside the symbol, so no legend is needed to read one.
MARKS = {"silent": "🟥 silent", "refused": "🟧 refused", "costly": "🟨 costly", "unproven": "❔ unproven",
         "differs": "✅ safe", "harness": "⬛ harness", "ok": "✅ safe", "skipped": "⬜ not run"}
#: A mark's symbol alone, where counts stand beside it.
SYMBOLS = {severity: mark.split()[0] for severity, mark in MARKS.items()}
#: What a box or an overview count shows apart, worst first: every severity that ran and is not safe.
NOT_SAFE = tuple(s for s in SEVERITIES if s not in SAFE and s != "skipped")
#: The axes a box sums over: a bad box says which of their values its bad cells share ("when init=lazy").
SETUP_AXES = ("checkpoint", "init", "clip")


@dataclass(frozen=True)
class Box:
    """One (freeze pattern, plugin) of a framework release: its cells of every model and setup."""

    freeze: str
    plugin: str
    cells: tuple[Row, ...]

    @property
    def counts(self) -> Counter[str]:
        """Cells per severity, skipped ones left out: what the box ran."""
        return Counter(severity for cell in self.cells if (severity := grid.severity(cell)) != "skipped")

    @property
    def worst(self) -> str:
        """The worst severity that ran, any that is not safe before a safe one (a harness failure is no ✅)."""
        ran = self.counts
        return min(ran, key=lambda s: (s in SAFE, SEVERITIES.index(s))) if ran else "skipped"


@dataclass(frozen=True)
class Harm:
    """The bad cells of one release that one entry explains (or none does), the boxes they fall in, and what to do
    instead: one numbered line under the release's table, its number in each of those boxes."""

    severities: dict[str, int]  # silent / refused -> cells, worst first
    cells: int
    boxes: tuple[tuple[str, str], ...]  # (freeze, plugin), in table order
    when: str  # "init=lazy" when every bad cell shares a setup value no other cell of its models in its boxes has
    entry: dict[str, Any]
    workaround: dict[str, Any] | None  # the best of the entry's workarounds on these cells (`_best_workaround`)
    instead: dict[str, Any] | None  # the most common nearest safe setup of these cells
    in_save_load: bool = False  # every bad cell went wrong in the save → load round trip, not in training
    models: tuple[str, ...] = ()  # the models it hits, where its boxes hold others it spares; else ()


@dataclass(frozen=True)
class Unproven:
    """The unproven cells of one release that left the same checks unrun, and their boxes: one numbered line."""

    cells: int
    boxes: tuple[tuple[str, str], ...]
    unchecked: tuple[str, ...]  # `core.names.UNCHECKED` keys
    models: tuple[str, ...] = ()  # as `Harm.models`


@dataclass(frozen=True)
class ReleaseGuide:
    framework: str
    release: str
    freezes: tuple[str, ...]
    plugins: tuple[str, ...]
    boxes: dict[tuple[str, str], Box]
    words: dict[str, dict[str, str]]
    models: dict[str, bool]  # every model that ran on this release -> whether it is a user's `@freeze_case`


def releases(report: dict[str, Any]) -> list[ReleaseGuide]:
    """One guide per framework release (newest first per framework), over every model the report holds: a box of
    the matrix's model alone would show ✅ where an example's PEFT model loses its adapter."""
    order = grid.axis_order(report)
    grouped: dict[tuple[str, str], list[Row]] = defaultdict(list)
    for cell in report["cells"]:
        grouped[(cell["framework"], cell["release"])].append(cell)
    found = []
    for (framework, release), cells in sorted(grouped.items(), key=lambda item: (
            item[0][0], [-1 * part for part in _parts(item[0][1])])):
        by_box: dict[tuple[str, str], list[Row]] = defaultdict(list)
        for cell in cells:
            by_box[(cell["freeze"], cell["plugin"])].append(cell)
        boxes = {key: Box(*key, tuple(box)) for key, box in by_box.items()}
        environment = report["environments"].get(cells[0]["environment"]) or {}  # the one that ran this release
        words = environment.get("words") or {}
        models = {cell["model"]: bool(cell.get("user_model")) for cell in cells}
        found.append(ReleaseGuide(framework, release, grid.distinct(cells, "freeze", order),
                                  grid.distinct(cells, "plugin", order), boxes, words,
                                  dict(sorted(models.items(), key=lambda item: (item[1], item[0])))))
    return found


def _parts(release: str) -> list[int]:
    order = release_order(release)[1]
    return list(getattr(order, "release", ())) or [0]


def _when(bad: list[Row], boxes: list[Box]) -> str:
    """The setup values the bad cells have and no other cell of a bad cell's model in its box has (`init=lazy or
    lazy-materialize`): when the harm happens. Nothing where such a cell shares every value, or where there is none
    (a model the harm spares says nothing of when it strikes another)."""
    hit = {(cell["freeze"], cell["plugin"], cell["model"]) for cell in bad}
    safe = [cell for box in boxes for cell in box.cells if (cell["freeze"], cell["plugin"], cell["model"]) in hit
            and grid.severity(cell) not in HARMFUL and grid.severity(cell) != "skipped"]
    said = []
    for axis in SETUP_AXES:
        values = list(dict.fromkeys(cell[axis] for cell in bad))
        if safe and not set(values) & {cell[axis] for cell in safe}:
            said.append(f"{axis}={' or '.join(values)}")
    return ", ".join(said)


def _best_workaround(cells: list[Row]) -> dict[str, Any] | None:
    """The entry's workaround that holds on most of these cells (ties: the entry's order), with how many."""
    tally: dict[str, dict[str, Any]] = {}
    for cell in cells:
        elsewhere = (cell["freeze"], cell["plugin"]) != (cells[0]["freeze"], cells[0]["plugin"])
        for proof in cell.get("workarounds") or []:
            seen = tally.setdefault(proof["workaround"], {**proof, "held": 0, "judged": 0, "proofs": [],
                                                          "held_in": set(), "unheld_in": set()})
            holds = proof["holds"] is not None and not proof.get("blocked_by") and bool(proof["holds"])
            (seen["held_in"] if holds else seen["unheld_in"]).add(cell["freeze"])
            if proof["holds"] is not None and not proof.get("blocked_by"):
                seen["judged"] += 1
                seen["held"] += holds
                if holds:
                    seen["proofs"].append((elsewhere, proof["proof"]))
    if not tally:
        return None
    best = max(tally.values(), key=lambda item: (item["held"], -list(tally).index(item["workaround"])))
    # The patterns it holds for no cell of: a reader of such a box must not take the line's "instead" for theirs.
    never = [freeze for freeze in dict.fromkeys(cell["freeze"] for cell in cells)
             if freeze in best["unheld_in"] and freeze not in best["held_in"]]
    # the first box's own proofs first (a stable sort): the cell a reader of that box looks for
    return {**best, "not_for": never,
            "proofs": [proof for _, proof in sorted(best["proofs"], key=lambda item: item[0])]}


def _models(hit: list[Row], boxes: list[Box]) -> tuple[str, ...]:
    """The models of the hit cells, where their boxes ran other models too (a line then names whom it hits)."""
    models = tuple(sorted({cell["model"] for cell in hit}))
    ran = {cell["model"] for box in boxes for cell in box.cells if grid.severity(cell) != "skipped"}
    return models if ran - set(models) else ()


def _in_table_order(guide: ReleaseGuide) -> list[Row]:
    return [cell for freeze in guide.freezes for plugin in guide.plugins
            for cell in (guide.boxes[(freeze, plugin)].cells if (freeze, plugin) in guide.boxes else ())]


def harms(guide: ReleaseGuide) -> list[Harm]:
    """A release's bad cells by explaining entry, in the order the table first shows them (its numbers)."""
    grouped: dict[str, list[Row]] = defaultdict(list)
    entries: dict[str, dict[str, Any]] = {}
    for cell in _in_table_order(guide):
        if grid.severity(cell) in HARMFUL:
            known = cell.get("known_issue") or {}
            key = known["id"] if known.get("expected") else ""
            grouped[key].append(cell)
            entries[key] = known if key else {}
    found = []
    for key, bad in grouped.items():
        boxes = tuple(dict.fromkeys((cell["freeze"], cell["plugin"]) for cell in bad))
        instead = Counter(tuple(map(tuple, cell["instead"][0]["changes"])) for cell in bad if cell.get("instead"))
        best = None
        if instead:
            changes = instead.most_common(1)[0][0]
            example = next(cell["instead"][0] for cell in bad
                           if cell.get("instead") and tuple(map(tuple, cell["instead"][0]["changes"])) == changes)
            best = {**example, "cells": instead[changes]}
        severities = {s: n for s in HARMFUL if (n := sum(grid.severity(c) == s for c in bad))}
        in_boxes = [guide.boxes[box] for box in boxes]
        found.append(Harm(severities, len(bad), boxes, _when(bad, in_boxes), entries[key], _best_workaround(bad),
                          best, all(c.get("check") == "resume" for c in bad), _models(bad, in_boxes)))
    return found


def unproven_groups(guide: ReleaseGuide) -> list[Unproven]:
    """A release's unproven cells by what they left unchecked, in the order the table first shows them."""
    grouped: dict[tuple[str, ...], list[Row]] = defaultdict(list)
    for cell in _in_table_order(guide):
        if grid.severity(cell) == "unproven":
            grouped[tuple(cell.get("unchecked") or ())].append(cell)
    found = []
    for keys, cells in grouped.items():
        boxes = tuple(dict.fromkeys((cell["freeze"], cell["plugin"]) for cell in cells))
        found.append(Unproven(len(cells), boxes, keys, _models(cells, [guide.boxes[box] for box in boxes])))
    return found


def reason(entry: dict[str, Any]) -> str:
    """An entry's first sentence: the one-line why."""
    summary = " ".join(entry.get("summary", "").split())
    return summary.split(". ")[0].rstrip(".")


def box_text(box: Box | None, refs: list[int]) -> str:
    """`🟥 silent 4/8 [1] [3]`: the worst severity, how many setups had it, and the numbered lines that say why;
    each severity that is not safe counted apart where a box has several, so none hides another."""
    if box is None:
        return "·"
    counts = box.counts
    ran = sum(counts.values())
    shown = [severity for severity in NOT_SAFE if counts[severity]]
    if len(shown) > 1:
        mark = " + ".join(f"{SYMBOLS[s]} {counts[s]} {s}" for s in shown) + f" of {ran}"
    elif shown:
        mark = MARKS[shown[0]] + ("" if counts[shown[0]] == ran else f" {counts[shown[0]]}/{ran}")
    else:
        mark = MARKS[box.worst]
    return mark + "".join(f" [{n}]" for n in refs)


def tally(counts: Counter[str]) -> str:
    """`🟥 2 · 🟧 0 · ❔ 1 · ✅ 40`: silent and refused always (a 0 answers "which release has none"), any other
    severity that is not safe where there is one, then the safe ones together; `⬜ not run` where none ran."""
    if not counts:
        return MARKS["skipped"]
    shown = [s for s in NOT_SAFE if s in HARMFUL or counts[s]]
    safe = sum(counts[s] for s in SAFE)
    return " · ".join([*(f"{SYMBOLS[s]} {counts[s]}" for s in shown), f"{SYMBOLS['ok']} {safe}"])


def _boxes_text(boxes: tuple[tuple[str, str], ...], guide: ReleaseGuide) -> str:
    """`embedding`, `lora` × `zero1`, `zero2`; `all` × every wrapper: the rows that share their columns together
    (every row, every wrapper of the release said so), so every box is named (a reader finds theirs) and a harm over
    many rows stays one short line."""
    columns: dict[str, list[str]] = defaultdict(list)
    for freeze, plugin in boxes:
        columns[freeze].append(plugin)
    rows: dict[tuple[str, ...], list[str]] = defaultdict(list)
    for freeze, plugins in columns.items():
        rows[tuple(plugins)].append(freeze)
    return "; ".join(" × ".join((_named(freezes, guide.freezes, "every row"),
                                 _named(plugins, guide.plugins, "every wrapper"))) for plugins, freezes in rows.items())


def _named(values: Iterable[str], every: tuple[str, ...], word: str) -> str:
    """The values, or `word` where they are all of `every` (and it holds several)."""
    values = list(values)
    return word if len(every) > 1 and set(values) == set(every) else ", ".join(f"`{v}`" for v in values)


def _on(models: tuple[str, ...]) -> str:
    """` with models `a`, `b``: whom a line's cells are of, where their boxes hold other models it spares."""
    return f" with model{'s' if len(models) > 1 else ''} {', '.join(f'`{m}`' for m in models)}" if models else ""


def unproven_line(item: Unproven, guide: ReleaseGuide) -> str:
    """One line of which boxes of a release are unproven and what their cells did not check, for `guide.md`."""
    words = "; ".join(not_checked(item.unchecked)) or "a check that decides the verdict"
    return (f"**{item.cells} unproven**{_on(item.models)}, in {_boxes_text(item.boxes, guide)}: nothing failed, "
            f"but not checked: {words}")


def harm_line(harm: Harm, guide: ReleaseGuide) -> str:
    """One line of what goes wrong on a release, where and when, why, and what to do instead (proved), for
    `guide.md`."""
    entry = harm.entry
    where = f" when {harm.when}" if harm.when else ""
    how = " + ".join(f"{n} {severity}" for severity, n in harm.severities.items())
    text = (f"**{how}**{' on save → load' if harm.in_save_load else ''}{_on(harm.models)}{where}, in "
            f"{_boxes_text(harm.boxes, guide)}: ")
    if entry:
        text += f"{reason(entry)} [`{entry['id']}`]"
        fixed = fixed_in_words(entry)
        text += f"; **fixed in {fixed}**" if fixed else "; no fixed release"
        scope = cpu_only(entry)
        text += f". **{scope}**" if scope else ""
    else:
        text += "no known issue or finding explains it"
    workaround = harm.workaround
    if workaround and workaround["held"]:
        share = "" if workaround["held"] == harm.cells else f" for {workaround['held']} of {harm.cells}"
        if workaround["not_for"]:
            share += f"; not for {', '.join(f'`{freeze}`' for freeze in workaround['not_for'])}"
        text += (f". **Instead**: {workaround['says']} (`{workaround['workaround']}`, proved{share}: "
                 f"`{workaround['proofs'][0]}`)")
    elif harm.instead:
        steps = len(harm.instead["changes"])
        text += (". **No safe setup one change away**; the nearest" if steps > 1 else ". **Instead**:")
        text += (f" {change_text(harm.instead['changes'])} (proved: `{harm.instead['cell']}`"
                 + ("" if harm.instead["cells"] == harm.cells else f", for {harm.instead['cells']} of {harm.cells}")
                 + ")")
    elif entry.get("no_workaround"):
        text += f". **No workaround known**: {entry['no_workaround']}"
    else:
        text += ". **No safe setup** of this pattern in this report"
    if workaround and not workaround["held"] and workaround["judged"]:
        text += f" (its workaround `{workaround['workaround']}` does not hold here)"
    return text


def overview(guides: list[ReleaseGuide]) -> list[str]:
    """Per framework, one row per freeze pattern and one column per release (newest first): its cells over every
    model, wrapper and setup, silent / refused / safe (`tally`): which release has no silent failure of a pattern."""
    out = ["## Overview: silent, refused and safe cells per pattern and release", "",
           "Every cell of a pattern on a release: every model, wrapper and setup the matrix ran. "
           f"{SYMBOLS['silent']} silent · {SYMBOLS['refused']} refused · {SYMBOLS['ok']} safe (other marks where "
           "there are any; `·`: the release has no such pattern). The release's own table below says where and why.",
           ""]
    frameworks: dict[str, list[ReleaseGuide]] = defaultdict(list)
    for guide in guides:
        frameworks[guide.framework].append(guide)
    for framework, found in frameworks.items():
        counts = {guide.release: defaultdict(Counter) for guide in found}
        for guide in found:
            for (freeze, _), box in guide.boxes.items():
                counts[guide.release][freeze].update(box.counts)
        freezes = dict.fromkeys(freeze for guide in found for freeze in guide.freezes)
        out += [f"### {framework}", "",
                "| you freeze ↓ · release → | " + " | ".join(
                    f"[{g.release}](#{anchor(g.framework + ' ' + g.release)})" for g in found) + " |",
                "|---" * (len(found) + 1) + "|"]
        out += [f"| `{freeze}` | " + " | ".join(tally(counts[g.release][freeze]) if freeze in g.freezes else "·"
                                               for g in found) + " |" for freeze in freezes]
        out.append("")
    return out


def render(report: dict[str, Any]) -> str:
    guides = releases(report)
    total = sum(len(box.cells) for guide in guides for box in guide.boxes.values())
    legend = ("silent", "refused", "costly", "unproven", "ok", "harness")
    out = ["# What to do instead: the freeze guide", "",
           f"Generated with the report from its own runs ({total} cells of every model it holds: the matrix's own "
           "and the examples' or users' `@freeze_case` models, such as the PEFT ones). Find your framework release, "
           "your row (what you freeze) and your column (how you wrap the model): each box is the worst outcome over "
           "every model and setup the matrix ran of it (activation checkpointing, init, clipping), ✅ only where "
           "every one is safe; `n/m` says how many were bad (no count: all of them; each kind counted apart where "
           "a box has several), `[k]` which line below says why. Each line: how bad, on which models and when, "
           "where, why (the registry entry or finding), the fixed-in release, and what to do instead: a workaround "
           "or setup the matrix ran and found safe, its cell named. `freezecompat advise --framework F --plugin P "
           "--freeze X [--model M]` answers one setup in a terminal (leave out --plugin or --freeze to list the "
           "values held).", "",
           "**Marks** — " + " · ".join(f"{MARKS[s]}: {SEVERITY_MEANING[s]}" for s in legend) + " (✅ also for "
           "`differs`: right weights under another correct way of writing the loop) · ⬜ not run: the matrix skips "
           "it, saying why.", ""]
    out += overview(guides)
    for guide in guides:
        out += _release(guide)
    return "\n".join(out) + "\n"


def _release(guide: ReleaseGuide) -> list[str]:
    words = guide.words
    found = harms(guide)
    unproven = unproven_groups(guide)
    refs: dict[tuple[str, str], list[int]] = defaultdict(list)
    for number, item in enumerate([*found, *unproven], 1):
        for box in item.boxes:
            refs[box].append(number)
    out = [f"## {guide.framework} {guide.release}", ""]
    out.append("| you freeze ↓ · wrapper → | " + " | ".join(f"`{p}`" for p in guide.plugins) + " |")
    out.append("|---" * (len(guide.plugins) + 1) + "|")
    for freeze in guide.freezes:
        cells = [box_text(guide.boxes.get((freeze, plugin)), refs[(freeze, plugin)]) for plugin in guide.plugins]
        out.append(f"| `{freeze}` | " + " | ".join(cells) + " |")
    out.append("")
    if len(guide.models) > 1:
        out += ["Models each box counts: " + ", ".join(f"`{model}`" + (" (`@freeze_case`)" if user else "")
                                                      for model, user in guide.models.items()) + ".", ""]
    plugin_words = [f"`{p}` {words['plugin'][p]}" for p in guide.plugins if p in words.get("plugin", {})]
    if plugin_words:
        out += ["Wrappers: " + " · ".join(plugin_words) + ".", ""]
    setups = [f"{name} `{v}` {words[axis][v]}" for axis, name in (("init", "init"), ("checkpoint", "activation "
              "checkpointing")) for v in dict.fromkeys(c[axis] for box in guide.boxes.values() for c in box.cells)
              if v in words.get(axis, {})]
    if setups:
        out += ["Setups a box sums over: " + " · ".join(setups) + "; clipping `clip` or `no-clip`.", ""]
    rows = [_row_words(guide, freeze) for freeze in guide.freezes]
    if any(rows):
        out += ["<details><summary>What each row freezes</summary>", "", *(f"- {w}" for w in rows if w), "",
                "</details>", ""]
    if not found and not unproven:
        safe = all(box.worst in SAFE for box in guide.boxes.values() if box.counts)
        return [*out, "Every box is safe on this release." if safe else "No cell is silent or refused on this "
                "release.", ""]
    out += ["**Why, and what to do instead** (the numbers in the boxes):", ""]
    out += [f"{number}. {harm_line(harm, guide)}" for number, harm in enumerate(found, 1)]
    out += [f"{number}. {unproven_line(item, guide)}" for number, item in enumerate(unproven, len(found) + 1)]
    return [*out, ""]


def _row_words(guide: ReleaseGuide, freeze: str) -> str:
    """`` `lora` (tiny-gpt, tiny-llama-lora): what it freezes``: the models that ran the row where several ran on the
    release, and the matrix's words for it where it has some; "" where there is nothing to say."""
    said = guide.words.get("freeze", {}).get(freeze, "")
    models = sorted({cell["model"] for (pattern, _), box in guide.boxes.items() if pattern == freeze
                     for cell in box.cells})
    if len(guide.models) > 1:
        return f"`{freeze}` ({', '.join(models)})" + (f": {said}" if said else "")
    return f"`{freeze}` {said}" if said else ""
