"""`matrix.html`: the whole report as one self-contained page, rendered from `assets/report.html.j2`.

The grids are `grid.sections`, as `matrix.md`'s are (per framework: rows are freeze patterns, a column group
per plugin with one labelled column per checkpoint mode), one coloured square per cell. CSS and JS are package
files inlined into the page, so nothing is fetched. Jinja escapes every value written into markup; the cell
records travel as JSON in a `<script type="application/json">` block that the page reads with `JSON.parse` and
writes into the DOM with `textContent` only, so nothing from a message, traceback or link can become markup.

The records are embedded compactly (`_Payload`), so the page grows linearly in cells: each distinct string
(message, traceback line, repro piece) is stored once and referenced by index, records are positional rows,
fields the details panel does not show are dropped, and long texts keep a bounded tail (matrix.json has all).
"""

from __future__ import annotations

import json
import re
from collections import Counter, defaultdict
from importlib import resources
from typing import Any

import jinja2
from markupsafe import Markup

from ..advice.answer import change_text
from ..advice.workarounds import outcome
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

#: Raw status -> glyph. The glyph always shows the raw status; colour shows the display status.
GLYPHS = {"pass": "✓", "fail": "✗", "error": "!", "timeout": "◷", "crash": "†", "skip": "–"}
#: A pass whose deciding check did not run never shows the pass's tick.
UNPROVEN_GLYPH = "?"
DISPLAY_HELP = {
    "pass": "every check held", "fail": "ran, a check failed", "error": "raised", "timeout": "hung",
    "crash": "a rank died", "skip": "not runnable here",
    "known": "failed as a known upstream issue says (xfail)",
    "fixed?": "passed though a known issue expects a failure (xpass: stale entry?)",
}
#: Bounds per embedded value, so one cell adds a bounded number of bytes however long its texts are.
STRING_CHARS = 2000
TAIL_LINES = 60
TAIL_CHARS = 6000
LIST_ITEMS = 60
#: The notes section: the message shown per group, and how many of its cells are named.
NOTE_CHARS = 240
NOTE_IDS = 4
#: Positional rows of the embedded records, by shape. Kinds: s string, v JSON value, S list of strings,
#: t text (tail, by line), r command line (by argument), k known-issue entry, [x] list of shape x, x shape x.
#: `instead`: a red cell's nearest safe setups; `workarounds`: its entry's, each with the cell that proves it or not.
SHAPES: dict[str, tuple[tuple[str, str], ...]] = {
    "cell": (("id", "s"), ("model", "s"), ("framework", "s"), ("plugin", "s"), ("init", "s"), ("checkpoint", "s"),
             ("freeze", "s"), ("clip", "s"), ("environment", "s"), ("status", "s"), ("display", "s"), ("cause", "s"),
             ("check", "s"), ("emulation", "v"), ("precision", "s"), ("world_size", "v"), ("duration_s", "v"),
             ("grad_access", "s"), ("grad_norm_source", "s"), ("resume", "s"), ("resume_api", "s"),
             ("round_trip_of", "s"), ("message", "s"), ("notes", "S"), ("severity", "s"), ("convention", "s"),
             ("differences", "S"), ("unchecked", "S"), ("tolerance", "s"),
             ("stack", "s"), ("versions", "s"), ("tied", "S"), ("cpu_only", "s"),
             ("known_issue", "k"), ("repro", "r"), ("failures", "[failure]"), ("rank_details", "[rank]"),
             ("instead", "[instead]"), ("workarounds", "[workaround]")),
    "instead": (("change", "s"), ("cell", "s"), ("severity", "s")),
    "workaround": (("workaround", "s"), ("says", "s"), ("proof", "s"), ("holds", "v"), ("outcome", "s")),
    "failure": (("check", "s"), ("step", "v"), ("message", "s"), ("params", "S")),
    "rank": (("rank", "v"), ("phase", "s"), ("error", "error"), ("exit", "s"), ("traceback", "t"), ("stack", "t"),
             ("log_tail", "t"), ("emulated", "S")),
    "error": (("type", "s"), ("message", "s"), ("where", "s"), ("phase", "s")),
}
_PIECES = {"t": re.compile(r"(?<=\n)"), "r": re.compile(r"(?<=[ ,])")}
_ENV = jinja2.Environment(loader=jinja2.PackageLoader(__package__, "assets"), autoescape=True, trim_blocks=True,
                          lstrip_blocks=True, undefined=jinja2.StrictUndefined)


def _asset(name: str) -> Markup:
    """Our own CSS/JS, inlined verbatim (not escaped), so a report opened from disk fetches nothing."""
    return Markup((resources.files(__package__) / "assets" / name).read_text(encoding="utf-8"))


