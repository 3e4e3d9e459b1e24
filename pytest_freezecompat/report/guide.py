"""`guide.md`: the answer a fine-tuner looks up, generated with the report.

Per framework release one table, what you freeze (rows) × the wrapper (columns), each box the worst outcome over
the setups the matrix ran of it (activation checkpointing, init, clipping); under it, for each unsafe box, one line:
how bad and when, why (the explaining entry), the fixed-in release, and what to do instead, proved by the run (the
entry's workaround and its state on this release, or the nearest safe setup). The HTML draws the same boxes (`boxes`)
and `freezecompat advise` answers one setup from the same annotated rows. Pure: an annotated report in, text out.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any

from ..advice.answer import change_text
from ..core.names import HARMFUL, SEVERITIES, SEVERITY_MEANING
from . import grid
from .markdown import anchor
from .releases import release_order

Row = dict[str, Any]
#: A box's mark: its worst severity. Plain words beside the symbol, so no legend is needed to read one.
MARKS = {"silent": "🟥 silent", "refused": "🟧 refused", "costly": "🟨 costly", "differs": "✅ safe",
         "harness": "⬛ harness", "ok": "✅ safe", "skipped": "⬜ not run"}
#: The axes a box sums over: a bad box says which of their values its bad cells share ("when init=lazy").
SETUP_AXES = ("checkpoint", "init", "clip")
#: A summary's first sentence, cut to a line.
REASON_CHARS = 220


@dataclass(frozen=True)
class Box:
    """One (freeze pattern, plugin) of a framework release: its cells that ran and their worst severity."""

    freeze: str
    plugin: str
    cells: tuple[Row, ...]
    worst: str
    bad: int  # silent or refused cells


@dataclass(frozen=True)
class Harm:
    """The bad cells of one release that one entry explains (or none does), the boxes they fall in, and what to do
    instead: one numbered line under the release's table, its number in each of those boxes."""

    severities: dict[str, int]  # silent / refused -> cells, worst first
    cells: int
    boxes: tuple[tuple[str, str], ...]  # (freeze, plugin), in table order
    when: str  # "init=lazy" when every bad cell shares a setup value no safe cell of its boxes has; else ""
    entry: dict[str, Any]
    workaround: dict[str, Any] | None  # the best of the entry's workarounds on these cells (`_best_workaround`)
    instead: dict[str, Any] | None  # the most common nearest safe setup of these cells
    in_save_load: bool = False  # every bad cell went wrong in the save → load round trip, not in training


@dataclass(frozen=True)
class ReleaseGuide:
    framework: str
    release: str
    freezes: tuple[str, ...]
    plugins: tuple[str, ...]
    boxes: dict[tuple[str, str], Box]
    words: dict[str, dict[str, str]]


def _worst(cells: list[Row]) -> str:
    ran = [grid.severity(cell) for cell in cells if grid.severity(cell) != "skipped"]
    return min(ran, key=SEVERITIES.index) if ran else "skipped"


def releases(report: dict[str, Any]) -> list[ReleaseGuide]:
    """One guide per framework release (newest first per framework), over the matrix's own model (user models, the
    examples, are in the HTML and matrix.md)."""
    order = grid.axis_order(report)
    grouped: dict[tuple[str, str], list[Row]] = defaultdict(list)
    for cell in report["cells"]:
        if not cell.get("user_model"):
            grouped[(cell["framework"], cell["release"])].append(cell)
    found = []
    for (framework, release), cells in sorted(grouped.items(), key=lambda item: (
            item[0][0], [-1 * part for part in _parts(item[0][1])])):
        by_box: dict[tuple[str, str], list[Row]] = defaultdict(list)
        for cell in cells:
            by_box[(cell["freeze"], cell["plugin"])].append(cell)
        boxes = {key: Box(*key, tuple(box), _worst(box), sum(grid.severity(c) in HARMFUL for c in box))
                 for key, box in by_box.items()}
        environment = report["environments"].get(cells[0]["environment"]) or {}  # the one that ran this release
        words = environment.get("words") or {}
        found.append(ReleaseGuide(framework, release, grid.distinct(cells, "freeze", order),
                                  grid.distinct(cells, "plugin", order), boxes, words))
    return found


