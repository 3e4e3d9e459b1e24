"""The one training loop, the model-checkpoint round trip, and the probe calls of a step in the order every
adapter makes them.

Stacks differ in two ways the loop knows about: who picks the batch (the adapter's
`forward_backward(step)`: a local batch, or a pipeline's microbatches) and whether clipping
is a call of its own or happens inside `step()` with the stack's `max_norm` (`clips_in_step`:
the norm is read after the step). A `no-clip` cell (`hyper.max_norm == 0`) makes neither call: the
stack's clipping path is not taken at all. A framework that owns the loop (Composer's Trainer)
drives the same `StepProbes` from its callbacks.

The round trip (the `resume` check; *model* checkpointing, not the `checkpoint` axis's activation
recompute): after step `SAVE_AFTER_STEP` the loop saves through the stack's documented API into a
folder every rank shares, the run goes on uninterrupted to its end, then the wrapped model and optimizer
are torn down, a fresh loop is built as a resuming user builds it (same init mode, the freeze applied
before wrapping), loads, and takes the remaining steps again, probed like the first time.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch.distributed as dist

from ..core.records import INTERPRETER_EXITS
from .base import ModelView, Probe, RunContext

#: The round trip saves after this step and resumes at the next (cells train `hyper.steps` = 2 steps).
SAVE_AFTER_STEP = 0


class Loop(Protocol):
    view: ModelView
    #: True where the stack clips inside `step()` (LowLevelZero, Gemini, Megatron's optimizer).
    clips_in_step: bool

    def zero_grad(self) -> None: ...

    def forward_backward(self, step: int) -> None: ...

    def clip(self, max_norm: float) -> tuple[float | None, str]:
        """Clip and return (total norm, where it came from); called when not `clips_in_step`."""

    def step(self) -> None: ...

    def norm_after_step(self) -> tuple[float | None, str]:
        """(total norm, where it came from) of the clipping inside `step()`; called when `clips_in_step`."""


@dataclass(frozen=True)
class Saved:
    """What the saved files hold, by the bare model's names, read back from the files themselves.

    `optimizer_state`: names whose optimizer state (Adam's moments) is in the files. None: the format hides it.
    `trainable_only`: the format saves what trains and nothing else (peft's adapter-only save): a frozen param
    missing from the files is by design, the base model supplies it.
    """

    params: frozenset[str] | None
    optimizer_state: frozenset[str] | None
    trainable_only: bool = False


@runtime_checkable
class Resumable(Protocol):
    """A `Loop` that saves and loads through its stack's own, documented model-checkpoint API."""

    #: What it calls, for the report: e.g. `torch.distributed.checkpoint (get_state_dict / set_state_dict)`.
    save_api: str

    def save(self, directory: Path) -> None:
        """Save model and optimizer into `directory` (a collective: every rank, the same folder)."""

    def saved(self, directory: Path) -> Saved:
        """Read back what `save` wrote (every rank calls it; rank 0's answer is recorded)."""

    def close(self) -> None:
        """Tear the wrapped model and optimizer down before a fresh loop is built (a collective)."""

    def load(self, directory: Path, omit: str | None = None) -> None:
        """On a freshly built loop: load what `save` wrote. `omit` (tests only): leave that param, by the bare
        model's name, at its fresh value, the way a broken load would, to prove the `resume` check sees it."""


class StepProbes:
    """The probe's fixed points of a training run, with the phases a hang report shows."""

    def __init__(self, probe: Probe, view: ModelView) -> None:
        self.probe = probe
        self.view = view

    def wrapped(self) -> None:
        self.probe.wrapped(self.view)

    def forward(self, step: int) -> None:
        self.probe.step_started(step)
        self.probe.phase(f"step {step}: forward/backward")

    def backward_done(self, step: int) -> None:
        self.probe.after_backward(step, self.view)

    def clipping(self, step: int) -> None:
        self.probe.phase(f"step {step}: clip")

    def clipped(self, step: int, norm: float | None, source: str) -> None:
        self.probe.clipped(step, norm, source)

    def optimizer_step(self, step: int) -> None:
        self.probe.phase(f"step {step}: optimizer step")

    def stepped(self, step: int) -> None:
        self.probe.after_step(step, self.view)


def _train_step(ctx: RunContext, loop: Loop, probes: StepProbes, step: int) -> None:
    clips = ctx.cell.hyper.clips
    probes.forward(step)
    loop.zero_grad()
    loop.forward_backward(step)
    probes.backward_done(step)
    if clips and not loop.clips_in_step:
        probes.clipping(step)
        probes.clipped(step, *loop.clip(ctx.cell.hyper.max_norm))
    probes.optimizer_step(step)
    loop.step()
    if clips and loop.clips_in_step:
        probes.clipped(step, *loop.norm_after_step())
    probes.stepped(step)


def train(ctx: RunContext, loop: Loop, rebuild: Callable[[], Loop] | None = None) -> None:
    """`ctx.cell.hyper.steps` steps of zero_grad, forward/backward, clip, step, probed at fixed points; then,
    where `rebuild` makes a fresh loop of a `Resumable` kind, the round trip from the save after step 0."""
    probes = StepProbes(ctx.probe, loop.view)
    probes.wrapped()
    resumes = rebuild is not None and isinstance(loop, Resumable) and runs_round_trip(ctx)
    with shared_folder(ctx) if resumes else _no_folder() as folder:
        for step in range(ctx.cell.hyper.steps):
            _train_step(ctx, loop, probes, step)
            if resumes and step == SAVE_AFTER_STEP:
                resumes = save(ctx, loop, folder, step)
        if not resumes:
            return
        ctx.probe.resuming("tear down")
        loop.close()
        ctx.probe.phase("resume: rebuild")
        fresh = rebuild()
        load(ctx, fresh, folder)
        probes = StepProbes(ctx.probe, fresh.view)
        for step in range(SAVE_AFTER_STEP + 1, ctx.cell.hyper.steps):
            _train_step(ctx, fresh, probes, step)


def runs_round_trip(ctx: RunContext) -> bool:
    """Whether this cell saves and resumes: it trains past the save, and cites no other cell's round trip (the
    controller found one of its round-trip group judged already: `Cell.round_trip_of`)."""
    return ctx.cell.hyper.steps > SAVE_AFTER_STEP + 1 and ctx.cell.round_trip_of is None


#: The phase a stack's save runs in (a Trainer saves from inside its own loop, before `save` is called).
SAVE_PHASE = "resume: save"


def save(ctx: RunContext, loop: Resumable, folder: Path, step: int) -> bool:
    """Save after `step` and record what the files hold (for adapters whose stack owns the loop, too).

    A save that raises fails the round trip, not the run: it is recorded, the ranks agree that it failed (one
    rank raising while its peers finished would otherwise leave them in different collectives), and the run
    goes on without a round trip (False), so its steps are judged as any cell's."""
    ctx.probe.phase(SAVE_PHASE)
    try:
        loop.save(folder)
        ctx.probe.phase("resume: read the saved files")
        ctx.probe.saved(loop.save_api, step, loop.saved(folder))
        saved = True
    except BaseException as exc:  # torch's DCP raises CheckpointException, a BaseException: the stack's too
        if isinstance(exc, INTERPRETER_EXITS):
            raise
        ctx.probe.save_failed(loop.save_api, step, exc)
        # a peer may still be inside the stack's collectives: should this rank wait forever below, the hang
        # report shows why it left the save
        ctx.probe.phase(f"resume: save raised {type(exc).__name__}: {str(exc)[:120]}; waiting for the other ranks")
        saved = False
    return all(_every_rank(ctx, saved))


def _every_rank(ctx: RunContext, value: Any) -> list[Any]:
    """Every rank's JSON-serializable `value`, in rank order (a collective where there are several ranks)."""
    from .views import all_gather_json  # views imports torch's FSDP: not at import time of the contract

    return all_gather_json(value) if dist.is_initialized() and ctx.world_size > 1 else [value]


def load(ctx: RunContext, fresh: Resumable, folder: Path) -> None:
    """Load into a freshly built loop and record its state before the next step."""
    ctx.probe.phase("resume: load")
    fresh.load(folder, omit=ctx.cell.break_load)
    ctx.probe.loaded(fresh.view)


#: Where the round trip's folders go; a folder per cell, removed when the cell ends.
FOLDER_PREFIX = "freezecompat-resume-"
#: Folders of cells that raised on rank 0: a peer may still be reading one (or waiting in a collective before it
#: reads), so rank 0 removes them when its next cell starts, when every rank of the cell that raised has reported
#: or been replaced. A rank 0 that is replaced first leaves them in its TMPDIR, which the pool removes.
_LEFT_FOR_PEERS: list[Path] = []


@contextmanager
def shared_folder(ctx: RunContext) -> Iterator[Path]:
    """A fresh folder for one cell's saved files that every rank names alike (rank 0 makes it and tells the
    others; a collective). Rank 0 removes it when the cell ends: at once when the cell ran through, and at the start
    of its next cell when it raised, so that a slower peer meets its own failure, not a missing file. On several
    hosts it must be on a shared file system: set TMPDIR there."""
    if ctx.rank == 0:
        while _LEFT_FOR_PEERS:
            shutil.rmtree(_LEFT_FOR_PEERS.pop(), ignore_errors=True)
    made = tempfile.mkdtemp(prefix=FOLDER_PREFIX) if ctx.rank == 0 else ""
    folder = Path(_every_rank(ctx, made)[0])
    try:
        yield folder
    except BaseException:
        if ctx.rank == 0:
            _LEFT_FOR_PEERS.append(folder)
        raise
    if ctx.rank == 0:
        shutil.rmtree(folder, ignore_errors=True)


@contextmanager
def _no_folder() -> Iterator[Path]:
    yield Path(os.devnull)
