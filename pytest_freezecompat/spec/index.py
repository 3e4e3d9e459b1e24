"""The package index's JSON API (`<index>/<name>/json`): what the release watch and the locks' cutoff dates ask.

Stdlib only: nox's own process asks it too (`nox -s locks`), without this package installed.
"""

from __future__ import annotations

import json
import urllib.request
from typing import Any

#: PyPI's JSON API; a folder of recorded answers works as a `file://` index.
INDEX = "https://pypi.org/pypi"


class IndexUnavailable(RuntimeError):
    """The index could not be asked: one line naming the package and the address."""


def answer(package: str, index: str | None = None, timeout_s: float = 60.0) -> dict[str, Any]:
    """The index's JSON answer for `package` (its `releases`: version -> files with their upload times)."""
    address = f"{(index or INDEX).rstrip('/')}/{package}/json"
    try:
        with urllib.request.urlopen(address, timeout=timeout_s) as reply:
            return json.load(reply)
    except (OSError, ValueError) as exc:
        raise IndexUnavailable(f"the package index did not answer for {package} ({address}: {exc})") from None
