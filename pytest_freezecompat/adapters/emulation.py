"""The one shim interface: CUDA-on-CPU patches that report themselves only when they really engage.

A shim may replace device plumbing (devices, streams, synchronize, memory queries) and arithmetic
kernels with the same math; it never touches the freeze logic a cell tests. Each adapter's
`emulation.py` defines a `Shim` whose `patches(cell, device)` lists `Patch`es; `apply` installs them
for one cell, wraps every replacement so its first real call is reported through
`probe.emulated(what)`, and restores the originals when the cell ends.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..core.cell import Cell
from .base import Probe


@dataclass(frozen=True)
class Patch:
    owner: Any  # a module, class or object
    name: str
    #: `replacement(report, original)` -> the new attribute; call `report()` where it really engages.
    replacement: Callable[[Callable[[], None], Any], Any]
    what: str  # for the report, e.g. "torch.cuda.current_device -> cpu"


def reporting(what: str, probe: Probe) -> Callable[[], None]:
    return functools.partial(probe.emulated, what)


def always(value: Callable[..., Any]) -> Callable[[Callable[[], None], Any], Any]:
    """A replacement that engages on every call: report, then call `value`."""

    def make(report: Callable[[], None], original: Any) -> Callable[..., Any]:
        @functools.wraps(value)
        def replaced(*args: Any, **kwargs: Any) -> Any:
            report()
            return value(*args, **kwargs)

        return replaced

    return make


class Shim:
    """Subclass and define `patches`; `contexts` adds context managers (e.g. a TorchFunctionMode)."""

    def patches(self, cell: Cell, device: torch.device) -> list[Patch]:
        raise NotImplementedError

    def contexts(self, cell: Cell, probe: Probe, device: torch.device) -> list[contextlib.AbstractContextManager]:
        return []

    @contextlib.contextmanager
    def apply(self, cell: Cell, probe: Probe, device: torch.device) -> Iterator[None]:
        if device.type != "cpu":  # on a GPU the stack runs as shipped
            yield
            return
        patches = self.patches(cell, device)
        saved = [(p.owner, p.name, p.owner.__dict__.get(p.name, _ABSENT) if hasattr(p.owner, "__dict__")
                  else getattr(p.owner, p.name)) for p in patches]
        try:
            for patch in patches:
                setattr(patch.owner, patch.name,
                        patch.replacement(reporting(patch.what, probe), getattr(patch.owner, patch.name, None)))
            with contextlib.ExitStack() as stack:
                for context in self.contexts(cell, probe, device):
                    stack.enter_context(context)
                yield
        finally:
            for owner, name, original in reversed(saved):
                if original is _ABSENT:
                    with contextlib.suppress(AttributeError):
                        delattr(owner, name)
                else:
                    setattr(owner, name, original)


_ABSENT = object()
