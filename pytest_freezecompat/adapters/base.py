"""The contract between the shared scenario and one framework.

An adapter builds, freezes and wraps the cell's model its framework's way, then trains it
through `loop.train` (or, where the framework owns the loop, drives the same `loop.StepProbes`
from its callbacks). It reports facts through the `Probe`; it never judges.

What an adapter implements (`Adapter`):
  run(ctx)                      build, freeze, wrap, train; the only required method
  reference_model(cell)         optional: (bare single-process model, loss) when the cell's model is
                                the framework's own; None means the tiny model of `models.py`
What its module may define:
  warm_up()                     first uses that cost every fresh process the same (a subprocess, a cache),
                                done once in each rank template before it forks ranks: CPU only, no process
                                group, and no thread may outlive it (the template refuses to fork then)
What it declares (`core.declaration.AdapterDeclaration` in its package's `__init__.py`):
  plugins, init modes, checkpoint modes it knows, its implementation class, its shim.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from ..core.cell import Cell
from ..core.freeze import FreezePlan, RowRange, is_quantized

Batch = dict[str, torch.Tensor]
LossOf = Callable[[nn.Module, Batch], torch.Tensor]


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
        """Record that a CUDA-on-CPU shim patch really engaged (the cell is labelled `emulation`)."""

    def observed(self, fact: str, value: object) -> None:
        """What the stack really is, read from the objects it built (`ZeRO stage` from the engine, the wrapper's
        class): the controller holds it against what the cell's name promises (`AdapterDeclaration.observes`)."""

    def wrapped(self, view: ModelView) -> None:
        """After wrapping, materializing and building the optimizer, before the first step."""

    def step_started(self, step: int) -> None:
        """From here on an error belongs to training step `step`, not to the setup."""

    def after_backward(self, step: int, view: ModelView) -> None: ...

    def clipped(self, step: int, total_norm: float | None, source: str) -> None:
        """`source` says where the norm came from, e.g. `returned by clip_grad_norm_`."""

    def after_step(self, step: int, view: ModelView) -> None: ...

    def saved(self, api: str, step: int, contents: object) -> None:
        """The round trip saved after `step` through `api`; `contents` is a `loop.Saved` of what the files hold."""

    def save_failed(self, api: str, step: int, exc: BaseException) -> None:
        """Saving through `api` raised: the round trip failed; the run goes on without it."""

    def resuming(self, what: str) -> None:
        """From here on the run is the resumed one: its phases read `resume: ...`, its steps are recorded apart,
        and an error belongs to the round trip."""

    def loaded(self, view: ModelView) -> None:
        """After the fresh loop loaded, before its first step."""


class Shim(Protocol):
    """A CUDA-on-CPU shim (`adapters.emulation.Shim` is the one implementation to subclass)."""

    def apply(self, cell: Cell, probe: Probe, device: torch.device) -> contextlib.AbstractContextManager[None]: ...


class KeptState(Protocol):
    """Framework state kept across clean cells with the rank's default process group (`rank.kept`)."""

    def ensure(self, name: str, key: Hashable, create: Callable[[], None], release: Callable[[], None]) -> bool:
        """Run `create` unless the state `name` exists for `key` (then True); state for another key is released."""


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
    loss: LossOf
    """The cell's loss on a (local) batch: `ctx.loss(model, ctx.local_batch(step))`."""
    kept: KeptState
    """Where an adapter keeps parallel state that a user's run makes once (it lives with the default group)."""
    shim: Shim | None = None

    def local_batch(self, step: int, dp_rank: int | None = None, dp_size: int | None = None) -> Batch:
        """This data-parallel rank's rows of the global batch of `step`, on the cell's device.

        Every rank is a data-parallel rank unless the adapter says otherwise (tensor or
        pipeline parallelism: pass the rank's index and the size of its data-parallel group).
        """
        dp_rank = self.rank if dp_rank is None else dp_rank
        dp_size = self.world_size if dp_size is None else dp_size
        return {k: v.to(self.device) for k, v in rows_of(self.batches[step], dp_rank, dp_size).items()}

    def eager_buffers(self) -> dict[str, torch.Tensor]:
        """The buffers of the bare model built for real on the CPU: what a meta model's buffers must hold."""
        return {name: buffer.detach() for name, buffer in self.build_model(device="cpu").named_buffers()}

    def make_optimizer(self, params: list[nn.Parameter]) -> torch.optim.Optimizer:
        h = self.cell.hyper
        return torch.optim.AdamW(params, lr=h.lr, betas=h.betas, eps=h.eps, weight_decay=h.weight_decay)

    @contextlib.contextmanager
    def emulation(self) -> Iterator[None]:
        """The adapter's shim around what needs it, when a matrix rule asked for emulation on this cell."""
        if self.shim is None:
            yield
            return
        with self.shim.apply(self.cell, self.probe, self.device):
            yield


