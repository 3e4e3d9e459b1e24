"""The Megatron adapter, plus a note of what this rank's optimizer holds before the union over ranks."""

from __future__ import annotations

from typing import Any

from pytest_freezecompat.adapters.base import RunContext
from pytest_freezecompat.adapters.megatron import adapter as mg

LOCAL_PREFIX = "locally tracked: "


class _ShardNotingProbe:
    """The rank's probe, noting this rank's own optimizer params when the model is wrapped."""

    def __init__(self, probe: Any, rank: int) -> None:
        self._probe = probe
        self._rank = rank

    def __getattr__(self, name: str) -> Any:
        return getattr(self._probe, name)

    def wrapped(self, view: mg._View) -> None:
        held = {id(p) for p in mg._optimizer_model_params(view.optimizer)}
        local = sorted(name for name, p in view._params() if id(p) in held)
        self._probe.note(f"rank {self._rank} {LOCAL_PREFIX}{','.join(local)}")
        self._probe.wrapped(view)


class ShardNotingAdapter(mg.MegatronAdapter):
    def run(self, ctx: RunContext) -> None:
        ctx.probe = _ShardNotingProbe(ctx.probe, ctx.rank)
        super().run(ctx)
