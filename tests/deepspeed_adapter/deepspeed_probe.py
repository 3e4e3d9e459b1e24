"""Adapters for the DeepSpeed slice's tests: one rank aborting after its results are in; stage 3's two reads
compared."""

from __future__ import annotations

import dataclasses
import gc
import os

import torch

from pytest_freezecompat.adapters.base import ModelView, Probe, RunContext
from pytest_freezecompat.adapters.deepspeed.adapter import DeepSpeedAdapter, DeepSpeedView


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


class _ComparesReads:
    """A probe that, at every read of the params, first reads them both ways and raises if the one-collective read
    of stage 3 (or its absence) differs from `GatheredParameters`' own, param by param, bit for bit."""

    def __init__(self, probe: Probe) -> None:
        self._probe = probe

    def __getattr__(self, name: str) -> object:
        return getattr(self._probe, name)

    def _compare(self, view: ModelView) -> None:
        assert isinstance(view, DeepSpeedView)
        from_partitions = view._from_partitions()
        assert from_partitions is not None, "params not plainly partitioned: the one-collective read was not taken"
        gathered = view.gathered_params()
        assert list(from_partitions) == list(gathered)
        for name, value in gathered.items():
            assert value.shape == from_partitions[name].shape and torch.equal(value, from_partitions[name]), name

    def wrapped(self, view: ModelView) -> None:
        self._compare(view)
        self._probe.wrapped(view)

    def after_step(self, step: int, view: ModelView) -> None:
        self._compare(view)
        self._probe.after_step(step, view)

    def loaded(self, view: ModelView) -> None:
        self._compare(view)
        self._probe.loaded(view)


class ComparesStage3ReadsAdapter(DeepSpeedAdapter):
    def run(self, ctx: RunContext) -> None:
        super().run(dataclasses.replace(ctx, probe=_ComparesReads(ctx.probe)))

