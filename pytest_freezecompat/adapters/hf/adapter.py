"""Hugging Face: a thin dispatcher from the plugin id to its driver (`accelerate-*`: the user's own loop)."""

from __future__ import annotations

from ..base import AdapterBase, RunContext
from ..loop import train
from . import state
from .accelerate_loop import PLUGINS, AccelerateLoop


class HFAdapter(AdapterBase):
    def run(self, ctx: RunContext) -> None:
        plugin = ctx.cell.key.plugin
        if plugin not in PLUGINS:
            raise ValueError(f"hf adapter has no plugin {plugin!r}; valid: {', '.join(PLUGINS)}")
        # Nothing a previous cell left (variables, shared state) may reach this one, nor this one's the next.
        state.fresh()
        try:
            with ctx.emulation():
                train(ctx, AccelerateLoop(ctx, plugin), rebuild=lambda: AccelerateLoop(ctx, plugin))
        finally:
            state.fresh()
