"""An adapter for the ColossalAI tests: ZeRO grads read in one all_gather, compared with reading one param at a time."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn

from pytest_freezecompat.adapters.base import ModelView, Probe, RunContext
from pytest_freezecompat.adapters.colossalai.adapter import ColossalAIAdapter, ZeroView


def grad_one_param_at_a_time(optimizer: object, param: nn.Parameter) -> torch.Tensor | None:
    """One param's grad, read as the adapter read it before: `get_param_grad` (0.4 on), the 0.3.x slices gathered."""
    if hasattr(optimizer, "get_param_grad"):
        return optimizer.get_param_grad(param)
    store = optimizer._grad_store
    slices = next((group[id(param)] for group in store._grads_of_params.values() if id(param) in group), None)
    if not slices:
        return None
    local = slices[store._working_index].flatten()
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group=optimizer.dp_pg))]
    dist.all_gather(gathered, local, group=optimizer.dp_pg)
    return torch.cat(gathered)[: param.numel()].view_as(param)


class _ComparesGrads:
    def __init__(self, probe: Probe) -> None:
        self._probe = probe

    def __getattr__(self, name: str) -> object:
        return getattr(self._probe, name)

    def after_backward(self, step: int, view: ModelView) -> None:
        assert isinstance(view, ZeroView), type(view)
        batched = view.full_grads()
        optimizer = view.optimizers[0]
        managed = {id(p) for group in optimizer._working_param_groups.values() for p in group}
        assert managed, "no param is ZeRO's: nothing compared"
        for name, param in view.named_parameters().items():
            if id(param) not in managed:
                continue
            one = grad_one_param_at_a_time(optimizer, param)
            got = batched[name]
            assert (one is None) == (got is None), name
            assert one is None or (one.dtype == got.dtype and torch.equal(one, got)), name
        self._probe.after_backward(step, view)


class ComparesZeroGradsAdapter(ColossalAIAdapter):
    def run(self, ctx: RunContext) -> None:
        super().run(dataclasses.replace(ctx, probe=_ComparesGrads(ctx.probe)))

