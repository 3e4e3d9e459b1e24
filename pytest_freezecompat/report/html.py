"""`matrix.html`: the whole report as one self-contained page (inline CSS and JS, nothing fetched).

The grids mirror `matrix.md` (per framework, model and init mode: rows are freeze patterns, columns
plugins, the checkpoint modes side by side in each table cell), one coloured square per cell. The
filters and the details panel run in the page; every cell's record travels as JSON in a
`<script type="application/json">` block that the page reads with `JSON.parse` and writes into the
DOM with `textContent` only, so nothing from a message, traceback or link can become markup.
"""

from __future__ import annotations

import json
from collections import Counter
from html import escape
from typing import Any

from ..core.records import display_status

#: Display status -> (label, glyph). The glyph always shows the raw status; colour shows the display status.
GLYPHS = {"pass": "✓", "fail": "✗", "error": "!", "timeout": "◷", "crash": "†", "skip": "–"}
DISPLAY_ORDER = ("pass", "fail", "error", "timeout", "crash", "skip", "known", "fixed?")
DISPLAY_HELP = {
    "pass": "every check held", "fail": "ran, a check failed", "error": "raised", "timeout": "hung",
    "crash": "a rank died", "skip": "not runnable here",
    "known": "failed the way a known upstream issue says (xfail)",
    "fixed?": "passed though a known issue expects it to fail (strict xpass: the entry may be stale)",
}

CSS = """
:root{--pass:#2e7d32;--fail:#c62828;--error:#e65100;--timeout:#6a1b9a;--crash:#212121;--skip:#cfd8dc;
--known:#f9a825;--fixed:#1e88e5;--line:#d0d7de;--muted:#57606a}
*{box-sizing:border-box}
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,"DejaVu Sans",sans-serif;margin:0;color:#1f2328}
header{padding:16px 24px 8px}h1{margin:0 0 4px;font-size:22px}h2{margin:28px 0 6px;font-size:19px}
h3{margin:16px 0 6px;font-size:14px;font-weight:600;color:#333}
main{padding:0 24px 40px}p.lead{margin:0;color:var(--muted);max-width:70em}
table{border-collapse:collapse}th,td{border:1px solid var(--line);padding:3px 6px;text-align:left;vertical-align:middle}
thead th{background:#f6f8fa;font-weight:600;white-space:nowrap}
table.grid td{white-space:nowrap;padding:3px 4px}table.grid tbody th{font-weight:500;white-space:nowrap}
.sticky{position:sticky;top:0;z-index:2;background:#fff;border-bottom:1px solid var(--line);padding:8px 24px;
display:flex;flex-wrap:wrap;gap:14px;align-items:center}
.sticky label{display:flex;gap:6px;align-items:center;font-weight:600}
.sticky select{font:inherit;padding:2px 4px}#shown{color:var(--muted)}
.legend{display:flex;flex-wrap:wrap;gap:12px;padding:4px 24px 8px}.legend span{display:flex;gap:5px;align-items:center}
button.cell,.swatch{display:inline-flex;justify-content:center;align-items:center;width:22px;height:22px;margin:1px;
border:0;border-radius:3px;font:700 13px/1 "DejaVu Sans",sans-serif;color:#fff;cursor:pointer;padding:0;
position:relative}
button.cell:focus-visible,button.cell.active{outline:3px solid #0969da;outline-offset:1px}
.d-pass{background:var(--pass)}.d-fail{background:var(--fail)}.d-error{background:var(--error)}
.d-timeout{background:var(--timeout)}.d-crash{background:var(--crash)}.d-skip{background:var(--skip);color:#37474f}
.d-known{background:repeating-linear-gradient(135deg,var(--known) 0 5px,#fbc02d 5px 8px);color:#3e2723}
.d-fixed{background:var(--fixed)}
button.emu::after,.swatch.emu::after{content:"E";position:absolute;right:1px;top:0;font-size:8px;color:inherit}
.absent{display:inline-block;width:22px;text-align:center;color:#aaa;margin:1px}
.counts td,.counts th{text-align:right}.counts td:first-child{text-align:left}
table.access{margin-top:10px}table.access code{font-size:12px}
[hidden]{display:none!important}
aside#details{position:fixed;top:0;right:0;bottom:0;width:min(760px,100%);background:#fff;
border-left:1px solid var(--line);
box-shadow:-6px 0 24px rgba(0,0,0,.15);overflow:auto;padding:16px 20px 40px;z-index:5}
aside#details h2{margin:0 32px 8px 0;font-size:16px;word-break:break-all}
aside#details h3{margin:18px 0 6px;font-size:13px;text-transform:uppercase;letter-spacing:.04em;color:var(--muted)}
#close{position:absolute;top:10px;right:12px;font-size:20px;border:0;background:none;cursor:pointer}
pre{background:#f6f8fa;border:1px solid var(--line);border-radius:4px;padding:8px;white-space:pre-wrap;
word-break:break-word;font:12px/1.4 ui-monospace,"DejaVu Sans Mono",monospace;margin:4px 0;max-height:28em;
overflow:auto}
dl.facts{display:grid;grid-template-columns:max-content 1fr;gap:2px 12px;margin:0}dl.facts dt{color:var(--muted)}
dl.facts dd{margin:0;word-break:break-word}
.badge{display:inline-block;padding:1px 8px;border-radius:10px;color:#fff;font-weight:600;margin-right:6px}
.rank{border-top:1px solid var(--line);margin-top:10px;padding-top:6px}
"""

