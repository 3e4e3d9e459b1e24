"""A staged unfreeze: params a rule names (`options.unfreeze_after_optimizer`, globs over the bare model's names)
stay frozen while the optimizer is built and are unfrozen right after, on the user's own model object, as a user who
unfreezes a module mid-run does. Both drivers build their optimizer from the params that require grad at that
moment (transformers' `Trainer.create_optimizer`, a user's AdamW over the trainable params), so the cell shows
whether anything else would ever train them."""

from __future__ import annotations

from collections.abc import Iterable
from fnmatch import fnmatchcase

from torch import nn

from ..base import RunContext, strip_wrapper_infixes
from ..views import FSDP1_INFIXES

#: The rule option naming the params to unfreeze once the optimizer exists.
OPTION = "unfreeze_after_optimizer"


def late_params(ctx: RunContext) -> tuple[str, ...]:
    """The globs this cell unfreezes after the optimizer is built (none for most cells)."""
    return tuple(ctx.cell.options.get(OPTION, ()))


def _matching(model: nn.Module, globs: Iterable[str]) -> list[nn.Parameter]:
    patterns = tuple(globs)
    return [p for n, p in model.named_parameters()
            if any(fnmatchcase(strip_wrapper_infixes(n, FSDP1_INFIXES), g) for g in patterns)]


def hold(model: nn.Module, globs: Iterable[str]) -> None:
    """Freeze them while the optimizer is built (the pattern means them to train)."""
    for param in _matching(model, globs):
        param.requires_grad_(False)


def release(model: nn.Module, globs: Iterable[str]) -> None:
    """Unfreeze them on the user's own model object (the bare model: a wrapper keeps it inside, FSDP2 in place)."""
    for param in _matching(model, globs):
        param.requires_grad_(True)
