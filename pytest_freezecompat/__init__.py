"""pytest-freezecompat: does partial freezing train correctly under each distributed stack?

`freeze_case` (see `pytest_freezecompat.user`) declares a user's own model as matrix cells.
It is imported lazily: the plugin loads in every pytest run and must not import torch there.
"""

from __future__ import annotations

from typing import Any

__all__ = ["freeze_case"]


def __getattr__(name: str) -> Any:
    if name == "freeze_case":
        from .user import freeze_case

        return freeze_case
    raise AttributeError(f"module 'pytest_freezecompat' has no attribute {name!r}")
