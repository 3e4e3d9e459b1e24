"""`matrix.md`: the report as a reader on GitHub takes it in, top down.

First a summary per framework (counts, what works, what breaks, which upstream issues explain the rest, and
the versions and run behind it), then narrow grids: one per model, init and checkpoint mode, one mark per
table cell, the first checkpoint mode open and the others folded. Then notes for the cells a reader must look
into (red with no known issue, `fixed?`, skipped) and the known issues. Cells are placed by `grid`, the model
`matrix.html` draws too, so the two cannot disagree on where a cell is.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from collections.abc import Iterable
from html import escape
from typing import Any

from ..core.names import (
    LATER_AXES,
    SEVERITIES,
    SEVERITY_MEANING,
    clip,
    cpu_only,
    fixed_in_words,
    kind_words,
    not_checked,
)
from ..core.records import FAILING, STATUSES, display_status, with_later_axes
from . import grid, releases

Cell = grid.Cell
SYMBOLS = {"pass": "✅", "fail": "❌", "error": "💥", "timeout": "⏱️", "crash": "☠️", "skip": "⏭️"}
EMULATION_MARK = "ᴱ"
#: Where the raw status's symbol would say more than the run proved, or draw a cost like harm: a pass with a
#: deciding check not run (`unproven`), a fail that reaches no weight (`costly`).
SEVERITY_SYMBOLS = {"unproven": "❔", "costly": "💲"}
#: Beside the raw status symbol, which stays visible: a known upstream issue explains it / a known issue expected
#: it to break but it passed.
REGISTRY_MARKS = {"known": "ᴷ", "fixed?": "ᶠ"}
#: Why a red cell is red, compared with its column's nothing-frozen control.
CAUSE_MARKS = {"freeze": "❄", "stack": "ˢ", "both": "ᵇ", "harness": "ʰ"}
#: After a cell's mark: its save → load round trip failed (the `resume` check).
RESUME_MARK = "↺"
_CAUSE_SHORT = {"freeze": "freezing", "stack": "the stack (red with nothing frozen too)", "both": "both",
                "harness": "our harness or a user's freeze_case raised (says nothing about the stack)"}
ABSENT = "·"
#: A note's message is cut at a sentence or field boundary before this many characters.
MESSAGE_CHARS = 300
#: Widest table line: GitHub scrolls wider tables sideways. Plugin names that do not fit become letters.
TABLE_WIDTH = 120
_NUMBER = re.compile(r"\d+(?:\.\d+)?(?:e[-+]?\d+)?")
#: A cell's part in the summaries; `red` is a red cell no known issue explains.
_KINDS = ("pass", "fixed?", "known", "red", "skip")


def _kind(cell: Cell) -> str:
    shown = display_status(cell)
    return "red" if shown in FAILING else shown


def _inline(text: str) -> str:
    """Text that stays text in a GitHub list item or table: no raw HTML, no column breaks, one line."""
    return " ".join(text.split()).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace("|", "\\|")


def _names(values: Iterable[str]) -> str:
    return ", ".join(f"`{_inline(v)}`" for v in values)


def anchor(heading: str) -> str:
    """The id GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def _mark(cell: Cell | None) -> str:
    """One mark per table cell: the raw status, why it is red, and the registry's word on it."""
    if cell is None:
        return ABSENT
    symbol = SEVERITY_SYMBOLS.get(grid.severity(cell), SYMBOLS[cell["status"]])
    return (symbol + CAUSE_MARKS.get(cell.get("cause") or "", "")
            + REGISTRY_MARKS.get(display_status(cell), "") + (RESUME_MARK if grid.round_trip(cell) == "failed" else ""))


def _tally(cells: list[Cell]) -> str:
    """`40 ✅ · 2 ❔ · 3 ❌ · 8 ᴷ · 6 ⏭️`: proven passes, unproven ones, unexplained red by status, known, skipped."""
    counts = Counter(_kind(c) for c in cells)
    unproven = sum(_kind(c) == "pass" and grid.severity(c) == "unproven" for c in cells)
    red = Counter(c["status"] for c in cells if _kind(c) == "red")
    parts = [(counts["pass"] - unproven, SYMBOLS["pass"]), (unproven, SEVERITY_SYMBOLS["unproven"]),
             (counts["fixed?"], SYMBOLS["pass"] + REGISTRY_MARKS["fixed?"]),
             *((red[s], SYMBOLS[s]) for s in FAILING), (counts["known"], REGISTRY_MARKS["known"]),
             (counts["skip"], SYMBOLS["skip"])]
    return " · ".join(f"{n} {symbol}" for n, symbol in parts if n)


