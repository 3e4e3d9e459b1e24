"""Merge shards from several environments into one report; a cell reported twice is an error."""

from __future__ import annotations

from typing import Any

from .schema import ReportError
from .write import build


def merge(shards: list[tuple[str, dict[str, Any]]], *, replace: bool = False) -> dict[str, Any]:
    """`shards` are (source name, loaded report) pairs, e.g. from `schema.load`. `replace`: a later shard's
    environments replace an earlier one's, their cells with them (a published report, then a new run of some of its
    environments: the release watch's new column or bumped pin)."""
    environments: dict[str, Any] = {}
    cells: dict[str, dict[str, Any]] = {}
    origin: dict[str, str] = {}
    for source, report in shards:
        if replace:
            renewed = report["environments"].keys()
            cells = {key: cell for key, cell in cells.items() if cell.get("environment") not in renewed}
            environments = {name: info for name, info in environments.items() if name not in renewed}
        for name, info in report["environments"].items():
            if name in environments and environments[name] != info:
                raise ReportError(f"{source}: environment {name!r} differs from the one in {origin.get('env:' + name)}")
            environments[name] = info
            origin.setdefault("env:" + name, source)
        for cell in report["cells"]:
            if cell["id"] in cells:
                raise ReportError(f"{source}: cell {cell['id']} is also in {origin[cell['id']]} (duplicate cell)")
            cells[cell["id"]] = cell
            origin[cell["id"]] = source
    return build(environments, list(cells.values()))