JS = """
(function () {
  const data = JSON.parse(document.getElementById('cell-data').textContent);
  const buttons = Array.from(document.querySelectorAll('button.cell'));
  const selects = Array.from(document.querySelectorAll('select[data-axis]'));
  const panel = document.getElementById('details');
  const body = document.getElementById('details-body');

  function el(tag, text, cls) {
    const e = document.createElement(tag);
    if (text !== undefined && text !== null) e.textContent = String(text);
    if (cls) e.className = cls;
    return e;
  }
  function wanted() {
    const w = {};
    selects.forEach(s => { if (s.value) w[s.dataset.axis] = s.value; });
    return w;
  }
  function visible(b, w) {
    return (!w.framework || b.dataset.framework === w.framework) && (!w.plugin || b.dataset.plugin === w.plugin)
      && (!w.freeze || b.dataset.freeze === w.freeze)
      && (!w.status || b.dataset.display === w.status || b.dataset.status === w.status);
  }
  function apply() {
    const w = wanted();
    let shown = 0;
    buttons.forEach(b => { const v = visible(b, w); b.hidden = !v; if (v) shown++; });
    document.querySelectorAll('[data-plugin]:not(button)').forEach(e => {
      e.hidden = !!w.plugin && e.dataset.plugin !== w.plugin;
    });
    document.querySelectorAll('tr[data-freeze]').forEach(e => {
      e.hidden = !!w.freeze && e.dataset.freeze !== w.freeze;
    });
    document.querySelectorAll('.block,section.framework').forEach(e => {
      e.hidden = !e.querySelector('button.cell:not([hidden])');
    });
    document.getElementById('shown').textContent = shown + ' of ' + buttons.length + ' cells shown';
  }
  function add(dl, term, value) {
    if (value === undefined || value === null || value === '') return;
    dl.append(el('dt', term), el('dd', value));
  }
  function pre(parent, title, text) {
    if (text) parent.append(el('h3', title), el('pre', text));
  }
  function link(href) {
    const a = el('a', href);
    if (/^https?:\\/\\//.test(href)) { a.href = href; a.target = '_blank'; a.rel = 'noopener noreferrer'; }
    return a;
  }
  function show(id) {
    const c = data[id];
    if (!c) return;
    buttons.forEach(b => b.classList.toggle('active', b.dataset.id === id));
    body.replaceChildren(el('h2', id));
    const line = el('p');
    line.append(el('span', c.status, 'badge d-' + c.status));
    const shown = c.display === 'fixed?' ? 'fixed' : c.display;
    if (c.display !== c.status) line.append(el('span', c.display, 'badge d-' + shown));
    if (c.check) line.append(el('span', 'failed check: ' + c.check));
    body.append(line);
    const dl = el('dl', undefined, 'facts');
    ['model', 'framework', 'plugin', 'init', 'checkpoint', 'freeze', 'environment', 'precision', 'world_size']
      .forEach(k => add(dl, k, c[k]));
    const emulated = [];
    (c.rank_details || []).forEach(r => (r.emulated || []).forEach(x => {
      if (!emulated.includes(x)) emulated.push(x);
    }));
    const what = emulated.length ? ': ' + emulated.join('; ') : '';
    add(dl, 'emulation', c.emulation ? 'yes (CUDA-on-CPU shim)' + what : 'no');
    add(dl, 'grad access', c.grad_access);
    add(dl, 'grad norm source', c.grad_norm_source);
    if (c.duration_s !== undefined) add(dl, 'duration', c.duration_s + ' s');
    body.append(dl);
    pre(body, c.status === 'skip' ? 'reason' : 'message', c.message);
    const k = c.known_issue;
    if (k && k.id) {
      body.append(el('h3', 'known issue'));
      const p = el('p');
      p.append(el('strong', k.id));
      if (k.summary) p.append(el('span', ' — ' + k.summary));
      const ul = el('ul');
      (k.links || (k.link ? [k.link] : [])).forEach(h => { const li = el('li'); li.append(link(h)); ul.append(li); });
      body.append(p, ul);
    }
    if ((c.notes || []).length) {
      const ul = el('ul');
      c.notes.forEach(n => ul.append(el('li', n)));
      body.append(el('h3', 'notes'), ul);
    }
    pre(body, 'reproduce', c.repro);
    (c.rank_details || []).forEach(r => {
      const box = el('div', undefined, 'rank');
      box.append(el('h3', 'rank ' + r.rank + ' — last phase: ' + r.phase));
      const facts = el('dl', undefined, 'facts');
      if (r.error) {
        add(facts, 'error', r.error.type + ': ' + r.error.message);
        add(facts, 'where', r.error.where);
        add(facts, 'phase', r.error.phase);
      }
      add(facts, 'exit', r.exit);
      if (r.emulated && r.emulated.length) add(facts, 'emulated', r.emulated.join('; '));
      box.append(facts);
      pre(box, 'traceback', r.traceback);
      pre(box, 'stack', r.stack);
      pre(box, 'log tail', r.log_tail);
      body.append(box);
    });
    panel.hidden = false;
    if (decodeURIComponent(location.hash.slice(1)) !== id) history.replaceState(null, '', '#' + encodeURIComponent(id));
  }
  function hide() {
    panel.hidden = true;
    buttons.forEach(b => b.classList.remove('active'));
    history.replaceState(null, '', location.pathname + location.search);
  }
  buttons.forEach(b => b.addEventListener('click', () => show(b.dataset.id)));
  selects.forEach(s => s.addEventListener('change', apply));
  document.getElementById('close').addEventListener('click', hide);
  document.addEventListener('keydown', e => { if (e.key === 'Escape') hide(); });
  apply();
  if (location.hash) show(decodeURIComponent(location.hash.slice(1)));
})();
"""


