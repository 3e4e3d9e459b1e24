"""Tied and shared params: one tensor under several module paths (a head tied to its input embedding).

Pure (no torch). `named_parameters()` lists such a tensor once, under its first name; its other names (aliases)
are no param a pattern can match, and freezing one name freezes them all.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping

#: alias -> the first name of its tensor, as `named_parameters()` lists it.
Ties = Mapping[str, str]


def ties_of(paths: Iterable[tuple[str, object]]) -> dict[str, str]:
    """Each alias and its tensor's first name, from (path, tensor) pairs in `named_parameters(remove_duplicate=False)`
    order; tensors are compared by identity (they stay alive in the model while it is read)."""
    first: dict[int, str] = {}
    ties: dict[str, str] = {}
    for name, tensor in paths:
        owner = first.setdefault(id(tensor), name)
        if owner != name:
            ties[name] = owner
    return ties


def alias_hint(glob: str, ties: Ties) -> str:
    """Why `glob` matches no parameter where it names aliases only: '' where it names none."""
    aliases = fnmatch.filter(sorted(ties), glob)
    if not aliases:
        return ""
    alias = aliases[0]
    more = f" (and {len(aliases) - 1} more)" if len(aliases) > 1 else ""
    return (f": {alias} is tied to {ties[alias]}{more} (one tensor, listed under its first name); name "
            f"{ties[alias]}, which freezes or trains both")
