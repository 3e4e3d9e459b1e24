"""The `*-deepspeed*` plugins: Lightning's DeepSpeed strategy, under the Trainer and under Fabric, read through the
DeepSpeed row's view (`deepspeed_views`).

What a Lightning user writes: the Trainer with `DeepSpeedStrategy(stage=N)` and `gradient_clip_val` (the strategy
puts it into the config's `gradient_clipping`: DeepSpeed clips inside its step, Lightning's own clipping is a
no-op); Fabric with `DeepSpeedStrategy(config=...)`, the config holding `gradient_clipping`, since Fabric's
`clip_gradients` refuses under DeepSpeed ("DeepSpeed handles gradient clipping automatically"). Checkpoints are
DeepSpeed's own folders (`engine.save_checkpoint(path, tag="checkpoint")`); the `*-exclude-frozen` plugins pass
`exclude_frozen_parameters=True` (Lightning PR #21060, in 2.5.5), which leaves the frozen params out of them.
DeepSpeed is imported only here, and this module only for those cells.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from deepspeed.runtime.engine import DeepSpeedEngine
from lightning.fabric.strategies import DeepSpeedStrategy as FabricDeepSpeed
from lightning.pytorch import Callback
from lightning.pytorch.strategies import DeepSpeedStrategy
from torch import nn

from ..base import Probe, RunContext
from ..deepspeed_ops import missing
from ..deepspeed_views import (
    PERSISTENCE_THRESHOLD,
    DeepSpeedView,
    Plugin,
    ds_config,
    keep_world_clone,
    saved_contents,
)
from ..loop import Saved
from .environment_setup import OPS

#: The tag Lightning gives every DeepSpeed checkpoint inside the folder it names.
TAG = "checkpoint"
#: The plugins' suffix for `DeepSpeedStrategy(exclude_frozen_parameters=True)`.
EXCLUDE_FROZEN = "-exclude-frozen"
NORM_SOURCE = ("engine.get_global_grad_norm() after the engine's step (DeepSpeed clips inside it with the config's "
               "gradient_clipping)")
OPTIMIZER_NORM_SOURCE = ("the ZeRO optimizer's _global_grad_norm after its step, which clips with the config's "
                         "gradient_clipping (Fabric's optimizer.step() steps it without engine.step(), so "
                         "engine.get_global_grad_norm() stays None)")


def plugin_of(ctx: RunContext) -> Plugin:
    """`trainer-deepspeed` -> ZeRO stage 2 (Lightning's `strategy="deepspeed"`), `*-deepspeed-stage-3` -> 3."""
    stage = 3 if ctx.cell.key.plugin.endswith("-stage-3") else 2
    return Plugin(stage, offload=False, config_optimizer=False)


def _ops_built() -> None:
    absent = missing(OPS)
    if absent:
        raise RuntimeError(f"DeepSpeed ops {', '.join(absent)} are not built in this environment: run "
                           "`python -m pytest_freezecompat.adapters.lightning.environment_setup` with its python")


def _exclusion(ctx: RunContext) -> dict[str, bool]:
    """The strategy's keyword for the `*-exclude-frozen` plugins (it does not exist before 2.5.5)."""
    return {"exclude_frozen_parameters": True} if excludes_frozen(ctx) else {}


def trainer_strategy(ctx: RunContext) -> DeepSpeedStrategy:
    """Stage 2: `DeepSpeedStrategy(stage=2)` (`strategy="deepspeed"`), the Trainer builds the config (clipping from
    gradient_clip_val). Stage 3: a config, the only way to partition every param of a tiny model
    (`stage3_param_persistence_threshold`; the Trainer still adds the clipping and batch sizes)."""
    _ops_built()
    plugin = plugin_of(ctx)
    if plugin.stage == 3:
        config = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": PERSISTENCE_THRESHOLD},
                  "zero_allow_untested_optimizer": True}
        return DeepSpeedStrategy(config=config, process_group_backend=dist.get_backend(), **_exclusion(ctx))
    return DeepSpeedStrategy(stage=2, process_group_backend=dist.get_backend(), **_exclusion(ctx))


def fabric_strategy(ctx: RunContext) -> FabricDeepSpeed:
    """`DeepSpeedStrategy(config=...)`: the DeepSpeed row's config (the user's optimizer, the cell's clipping)."""
    _ops_built()
    return FabricDeepSpeed(config=ds_config(ctx.cell, plugin_of(ctx), ctx.world_size),
                           process_group_backend=dist.get_backend(), **_exclusion(ctx))


class LightningDeepSpeedView(DeepSpeedView):
    """The engine's module by the bare model's names: the Trainer's engine holds the LightningModule, whose child
    `model` is the bare model (`prefix`); Fabric's holds the bare model."""

    def __init__(self, engine: Any, plugin: Plugin, prefix: str = "") -> None:
        super().__init__(engine, plugin)
        self.prefix = prefix

    def named_parameters(self) -> dict[str, nn.Parameter]:
        return {name.removeprefix(self.prefix): p for name, p in super().named_parameters().items()}

    def full_buffers(self) -> dict[str, torch.Tensor]:
        return {name.removeprefix(self.prefix): b for name, b in super().full_buffers().items()}


def saved(folder: Path, view: LightningDeepSpeedView, exclude_frozen: bool) -> Saved:
    """What Lightning's DeepSpeed checkpoint `folder` holds, by the bare model's names."""
    contents = saved_contents(folder / TAG, view, exclude_frozen)

    def bare(names: frozenset[str] | None) -> frozenset[str] | None:
        return None if names is None else frozenset(name.removeprefix(view.prefix) for name in names)

    return Saved(bare(contents.params), bare(contents.optimizer_state), contents.trainable_only)


def norm(engine: Any) -> tuple[float | None, str]:
    """The total norm DeepSpeed clipped with: the engine's, after `engine.step()` (the Trainer); Fabric's
    `optimizer.step()` steps the engine's ZeRO optimizer itself (the engine is not an `Optimizable` to
    `_FabricOptimizer.step`), so the engine never copies the norm: then the ZeRO optimizer's own."""
    value = engine.get_global_grad_norm()
    if value is not None:
        return float(value), NORM_SOURCE
    value = getattr(engine.optimizer, "_global_grad_norm", None)
    return (None if value is None else float(value)), OPTIMIZER_NORM_SOURCE


def observe(probe: Probe, strategy: Any, engine: Any) -> None:
    """The ZeRO stage the engine runs and whether the strategy leaves frozen params out of its checkpoints (False
    where the release has no such switch)."""
    probe.observed("zero_stage", engine.zero_optimization_stage())
    probe.observed("exclude_frozen_parameters", getattr(strategy, "exclude_frozen_parameters", False))


WRAPPERS = (DeepSpeedEngine,)


def excludes_frozen(ctx: RunContext) -> bool:
    return ctx.cell.key.plugin.endswith(EXCLUDE_FROZEN)


def exclusion_words(ctx: RunContext) -> str:
    return ", exclude_frozen_parameters=True" if excludes_frozen(ctx) else ""


class KeepWorldClone(Callback):
    """DeepSpeed's world-group clone kept with the rank's group (`keep_world_clone`), once the strategy has
    initialized DeepSpeed's comm (`setup_environment`) and before it builds the engine: a callback's `setup`."""

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        keep_world_clone(self.ctx)