def _css_class(display: str) -> str:
    return "d-fixed" if display == "fixed?" else f"d-{display}"


def _json_for_script(value: Any) -> Markup:
    """JSON that cannot end its <script> element or open markup inside it."""
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    return Markup(text.replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e"))


def _cut(text: str) -> str:
    if len(text) <= STRING_CHARS:
        return text
    return text[:STRING_CHARS] + f"… [{len(text) - STRING_CHARS} more characters in matrix.json]"


def _tail(text: str) -> str:
    """A traceback or log ends with what broke: keep its last lines, and say where the rest is."""
    tail = ""
    for line in reversed(text.splitlines(keepends=True)[-TAIL_LINES:]):
        if len(tail) + len(line) > TAIL_CHARS:
            tail = tail or line[-TAIL_CHARS:]
            break
        tail = line + tail
    if len(tail) == len(text):
        return text
    return f"[{len(text) - len(tail)} earlier characters left out here; matrix.json has the full text]\n{tail}"


class _Payload:
    """The page's data: every distinct string and text once, records as positional rows that refer to them."""

    def __init__(self) -> None:
        self.strings: dict[str, int] = {}
        self.texts: dict[tuple[int, ...], int] = {}
        self.issues: dict[str, int] = {}

    def string(self, value: str) -> int:
        return self.strings.setdefault(_cut(value), len(self.strings))

    def text(self, value: str, kind: str) -> int:
        pieces = tuple(self.string(p) for p in _PIECES[kind].split(_tail(value) if kind == "t" else value) if p)
        return self.texts.setdefault(pieces, len(self.texts))

    def issue(self, known: dict[str, Any]) -> int:
        entry = {"id": known["id"], "summary": known.get("summary", ""), "links": grid.links(known),
                 "expected": bool(known.get("expected")), "fixed": bool(known.get("fixed")),
                 "kind_words": kind_words(known), "reproducer": known.get("reproducer", ""),
                 "no_workaround": known.get("no_workaround", "")}
        return self.issues.setdefault(json.dumps(entry, sort_keys=True), len(self.issues))

    def value(self, value: Any, kind: str) -> Any:
        if value is None or value is False or value in ("", [], {}):
            return None  # a row's absent and empty fields read the same in the page
        if kind == "s":
            return self.string(str(value))
        if kind == "S":
            more = [f"… and {len(value) - LIST_ITEMS} more"] if len(value) > LIST_ITEMS else []
            return [self.string(str(v)) for v in [*value[:LIST_ITEMS], *more]]
        if kind in _PIECES:
            return self.text(str(value), kind)
        if kind == "k":
            return self.issue(value)
        if kind.startswith("["):
            return [self.row(item, kind[1:-1]) for item in value]
        return value if kind == "v" else self.row(value, kind)

    def row(self, record: dict[str, Any], shape: str) -> list[Any]:
        row = [self.value(record.get(name), kind) for name, kind in SHAPES[shape]]
        while row and row[-1] is None:
            row.pop()
        return row

    def encode(self, cells: list[dict[str, Any]], plugins: tuple[str, ...]) -> dict[str, Any]:
        """`plugins`: the page's plugin columns, by the index their `data-p` attribute holds."""
        rows = [self.row({**cell, "display": display_status(cell), "resume": grid.round_trip(cell),
                          "severity": grid.severity(cell), "unchecked": not_checked(cell.get("unchecked") or ()),
                          "tolerance": grid.tolerance_text(cell), "stack": _facts_text(cell.get("observed")),
                          "versions": _facts_text(cell.get("versions")),
                          "cpu_only": cpu_only(cell.get("known_issue") or {}),
                          "instead": [{**found, "change": change_text(found["changes"])}
                                      for found in cell.get("instead") or []],
                          "workarounds": [{**proof, "outcome": outcome(proof)}
                                          for proof in cell.get("workarounds") or []]}, "cell") for cell in cells]
        return {"shapes": SHAPES, "strings": list(self.strings), "texts": [list(t) for t in self.texts],
                "issues": [json.loads(i) for i in self.issues], "plugins": plugins, "cells": rows}


def _facts_text(facts: dict[str, str] | None) -> str | None:
    """`wrapper DeepSpeedEngine · zero_stage 2`: a row's observed stack or versions in one line."""
    return " · ".join(f"{name} {value}" for name, value in facts.items()) if facts else None


def _emulated(cells: list[dict[str, Any]]) -> bool:
    """Every cell that ran, ran under the CUDA-on-CPU shim (a skip ran nothing): say it once, not per square."""
    ran = [c for c in cells if c["status"] != "skip"]
    return bool(ran) and all(c.get("emulation") for c in ran)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]+", "-", text).strip("-") or "x"


