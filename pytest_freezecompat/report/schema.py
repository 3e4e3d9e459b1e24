"""`matrix.json`, schema 1: what a cell record holds, and a loader that refuses what it can't read.

New fields are optional under schema 1; a reader ignores what it does not know.
"""

from __future__ import annotations

import json
import platform
from importlib import metadata
from pathlib import Path
from typing import Any

from ..core.records import STATUSES

SCHEMA = 1
REQUIRED_CELL_FIELDS = ("id", "model", "framework", "plugin", "init", "checkpoint", "freeze", "environment", "status")


class ReportError(ValueError):
    """A report file we cannot use; the message is one line naming the file."""


def distribution_version(module: str) -> str | None:
    """Version of the distribution that provides top-level `module` (e.g. colossalai, megatron)."""
    top = module.split(".")[0]
    for dist in metadata.packages_distributions().get(top, []):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def environment_info(frameworks: dict[str, str], device: str, backend: str) -> dict[str, Any]:
    """Versions that decide the results: python, torch, each framework this environment runs."""
    return {
        "python": platform.python_version(),
        "torch": distribution_version("torch"),
        "frameworks": {name: distribution_version(module) for name, module in frameworks.items()},
        "device": device,
        "backend": backend,
        "platform": platform.platform(terse=True),
    }


def load(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise ReportError(f"{path}: cannot read report ({exc.strerror})") from None
    except json.JSONDecodeError as exc:
        raise ReportError(f"{path}: not a matrix report (invalid JSON at line {exc.lineno}: {exc.msg})") from None
    if not isinstance(data, dict) or "schema" not in data:
        raise ReportError(f"{path}: not a matrix report (no schema field)")
    if data["schema"] != SCHEMA:
        raise ReportError(f"{path}: report schema {data['schema']!r}, this tool reads schema {SCHEMA}")
    cells = data.get("cells")
    if not isinstance(cells, list) or not isinstance(data.get("environments"), dict):
        raise ReportError(f"{path}: corrupt report (cells must be a list, environments a table)")
    for index, cell in enumerate(cells):
        missing = [f for f in REQUIRED_CELL_FIELDS if not isinstance(cell, dict) or f not in cell]
        if missing:
            raise ReportError(f"{path}: corrupt report (cell {index} lacks {', '.join(missing)})")
        if cell["status"] not in STATUSES:
            raise ReportError(f"{path}: corrupt report (cell {cell['id']} has status {cell['status']!r})")
    return data
