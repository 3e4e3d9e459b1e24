"""`matrix.md`: one table per framework, model and init mode that reads well on GitHub.

Rows are freeze patterns, columns plugins; each table cell shows the checkpoint modes
side by side, so 300 cells of a framework fit in a few screens. Notes below group
cells that failed the same way.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

from ..core.records import STATUSES, display_status
from . import grid

SYMBOLS = {"pass": "✅", "fail": "❌", "error": "💥", "timeout": "⏱️", "crash": "☠️", "skip": "⏭️"}
EMULATION_MARK = "ᴱ"
#: Beside the raw status symbol, which stays visible: a known upstream issue explains it / a known issue expected
#: it to break but it passed.
REGISTRY_MARKS = {"known": "ᴷ", "fixed?": "ᶠ"}
#: Why a red cell is red, compared with its column's nothing-frozen control.
CAUSE_MARKS = {"freeze": "❄", "stack": "ˢ", "both": "ᵇ", "harness": "ʰ"}
CAUSE_HELP = {"freeze": "caused by freezing (the control passes, or a frozen / non-optimized param or the optimizer "
                        "set is wrong)",
              "stack": "the stack fails the same way with nothing frozen",
              "both": "the stack fails with nothing frozen too, and freezing changes or adds to it",
              "harness": "our own harness (or a user's freeze_case function) raised: says nothing about the stack"}
ABSENT = "·"
MESSAGE_CHARS = 300


def _legend() -> str:
    items = " · ".join(f"{symbol} {status}" for status, symbol in SYMBOLS.items())
    return (f"Legend: {items} · {EMULATION_MARK} ran its real logic on CPU behind a CUDA-on-CPU shim (emulation) · "
            f"{REGISTRY_MARKS['known']} `known`: fails the way a known upstream issue says (listed under Known "
            f"issues; an xfail in pytest) · {REGISTRY_MARKS['fixed?']} `fixed?`: passed though a known issue expects "
            f"it to fail (a strict xpass: the entry may be stale) · "
            + " · ".join(f"{CAUSE_MARKS[c]} {CAUSE_HELP[c]}" for c in grid.CAUSES)
            + f" · {ABSENT} not in the matrix. Each table cell "
            "lists the checkpoint modes in the order given above the table.")


def _environments(report: dict[str, Any]) -> list[str]:
    lines = ["| environment | python | torch | frameworks | device |", "|---|---|---|---|---|"]
    for name, info in sorted(report["environments"].items()):
        frameworks = ", ".join(f"{k} {v}" for k, v in sorted(info.get("frameworks", {}).items()))
        lines.append(f"| {name} | {info.get('python', '?')} | {info.get('torch', '?')} | {frameworks} | "
                     f"{info.get('device', '?')} ({info.get('backend', '?')}) |")
    return lines


def _summary(sections: list[grid.Section]) -> list[str]:
    causes = [f"red: {c} {CAUSE_MARKS[c]}" for c in grid.CAUSES]
    header = "| framework | " + " | ".join([*grid.DISPLAY_STATUSES, *causes]) + " | cells |"
    lines = [header, "|---" * (len(grid.DISPLAY_STATUSES) + len(causes) + 2) + "|"]
    for section in sections:
        lines.append(f"| {section.framework} | " + " | ".join(
            [*(str(section.counts[s]) for s in grid.DISPLAY_STATUSES), *(str(section.causes[c]) for c in grid.CAUSES)])
            + f" | {section.cells} |")
    return lines


def _symbol(cell: dict[str, Any] | None) -> str:
    if cell is None:
        return ABSENT
    return (SYMBOLS[cell["status"]] + CAUSE_MARKS.get(cell.get("cause") or "", "")
            + REGISTRY_MARKS.get(display_status(cell), "") + (EMULATION_MARK if cell.get("emulation") else ""))


def _tables(sections: list[grid.Section]) -> list[str]:
    lines: list[str] = []
    for section in sections:
        lines += ["", f"## {section.framework}"]
        for block in section.blocks:
            lines += ["", f"### {block.model}, init `{block.init}` — checkpoint: {' · '.join(section.checkpoints)}",
                      "", "| freeze | " + " | ".join(section.plugins) + " |",
                      "|---" * (len(section.plugins) + 1) + "|"]
            lines += [f"| {row.freeze} | " + " | ".join("".join(map(_symbol, column.slots)) for column in row.columns)
                      + " |" for row in block.rows]
        lines += ["", _access_table(section.grad_access)]
    return lines


def _access_table(access: tuple[grid.GradAccess, ...]) -> str:
    """Where a user reads full grads and the clip norm, per plugin
    (sharded stacks hide it: ZeRO in its optimizer, Gemini in chunks)."""
    if not access:
        return ""
    rows = ["| plugin | full grad of a trainable param | clip norm |", "|---|---|---|"]
    rows += [f"| {a.plugin} | `{a.grad}` | {a.norm} |" for a in access]
    return "\n".join(rows)


def _inline(text: str) -> str:
    """Message text that stays text in a GitHub list item or table: no raw HTML, no column breaks."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace("|", "\\|")


