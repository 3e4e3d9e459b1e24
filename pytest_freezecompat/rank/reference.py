"""The single-process reference: plain PyTorch, no wrapper, no checkpointing, full global batch.

It starts from the values the wrapped model really held after wrapping, so a cell
is judged on training, not on how its init mode filled the weights. A low-precision cell
also gets a second, mixed-precision reference (the model in bf16/fp16 for forward and
backward, fp32 master weights that clipping and the optimizer work on): the distance
between the two is the precision's own spread, which the verdict turns into its tolerance.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch
from torch import nn

from .. import models
from ..adapters.base import LossOf, apply_freeze, cast_inputs, rows_of
from ..core.cell import Cell
from ..core.freeze import FreezePlan, is_quantized
from ..core.names import CANONICAL_LOOP, CLIP_OPTIMIZED_LOOP, MODEL_ZERO_GRAD_LOOP

Tensors = dict[str, torch.Tensor]
Value = TypeVar("Value")
#: The working dtype of a mixed-precision cell (fp32 cells need no second reference).
LOW_PRECISION = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class ReferenceStep:
    grads: dict[str, torch.Tensor | None]
    norm: float
    params: Tensors
    buffers: Tensors  # rank 0's, where the reference replays each rank's rows (`shards`)


def coupled_modules(model: nn.Module) -> list[str]:
    """Modules in train mode that couple a batch's rows: plain BatchNorm normalises over the rows it is given, so a
    data-parallel run (each rank its own rows) differs from one process over the whole batch, by design.
    SyncBatchNorm promises the whole batch and is left out."""
    return [name for name, module in model.named_modules()
            if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(module, nn.SyncBatchNorm)
            and module.training]


def _buffer_slots(model: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    """Each buffer's name -> (its module, its local name): where the per-rank replay swaps one rank's in."""
    return {f"{owner}.{local}" if owner else local: (module, local)
            for owner, module in model.named_modules() for local, value in module._buffers.items() if value is not None}


def _per_rank_loss(model: nn.Module, loss_of: LossOf, batch: dict[str, torch.Tensor], states: list[Tensors],
                   slots: dict[str, tuple[nn.Module, str]], rng: torch.Tensor | None = None) -> torch.Tensor:
    """The mean of each rank's loss over its own rows, each forward with that rank's buffers (new tensor objects
    swapped in, never written into: autograd keeps what BatchNorm saved) and, where `rng` is given, from that CPU
    generator state (the one every rank drew its masks from); `states` is updated to what each rank's forward left.
    The model keeps rank 0's buffers."""
    losses = []
    for rank, state in enumerate(states):
        for name, (module, local) in slots.items():
            module._buffers[local] = state[name]
        if rng is not None:
            torch.set_rng_state(rng)
        losses.append(loss_of(model, rows_of(batch, rank, len(states))))
        states[rank] = {name: module._buffers[local] for name, (module, local) in slots.items()}
    for name, (module, local) in slots.items():
        module._buffers[local] = states[0][name]
    return torch.stack(losses).mean()


def random_draws(model: nn.Module, loss_of: LossOf, batch: dict[str, torch.Tensor]) -> list[str]:
    """What in `model` draws random numbers in a forward of `batch` ([] where the CPU generator does not move):
    dropout modules in train mode with their p, a Hugging Face config's dropout fields, else the forward itself
    (an op no module names, e.g. `F.dropout` in a model's own forward). The generator is left as it was."""
    state = torch.get_rng_state()
    try:
        with torch.no_grad():
            loss_of(model, batch)
        moved = not torch.equal(torch.get_rng_state(), state)
    finally:
        torch.set_rng_state(state)
    if not moved:
        return []
    named = [f"{name} ({type(module).__name__} p={module.p:g})" for name, module in model.named_modules()
             if isinstance(module, nn.modules.dropout._DropoutNd) and module.training and module.p > 0]
    config = getattr(model, "config", None)
    fields = config.to_dict() if hasattr(config, "to_dict") else {}
    named += [f"config.{key}={value:g}" for key, value in sorted(fields.items())
              if ("dropout" in key or "pdrop" in key) and isinstance(value, float) and value > 0]
    return named or ["the forward (no dropout module or config field names the op)"]