#: A filter's label in plain words (the axis's own name where it is already plain).
FILTER_NAMES = {"severity": "how bad", "framework": "framework release", "plugin": "wrapper (plugin)",
                "freeze": "what is frozen", "clip": "clipping", "status": "raw status", "cause": "why red",
                "resume": "save → load"}
#: The registry's word on a square is a badge on its severity colour, never a colour that hides the harm.
REGISTRY_BADGES = {"known": " kn", "fixed?": " fx"}


def _square(cell: dict[str, Any], index: int, mark_emulation: bool) -> dict[str, Any]:
    display = display_status(cell)
    return {"i": index, "css": f"sev-{grid.severity(cell)}" + REGISTRY_BADGES.get(display, "")
            + (" emu" if mark_emulation and cell.get("emulation") else "")
            + (" rs" if grid.round_trip(cell) == "failed" else ""),
            "display": display, "cause": cell.get("cause") or "",
            "glyph": UNPROVEN_GLYPH if grid.severity(cell) == "unproven" else GLYPHS[cell["status"]]}


def _section(section: grid.Section, index: dict[str, int], plugin_index: dict[str, int]) -> dict[str, Any]:
    """The template's view of one framework: its column groups, and each slot as a square or a gap."""
    cells = [c for block in section.blocks for row in block.rows for col in row.columns for c in col.slots if c]
    everywhere = _emulated(cells)
    columns = {p: not everywhere and _emulated([c for c in cells if c["plugin"] == p]) for p in section.plugins}
    blocks = [{"model": block.model, "init": block.init,
               "clip": None if block.clip == LATER_AXES["clip"] else block.clip, "rows": [
        {"freeze": row.freeze, "slots": [
            {"p": plugin_index[col.plugin], "first": k == 0,
             "square": cell and _square(cell, index[cell["id"]], not everywhere and not columns[col.plugin])}
            for col in row.columns for k, cell in enumerate(col.slots)]}
        for row in block.rows]} for block in section.blocks]
    return {"name": section.framework, "id": f"framework-{_slug(section.framework)}", "cells": section.cells,
            "emulated": everywhere, "checkpoints": section.checkpoints, "access": section.grad_access,
            "plugins": [{"name": p, "p": plugin_index[p], "emulated": columns[p]} for p in section.plugins],
            "blocks": blocks, "counts": section.counts, "causes": section.causes, "severities": section.severities,
            "untied": section.untied}