def _cells(section: grid.Section) -> list[Cell]:
    return [cell for block in section.blocks for row in block.rows for column in row.columns
            for cell in column.slots if cell is not None]


def _legend() -> str:
    statuses = " · ".join(f"{symbol} {status}" for status, symbol in SYMBOLS.items())
    causes = " · ".join(f"{CAUSE_MARKS[c]} {_CAUSE_SHORT[c]}" for c in grid.CAUSES)
    unproven, costly = SEVERITY_SYMBOLS["unproven"], SEVERITY_SYMBOLS["costly"]
    return (f"**Legend** — {statuses} · {ABSENT} not in the matrix. {unproven} in place of {SYMBOLS['pass']}: "
            "nothing failed, but a check that decides the verdict did not run (unproven, not safe); "
            f"{costly} in place of {SYMBOLS['fail']}: a fail that reaches no weight (costly). Red is silent or "
            f"refused: every other {SYMBOLS['fail']}, {SYMBOLS['error']}, {SYMBOLS['timeout']} and "
            f"{SYMBOLS['crash']}. After a red mark, why, against its column's nothing-frozen control: {causes}. "
            f"{REGISTRY_MARKS['known']} a known upstream issue explains it (an xfail) · {REGISTRY_MARKS['fixed?']} "
            "passed though a known issue expects it to fail (the entry may be stale). "
            f"{RESUME_MARK} its save → load round trip failed (check `resume`: saved after step 0, loaded into a "
            f"fresh model, it did not go on as the uninterrupted run). {EMULATION_MARK} on a plugin: it ran on CPU "
            "behind a CUDA-on-CPU shim (emulation).")


def _counts(sections: list[grid.Section]) -> list[str]:
    """Raw statuses per framework, then the registry's verdicts on some of them and the causes of red cells."""
    causes = [CAUSE_MARKS[c] for c in grid.CAUSES]
    trips = [f"resume {r}" for r in grid.ROUND_TRIPS]
    trip_headers = [RESUME_MARK, f"{RESUME_MARK}✓"]  # failed, held: short, so the table stays narrow
    lines = ["| framework | " + " | ".join([*grid.DISPLAY_STATUSES, *causes, *trip_headers]) + " | cells |",
             "|---" * (len(grid.DISPLAY_STATUSES) + len(causes) + len(trips) + 2) + "|"]
    for section in sections:
        lines.append(f"| {_inline(section.framework)} | " + " | ".join(
            [*(str(section.counts[s]) for s in grid.DISPLAY_STATUSES), *(str(section.causes[c]) for c in grid.CAUSES),
             *(str(section.counts[t]) for t in trips)]) + f" | {section.cells} |")
    return [*lines, "", "Raw statuses; `known` / `fixed?`: how many of them the known-issue registry explains / flags; "
                        + ", ".join(f"{CAUSE_MARKS[c]} {c}" for c in grid.CAUSES) + ": red cells by cause, known ones "
                        f"included; {RESUME_MARK} / {RESUME_MARK}✓: cells whose save → load round trip failed / "
                        "held (a refusal or a run that raised has none)."]


def _harm(sections: list[grid.Section]) -> list[str]:
    """The first table: per framework release, how bad its cells are for the user, silent harm first."""
    lines = ["| framework release | " + " | ".join(SEVERITIES) + " | unexplained | cells |",
             "|---" * (len(SEVERITIES) + 3) + "|"]
    for section in sections:
        lines.append(f"| {_inline(section.framework)} | "
                     + " | ".join(str(section.severities[v]) for v in SEVERITIES)
                     + f" | {section.untied} | {section.cells} |")
    total = sum((s.severities for s in sections), Counter())
    lines.append("| **all** | " + " | ".join(f"**{total[v]}**" for v in SEVERITIES)
                 + f" | **{sum(s.untied for s in sections)}** | **{sum(s.cells for s in sections)}** |")
    words = "; ".join(f"**{v}**: {SEVERITY_MEANING[v]}" for v in SEVERITIES)
    return [*lines, "", f"{words}. Red is `silent` or `refused` only; safe is `ok` or `differs` only. "
                        "*Unexplained*: red cells that no registry entry or finding explains (a `silent` cell an entry "
                        "explains is still `silent`)."]