def rank_divergent(model: nn.Module, loss_of: LossOf, batches: list[dict[str, torch.Tensor]], world_size: int
                   ) -> list[str]:
    """Params that some data-parallel ranks' rows reach and others' do not, in the same step (an expert that got no
    tokens on one rank, a task head, a VLM's tower on a text-only rank): each rank's rows of each batch through the
    model alone, every param trainable; the generator is left as it was."""
    state = torch.get_rng_state()
    params = {name: param for name, param in model.named_parameters()
              if param.is_floating_point() and not is_quantized(param)}
    divergent: set[str] = set()
    try:
        for param in params.values():
            param.requires_grad_(True)
        for batch in batches:
            reached = []
            for rank in range(world_size):
                model.zero_grad(set_to_none=True)
                loss = loss_of(model, rows_of(batch, rank, world_size))
                if loss.requires_grad:
                    loss.backward()
                reached.append({name for name, param in params.items() if param.grad is not None})
            divergent |= set.union(*reached) - set.intersection(*reached)
    finally:
        model.zero_grad(set_to_none=True)
        torch.set_rng_state(state)
    return sorted(divergent)


def tiny_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return models.loss_fn(model(batch["tokens"]), batch["targets"])


def run(cell: Cell, plan: FreezePlan, initial: Tensors, batches: list[dict[str, torch.Tensor]],
        model: nn.Module, loss_of: LossOf, compute_dtype: torch.dtype | None = None,
        resumed_after: int | None = None, convention: str = CANONICAL_LOOP, buffers: Tensors | None = None,
        shards: int = 1, rng: list[torch.Tensor] | None = None) -> list[ReferenceStep]:
    """Returns per-step grads (None where absent), clip norm and params, all in float32 on CPU.

    `model` is bare and single-process, with the same parameter names as the cell's model
    (its values are replaced by `initial`); `loss_of(model, batch)` computes its loss.
    `compute_dtype`: run as mixed precision does, with the model and its floating-point inputs in that dtype and fp32
    masters (float32: a model that holds its own bf16/fp16 params, upcast).
    `resumed_after`: the process stops after that step and resumes from a model checkpoint: no grad survives
    (grads of params outside the optimizer stop accumulating there).
    `convention`: how the loop zeroes and clips (`core.names.LOOP_CONVENTIONS`); it matters only where the
    optimizer holds a subset of the trainable params.
    `buffers`: the buffers the stack's model held after wrapping, the reference's start (else the bare model's own).
    `shards`: each step runs each of that many data-parallel ranks' rows alone, with that rank's buffers, and
    averages their losses (a model whose rows are coupled, `coupled_modules`, or whose forward draws random numbers,
    `random_draws`); the steps record rank 0's buffers.
    `rng`: by step, the CPU generator state the ranks drew that step's masks from: each rank's rows are replayed from
    it (`shards`), so dropout draws the masks the ranks drew.
    """
    h = cell.hyper
    with torch.no_grad():
        for name, param in model.named_parameters():
            # packed quantized weights: every build makes them alike, and the float trip of `initial` keeps the
            # values, not the bytes (bf16-stored 4-bit data holds NaN patterns)
            if not is_quantized(param):
                param.copy_(initial[name].to(param.dtype))
    slots = _buffer_slots(model)
    for name, (module, local) in slots.items():
        if buffers is not None and name in buffers and buffers[name].shape == module._buffers[local].shape:
            module._buffers[local] = buffers[name].to(module._buffers[local].dtype).clone()
    if compute_dtype is not None:
        model.to(compute_dtype)
        cast_inputs(model, compute_dtype)
    slots = _buffer_slots(model)
    states = [{name: module._buffers[local].clone() for name, (module, local) in slots.items()}
              for _ in range(shards)]
    apply_freeze(plan, model)
    params = dict(model.named_parameters())
    masters = params if compute_dtype is None else {
        n: nn.Parameter(p.detach().float().clone(), requires_grad=p.requires_grad) for n, p in params.items()}
    optimized = [masters[n] for n in params if n in plan.optimized]
    optimizer = (torch.optim.AdamW(optimized, lr=h.lr, betas=h.betas, eps=h.eps, weight_decay=h.weight_decay)
                 if optimized else None)
    steps = []
    for step, batch in enumerate(batches):
        if step - 1 == resumed_after:
            for param in (*params.values(), *masters.values()):
                param.grad = None
        if convention == MODEL_ZERO_GRAD_LOOP:
            model.zero_grad(set_to_none=True)
        # The canonical loop zeroes through the optimizer: with an optimizer over a subset,
        # grads of params outside it accumulate (and count in the clip norm), as they do for users.
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)
            if compute_dtype is not None:
                for name in plan.optimized:
                    params[name].grad = None
        drawn = rng[step] if rng is not None else None
        loss = (loss_of(model, batch) if shards == 1 and drawn is None
                else _per_rank_loss(model, loss_of, batch, states, slots, drawn))
        if loss.requires_grad:
            loss.backward()
        grads = {n: (None if p.grad is None else p.grad.detach().float().clone()) for n, p in params.items()}
        if compute_dtype is not None:
            for name, master in masters.items():
                master.grad = None if grads[name] is None else grads[name].clone()
        # Without clipping the norm is still measured (an infinite max norm scales nothing) for the record.
        clipped = [p for n, p in masters.items() if p.grad is not None
                   and (convention != CLIP_OPTIMIZED_LOOP or n in plan.optimized)]
        norm = float(torch.nn.utils.clip_grad_norm_(clipped, h.max_norm if h.clips else math.inf))
        if optimizer is not None:
            optimizer.step()
        if compute_dtype is not None:
            with torch.no_grad():
                for name, param in params.items():
                    param.copy_(masters[name])
        steps.append(ReferenceStep(grads, norm, {n: p.detach().float().clone() for n, p in params.items()},
                                   {name: module._buffers[local].detach().clone()
                                    for name, (module, local) in slots.items()}))
    return steps


