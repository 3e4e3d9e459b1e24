"""What differs between the Composer releases (and their pinned torch) the adapter runs on, 0.23.5 to 0.32.1.

Each difference is one named function, found by feature detection (an import or an attribute) rather than
by version number, so the adapter itself reads the same on every release. None of them touches what the
matrix judges: Composer's optimizer handling and FSDP wrapping run as each release ships them.
"""

from __future__ import annotations

import importlib
from typing import Any

#: The first Composer release with FSDP2 (`FSDP2Config`, `fully_shard` under `parallelism_config`).
FSDP2_FROM = "0.31"


def is_dtensor(value: Any) -> bool:
    """`isinstance(value, DTensor)` wherever this torch keeps the class (public from torch 2.4 only)."""
    from ..materialize import DTensor

    return isinstance(value, DTensor)


def fsdp2_config_class() -> type | None:
    """Composer's `FSDP2Config`, or None on a release without FSDP2 (before 0.31): its FSDP cells are FSDP1.

    Rules in matrix/frameworks/composer.toml keep the fsdp2 plugins off those releases; the adapter refuses
    them with this reason if one is asked for anyway.
    """
    parallelism = importlib.import_module("composer.utils.parallelism")
    return getattr(parallelism, "FSDP2Config", None)


def composer_version() -> str:
    """The installed Composer release, for messages."""
    import composer

    return str(getattr(composer, "__version__", "unknown"))