def _unproven(sections: list[grid.Section]) -> list[str]:
    """Per framework release, what the `unproven` cells did not check, with one cell each to look at."""
    lines = []
    for section in sections:
        unproven = [c for c in _cells(section) if grid.severity(c) == "unproven"]
        for what in dict.fromkeys(w for c in unproven for w in c.get("unchecked") or ()):
            alike = [c for c in unproven if what in (c.get("unchecked") or ())]
            lines.append(f"| {_inline(section.framework)} | {_inline(not_checked((what,))[0])} | {len(alike)} | "
                         f"`{_inline(alike[0]['id'])}` |")
    if not lines:
        return ["Every cell that passed ran every check that decides its verdict."]
    return ["A cell is `unproven` (❔) where nothing failed but a check that decides the verdict did not run on it; "
            "no summary counts it as safe.", "", "| framework release | not checked | cells | e.g. |",
            "|---|---|---|---|", *lines]


def _retries(cells: list[Cell]) -> str:
    retried = grid.rendezvous_retried(cells)
    shown = ", ".join(f"`{i}`" for i in retried[:6]) + (f" and {len(retried) - 6} more" if len(retried) > 6 else "")
    return (f"Rendezvous retries (harness): {len(retried)} cell(s) were rerun because joining their fresh process "
            f"group hung{': ' + shown if retried else ''}.")


def _environment(name: str, info: dict[str, Any]) -> str:
    """Versions that decide the results, then who ran them, when and how (when the report records it)."""
    if not info:
        return f"Environment `{_inline(name)}`: not described in the report"
    versions = dict.fromkeys([*(f"{k} {v}" for k, v in sorted((info.get("frameworks") or {}).items())),
                              f"torch {info.get('torch') or '?'}", f"python {info.get('python', '?')}",
                              f"{info.get('device', '?')} ({info.get('backend', '?')})"])
    run = info.get("run") or {}
    facts = [f"run {run['date']}" if run.get("date") else "", f"commit `{run['commit']}`" if run.get("commit") else "",
             f"pytest-freezecompat {run['plugin']}" if run.get("plugin") else "",
             f"`{_inline(run['command'])}`" if run.get("command") else ""]
    return f"Environment `{_inline(name)}`: " + " · ".join([*map(_inline, versions), *filter(None, facts),
                                                            *_lock(info.get("lock"))])


def _lock(lock: dict[str, Any] | None) -> list[str]:
    """The environment's lock, by file and hash prefix; each difference from it said (the run did not have it)."""
    if not lock:
        return []
    said = f"lock `matrix/{_inline(lock['file'])}` (sha256 {lock['sha256'][:12]})"
    differs = lock.get("differs") or []
    return [said + (f", **not as locked**: {_inline(', '.join(differs))}" if differs else "")]


def _emulated(section: grid.Section) -> tuple[set[str], bool]:
    """Plugins whose cells ran behind the shim, and whether that is every plugin that ran (then said once)."""
    ran = [c for c in _cells(section) if c["status"] != "skip"]
    plugins = {c["plugin"] for c in ran if c.get("emulation")}
    return plugins, bool(plugins) and plugins == {c["plugin"] for c in ran}