def _parts(release: str) -> list[int]:
    order = release_order(release)[1]
    return list(getattr(order, "release", ())) or [0]


def _when(bad: list[Row], boxes: list[Box]) -> str:
    """The setup values the bad cells have and no safe cell of their boxes has (`init=lazy or lazy-materialize`):
    when the harm happens. Nothing where a safe cell shares every value, or where no cell of the boxes is safe."""
    safe = [cell for box in boxes for cell in box.cells
            if grid.severity(cell) not in HARMFUL and grid.severity(cell) != "skipped"]
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
            seen = tally.setdefault(proof["workaround"], {**proof, "held": 0, "judged": 0, "proofs": []})
            if proof["holds"] is not None and not proof.get("blocked_by"):
                seen["judged"] += 1
                seen["held"] += bool(proof["holds"])
                if proof["holds"]:
                    seen["proofs"].append((elsewhere, proof["proof"]))
    if not tally:
        return None
    best = max(tally.values(), key=lambda item: (item["held"], -list(tally).index(item["workaround"])))
    # the first box's own proofs first (a stable sort): the cell a reader of that box looks for
    return {**best, "proofs": [proof for _, proof in sorted(best["proofs"], key=lambda item: item[0])]}


def harms(guide: ReleaseGuide) -> list[Harm]:
    """A release's bad cells by explaining entry, in the order the table first shows them (its numbers)."""
    grouped: dict[str, list[Row]] = defaultdict(list)
    entries: dict[str, dict[str, Any]] = {}
    for freeze in guide.freezes:
        for plugin in guide.plugins:
            for cell in guide.boxes[(freeze, plugin)].cells if (freeze, plugin) in guide.boxes else ():
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
        found.append(Harm(severities, len(bad), boxes, _when(bad, [guide.boxes[box] for box in boxes]),
                          entries[key], _best_workaround(bad), best, all(c.get("check") == "resume" for c in bad)))
    return found


def reason(entry: dict[str, Any]) -> str:
    """An entry's first sentence: the one-line why."""
    summary = " ".join(entry.get("summary", "").split())
    first = summary.split(". ")[0].rstrip(".")
    return first if len(first) <= REASON_CHARS else first[:REASON_CHARS - 4] + " ..."


def box_text(box: Box | None, refs: list[int]) -> str:
    """`🟥 silent 4/8 ¹ ³`: the worst severity, how many setups were bad, and the numbered lines that say why."""
    if box is None:
        return "·"
    ran = sum(grid.severity(cell) != "skipped" for cell in box.cells)
    counts = Counter(grid.severity(cell) for cell in box.cells)
    if counts["silent"] and counts["refused"]:  # both kinds of harm: each counted, so neither hides the other
        mark = f"🟥 {counts['silent']} silent + 🟧 {counts['refused']} refused of {ran}"
    else:
        mark = MARKS[box.worst] if box.bad in (0, ran) else f"{MARKS[box.worst]} {box.bad}/{ran}"
    return mark + "".join(f" [{n}]" for n in refs)


def _boxes_text(boxes: tuple[tuple[str, str], ...]) -> str:
    """`embedding`, `lora` × `zero1`, `zero2` where the boxes are every pairing; else per row, its columns: every
    box named, so a reader finds theirs."""
    freezes = list(dict.fromkeys(f for f, _ in boxes))
    plugins = list(dict.fromkeys(p for _, p in boxes))
    if len(freezes) * len(plugins) == len(boxes):
        return f"{', '.join(f'`{f}`' for f in freezes)} × {', '.join(f'`{p}`' for p in plugins)}"
    return "; ".join(f"`{f}` × " + ", ".join(f"`{p}`" for g, p in boxes if g == f) for f in freezes)