def digest(*parts: object) -> str:
    """A key for everything a reference reads: tensors by dtype, shape and bytes; mappings by sorted key; sets
    sorted; anything else by its repr (plain data: the cell's hyperparameters, plan and references)."""
    h = hashlib.blake2b(digest_size=20)

    def feed(part: object) -> None:
        if isinstance(part, torch.Tensor):
            flat = part.detach().to("cpu").contiguous().reshape(-1)
            h.update(f"T{flat.dtype}{tuple(part.shape)}|".encode())
            h.update(flat.view(torch.uint8).numpy().tobytes())
        elif isinstance(part, dict):
            h.update(b"{")
            for name in sorted(part, key=repr):
                feed(name)
                feed(part[name])
            h.update(b"}")
        elif isinstance(part, (list, tuple)):
            h.update(b"[")
            for item in part:
                feed(item)
            h.update(b"]")
        elif isinstance(part, (set, frozenset)):
            feed(sorted(part, key=repr))
        else:
            h.update(f"{type(part).__name__}:{part!r}|".encode())

    for part in parts:
        feed(part)
    return h.hexdigest()


class Memo(Generic[Value]):
    """Rank 0's references, by the digest of what they read, for the rank's life.

    A reference depends on the model's values after wrapping, the freeze plan, the batches and the
    hyperparameters, never on the stack that ran the cell: the cells of one model and pattern under every plugin,
    init and checkpoint mode that leave the same values share it (the deepspeed slice: 1000 cells, 10 s of
    references). Least recently used entries go past `size` (each is a tiny model's few steps)."""

    def __init__(self, size: int = 512) -> None:
        self.size = size
        self._entries: OrderedDict[str, Value] = OrderedDict()
        self.hits = 0

    def get(self, key: str, compute: Callable[[], Value]) -> Value:
        if key in self._entries:
            self._entries.move_to_end(key)
            self.hits += 1
            return self._entries[key]
        value = self._entries[key] = compute()
        if len(self._entries) > self.size:
            self._entries.popitem(last=False)
        return value