def _emulation(section: grid.Section) -> str:
    """Said once per framework; where the shim engaged in only some of a plugin's cells, in how many."""
    plugins, everywhere = _emulated(section)
    ran = [c for c in _cells(section) if c["status"] != "skip"]

    def share(plugin: str | None) -> str:
        mine = [c for c in ran if plugin in (None, c["plugin"])]
        engaged = sum(bool(c.get("emulation")) for c in mine)
        return "" if engaged == len(mine) else f" ({engaged}/{len(mine)})"

    if not plugins:
        return ""
    shown = f"every plugin here{share(None)}" if everywhere else ", ".join(
        f"`{_inline(p)}`{share(p)}" for p in section.plugins if p in plugins)
    counted = any(map(share, [None, *plugins]))
    return (f"{EMULATION_MARK} **Emulation**: {shown} ran on CPU behind a CUDA-on-CPU shim"
            + (" (n/m: it engaged in n of the m cells that ran)" if counted else "")
            + (", so the grids do not mark it." if everywhere else f"; the grids mark these plugins {EMULATION_MARK}."))


def _links(known: dict[str, Any]) -> str:
    """`[pytorch#91167](…) · [lazy_init.md](…)`: each upstream thread by a name a reader recognizes."""
    labels = []
    for link in grid.links(known):
        thread = re.match(r"https?://github\.com/[^/]+/([^/]+)/(?:issues|pull)/(\d+)", link)
        label = f"{thread[1]}#{thread[2]}" if thread else link.rstrip("/").rsplit("/", 1)[-1]
        labels.append(f"[{_inline(label)}]({link})")
    return " · ".join(labels)


def _known(known: dict[str, Any]) -> str:
    """`[id](first link)`, or the bare id where the entry has no link."""
    return f"[{_inline(known['id'])}]({known['link']})" if known.get("link") else f"`{_inline(known['id'])}`"


def _plugin_table(section: grid.Section, cells: list[Cell], marked: set[str]) -> list[str]:
    """Per plugin: how bad its cells are, in the columns of the first table; each row adds up to `cells`."""
    shown = [v for v in SEVERITIES if section.severities[v]]
    lines = ["| plugin | " + " | ".join(shown) + " | cells |", "|---" * (len(shown) + 2) + "|"]
    for plugin in section.plugins:
        counts = Counter(grid.severity(c) for c in cells if c["plugin"] == plugin)
        lines.append(f"| {_inline(plugin)}{EMULATION_MARK if plugin in marked else ''} | "
                     + " | ".join(str(counts[v]) for v in shown) + f" | {counts.total()} |")
    return lines


def _works_and_breaks(section: grid.Section, cells: list[Cell]) -> list[str]:
    """What a user deciding on a stack asks: what is safe wherever it ran, and where is the silent harm (a known
    issue explains a cell; it never makes it safe)."""
    freezes = tuple(dict.fromkeys(row.freeze for block in section.blocks for row in block.rows))
    ran = [c for c in cells if c["status"] != "skip"]
    safe = ("ok", "differs")
    green = [f for f in freezes if (mine := [c for c in ran if c["freeze"] == f])
             and all(grid.severity(c) in safe for c in mine)]
    clean = [p for p in section.plugins if (mine := [c for c in ran if c["plugin"] == p])
             and all(grid.severity(c) in safe for c in mine)]
    works = [f"freeze {_names(green)} under every plugin" if green else "",
             f"every freeze pattern under {_names(clean)}" if clean else ""]
    lines = [f"- ✅ **Safe wherever it ran**: {'; '.join(filter(None, works)) or 'no freeze pattern and no plugin'}."]
    silent = [c for c in cells if grid.severity(c) == "silent"]
    if silent:
        patterns = [f for f in freezes if any(c["freeze"] == f for c in silent)]
        lines.append(f"- 🟥 **Silent harm** ({len(silent)} cells) with freeze {_names(patterns)}: the "
                     f"[guide](guide.md#{anchor(section.framework.replace('@', ' '))}) says when and what to do "
                     "instead.")
    red = [c for c in cells if _kind(c) == "red"]
    if not red:
        return [*lines, "- ❌ **Not explained**: no red cell lacks a known issue or finding."]
    lines.append("- ❌ **Not explained** by a known issue or finding:")
    for freeze in freezes:
        mine = [c for c in red if c["freeze"] == freeze]
        if mine:
            causes = "".join(CAUSE_MARKS[c] for c in grid.CAUSES if any(m.get("cause") == c for m in mine))
            plugins = [p for p in section.plugins if any(m["plugin"] == p for m in mine)]
            total = sum(c["freeze"] == freeze for c in cells)
            lines.append(f"  - `{_inline(freeze)}`{' ' * bool(causes)}{causes} — {len(mine)} of {total} cells, under "
                         f"{_names(plugins)}")
    return lines


