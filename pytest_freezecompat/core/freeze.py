"""Freeze patterns as data: which parameters train, which the optimizer gets.

Pure (no torch): `adapters.base.apply_freeze` sets the flags on a model.

A pattern names *groups* (`embedding`, `decoder`, `last_block`, ...); each model
maps groups to parameter-name globs in the matrix file. Resolving a pattern
against a built model gives a `FreezePlan`: concrete original names, the one
thing checks and adapters share.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .names import ALL_GROUP, import_ref
from .ties import Ties, alias_hint

if TYPE_CHECKING:  # this module is pure: torch only for the annotation
    import torch

#: Rows of a param's first dimension, as a slice's (start, stop).
RowRange = tuple[int | None, int | None]
ROWS_RE = re.compile(r"^\s*(-?\d+)?\s*:\s*(-?\d+)?\s*$")


@dataclass(frozen=True)
class FreezePattern:
    id: str
    frozen: tuple[str, ...] = ()
    trainable: tuple[str, ...] | None = None
    optimizer: tuple[str, ...] | None = None
    unused: tuple[str, ...] = ()
    features: tuple[str, ...] = ()
    description: str = ""
    #: `module:qualname` of `f(name) -> bool` (True = trainable), instead of `frozen`/`trainable` groups.
    predicate: str | None = None
    #: A stack may refuse this pattern before the first step (e.g. nothing left to train): a refusal passes.
    may_refuse: bool = False
    #: Partial trainability: group -> `start:stop` rows (Python slice syntax, negative counts from the end) that
    #: train in each of the group's params; the other rows are held by a gradient-mask hook, as users do where a
    #: stack has no per-row `requires_grad` (DeepSpeed#5041). The group's params must be trainable.
    rows: Mapping[str, str] = field(default_factory=dict)
    #: Groups of buffer-name globs the pattern means to update although their module is frozen (BatchNorm statistics
    #: a user re-estimates on new data): they may move. Every other buffer of a frozen module must not.
    buffers: tuple[str, ...] = ()
    #: Groups of module-name globs put in eval mode once, after `model.train()` and before wrapping: the recipe users
    #: apply to frozen norms (`backbone.eval()`); a trainer that calls `model.train()` again undoes it.
    eval: tuple[str, ...] = ()


@dataclass(frozen=True)
class FreezePlan:
    """Original parameter names by role; `requires_grad` is True exactly for `trainable`."""

    names: tuple[str, ...]
    trainable: frozenset[str]
    optimized: frozenset[str]
    unused: frozenset[str]
    #: name -> the rows that train (`FreezePattern.rows`); a gradient-mask hook zeroes the grads of the others.
    rows: Mapping[str, RowRange] = field(default_factory=dict)

    @property
    def frozen(self) -> frozenset[str]:
        return frozenset(self.names) - self.trainable

    @property
    def expect_grad(self) -> frozenset[str]:
        """Params that must end a backward with a gradient."""
        return self.trainable - self.unused


class PatternError(ValueError):
    pass


def parse_rows(text: str) -> RowRange:
    """`"-16:"` -> (-16, None): a slice of the first dimension, as Python writes it."""
    match = ROWS_RE.match(text)
    if not match or text.strip() == ":":
        raise PatternError(f"rows {text!r} is not a row range such as '-16:' or '0:8' (start:stop of a slice)")
    start, stop = match.groups()
    return (None if start is None else int(start)), (None if stop is None else int(stop))


def _names_in_groups(groups: Iterable[str], group_globs: Mapping[str, Iterable[str]],
                     names: Iterable[str], pattern_id: str, ties: Ties) -> set[str]:
    names = list(names)
    selected: set[str] = set()
    for group in groups:
        if group == ALL_GROUP:
            selected.update(names)
            continue
        if group not in group_globs:
            raise PatternError(
                f"freeze pattern {pattern_id!r} names group {group!r}; the model defines: "
                f"{', '.join(sorted(group_globs))}"
            )
        for glob in group_globs[group]:
            hits = fnmatch.filter(names, glob)
            if not hits:
                raise PatternError(
                    f"freeze pattern {pattern_id!r}: glob {glob!r} of group {group!r} matches no parameter"
                    f"{alias_hint(glob, ties)}")
            selected.update(hits)
    return selected


def resolve(pattern: FreezePattern, group_globs: Mapping[str, Iterable[str]], names: Iterable[str],
            ties: Ties | None = None) -> FreezePlan:
    """`names` as `named_parameters()` lists them; `ties`: the model's aliases (`core.ties`), which they leave out,
    so that a glob naming only an alias says which name to use."""
    names, ties = tuple(names), ties or {}
    if pattern.predicate is not None:
        is_trainable = import_ref(pattern.predicate)
        trainable = {n for n in names if is_trainable(n)}
    elif pattern.trainable is not None:
        trainable = _names_in_groups(pattern.trainable, group_globs, names, pattern.id, ties)
    else:
        trainable = set(names) - _names_in_groups(pattern.frozen, group_globs, names, pattern.id, ties)
    optimized = (
        _names_in_groups(pattern.optimizer, group_globs, names, pattern.id, ties)
        if pattern.optimizer is not None
        else trainable
    )
    unused = _names_in_groups(pattern.unused, group_globs, names, pattern.id, ties)
    rows: dict[str, RowRange] = {}
    for group, text in pattern.rows.items():
        bounds = parse_rows(text)
        for name in sorted(_names_in_groups([group], group_globs, names, pattern.id, ties)):
            if name not in trainable:
                raise PatternError(f"freeze pattern {pattern.id!r}: rows of group {group!r} train in {name}, "
                                   "which the pattern freezes")
            rows[name] = bounds
    return FreezePlan(names, frozenset(trainable), frozenset(optimized), frozenset(unused), rows)


def held_buffers(owners: Mapping[str, tuple[str, ...]], trainable: Iterable[str],
                 trained: Iterable[str]) -> tuple[str, ...]:
    """The buffers that must not move: `owners` maps each buffer to the params of the module that owns it (or of the
    nearest module above it with params: a `FrozenBatchNorm2d` has none); a buffer is held where those params are
    all frozen and it matches none of the `trained` buffer globs. A user who freezes a backbone means its
    BatchNorm statistics too: `requires_grad=False` stops the weights, not the running mean."""
    trains, trained = set(trainable), tuple(trained)
    return tuple(sorted(name for name, params in owners.items()
                        if params and not trains.intersection(params)
                        and not any(fnmatch.fnmatchcase(name, glob) for glob in trained)))


def is_quantized(param: torch.Tensor) -> bool:
    """Packed quantized storage, which no optimizer can step: an integer dtype, or a quantization state beside the
    data (bitsandbytes' `Params4bit`, whichever dtype stores it)."""
    return not param.is_floating_point() or getattr(param, "quant_state", None) is not None
