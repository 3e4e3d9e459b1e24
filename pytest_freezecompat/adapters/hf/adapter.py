"""Hugging Face: a thin dispatcher from the plugin id to its driver (`accelerate-*`: the user's own loop;
`trainer-*`: the Transformers Trainer's; `trl-*`: TRL's SFTTrainer over the Trainer's stacks)."""

from __future__ import annotations

import importlib.util

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
                from . import zero  # the template has it (warm_up) where DeepSpeed is installed

                zero.run_accelerate(ctx, plugin)
                return
            if plugin.startswith("trl-"):
                from . import trainer_loop, trl_loop  # where TRL is installed (the row's rule says where not)

                trainer_loop.run(ctx, plugin, ctx.emulation, trl_loop.SFTRun)
                return
            if plugin.startswith("trainer-"):
                from . import trainer_loop  # the template has it (warm_up)

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


def warm_up() -> None:
    """Once in each rank template, so that every fork has them: the Trainer driver's import (transformers' trainer)
    and, where DeepSpeed is installed, the ZeRO plugins' with DeepSpeed's own first uses (`deepspeed_ops.warm_up`;
    Accelerate imports DeepSpeed in every cell's `extract_model_from_parallel` once it is installed). A fork is
    a fresh rank after every cell that failed unevenly (19 in the 1.10.1 slice): its first cell paid ~4.7 s of
    imports, 2.2 s in 1.15.0's."""
    from . import trainer_loop  # noqa: F401

    if importlib.util.find_spec("deepspeed") is not None:
        from .. import deepspeed_ops
        from . import zero

        deepspeed_ops.warm_up(zero.OPS)
