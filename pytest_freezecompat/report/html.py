"""`matrix.html`: the whole report as one self-contained page (CSS and JS from assets/ inlined, nothing fetched).

The grids mirror `matrix.md` (per framework, model and init mode: rows are freeze patterns, columns
plugins, the checkpoint modes side by side in each table cell), one coloured square per cell. The
filters and the details panel run in the page; every cell's record travels as JSON in a
`<script type="application/json">` block that the page reads with `JSON.parse` and writes into the
DOM with `textContent` only, so nothing from a message, traceback or link can become markup.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from html import escape
from importlib import resources
from typing import Any

from ..core.records import display_status
from . import grid

#: Raw status -> glyph. The glyph always shows the raw status; colour shows the display status.
GLYPHS = {"pass": "✓", "fail": "✗", "error": "!", "timeout": "◷", "crash": "†", "skip": "–"}
DISPLAY_HELP = {
    "pass": "every check held", "fail": "ran, a check failed", "error": "raised", "timeout": "hung",
    "crash": "a rank died", "skip": "not runnable here",
    "known": "failed the way a known upstream issue says (xfail)",
    "fixed?": "passed though a known issue expects it to fail (strict xpass: the entry may be stale)",
}


def _asset(name: str) -> str:
    """Inlined into the page, so a report opened from disk or an artifact store fetches nothing."""
    return (resources.files(__package__) / "assets" / name).read_text(encoding="utf-8")


def _css_class(display: str) -> str:
    return "d-fixed" if display == "fixed?" else f"d-{display}"


def _json_for_script(value: Any) -> str:
    """JSON that cannot end its <script> element or open markup inside it."""
    text = json.dumps(value, ensure_ascii=False, sort_keys=True)
    return text.replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e")


def _button(cell: dict[str, Any]) -> str:
    display = display_status(cell)
    classes = f"cell {_css_class(display)}" + (" emu" if cell.get("emulation") else "")
    title = f"{cell['id']}: {cell['status']}"
    if cell.get("check"):
        title += f" [{cell['check']}]"
    if display != cell["status"]:
        title += f" ({display}: {cell['known_issue']['id']})"
    if cell.get("emulation"):
        title += " · emulated"
    if cell.get("cause"):
        title += f" · cause: {cell['cause']}"
    attrs = {"class": classes, "type": "button", "data-id": cell["id"], "data-framework": cell["framework"],
             "data-plugin": cell["plugin"], "data-freeze": cell["freeze"], "data-status": cell["status"],
             "data-display": display, "data-cause": cell.get("cause") or "", "title": title, "aria-label": title}
    rendered = " ".join(f'{name}="{escape(str(value), quote=True)}"' for name, value in attrs.items())
    return f"<button {rendered}>{escape(GLYPHS[cell['status']])}</button>"


def _absent(checkpoint: str) -> str:
    return f'<span class="absent" title="{escape(checkpoint)}: not in the matrix">·</span>'


def _grid(section: grid.Section) -> list[str]:
    out: list[str] = []
    for block in section.blocks:
        out.append(f'<div class="block"><h3>{escape(block.model)}, init <code>{escape(block.init)}</code> — '
                   f'checkpoint: {escape(" · ".join(section.checkpoints))}</h3><table class="grid"><thead><tr>'
                   "<th>freeze</th>")
        out += [f'<th data-plugin="{escape(p, quote=True)}">{escape(p)}</th>' for p in section.plugins]
        out.append("</tr></thead><tbody>")
        for row in block.rows:
            out.append(f'<tr data-freeze="{escape(row.freeze, quote=True)}"><th>{escape(row.freeze)}</th>')
            for column in row.columns:
                squares = "".join(_absent(ck) if cell is None else _button(cell)
                                  for ck, cell in zip(section.checkpoints, column.slots))
                out.append(f'<td data-plugin="{escape(column.plugin, quote=True)}">{squares}</td>')
            out.append("</tr>")
        out.append("</tbody></table></div>")
    return out


def _access(access: tuple[grid.GradAccess, ...]) -> list[str]:
    """Where a user reads a full grad and the clip norm, per plugin
    (sharded stacks hide it: ZeRO in its optimizer, Gemini in chunks)."""
    if not access:
        return []
    rows = [f'<tr data-plugin="{escape(a.plugin, quote=True)}"><td>{escape(a.plugin)}</td><td><code>'
            f"{escape(a.grad)}</code></td><td>{escape(a.norm)}</td></tr>" for a in access]
    return ['<table class="access"><thead><tr><th>plugin</th><th>full grad of a trainable param</th>'
            "<th>clip norm</th></tr></thead><tbody>", *rows, "</tbody></table>"]


def _environments(report: dict[str, Any]) -> list[str]:
    rows = []
    for name, info in sorted(report["environments"].items()):
        frameworks = ", ".join(f"{k} {v}" for k, v in sorted((info.get("frameworks") or {}).items()))
        rows.append(f"<tr><td>{escape(name)}</td><td>{escape(str(info.get('python', '?')))}</td>"
                    f"<td>{escape(str(info.get('torch', '?')))}</td><td>{escape(frameworks)}</td>"
                    f"<td>{escape(str(info.get('device', '?')))} ({escape(str(info.get('backend', '?')))})</td></tr>")
    return ["<table><thead><tr><th>environment</th><th>python</th><th>torch</th><th>frameworks</th><th>device</th>"
            "</tr></thead><tbody>", *rows, "</tbody></table>"]


def _counts(sections: list[grid.Section]) -> list[str]:
    """Raw statuses per framework, then how many of them the known-issue registry explains or flags."""
    head = "".join(f'<th><span class="swatch {_css_class(s)}"></span> {escape(s)}</th>'
                   for s in grid.DISPLAY_STATUSES) + "".join(f"<th>red: {c}</th>" for c in grid.CAUSES)
    rows = [f"<tr><td>{escape(section.framework)}</td>"
            + "".join(f"<td>{section.counts[s]}</td>" for s in grid.DISPLAY_STATUSES)
            + "".join(f"<td>{section.causes[c]}</td>" for c in grid.CAUSES)
            + f"<td>{section.cells}</td></tr>" for section in sections]
    return [f'<table class="counts"><thead><tr><th>framework</th>{head}<th>cells</th></tr></thead><tbody>', *rows,
            "</tbody></table>"]


def _select(axis: str, values: Iterable[str]) -> str:
    options = "".join(f'<option value="{escape(v, quote=True)}">{escape(v)}</option>' for v in values)
    return (f'<label>{escape(axis)} <select id="filter-{axis}" data-axis="{axis}"><option value="">all</option>'
            f"{options}</select></label>")


def _legend() -> str:
    items = "".join(f'<span><span class="swatch {_css_class(s)}">{escape(GLYPHS.get(s, ""))}</span>'
                    f"{escape(s)}: {escape(DISPLAY_HELP[s])}</span>" for s in grid.DISPLAY_STATUSES)
    return (f'<div class="legend">{items}<span><span class="swatch d-pass emu">✓</span>E: ran its real logic on '
            "CPU behind a CUDA-on-CPU shim (emulation)</span><span>The glyph is the raw status; a "
            "<code>known</code> square shows ✗ or ! on amber. Cause (filter above): <em>freeze</em>, the cell "
            "fails where its nothing-frozen control passes, or on a frozen param; <em>stack</em>, the control "
            "fails the same way; "
            "<em>both</em>; <em>harness</em>, our own code (or a user's freeze_case function) raised. "
            "Click a square for its details.</span></div>")


def render(report: dict[str, Any]) -> str:
    cells = report["cells"]
    sections = grid.sections(cells, grid.axis_order(report))
    statuses = [s for s in grid.DISPLAY_STATUSES if any(s in section.counts for section in sections)]
    filters = [_select("framework", [section.framework for section in sections]),
               _select("plugin", grid.distinct(cells, "plugin")), _select("freeze", grid.distinct(cells, "freeze")),
               _select("status", statuses),
               _select("cause", [c for c in grid.CAUSES if any(section.causes[c] for section in sections)])]
    grids: list[str] = []
    for section in sections:
        grids += [f'<section class="framework" data-framework="{escape(section.framework, quote=True)}">'
                  f"<h2>{escape(section.framework)}</h2>", *_grid(section), *_access(section.grad_access), "</section>"]
    payload = {c["id"]: {**c, "display": display_status(c)} for c in cells}
    return "\n".join([
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>Freeze compatibility matrix</title><style>\n{_asset('report.css')}</style></head><body>",
        "<header><h1>Freeze compatibility matrix</h1><p class=\"lead\">Does partial freezing "
        "(<code>requires_grad=False</code>, or params left out of the optimizer) train correctly under each "
        "distributed stack? Every cell is a real multi-rank run checked against a single-process reference "
        "(requires_grad flags, optimizer-tracked params, grads, clip norm, updates).</p></header>",
        '<div class="sticky" id="filters">', *filters, '<span id="shown"></span></div>', _legend(),
        "<main><h2>Environments</h2>", *_environments(report), "<h2>Summary</h2>", *_counts(sections),
        f"<p>Rendezvous retries (harness): {len(grid.rendezvous_retried(cells))} cell(s) were rerun because "
        "joining their fresh process group hung.</p>", *grids,
        "</main>",
        '<aside id="details" hidden><button id="close" type="button" aria-label="close">×</button>'
        '<div id="details-body"></div></aside>',
        f'<script type="application/json" id="cell-data">{_json_for_script(payload)}</script>',
        f"<script>\n{_asset('report.js')}</script></body></html>",
    ]) + "\n"