def rows_of(batch: Batch, rank: int, ranks: int) -> Batch:
    """Data-parallel rank `rank`'s rows of a global batch: the same split for the stacks and the per-rank reference."""
    per_rank = next(iter(batch.values())).shape[0] // ranks
    return {k: v[rank * per_rank:(rank + 1) * per_rank] for k, v in batch.items()}


def buffers_of(module: nn.Module, infixes: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """Every buffer of `module` by the bare model's name, whole (a DTensor buffer gathered): buffers are replicated,
    not sharded, under DDP, FSDP and ZeRO, so each rank reads its own copy."""
    return {strip_wrapper_infixes(name, infixes): (buffer.full_tensor() if hasattr(buffer, "full_tensor") else buffer)
            .detach().clone() for name, buffer in module.named_buffers()}


class Adapter(Protocol):
    def run(self, ctx: RunContext) -> None: ...

    def reference_model(self, cell: Cell) -> tuple[nn.Module, LossOf] | None:
        """The single-process reference for the framework's own model, or None for the cell's model."""


class AdapterBase:
    """Defaults of the optional parts of `Adapter`."""

    def reference_model(self, cell: Cell) -> tuple[nn.Module, LossOf] | None:
        return None


#: How cells name a precision, by the dtype the model computes in.
PRECISION_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def dtypes_of(params: Iterable[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """Param name -> its storage dtype's name (`core.dtypes`); packed quantized weights are left out (their layer
    computes in its own compute dtype)."""
    return {name: PRECISION_NAMES.get(param.dtype, str(param.dtype)) for name, param in params
            if not is_quantized(param)}


def hold_as(model: nn.Module, dtypes: Mapping[str, str]) -> nn.Module:
    """`model` with each param in the dtype the stack's own build of it held (`deepspeed.zero.Init` builds a bf16
    model in its config's dtype): the reference runs the model as the user holds it under the cell's init."""
    by_name = {name: dtype for dtype, name in PRECISION_NAMES.items()}
    for name, param in model.named_parameters():
        wanted = by_name.get(dtypes.get(name, ""))
        if wanted is not None and param.dtype != wanted:
            param.data = param.data.to(wanted)
    return model


def precision_of(model: nn.Module) -> str:
    """The precision the wrapped model computes in, as cells name it (`bf16+fp32` where its params are mixed). A
    quantized layer's packed weights are left out (`is_quantized`, or a module that keeps a quantization state, as
    bitsandbytes' layers do once FSDP2 has made their weights DTensors): the layer computes in its compute dtype."""
    dtypes = {PRECISION_NAMES.get(p.dtype, str(p.dtype)) for module in model.modules()
              if getattr(module, "quant_state", None) is None
              for p in module.parameters(recurse=False) if not is_quantized(p)}
    return "+".join(sorted(dtypes)) or "no params"


def cast_inputs(module: nn.Module, dtype: torch.dtype) -> torch.utils.hooks.RemovableHandle:
    """Feed `module` its floating-point inputs in `dtype`, as mixed precision does (and as a user of a bf16 engine
    that casts nothing does before calling it); integer inputs (token ids) and the loss's own targets are left as
    they are: only what enters `module.forward` is cast."""

    def cast(value: object) -> object:
        return value.to(dtype) if isinstance(value, torch.Tensor) and value.is_floating_point() else value

    def hook(_: nn.Module, args: tuple[object, ...], kwargs: dict[str, object]) -> tuple[tuple[object, ...],
                                                                                          dict[str, object]]:
        return tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}

    return module.register_forward_pre_hook(hook, with_kwargs=True)


def class_among(obj: object, classes: tuple[type, ...]) -> str:
    """The first of the framework's `classes` that `obj` is an instance of, by name; else its own class's name (a
    wrapper may build a class per model, as `fully_shard` does)."""
    return next((cls.__name__ for cls in classes if isinstance(obj, cls)), type(obj).__name__)


def apply_freeze(plan: FreezePlan, model: nn.Module, names: Callable[[str], str] = str) -> None:
    """Set `requires_grad` on the bare model, before any wrapper sees it (`names` maps local to plan names); a
    param that trains only some rows gets the gradient-mask hook users write for it (`FreezePlan.rows`)."""
    for name, param in model.named_parameters():
        param.requires_grad_(names(name) in plan.trainable)
        rows = plan.rows.get(names(name))
        if rows is not None:
            param.register_hook(functools.partial(keep_rows, rows))


def keep_rows(rows: RowRange, grad: torch.Tensor) -> torch.Tensor:
    """The grad with every row outside `rows` zeroed (a new tensor: a hook must not change its input)."""
    kept = torch.zeros_like(grad)
    kept[slice(*rows)] = grad[slice(*rows)]
    return kept


def strip_wrapper_infixes(name: str, infixes: tuple[str, ...]) -> str:
    """`_fsdp_wrapped_module.blocks.0._fsdp_wrapped_module.w` -> `blocks.0.w`: wrappers insert
    module names into parameter names; the checks speak the bare model's names."""
    return ".".join(part for part in name.split(".") if part not in infixes)
