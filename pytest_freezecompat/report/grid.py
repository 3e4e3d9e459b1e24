"""The grid that `matrix.md` and `matrix.html` both draw, built once so the two cannot place a cell differently.

Per framework: blocks (model, init mode, clipping), rows (freeze patterns), columns (plugins), and in each
table cell one slot per checkpoint mode. Cells are found by their key fields, never by re-formatting an id.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ..core.names import HARMFUL
from ..core.records import STATUSES, display_status
from ..verdict.severity import recorded as severity
from .releases import release_order

Cell = dict[str, Any]
#: Summary columns: raw statuses, then the registry's verdicts on some of them.
DISPLAY_STATUSES = (*STATUSES, "known", "fixed?")
#: Why red cells are red (`verdict.cause`), counted apart: does freezing break this stack?
CAUSES = ("freeze", "stack", "both", "harness")
#: What each cause means, in the words both reports use.
CAUSE_HELP = {"freeze": "caused by freezing (the control passes, or a frozen / non-optimized param or the optimizer "
                        "set is wrong)",
              "stack": "the stack fails the same way with nothing frozen",
              "both": "the stack fails with nothing frozen too, and freezing changes or adds to it",
              "harness": "our own harness (or a user's freeze_case function) raised: says nothing about the stack"}
_KEY_FIELDS = ("framework", "model", "init", "clip", "freeze", "plugin", "checkpoint")


def tolerance_text(cell: Cell) -> str | None:
    """How a row's steps were judged, on one line: the fp32 tolerances, and a low precision's measured room."""
    tol = cell.get("tolerance")
    if not tol:
        return None
    text = (f"{tol['precision']}: grads rtol {tol['grad_rtol']:g} atol {tol['grad_atol']:g}; params rtol "
            f"{tol['param_rtol']:g} atol {tol['param_atol']:g}; clip norm rtol {tol['norm_rtol']:g}")
    if "per_tensor_floor" in tol:
        text += (f"; plus {tol['spread_factor']:g}x each tensor's own measured {tol['precision']} spread, at least "
                 f"{tol['per_tensor_floor']:.2e} of its scale (widest {tol['widest_relative_grad_spread']:.2e})")
    elif "spread_factor" in tol:  # judged before the room was per tensor
        text += (f"; plus {tol['spread_factor']:g}x the precision's measured spread (widest relative grad spread "
                 f"{tol['widest_relative_grad_spread']:.2e} of each tensor's scale)")
    used = tol.get("used")
    if used:
        text += f"; used at most {used['grads']:.2g} of it on grads, {used['params']:.2g} on params"
    return text


#: The shares of their tolerance that `tolerance_used_table` shows per precision.
QUANTILES = (0.5, 0.9, 0.99, 1.0)


def tolerance_used(cells: list[Cell]) -> dict[str, dict[str, list[float]]]:
    """Per precision, the sorted shares of their tolerance that passing rows used, grads and params apart (rows
    judged before shares were stated are left out)."""
    found: dict[str, dict[str, list[float]]] = {}
    for cell in cells:
        used = (cell.get("tolerance") or {}).get("used")
        if cell["status"] != "pass" or not used:
            continue
        per = found.setdefault(cell["tolerance"]["precision"], {"grads": [], "params": []})
        for what in per:
            per[what].append(used[what])
    return {precision: {what: sorted(values) for what, values in per.items()} for precision, per in found.items()}


def quantile(values: list[float], q: float) -> float:
    """The `q` quantile of sorted `values` (nearest rank)."""
    return values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))]


def untied(cell: Cell) -> bool:
    """Red (silent or refused) and neither explained by a registry entry or finding nor our own harness."""
    return severity(cell) in HARMFUL and not (cell.get("known_issue") or {}).get("expected")


@dataclass(frozen=True)
class Column:
    plugin: str
    slots: tuple[Cell | None, ...]  # one per `Section.checkpoints`; None: not in the matrix


@dataclass(frozen=True)
class Row:
    freeze: str
    columns: tuple[Column, ...]  # one per `Section.plugins`


@dataclass(frozen=True)
class Block:
    model: str
    init: str
    clip: str
    rows: tuple[Row, ...]


@dataclass(frozen=True)
class GradAccess:
    """Where a user reads a full grad and the clip norm under one plugin
    (sharded stacks hide it: ZeRO in its optimizer, Gemini in chunks)."""

    plugin: str
    grad: str
    norm: str
    save: str = "not recorded"  # the model-checkpoint API the round trip (`resume`) went through


#: A cell's model-checkpoint round trip: it failed the `resume` check, it held, or there was none (a refusal, a
#: red run before the save, a report from before the check).
ROUND_TRIPS = ("failed", "held")


def round_trip(cell: Cell) -> str:
    """`failed`, `held` or "" for a report row."""
    if any(f.get("check") == "resume" for f in cell.get("failures") or ()):
        return "failed"
    return "held" if cell.get("resume_api") and cell["status"] != "error" else ""


@dataclass(frozen=True)
class Section:
    framework: str
    plugins: tuple[str, ...]
    checkpoints: tuple[str, ...]
    blocks: tuple[Block, ...]
    counts: Counter[str]  # raw statuses, plus `known` / `fixed?` for the cells the registry explains or flags
    causes: Counter[str]  # red cells by cause
    cells: int
    grad_access: tuple[GradAccess, ...]
    severities: Counter[str] = dataclasses.field(default_factory=Counter)  # cells by `verdict.severity`
    untied: int = 0  # silent or refused cells that no registry entry or finding explains


#: An axis -> its values in the matrix file's order (`axis_order`); values it does not list come after, as seen.
Order = dict[str, list[str]]


def axis_order(report: dict[str, Any]) -> Order:
    """The matrix file's order of every axis, from the environments that ran (each records its spec's `axes`)."""
    order: dict[str, dict[str, None]] = {}
    for info in report.get("environments", {}).values():
        for axis, values in (info.get("axes") or {}).items():
            if isinstance(values, list):
                order.setdefault(axis, {}).update(dict.fromkeys(v for v in values if isinstance(v, str)))
    return {axis: list(values) for axis, values in order.items()}


def words(report: dict[str, Any]) -> dict[str, dict[str, str]]:
    """Plain words per axis value, from every environment that recorded them (`spec.Spec.words`); a value two
    frameworks name alike (`ddp`) reads as the first environment says."""
    found: dict[str, dict[str, str]] = {}
    for info in report.get("environments", {}).values():
        for axis, values in (info.get("words") or {}).items():
            if isinstance(values, dict):
                for value, text in values.items():
                    if isinstance(text, str):
                        found.setdefault(axis, {}).setdefault(value, text)
    return found


def distinct(cells: Iterable[Cell], field: str, order: Order | None = None) -> tuple[str, ...]:
    """A field's values in the matrix file's order where `order` knows them, then the rest in first-seen order."""
    seen = dict.fromkeys(cell[field] for cell in cells)
    ranked = dict.fromkeys(value for value in (order or {}).get(field, ()) if value in seen)
    return (*ranked, *(value for value in seen if value not in ranked))


def _key(cell: Cell) -> tuple[str, ...]:
    return tuple(cell[field] for field in _KEY_FIELDS)


def _counts(cells: list[Cell]) -> Counter[str]:
    """Raw statuses, `known` / `fixed?`, and the round trips (`resume failed`, `resume held`)."""
    counts = Counter(cell["status"] for cell in cells)
    counts.update(shown for cell in cells if (shown := display_status(cell)) != cell["status"])
    counts.update(f"resume {trip}" for cell in cells if (trip := round_trip(cell)))
    return counts


def _grad_access(cells: list[Cell]) -> tuple[GradAccess, ...]:
    """The first cell per plugin that recorded it: the access path is the plugin's, not the cell's."""
    first: dict[str, GradAccess] = {}
    for cell in cells:
        if cell.get("grad_access") and cell["plugin"] not in first:
            first[cell["plugin"]] = GradAccess(cell["plugin"], cell["grad_access"],
                                               cell.get("grad_norm_source") or "not exposed")
    for cell in cells:  # the save API from the first cell that saved (a refusal saves nothing)
        if cell.get("resume_api") and cell["plugin"] in first and first[cell["plugin"]].save == "not recorded":
            first[cell["plugin"]] = dataclasses.replace(first[cell["plugin"]], save=cell["resume_api"])
    return tuple(first.values())


def _section(framework: str, cells: list[Cell], order: Order | None) -> Section:
    index = {_key(cell): cell for cell in cells}
    plugins, checkpoints = distinct(cells, "plugin", order), distinct(cells, "checkpoint", order)
    blocks = []
    for model in distinct(cells, "model", order):
        for init in distinct((c for c in cells if c["model"] == model), "init", order):
            for clip in distinct((c for c in cells if c["model"] == model and c["init"] == init), "clip", order):
                freezes = distinct((c for c in cells if (c["model"], c["init"], c["clip"]) == (model, init, clip)),
                                   "freeze", order)
                rows = tuple(Row(freeze, tuple(
                    Column(plugin, tuple(index.get((framework, model, init, clip, freeze, plugin, ck))
                                         for ck in checkpoints))
                    for plugin in plugins)) for freeze in freezes)
                blocks.append(Block(model, init, clip, rows))
    causes = Counter(cell["cause"] for cell in cells if cell.get("cause"))
    return Section(framework, plugins, checkpoints, tuple(blocks), _counts(cells), causes, len(cells),
                   _grad_access(cells), Counter(map(severity, cells)), sum(map(untied, cells)))


def by_release(cells: list[Cell], order: Order) -> tuple[list[Cell], Order]:
    """Cells as the grids show them: a framework run on several releases is a section per release, so each cell's
    `framework` becomes `composer@0.23.5` (in copies); the order: the matrix file's frameworks, newest release first."""
    shown = [{**cell, "framework": f"{cell['framework']}@{cell['release']}"} if cell.get("release") else cell
             for cell in cells]
    rank = {fw: k for k, fw in enumerate(order.get("framework", ()))}
    newest_first = sorted(dict.fromkeys(c["framework"] for c in shown),
                          key=lambda label: release_order(label.partition("@")[2]), reverse=True)
    ranked = sorted(newest_first, key=lambda label: (rank.get(label.partition("@")[0], len(rank)),
                                                     label.partition("@")[0]))  # stable: newest first stays
    return shown, {**order, "framework": ranked}