def _workarounds(issue_id: str, known: dict[str, Any], table: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry's workarounds: what each says, and its state per release as the run proved it."""
    views: dict[str, dict[str, Any]] = {}
    for row in table:
        if row["entry"] == issue_id:
            view = views.setdefault(row["workaround"], {"workaround": row["workaround"], "releases": [],
                                                        "says": row.get("says", "")})
            view["releases"].append({"release": row["release"], "state": row["state"], "held": row["held"],
                                     "judged": row["held"] + row["not_held"]})
    return list(views.values())


def _known_issues(cells: list[dict[str, Any]], table: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each registry entry that matched cells, in first-matched order, with its cells by display status and its
    workarounds' states per release."""
    views = []
    for issue_id, (known, mine) in grid.known_issues(cells).items():
        counts = Counter(map(display_status, mine))
        views.append({"id": issue_id, "summary": known.get("summary", ""), "links": grid.links(known),
                      "cells": len(mine), "known": counts["known"], "fixed": counts["fixed?"],
                      "other": ", ".join(f"{n} {s}" for s, n in counts.items() if s not in ("known", "fixed?")),
                      "fixed_in": fixed_in_words(known), "cpu_only": cpu_only(known) or "",
                      "narrow": sum(bool((c.get("known_issue") or {}).get("range_too_narrow")) for c in mine),
                      "workarounds": _workarounds(issue_id, known, table),
                      "no_workaround": known.get("no_workaround", "")})
    return views


def _notes(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Red cells no known issue explains, and `fixed?` ones, grouped by how they failed (as matrix.md groups)."""
    groups: dict[tuple[str, str, str, str], list[dict[str, Any]]] = defaultdict(list)
    for cell in cells:
        display = display_status(cell)
        if display in FAILING or display == "fixed?":
            message = cell.get("message") or "; ".join(cell.get("notes") or [])
            message = clip(message, NOTE_CHARS)
            groups[(display, cell.get("check") or "", cell.get("cause") or "", message)].append(cell)
    order = [*STATUSES, "fixed?"]
    return [{"display": display, "css": _css_class(display), "check": check, "cause": cause, "message": message,
             "count": len(members), "ids": [m["id"] for m in members[:NOTE_IDS]], "more": len(members) - NOTE_IDS}
            for (display, check, cause, message), members in sorted(
                groups.items(), key=lambda g: (order.index(g[0][0]), -len(g[1]), g[0][1:]))]


def _one_or_many(values: list[str]) -> str:
    distinct = list(dict.fromkeys(v for v in values if v))
    return ", ".join(distinct) if distinct else "not recorded"


def _run(environments: dict[str, Any]) -> dict[str, Any]:
    """The header's run line: each value once when the environments agree; `recorded` is False for older reports."""
    runs = [info.get("run") or {} for info in environments.values()]
    dates = sorted(r["date"] for r in runs if r.get("date"))
    span = " … ".join(dict.fromkeys([dates[0], dates[-1]])) if dates else "not recorded"
    return {"recorded": any(runs), "date": span, "commit": _one_or_many([r.get("commit") or "" for r in runs]),
            "plugin": _one_or_many([r.get("plugin") or "" for r in runs])}


def _environments(environments: dict[str, Any]) -> list[dict[str, Any]]:
    """Per environment: the versions that decide its results, and the run that made its cells (or `-`)."""
    views = []
    for name, info in sorted(environments.items()):
        frameworks = info.get("frameworks") or {}
        torch = info.get("torch") or "?"
        versions = [f"{k} {v}" for k, v in sorted(frameworks.items())]
        views.append({
            "name": name, "python": info.get("python", "?"), "torch": torch, "frameworks": ", ".join(versions),
            "versions": " · ".join([*versions, *([] if "torch" in frameworks else [f"torch {torch}"]),
                                    f"python {info.get('python', '?')}"]),
            "device": f"{info.get('device', '?')} ({info.get('backend', '?')})",
            "lock": _lock(info.get("lock")),
            **{k: (info.get("run") or {}).get(k) or "-" for k in ("plugin", "commit", "date", "command")}})
    return views


def _lock(lock: dict[str, Any] | None) -> str:
    """The environment's lock file and hash prefix, or where the run differed from it; `-` without a lock."""
    if not lock:
        return "-"
    differs = lock.get("differs") or []
    return f"matrix/{lock['file']} ({lock['sha256'][:12]})" + (f", not as locked: {', '.join(differs)}" if differs
                                                                 else "")


def render(report: dict[str, Any]) -> str:
    """The page for `report` (matrix.json's content), self-contained and linear in size in its cells."""
    rows = [with_later_axes(cell) for cell in report["cells"]]
    cells, order = grid.by_release(rows, grid.axis_order(report))
    sections = grid.sections(cells, order)
    plugins = grid.distinct(cells, "plugin", order)
    plugin_index = {p: k for k, p in enumerate(plugins)}
    index = {cell["id"]: k for k, cell in enumerate(cells)}
    present = [s for s in grid.DISPLAY_STATUSES if any(s in section.counts for section in sections)]
    filters = {"severity": [v for v in SEVERITIES if any(s.severities[v] for s in sections)],
               "framework": [s.framework for s in sections], "plugin": plugins,
               "freeze": grid.distinct(cells, "freeze", order), "clip": grid.distinct(cells, "clip", order),
               "status": present,
               "cause": [c for c in grid.CAUSES if any(s.causes[c] for s in sections)],
               "resume": [r for r in grid.ROUND_TRIPS if any(s.counts[f"resume {r}"] for s in sections)]}
    views = [_section(section, index, plugin_index) for section in sections]
    ids = Counter(view["id"] for view in views)
    for k, view in enumerate(views):  # frameworks whose names slug alike still get their own anchor
        view["id"] += f"-{k}" if ids[view["id"]] > 1 else ""
    totals = {"counts": sum((s.counts for s in sections), Counter()),
              "causes": sum((s.causes for s in sections), Counter()), "cells": len(cells),
              "severities": sum((s.severities for s in sections), Counter()),
              "untied": sum(s.untied for s in sections)}
    return _ENV.get_template("report.html.j2").render(
        css=_asset("report.css"), js=_asset("report.js"), data=_json_for_script(_Payload().encode(cells, plugins)),
        run=_run(report["environments"]), environments=_environments(report["environments"]), filters=filters,
        sections=views, totals=totals, statuses=grid.DISPLAY_STATUSES, causes=grid.CAUSES, glyphs=GLYPHS,
        round_trips=grid.ROUND_TRIPS, severities=SEVERITIES, severity_help=SEVERITY_MEANING,
        filter_names=FILTER_NAMES, words=grid.words(report),
        display_help=DISPLAY_HELP, cause_help=grid.CAUSE_HELP, css_class=_css_class,
        known_issues=_known_issues(cells, report.get("workarounds") or []), notes=_notes(cells),
        across_releases=releases.across_releases(rows, report.get("bisections") or []),
        retried=len(grid.rendezvous_retried(cells)))