def _ordered(values: list[str]) -> list[str]:
    return list(dict.fromkeys(values))


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
    attrs = {"class": classes, "type": "button", "data-id": cell["id"], "data-framework": cell["framework"],
             "data-plugin": cell["plugin"], "data-freeze": cell["freeze"], "data-status": cell["status"],
             "data-display": display, "title": title, "aria-label": title}
    rendered = " ".join(f'{name}="{escape(str(value), quote=True)}"' for name, value in attrs.items())
    return f"<button {rendered}>{escape(GLYPHS[cell['status']])}</button>"


def _grid(cells: list[dict[str, Any]], index: dict[str, dict[str, Any]], framework: str) -> list[str]:
    plugins = _ordered([c["plugin"] for c in cells])
    checkpoints = _ordered([c["checkpoint"] for c in cells])
    out: list[str] = []
    for model in _ordered([c["model"] for c in cells]):
        for init in _ordered([c["init"] for c in cells if c["model"] == model]):
            scope = [c for c in cells if c["model"] == model and c["init"] == init]
            out.append(f'<div class="block"><h3>{escape(model)}, init <code>{escape(init)}</code> — checkpoint: '
                       f'{escape(" · ".join(checkpoints))}</h3><table class="grid"><thead><tr><th>freeze</th>')
            out += [f'<th data-plugin="{escape(p, quote=True)}">{escape(p)}</th>' for p in plugins]
            out.append("</tr></thead><tbody>")
            for freeze in _ordered([c["freeze"] for c in scope]):
                out.append(f'<tr data-freeze="{escape(freeze, quote=True)}"><th>{escape(freeze)}</th>')
                for plugin in plugins:
                    squares = []
                    for ck in checkpoints:
                        cell = index.get(f"{model}/{framework}/{plugin}/{init}/{ck}/{freeze}")
                        squares.append(_button(cell) if cell else f'<span class="absent" title="{escape(ck)}: not '
                                                                    'in the matrix">·</span>')
                    out.append(f'<td data-plugin="{escape(plugin, quote=True)}">{"".join(squares)}</td>')
                out.append("</tr>")
            out.append("</tbody></table></div>")
    return out


