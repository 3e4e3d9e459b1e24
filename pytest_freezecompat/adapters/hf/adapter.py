"""Hugging Face: a thin dispatcher from the plugin id to its driver (`accelerate-*`: the user's own loop;
`trainer-*`: the Transformers Trainer's)."""

from __future__ import annotations

from ..base import AdapterBase, RunContext
from ..loop import train
from . import ZERO_PLUGINS, state
from .accelerate_loop import PLUGINS, AccelerateLoop


class HFAdapter(AdapterBase):
    def run(self, ctx: RunContext) -> None:
        plugin = ctx.cell.key.plugin
        # Nothing a previous cell left (variables, shared state) may reach this one, nor this one's the next.
        state.fresh()
        try:
            if plugin in ZERO_PLUGINS and plugin.startswith("accelerate-"):
                from . import zero  # DeepSpeed's import is the ZeRO cells' cost alone

                zero.run_accelerate(ctx, plugin)
                return
            if plugin.startswith("trainer-"):
                from . import trainer_loop  # transformers' import is the Trainer cells' cost alone

                if plugin not in trainer_loop.TRAINER_PLUGINS:
                    raise ValueError(f"hf adapter has no plugin {plugin!r}; valid: "
                                     f"{', '.join([*PLUGINS, *trainer_loop.TRAINER_PLUGINS])}")
                trainer_loop.run(ctx, plugin, ctx.emulation)
                return
            if plugin not in PLUGINS:
                raise ValueError(f"hf adapter has no plugin {plugin!r}; valid: {', '.join(PLUGINS)}")
            with ctx.emulation():
                train(ctx, AccelerateLoop(ctx, plugin), rebuild=lambda: AccelerateLoop(ctx, plugin))
        finally:
            state.fresh()