def _issue_tally(cells: list[Cell]) -> str:
    return ", ".join(f"{n} {shown}" for shown, n in sorted(Counter(map(display_status, cells)).items()))


def _framework_summary(section: grid.Section, report: dict[str, Any]) -> list[str]:
    """Versions and run, counts per plugin, what works and breaks, and the upstream threads behind `known`."""
    cells = _cells(section)
    marked, everywhere = _emulated(section)
    lines = ["", f"### {section.framework}", "",
             *(_environment(env, report["environments"].get(env) or {}) + "  "
               for env in grid.distinct(cells, "environment")),
             f"{section.cells} cells: " + " · ".join(f"{section.severities[v]} {v}" for v in SEVERITIES
                                                     if section.severities[v]) + f" ({_tally(cells)}). "
             f"[Grids](#{anchor(section.framework + ' grids')}) · "
             f"[notes](#{anchor(section.framework + ' notes')})"]
    if emulation := _emulation(section):
        lines += ["", emulation]
    lines += ["", *_plugin_table(section, cells, set() if everywhere else marked), "",
              *_works_and_breaks(section, cells)]
    issues = grid.known_issues(cells)
    if issues:
        lines.append(f"- {REGISTRY_MARKS['known']} **Known upstream issues** (see [Known issues](#known-issues)):")
        for issue_id, (known, mine) in issues.items():
            plugins = [p for p in section.plugins if any(c["plugin"] == p for c in mine)]
            links = _links(known)
            lines.append(f"  - **{_inline(issue_id)}** ({_issue_tally(mine)}) under {_names(plugins)}"
                         + (f" — {links}" if links else ""))
    return lines


def _letter(index: int) -> str:
    """A, B, …, Z, AA, AB, …: column labels for plugins whose names would make the grid too wide."""
    label = ""
    index += 1
    while index:
        index, rest = divmod(index - 1, 26)
        label = chr(ord("A") + rest) + label
    return label


def _labels(section: grid.Section, marked: set[str]) -> tuple[dict[str, str], bool]:
    """Column heads: the plugin names where the widest table fits TABLE_WIDTH, else letters (True: needs a key)."""
    names = {p: _inline(p) + (EMULATION_MARK if p in marked else "") for p in section.plugins}
    freeze = max((len(_inline(r.freeze)) for b in section.blocks for r in b.rows), default=0)
    head = len("| freeze | " + " | ".join(names.values()) + " |")
    if max(head, freeze + 4 + 7 * len(names)) <= TABLE_WIDTH:  # a mark: up to 4 characters (⏱️❄ᴷ)
        return names, False
    return {p: _letter(k) + (EMULATION_MARK if p in marked else "") for k, p in enumerate(section.plugins)}, True


def _table(section: grid.Section, block: grid.Block, slot: int, labels: dict[str, str]) -> tuple[list[str], list[Cell]]:
    """One checkpoint mode's grid of a block, without the rows and columns that have no cell in it."""
    rows = [(row.freeze, [column.slots[slot] for column in row.columns]) for row in block.rows]
    rows = [(freeze, slots) for freeze, slots in rows if any(slots)]
    keep = [k for k in range(len(section.plugins)) if any(slots[k] for _, slots in rows)]
    lines = ["| freeze | " + " | ".join(labels[section.plugins[k]] for k in keep) + " |",
             "|---" * (len(keep) + 1) + "|"]
    lines += [f"| {_inline(freeze)} | " + " | ".join(_mark(slots[k]) for k in keep) + " |" for freeze, slots in rows]
    return lines, [cell for _, slots in rows for cell in slots if cell is not None]