def harm_line(harm: Harm, framework: str) -> str:
    """One line of what goes wrong, where and when, why, and what to do instead (proved), for `guide.md`."""
    entry = harm.entry
    where = f" when {harm.when}" if harm.when else ""
    how = " + ".join(f"{n} {severity}" for severity, n in harm.severities.items())
    text = f"**{how}**{' on save → load' if harm.in_save_load else ''}{where}, in {_boxes_text(harm.boxes)}: "
    if entry:
        text += f"{reason(entry)} [`{entry['id']}`]"
        fixed = (entry.get("fixed_in") or {}).get(framework)
        text += f"; **fixed in {fixed}**" if fixed else "; no fixed release"
    else:
        text += "no known issue or finding explains it"
    workaround = harm.workaround
    if workaround and workaround["held"]:
        share = "" if workaround["held"] == harm.cells else f" for {workaround['held']} of {harm.cells}"
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


def render(report: dict[str, Any]) -> str:
    guides = releases(report)
    total = sum(len(box.cells) for guide in guides for box in guide.boxes.values())
    out = ["# What to do instead: the freeze guide", "",
           f"Generated with the report from its own runs ({total} cells of the matrix's models; the examples' "
           "Hugging Face models are in `matrix.html`). Find your framework release, your row (what you freeze) and "
           "your column (how you wrap the model): each box is the worst outcome over the setups the matrix ran "
           "(activation checkpointing, init, clipping); `n/m` says how many of them were bad (no count: all of them; "
           "silent and refused counted apart where a box has both), `[k]` which line below "
           "says why. Each line: how bad and when, where, why (the registry entry or finding), the fixed-in "
           "release, and what to do instead: a workaround or setup the matrix ran and found safe, its cell named. "
           "`freezecompat advise --framework F --plugin P --freeze X` answers one setup in a terminal.", "",
           "**Marks** — " + " · ".join(f"{MARKS[s]}: {SEVERITY_MEANING[s]}"
                                       for s in ("silent", "refused", "costly", "ok")) + " (or `differs`: right "
           "weights under another correct way of writing the loop) · ⬜ not run: the matrix skips it, saying why.",
           "",
           "Releases: " + " · ".join(f"[{g.framework} {g.release}](#{anchor(g.framework + ' ' + g.release)})"
                                     for g in guides), ""]
    for guide in guides:
        out += _release(guide)
    return "\n".join(out) + "\n"


def _release(guide: ReleaseGuide) -> list[str]:
    words = guide.words
    found = harms(guide)
    refs: dict[tuple[str, str], list[int]] = defaultdict(list)
    for number, harm in enumerate(found, 1):
        for box in harm.boxes:
            refs[box].append(number)
    out = [f"## {guide.framework} {guide.release}", ""]
    out.append("| you freeze ↓ · wrapper → | " + " | ".join(f"`{p}`" for p in guide.plugins) + " |")
    out.append("|---" * (len(guide.plugins) + 1) + "|")
    for freeze in guide.freezes:
        cells = [box_text(guide.boxes.get((freeze, plugin)), refs[(freeze, plugin)]) for plugin in guide.plugins]
        out.append(f"| `{freeze}` | " + " | ".join(cells) + " |")
    out.append("")
    plugin_words = [f"`{p}` {words['plugin'][p]}" for p in guide.plugins if p in words.get("plugin", {})]
    if plugin_words:
        out += ["Wrappers: " + " · ".join(plugin_words) + ".", ""]
    setups = [f"{name} `{v}` {words[axis][v]}" for axis, name in (("init", "init"), ("checkpoint", "activation "
              "checkpointing")) for v in dict.fromkeys(c[axis] for box in guide.boxes.values() for c in box.cells)
              if v in words.get(axis, {})]
    if setups:
        out += ["Setups a box sums over: " + " · ".join(setups) + "; clipping `clip` or `no-clip`.", ""]
    freeze_words = [f"`{f}` {words['freeze'][f]}" for f in guide.freezes if f in words.get("freeze", {})]
    if freeze_words:
        out += ["<details><summary>What each row freezes</summary>", "", *(f"- {w}" for w in freeze_words), "",
                "</details>", ""]
    if not found:
        return [*out, "Every box is safe on this release.", ""]
    out += ["**Why, and what to do instead** (the numbers in the boxes):", ""]
    out += [f"{number}. {harm_line(harm, guide.framework)}" for number, harm in enumerate(found, 1)]
    return [*out, ""]
