"""The interface between the shared scenario and one framework.

An adapter owns training for its framework (some, like Composer's Trainer, own
the loop), and reports facts through the `Probe` at fixed points. It never
judges: the controller compares what the probe saw with the reference.

Adapters that drive the loop themselves implement `ExplicitLoop` and hand it to
`scenario.run_explicit_loop`, which makes the probe calls in the right order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from ..cell import Cell
from ..freeze import FreezePlan

Batch = dict[str, torch.Tensor]


class ModelView(Protocol):
    """How to read the wrapped model back in terms of the bare model's parameter names.

    `full_params` and `full_grads` are collectives where the model is sharded:
    every rank calls them at the same point.
    """

    grad_access: str

    def requires_grad_flags(self) -> dict[str, bool]: ...

    def tracked_names(self) -> set[str]: ...

    def full_params(self) -> dict[str, torch.Tensor]: ...

    def full_grads(self) -> dict[str, torch.Tensor | None]: ...


class Probe(Protocol):
    def phase(self, text: str) -> None:
        """Mark progress; the controller shows the last phase of every rank on a hang."""

    def note(self, text: str) -> None: ...

    def emulated(self, what: str) -> None:
        """Record that a CUDA-on-CPU shim was engaged (labelled `emulation` in the report)."""

    def wrapped(self, view: ModelView) -> None:
        """After wrapping, materializing and building the optimizer, before the first step."""

    def after_backward(self, step: int, view: ModelView) -> None: ...

    def clipped(self, step: int, total_norm: float | None, source: str) -> None:
        """`source` says where the norm came from, e.g. `returned by clip_grad_norm_`."""

    def after_step(self, step: int, view: ModelView) -> None: ...


@dataclass
class RunContext:
    """What a rank knows about the cell it runs; built by the scenario."""

    cell: Cell
    rank: int
    world_size: int
    device: torch.device
    probe: Probe
    batches: list[Batch]
    build_model: Callable[..., nn.Module]
    resolve_plan: Callable[[nn.Module], FreezePlan]
    loss: Callable[[nn.Module, Batch], torch.Tensor]
    """The cell's loss on a (local) batch: `ctx.loss(model, ctx.local_batch(step))`."""

    def local_batch(self, step: int, dp_rank: int | None = None, dp_size: int | None = None) -> Batch:
        """This data-parallel rank's rows of the global batch of `step`, on the cell's device.

        Every rank is a data-parallel rank unless the adapter says otherwise (tensor or
        pipeline parallelism: pass the rank's index and the size of its data-parallel group).
        """
        dp_rank = self.rank if dp_rank is None else dp_rank
        dp_size = self.world_size if dp_size is None else dp_size
        global_rows = next(iter(self.batches[step].values())).shape[0]
        per_rank = global_rows // dp_size
        rows = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
        return {k: v[rows].to(self.device) for k, v in self.batches[step].items()}

    def make_optimizer(self, params: list[nn.Parameter]) -> torch.optim.Optimizer:
        h = self.cell.hyper
        return torch.optim.AdamW(params, lr=h.lr, betas=h.betas, eps=h.eps, weight_decay=h.weight_decay)


class ExplicitLoop(Protocol):
    view: ModelView

    def forward_backward(self, batch: Batch) -> torch.Tensor: ...

    def clip(self, max_norm: float) -> tuple[float | None, str]: ...

    def step(self) -> None: ...

    def zero_grad(self) -> None: ...


class Adapter(Protocol):
    """One framework. Optionally also `reference_model(cell) -> (bare nn.Module, loss_of(model, batch))`
    when the cell's model is the framework's own (same parameter names, single process, no wrapper);
    the default reference is the tiny model of `models.py`. Eager init means `models.init_weights`."""

    def run(self, ctx: RunContext) -> None: ...


def strip_wrapper_infixes(name: str, infixes: tuple[str, ...]) -> str:
    """`_fsdp_wrapped_module.blocks.0._fsdp_wrapped_module.w` -> `blocks.0.w`: wrappers insert
    module names into parameter names; the checks speak the bare model's names."""
    return ".".join(part for part in name.split(".") if part not in infixes)
