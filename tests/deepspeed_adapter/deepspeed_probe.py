"""Adapters for the DeepSpeed slice's tests: one rank aborting after its results are in."""

from __future__ import annotations

import gc
import os

from pytest_freezecompat.adapters.base import RunContext
from pytest_freezecompat.adapters.deepspeed.adapter import DeepSpeedAdapter


class _AbortWhenCollected:
    """Aborts the process when the garbage collector frees it: in the pool's tidy (`gc.collect`), after the rank
    sent its record, as DeepSpeed's rank did at exit ("terminate called without an active exception")."""

    def __init__(self) -> None:
        self.cycle = self

    def __del__(self) -> None:
        os.abort()


class AbortsAtTeardownAdapter(DeepSpeedAdapter):
    def run(self, ctx: RunContext) -> None:
        super().run(ctx)
        if ctx.rank == 1:
            gc.collect()
            _AbortWhenCollected()  # unreachable but for its own cycle: freed by the next gc.collect
