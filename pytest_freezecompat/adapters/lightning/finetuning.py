"""Lightning's own way of freezing: a `BaseFinetuning` callback, written as Lightning's docs write one, freezes the
modules a rule names (`options.finetuning_unfreezes`) before training and unfreezes them at epoch 0 in a param group
of their own (`unfreeze_and_add_param_group`, at the optimizer's lr). Each cell step is one epoch, so the round trip
saves after the unfreeze and resumes at epoch 1: where Lightning-AI/pytorch-lightning#21901 holds, the resumed
`setup()` freezes them again and nothing unfreezes them."""

from __future__ import annotations

from lightning.pytorch import LightningModule
from lightning.pytorch.callbacks import BaseFinetuning
from torch import nn
from torch.optim import Optimizer

from ..base import RunContext

#: The rule option naming the modules (`<module path>.*` globs over the bare model's names).
OPTION = "finetuning_unfreezes"
#: The epoch the callback unfreezes at.
UNFREEZE_AT_EPOCH = 0


def unfrozen_modules(ctx: RunContext) -> tuple[str, ...]:
    """The module paths this cell's callback freezes and unfreezes (none for most cells)."""
    paths = []
    for glob in ctx.cell.options.get(OPTION, ()):
        if not glob.endswith(".*") or any(c in glob[:-2] for c in "*?["):
            raise ValueError(f"{OPTION}: {glob!r} must name one module's params, as `<module path>.*` "
                             "(BaseFinetuning freezes modules)")
        paths.append(glob[:-2])
    return tuple(paths)


class UnfreezeAtFirstEpoch(BaseFinetuning):
    """Freeze `paths` of the LightningModule's `model` before training; unfreeze them at epoch 0."""

    def __init__(self, paths: tuple[str, ...]) -> None:
        super().__init__()
        self.paths = paths

    def _modules(self, pl_module: LightningModule) -> list[nn.Module]:
        return [pl_module.model.get_submodule(path) for path in self.paths]

    def freeze_before_training(self, pl_module: LightningModule) -> None:
        self.freeze(self._modules(pl_module))

    def finetune_function(self, pl_module: LightningModule, epoch: int, optimizer: Optimizer) -> None:
        if epoch == UNFREEZE_AT_EPOCH:
            # lr said: left out, Lightning gives the new group a tenth of the first group's
            self.unfreeze_and_add_param_group(self._modules(pl_module), optimizer, lr=optimizer.param_groups[0]["lr"])
