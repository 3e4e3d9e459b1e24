"""The Megatron adapter, plus a note of what this rank's optimizer holds before the union over ranks."""

from __future__ import annotations

from pytest_freezecompat.adapters import megatron as mg
from pytest_freezecompat.adapters.base import RunContext

LOCAL_PREFIX = "locally tracked: "


class Adapter(mg.Adapter):
    def _train(self, ctx: RunContext, layout: mg.Layout, config: mg.TransformerConfig, view: mg._View) -> None:
        held = {id(p) for p in mg._optimizer_model_params(view.optimizer)}
        local = sorted(name for name, p in view._params() if id(p) in held)
        ctx.probe.note(f"rank {ctx.rank} {LOCAL_PREFIX}{','.join(local)}")
        super()._train(ctx, layout, config, view)
