"""Tied and shared params: one tensor under several module paths (a head tied to its input embedding).

Pure (no torch). `named_parameters()` lists such a tensor once, under its first name; its other names (aliases)
are no param a pattern can match, and freezing one name freezes them all. A wrapper or a materialization that
gives each path its own tensor unties them: the two copies then train apart. The words for both live here.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Collection, Iterable, Mapping

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


def trains(name: str, trainable: Collection[str], ties: Ties) -> bool:
    """Whether the pattern trains `name`: an alias trains exactly when its tensor's first name does."""
    return ties.get(name, name) in trainable


def stated(ties: Ties) -> list[str]:
    """The row's `tied`: `head.weight = tok_emb.weight`, one per alias."""
    return [f"{alias} = {first}" for alias, first in sorted(ties.items())]


def alias_hint(glob: str, ties: Ties) -> str:
    """Why `glob` matches no parameter where it names aliases only: '' where it names none."""
    aliases = fnmatch.filter(sorted(ties), glob)
    if not aliases:
        return ""
    alias = aliases[0]
    more = f" (and {len(aliases) - 1} more)" if len(aliases) > 1 else ""
    return (f": {alias} is tied to {ties[alias]}{more} (one tensor, listed under its first name); name "
            f"{ties[alias]}, which freezes or trains both")


def untied_reason(alias: str, first: str, init: str, observed: Mapping[str, str]) -> str:
    """Why `alias`, tied to `first` in the bare model, became a tensor of its own in the stack, and the fix."""
    if init == "meta":
        return (f"meta init: to_empty() allocates each param afresh and breaks the tie {alias} = {first}: call "
                "tie_weights() (or re-tie) after to_empty")
    if observed.get("wrapper") == "FullyShardedDataParallel" and observed.get("use_orig_params") == "False":
        return (f"{alias} was tied to {first}; FSDP(use_orig_params=False) flattens each unit's params into its "
                "own flat param, so a tie across two units becomes two tensors (they no longer share): keep the tied "
                "modules in one unit (FSDP2 and use_orig_params=True refuse a tie across units)")
    return f"{alias} was tied to {first}; the stack made it a tensor of its own (they no longer share)"
