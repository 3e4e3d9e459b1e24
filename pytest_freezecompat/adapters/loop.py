"""The one training loop, and the probe calls of a step in the order every adapter makes them.

Stacks differ in two ways the loop knows about: who picks the batch (the adapter's
`forward_backward(step)`: a local batch, or a pipeline's microbatches) and whether clipping
is a call of its own or happens inside `step()` with the stack's `max_norm` (`clips_in_step`:
the norm is read after the step). A `no-clip` cell (`hyper.max_norm == 0`) makes neither call: the
stack's clipping path is not taken at all. A framework that owns the loop (Composer's Trainer)
drives the same `StepProbes` from its callbacks.
"""

from __future__ import annotations

from typing import Protocol

from .base import ModelView, Probe, RunContext


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


def train(ctx: RunContext, loop: Loop) -> None:
    """`ctx.cell.hyper.steps` steps of zero_grad, forward/backward, clip, step, probed at fixed points."""
    probes = StepProbes(ctx.probe, loop.view)
    clips = ctx.cell.hyper.clips
    probes.wrapped()
    for step in range(ctx.cell.hyper.steps):
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