def _known_label(cell: dict[str, Any]) -> str:
    """`known: [id](link)` / `fixed?: [id](link)` / `[id](link)` (a skip tied to an entry), or ''."""
    known = cell.get("known_issue") or {}
    if not known.get("link"):
        return ""
    shown = display_status(cell)
    prefix = f"{shown}: " if shown in REGISTRY_MARKS else ""
    return f"{prefix}[{known['id']}]({known['link']})"


def _notes(cells: list[dict[str, Any]]) -> list[str]:
    groups: dict[tuple[str, str, str, str], list[str]] = defaultdict(list)
    for cell in cells:
        if cell["status"] != "pass" or cell.get("notes") or cell.get("known_issue"):
            message = cell.get("message") or "; ".join(cell.get("notes", [])) or ""
            if len(message) > MESSAGE_CHARS:
                message = message[:MESSAGE_CHARS] + "…"
            groups[(cell["status"], cell.get("check") or "", _known_label(cell), message)].append(cell["id"])
    lines = ["", "## Notes", ""]
    for (status, check, known, message), ids in sorted(groups.items(),
                                                        key=lambda g: (STATUSES.index(g[0][0]), g[0][1:])):
        what = f"**{status}**" + (f" (check `{check}`)" if check else "") + (f" ({known})" if known else "")
        shown = ", ".join(f"`{i}`" for i in ids[:6]) + (f" and {len(ids) - 6} more" if len(ids) > 6 else "")
        text = f" — {_inline(message)}" if message else ""
        lines.append(f"- {SYMBOLS[status]} {what}{text} — {len(ids)} cell(s): {shown}")
    return lines


def _retries(cells: list[dict[str, Any]]) -> list[str]:
    retried = grid.rendezvous_retried(cells)
    shown = ", ".join(f"`{i}`" for i in retried[:6]) + (f" and {len(retried) - 6} more" if len(retried) > 6 else "")
    return ["", f"Rendezvous retries (harness): {len(retried)} cell(s) were rerun because joining their fresh "
                f"process group hung{': ' + shown if retried else ''}."]


def _known_issues(cells: list[dict[str, Any]]) -> list[str]:
    """Each registry entry the report touches: its links, what the thread says, and its cells by display status."""
    entries: dict[str, dict[str, Any]] = {}
    counts: dict[str, Counter] = defaultdict(Counter)
    for cell in cells:
        known = cell.get("known_issue") or {}
        if known.get("link"):
            entries.setdefault(known["id"], known)
            counts[known["id"]][display_status(cell)] += 1
    if not entries:
        return []
    lines = ["", "## Known issues", ""]
    for issue_id, known in entries.items():
        links = " · ".join(f"<{link}>" for link in known.get("links") or [known["link"]])
        tally = ", ".join(f"{n} {status}" for status, n in sorted(counts[issue_id].items()))
        lines.append(f"- **{issue_id}** ({tally}) — {_inline(known.get('summary', ''))} — {links}")
    return lines


def render(report: dict[str, Any]) -> str:
    cells = report["cells"]
    sections = grid.sections(cells, grid.axis_order(report))
    out = ["# Freeze compatibility matrix", "",
           "Does partial freezing (`requires_grad=False`, or params left out of the optimizer) train correctly "
           "under each distributed stack? Every cell is a real multi-rank run checked against a single-process "
           "reference (requires_grad flags, optimizer-tracked params, grads, clip norm, updates).", "",
           _legend(), "", *_environments(report), "", *_summary(sections), *_retries(cells), *_tables(sections),
           *_notes(cells),
           *_known_issues(cells)]
    return "\n".join(out) + "\n"