def sections(cells: list[Cell], order: Order | None = None) -> list[Section]:
    """One section per framework, in the matrix file's order (`axis_order`), else in report order."""
    return [_section(framework, [c for c in cells if c["framework"] == framework], order)
            for framework in distinct(cells, "framework", order)]


def known_issues(cells: Iterable[Cell]) -> dict[str, tuple[dict[str, Any], list[Cell]]]:
    """Registry entries by id, in first-seen order, with the cells each is tied to (both reports list them)."""
    entries: dict[str, tuple[dict[str, Any], list[Cell]]] = {}
    for cell in cells:
        known = cell.get("known_issue") or {}
        if known.get("id"):
            entries.setdefault(known["id"], (known, []))[1].append(cell)
    return entries


def framing_problem(known: dict[str, Any], cells: list[Cell]) -> str | None:
    """Where an entry's word on freezing and its red cells' causes disagree: `about_freezing = false` yet a cell's
    nothing-frozen control passes, or about freezing yet every red cell's control fails alike (a mis-framed entry
    shows in the report, as a stale range does)."""
    causes = Counter(cell.get("cause") for cell in cells if severity(cell) in HARMFUL)
    if known.get("about_freezing") is False and causes["freeze"]:
        return (f"says it is not about freezing, yet the nothing-frozen control passes where {causes['freeze']} of "
                "its cells fail")
    if known.get("about_freezing", True) and causes["stack"] and causes["stack"] == sum(causes.values()):
        return f"every one of its {causes['stack']} red cells' nothing-frozen control fails alike: not about freezing?"
    return None


def links(known: dict[str, Any]) -> list[str]:
    """An entry's upstream threads (reports written before `links` have one `link`)."""
    return list(known.get("links") or ([known["link"]] if known.get("link") else []))


def rendezvous_retried(cells: list[dict[str, Any]]) -> list[str]:
    """Ids of cells rerun because joining their fresh process group hung: a harness event the report counts."""
    return [cell["id"] for cell in cells if cell.get("rendezvous_retries")]