def _shared_trips(cells: list[Cell]) -> list[str]:
    """How many cells ran their own round trip and how many cite their round-trip group's (`round_trip_of`)."""
    cited = Counter(cell["round_trip_of"] for cell in cells if cell.get("round_trip_of"))
    if not cited:
        return []
    example = next(cell for cell in cells if cell.get("round_trip_of"))
    return ["", f"Round trips: {len(cited)} cells ran one that {sum(cited.values())} others cite: cells that differ "
                "only in values whose round trips gave the same result in every group (the framework's "
                "`[round_trip]`, measured by `benchmarks/round_trip_axes.py`) share one. Each citing cell names "
                f"the cell that ran it (`round_trip_of`; the HTML report links it), e.g. `{example['id']}` cites "
                f"`{example['round_trip_of']}`."]


def _access(access: tuple[grid.GradAccess, ...], cells: list[Cell]) -> list[str]:
    """Where a user reads full grads and the clip norm, per plugin (sharded stacks hide it: ZeRO in its
    optimizer, Gemini in chunks); plugins that share a way are listed together; then the shared round trips."""
    if not access:
        return []
    ways: dict[tuple[str, str, str], list[str]] = defaultdict(list)
    for a in access:
        ways[(a.grad, a.norm, a.save)].append(a.plugin)
    return ["", "<details><summary>Where a user reads the full grad of a trainable param and the clip norm, and "
                "how the <code>resume</code> check saved and loaded the model</summary>", "",
            *(f"- {_names(plugins)}: `{_inline(grad)}`; clip norm: {_inline(norm)}; save / load: `{_inline(save)}`"
              for (grad, norm, save), plugins in ways.items()), *_shared_trips(cells), "", "</details>"]


def _grids(section: grid.Section) -> list[str]:
    """Per model and init: the first checkpoint mode's table open, the others folded with their counts shown."""
    marked, everywhere = _emulated(section)
    labels, keyed = _labels(section, set() if everywhere else marked)
    key = "Columns: " + " · ".join(f"**{labels[p]}** {_inline(p)}" for p in section.plugins) if keyed else ""
    lines = ["", f"### {section.framework} grids"]
    if everywhere:
        lines += ["", f"Every plugin here ran behind the CUDA-on-CPU shim ({EMULATION_MARK}), so no cell is marked."]
    for block in section.blocks:
        clipping = "" if block.clip == LATER_AXES["clip"] else f" · `{_inline(block.clip)}` (never clipped)"
        lines += ["", f"#### {block.model} · init `{_inline(block.init)}`{clipping}", *(["", key] if key else [])]
        opened = False
        for slot, checkpoint in enumerate(section.checkpoints):
            table, cells = _table(section, block, slot, labels)
            if not cells:
                continue
            if not opened:
                lines += ["", f"**activation checkpointing `{_inline(checkpoint)}`** — {_tally(cells)}", "", *table]
                opened = True
            else:
                lines += ["", f"<details><summary>activation checkpointing <code>{escape(checkpoint)}</code> — "
                              f"{_tally(cells)}</summary>", "", *table, "", "</details>"]
    return lines + _access(section.grad_access, _cells(section))


def _where(cells: list[Cell], section_cells: list[Cell]) -> str:
    """`plugin a, b · freeze c · checkpoint reentrant`: model, init, checkpoint and clip only where not all of them."""
    parts = []
    for field in ("plugin", "freeze", "model", "init", "checkpoint", "clip"):
        values, every = grid.distinct(cells, field), grid.distinct(section_cells, field)
        if len(values) < len(every):
            parts.append(f"{field} {', '.join(map(_inline, values))}")
        elif field in ("plugin", "freeze"):
            parts.append(f"every {field}" if len(every) > 1 else f"{field} {_inline(every[0])}")
    return " · ".join(parts)


def _message(cell: Cell) -> str:
    return cell.get("message") or "; ".join(cell.get("notes") or [])


def _noted(cell: Cell) -> bool:
    """What a reader must look into: red with no known issue (harness included), `fixed?`, skipped."""
    return _kind(cell) in ("red", "fixed?", "skip")