def _access(cells: list[dict[str, Any]]) -> list[str]:
    """Where a user reads a full grad and the clip norm, per plugin (CASES C5)."""
    seen: dict[str, tuple[str, str]] = {}
    for cell in cells:
        if cell.get("grad_access") and cell["plugin"] not in seen:
            seen[cell["plugin"]] = (cell["grad_access"], cell.get("grad_norm_source") or "not exposed")
    if not seen:
        return []
    rows = [f'<tr data-plugin="{escape(p, quote=True)}"><td>{escape(p)}</td><td><code>{escape(g)}</code></td>'
            f"<td>{escape(n)}</td></tr>" for p, (g, n) in seen.items()]
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


def _counts(cells: list[dict[str, Any]]) -> list[str]:
    """Raw statuses per framework, then how many of them the known-issue registry explains or flags."""
    by_framework: dict[str, Counter] = {}
    for cell in cells:
        counts = by_framework.setdefault(cell["framework"], Counter())
        counts[cell["status"]] += 1
        if display_status(cell) != cell["status"]:
            counts[display_status(cell)] += 1
    head = "".join(f'<th><span class="swatch {_css_class(s)}"></span> {escape(s)}</th>' for s in DISPLAY_ORDER)
    rows = [f"<tr><td>{escape(fw)}</td>" + "".join(f"<td>{counts.get(s, 0)}</td>" for s in DISPLAY_ORDER)
            + f"<td>{sum(counts.get(s, 0) for s in GLYPHS)}</td></tr>" for fw, counts in by_framework.items()]
    return [f'<table class="counts"><thead><tr><th>framework</th>{head}<th>cells</th></tr></thead><tbody>', *rows,
            "</tbody></table>"]


def _select(axis: str, values: list[str]) -> str:
    options = "".join(f'<option value="{escape(v, quote=True)}">{escape(v)}</option>' for v in values)
    return (f'<label>{escape(axis)} <select id="filter-{axis}" data-axis="{axis}"><option value="">all</option>'
            f"{options}</select></label>")


def _legend() -> str:
    items = "".join(f'<span><span class="swatch {_css_class(s)}">{escape(GLYPHS.get(s, ""))}</span>'
                    f"{escape(s)}: {escape(DISPLAY_HELP[s])}</span>" for s in DISPLAY_ORDER)
    return (f'<div class="legend">{items}<span><span class="swatch d-pass emu">✓</span>E: ran its real logic on '
            "CPU behind a CUDA-on-CPU shim (emulation)</span><span>The glyph is the raw status; a "
            "<code>known</code> square shows ✗ or ! on amber. Click a square for its details.</span></div>")


def render(report: dict[str, Any]) -> str:
    cells = report["cells"]
    index = {c["id"]: c for c in cells}
    frameworks = _ordered([c["framework"] for c in cells])
    filters = [_select("framework", frameworks), _select("plugin", _ordered([c["plugin"] for c in cells])),
               _select("freeze", _ordered([c["freeze"] for c in cells])),
               _select("status", [s for s in DISPLAY_ORDER if any(display_status(c) == s or c["status"] == s
                                                                   for c in cells)])]
    grids: list[str] = []
    for framework in frameworks:
        fw_cells = [c for c in cells if c["framework"] == framework]
        grids += [f'<section class="framework" data-framework="{escape(framework, quote=True)}">'
                  f"<h2>{escape(framework)}</h2>", *_grid(fw_cells, index, framework), *_access(fw_cells),
                  "</section>"]
    payload = {c["id"]: {**c, "display": display_status(c)} for c in cells}
    return "\n".join([
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>Freeze compatibility matrix</title><style>{CSS}</style></head><body>",
        "<header><h1>Freeze compatibility matrix</h1><p class=\"lead\">Does partial freezing "
        "(<code>requires_grad=False</code>, or params left out of the optimizer) train correctly under each "
        "distributed stack? Every cell is a real multi-rank run checked against a single-process reference "
        "(requires_grad flags, optimizer-tracked params, grads, clip norm, updates).</p></header>",
        '<div class="sticky" id="filters">', *filters, '<span id="shown"></span></div>', _legend(),
        "<main><h2>Environments</h2>", *_environments(report), "<h2>Summary</h2>", *_counts(cells), *grids, "</main>",
        '<aside id="details" hidden><button id="close" type="button" aria-label="close">×</button>'
        '<div id="details-body"></div></aside>',
        f'<script type="application/json" id="cell-data">{_json_for_script(payload)}</script>',
        f"<script>{JS}</script></body></html>",
    ]) + "\n"
