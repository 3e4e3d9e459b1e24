"""Write a report directory atomically: matrix.json, matrix.md, matrix.html and guide.md, never half a file."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from .. import advice
from . import guide, html, markdown
from .schema import SCHEMA


def _atomic_write(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.chmod(tmp, 0o644)  # mkstemp makes it private; a report is for reading
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def build(environments: dict[str, Any], cells: list[dict[str, Any]]) -> dict[str, Any]:
    return {"schema": SCHEMA, "environments": environments, "cells": sorted(cells, key=lambda c: c["id"])}


def write(directory: Path, report: dict[str, Any]) -> Path:
    """Write matrix.json, matrix.md, matrix.html and guide.md into `directory`, with the advice computed from its cells
    (each red cell's nearest safe setups, each workaround's proof), so every format shows the same."""
    directory.mkdir(parents=True, exist_ok=True)
    advice.annotate(report)
    _atomic_write(directory / "matrix.json", json.dumps(report, indent=1, sort_keys=True) + "\n")
    _atomic_write(directory / "matrix.md", markdown.render(report))
    _atomic_write(directory / "matrix.html", html.render(report))
    _atomic_write(directory / "guide.md", guide.render(report))
    return directory / "matrix.json"