def _notes(section: grid.Section) -> list[str]:
    """Cells that ended the same way (the same words; numbers may differ) as one item."""
    cells = _cells(section)
    groups: dict[tuple[str, ...], list[Cell]] = defaultdict(list)
    for cell in filter(_noted, cells):
        shown = display_status(cell)
        known = "" if shown == "skip" else (cell.get("known_issue") or {}).get("id", "")  # a skip: why, once
        groups[(shown, cell["status"], cell.get("check") or "", cell.get("cause") or "", known,
                _NUMBER.sub("#", _message(cell)))].append(cell)
    lines = ["", f"### {section.framework} notes", ""]
    if not groups:
        return [*lines, "Nothing to note: every cell passed or is explained by a known issue."]
    order = [*(s for s in STATUSES if s != "skip"), "fixed?", "skip"]
    for (shown, status, check, cause, _, _), members in sorted(
            groups.items(), key=lambda g: (order.index(g[0][0]), -len(g[1]), g[0][2:])):
        issues = ", ".join(_known(known) for known, _ in grid.known_issues(members).values())
        what = (f"{SYMBOLS[status]}{CAUSE_MARKS.get(cause, '')}{REGISTRY_MARKS.get(shown, '')} **{shown}**"
                + (f" `{_inline(check)}`" if check else "") + (f" ({issues})" if issues else ""))
        message = clip(_message(members[0]), MESSAGE_CHARS)
        varies = len(set(map(_message, members))) > 1
        text = f" — {'e.g. ' if varies else ''}{_inline(message)}" if message else ""
        lines.append(f"- {what} — {len(members)} cell(s): {_where(members, cells)}{text}")
    return lines


def _workaround_states(rows: list[dict[str, Any]]) -> str:
    """`plugin=fsdp2`: verified on torch@2.13.0 (6/6), broken on torch@2.8.0 (0/6): one entry's workarounds."""
    by_workaround: dict[str, list[str]] = {}
    for row in rows:
        judged = row["held"] + row["not_held"]
        blocked = f", {row['blocked']} meet another issue" if row.get("blocked") else ""
        by_workaround.setdefault(row["workaround"], []).append(
            f"{row['state']} on {_inline(row['release'])}" + (f" ({row['held']}/{judged} hold{blocked})"
                                                               if judged or blocked else ""))
    return "; ".join(f"`{_inline(name)}` {', '.join(states)}" for name, states in by_workaround.items())


def _known_issues(cells: list[Cell], workarounds: list[dict[str, Any]]) -> list[str]:
    """Each registry entry the report touches: its links, what the thread says, its cells by display status, and
    its workarounds as the run proved them per release (a broken one shows, like a stale `fixed?`)."""
    issues = grid.known_issues(cells)
    if not issues:
        return []
    lines = ["", "## Known issues", ""]
    for issue_id, (known, mine) in issues.items():
        where = "; ".join(f"{_inline(fw)}: " + ", ".join(map(_inline, grid.distinct(
            [c for c in mine if c["framework"] == fw], "plugin"))) for fw in grid.distinct(mine, "framework"))
        links = _links(known)
        fixed = fixed_in_words(known)
        scope = cpu_only(known)
        narrow = sum(bool((c.get("known_issue") or {}).get("range_too_narrow")) for c in mine)
        kind = f" *{_inline(words)}*" if (words := kind_words(known)) else ""
        lines.append(f"- **{_inline(issue_id)}** ({_issue_tally(mine)}){kind} — {where} — "
                     f"{_inline(known.get('summary', ''))}"
                     + (f" — **fixed in {_inline(fixed)}**" if fixed else "")
                     + (f" — **{_inline(scope)}**" if scope else "")
                     + (f" — ⚠ range too narrow: {narrow} red cells outside its versions fail as it describes"
                        if narrow else "")
                     + (f" — ⚠ {_inline(framing)}" if (framing := grid.framing_problem(known, mine)) else "")
                     + (f" — {links}" if links else ""))
        proved = [row for row in workarounds if row["entry"] == issue_id]
        if proved:
            lines.append(f"  - **Instead**{' (on CPU)' if scope else ''}: {_workaround_states(proved)}")
        elif known.get("no_workaround"):
            lines.append(f"  - **No workaround known**: {_inline(known['no_workaround'])}")
    return lines


#: Rows of the across-releases table per framework in matrix.md (matrix.json and matrix.html hold them all).
RELEASE_ROWS = 80


