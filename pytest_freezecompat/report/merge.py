"""Merge shards from several environments into one report; a cell reported twice is an error."""

from __future__ import annotations

from typing import Any

from .schema import ReportError
from .write import build


def merge(shards: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """`shards` are (source name, loaded report) pairs, e.g. from `schema.load`."""
    environments: dict[str, Any] = {}
    cells: dict[str, dict[str, Any]] = {}
    origin: dict[str, str] = {}
    for source, report in shards:
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