def _across_releases(rows: list[Cell], bisections: list[dict[str, Any]]) -> list[str]:
    """Per framework run on several releases: the cells whose status changes, and where the runs place it."""
    tables = releases.across_releases(rows, bisections)
    if not tables:
        return []
    lines = ["", "## Across releases", "",
             "The same cell (its id without the release) on every release the matrix ran; only cells whose status "
             "changes between releases are listed. \"fixed in X (bisected)\": `freezecompat bisect` ran the "
             "releases between and found X first; else the runs place the change between two releases."]
    for table in tables:
        shown = table.changes[:RELEASE_ROWS]
        worse = sum(change.regression for change in table.changes)
        lines += ["", f"### {_inline(table.framework)}: {' → '.join(map(_inline, table.releases))}", "",
                  f"{table.cells} cells ran on every release; {len(table.changes)} change status, **{worse} of them "
                  "for the worse** (broke, or a harm turned worse: listed first).", ""]
        if not shown:
            continue
        lines += ["| cell | " + " | ".join(map(_inline, table.releases)) + " | change | known issue |",
                  "|---" * (len(table.releases) + 3) + "|"]
        for change in shown:
            lines.append(f"| `{_inline(change.cell)}` | " + " | ".join(change.statuses.get(r, "—")
                                                                      for r in table.releases)
                         + f" | {_inline(change.label)} | {_inline(change.known_issue or '')} |")
        if len(table.changes) > len(shown):
            lines.append(f"\n… and {len(table.changes) - len(shown)} more (matrix.html lists them all).")
    return lines


def _tolerance_used(rows: list[Cell]) -> list[str]:
    """How close passing rows came to their tolerance, per precision: a pass at 0.9 of it is a near miss."""
    used = grid.tolerance_used(rows)
    if not used:
        return []
    head = " | ".join(f"{q:g} quantile" if q < 1 else "max" for q in grid.QUANTILES)
    lines = ["", "## How close passes came to their tolerance", "",
             "Each passing row's largest |stack − reference| / tolerance over every element it judged (1 = at the "
             "edge), grads and params apart; tolerances are per tensor, from the precision's own measured spread.", "",
             f"| precision | judged | passing rows | {head} |", "|---|---|---|" + "---|" * len(grid.QUANTILES)]
    for precision, per in sorted(used.items()):
        for what, values in per.items():
            lines.append(f"| {precision} | {what} | {len(values)} | "
                         + " | ".join(f"{grid.quantile(values, q):.2g}" for q in grid.QUANTILES) + " |")
    return lines


def render(report: dict[str, Any]) -> str:
    """matrix.md for `report` (matrix.json's content)."""
    rows = [with_later_axes(cell) for cell in report["cells"]]
    cells, order = grid.by_release(rows, grid.axis_order(report))
    sections = grid.sections(cells, order)
    out = ["# Freeze compatibility matrix", "",
           "Does partial freezing (`requires_grad=False`, or params left out of the optimizer) train correctly "
           "under each distributed stack? Every cell is a real multi-rank run checked against a single-process "
           "reference (requires_grad flags, optimizer-tracked params, grads, clip norm, updates).", "",
           "**What to do instead**: [guide.md](guide.md) — per framework release, what you freeze × how you wrap the "
           "model: safe, silent harm or refused; for each unsafe box when, why, the fixed-in release and an "
           "alternative the matrix ran and found safe. `freezecompat advise --framework F --plugin P --freeze X` "
           "answers one setup.", "",
           "## How bad, per framework release", "", *_harm(sections), "", _legend(), "",
           "## Not proven", "", *_unproven(sections), *_tolerance_used(rows)]
    for section in sections:
        out += _framework_summary(section, report)
    out += ["", "## Raw statuses and causes", "", *_counts(sections), "", _retries(cells), "", "## Grids"]
    for section in sections:
        out += _grids(section)
    out += ["", "## Notes", "",
            "Red cells no known issue explains, `fixed?` cells and skipped ones, grouped by how they ended; cells "
            "a known issue explains are counted under [Known issues](#known-issues)."]
    for section in sections:
        out += _notes(section)
    out += _across_releases(rows, report.get("bisections") or [])
    return "\n".join([*out, *_known_issues(cells, report.get("workarounds") or [])]) + "\n"
