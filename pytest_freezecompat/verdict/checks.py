"""Pure verdicts: what the ranks saw + the single-process reference -> a cell's status.

Statuses: pass, fail (it ran; a check failed), error (it raised), timeout (a hang),
crash (a rank died), skip (decided at planning). The checks, in the order they are
reported:
  requires_grad  flags after wrapping equal the freeze pattern's
  optimizer      the optimizer tracks exactly the intended params, by original name
  buffers        after each step: a frozen module's buffers (BatchNorm statistics, counters) have not moved on any
                 rank; rank 0's other buffers equal the reference's (rank 0's rows, where the reference runs per rank)
  grads          after backward: full, finite, equal to the reference; none where the reference has none
  grad_norm      the norm the framework's clipping reported equals the reference's
  update         after step: params that the reference leaves alone are bit-identical, the rest match
  (every rank)   grads (but those of params outside the optimizer) and params of every other rank match rank 0's
  resume         the model-checkpoint round trip: saved after step 0 through the stack's own API, loaded into a
                 fresh model frozen the same way, it goes on as the uninterrupted run did (flags, optimizer set,
                 saved files, values and buffers after load, the next step's grads, norm and update)
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..core import dtypes, ties
from ..core.cell import Cell
from ..core.messages import RENDEZVOUS_PHASE
from ..core.names import CANONICAL_LOOP, CHECKS, CLIP_OPTIMIZED_LOOP
from ..core.records import (
    FREEZE_CASE_ERROR,
    CellRun,
    Outcome,
    PlanFacts,
    RankError,
    RankRecord,
    Status,
    StepFacts,
)
from . import stack


@dataclass(frozen=True)
class Tolerance:
    grad_rtol: float
    grad_atol: float
    #: Adam divides by sqrt(v): float noise in a near-zero grad becomes a visible part of one
    #: lr step, so params get an absolute tolerance of a fraction of the step (lr = 1e-2).
    param_rtol: float
    param_atol: float
    norm_rtol: float


#: Float reassociation across ranks (sums in another order); every cell gets it.
FP32 = Tolerance(grad_rtol=1e-4, grad_atol=1e-6, param_rtol=1e-4, param_atol=1e-3, norm_rtol=1e-4)
#: A bf16/fp16 cell may sit this many times its precision's measured spread (the distance between the fp32
#: reference and the same run as mixed precision does it) from the fp32 reference. Measured on ColossalAI
#: HybridParallel zero-1 bf16 (tiny-gpt, tiny-llama, a peft LoRA): healthy cells reach at most 1.2x the step's
#: widest relative grad spread, a real failure (reentrant checkpointing over a frozen embedding) 17x.
SPREAD_FACTOR = 2.0
#: Grads that are one multiple of the reference's (a sum where a mean was due): every element within 0.1%.
SCALE_RTOL = 1e-3
#: An element whose reference grad is noise may move the other way: by up to this many lr per step.
ADAM_FLIP_STEPS = 2.0
#: How many parameter names a message lists before it says "and N more".
NAMES_SHOWN = 4
DETAIL_CHARS = 4000
REFUSAL_NOTE = "refused before the first step"


@dataclass(frozen=True)
class Room:
    """Absolute slack at one step beyond `FP32`, per tensor: what the cell's low precision itself costs.

    Grads: each tensor's own relative spread (|mixed - fp32| / its largest |grad|), at least one bf16 epsilon, times
    its scale: one noisy tensor no longer widens every other's. Params: each tensor's own largest spread (storage
    rounding, Adam's reaction).
    """

    grads: dict[str, float] = field(default_factory=dict)
    params: dict[str, float] = field(default_factory=dict)
    norm: float = 0.0
    spread: float = 0.0  # the step's widest relative grad spread (stated; no longer anyone else's room)

    def grad(self, name: str) -> float:
        return self.grads.get(name, 0.0)

    def param(self, name: str) -> float:
        return self.params.get(name, 0.0)


#: The least relative grad spread a low-precision tensor is allowed: one bf16 epsilon (2^-7) of its scale. The mixed
#: reference may round a tensor more kindly than the stack does (a grad it sums in fp32, the stack in bf16).
LOW_PRECISION_FLOOR = 2.0 ** -7
#: The least absolute room of any low-precision tensor, as a share of the step's largest grad: a grad whose terms
#: cancel (exactly zero in theory, or nearly) keeps the rounding of terms as large as the step's other grads, which
#: its own tiny scale does not show. A real failure (a missing or wrong grad) is of the size of its terms.
CANCELLATION_FLOOR = 2.0 ** -10


def measured_room(ref: StepFacts, mixed: StepFacts, stored: Mapping[str, str] | None = None) -> Room:
    """The room a low-precision cell gets at one step, from the two reference runs (SPREAD_FACTOR times it). A param
    the model stores in bf16/fp16 (`stored`: name -> dtype) rounds every update to it: its params get at least
    SPREAD_FACTOR storage ulps of its largest value (`dtypes.STORAGE_ULP`), whatever the spread measured."""
    pairs = {n: (r, (mixed.grads or {}).get(n)) for n, r in (ref.grads or {}).items()}
    pairs = {n: (r, m) for n, (r, m) in pairs.items() if r is not None and m is not None and r.shape == m.shape}
    scales = {n: float(np.max(np.abs(r), initial=0.0)) for n, (r, _) in pairs.items()}
    relative = {n: float(np.max(np.abs(m - r))) / scales[n] for n, (r, m) in pairs.items() if scales[n] > 0}
    widest = max(relative.values(), default=0.0)
    params = {n: SPREAD_FACTOR * max(float(np.max(np.abs(mixed.params[n] - r), initial=0.0)),
                                     dtypes.STORAGE_ULP.get((stored or {}).get(n, ""), 0.0)
                                     * float(np.max(np.abs(r), initial=0.0)))
              for n, r in (ref.params or {}).items() if n in (mixed.params or {}) and mixed.params[n].shape == r.shape}
    norm_spread = max(abs((mixed.norm or 0.0) - (ref.norm or 0.0)), widest * abs(ref.norm or 0.0))
    cancelled = CANCELLATION_FLOOR * max(scales.values(), default=0.0)
    grads = {n: SPREAD_FACTOR * max(relative.get(n, 0.0) * scale, LOW_PRECISION_FLOOR * scale, cancelled)
             for n, scale in scales.items()}
    return Room(grads, params, SPREAD_FACTOR * norm_spread, widest)


@dataclass(frozen=True)
class Problem:
    """What one check found at one step, and the params it names (all of them, unabridged)."""

    text: str
    params: tuple[str, ...]
    scale: float | None = None  # grads: the one factor every differing grad is of the reference's
    ranks_combine: str | None = None  # grad_norm: "l2" where the ranks' own norms combine to the reference's
    #: What it found, as `FAILURE_KINDS` (severity, cause and the registry read these, never `text`).
    kinds: tuple[str, ...] = ()


@dataclass(frozen=True)
class CheckFailure:
    check: str
    step: int  # -1: before the first step (requires_grad, optimizer)
    message: str
    params: tuple[str, ...]
    #: It names a param the pattern holds fixed (frozen, or outside the optimizer): freezing is involved.
    on_held_params: bool = False
    #: What the named params are: held (by the pattern), no-grad (trainable, the reference gives none),
    #: trained, or mixed; None when it names none. Registry entries predict it.
    params_kind: str | None = None
    #: grads: the factor of `Problem.scale` at the first step that failed; a later step starts from params that
    #: already moved differently (unclipped, a grad twice as large moves AdamW's params by a hair more).
    scale: float | None = None
    ranks_combine: str | None = None
    #: What it found at any step, as `FAILURE_KINDS`, in the order first found.
    kinds: tuple[str, ...] = ()
    #: Whether a param it names is in the optimizer the stack built (None: it names none): a grad on a param no
    #: optimizer holds reaches no weight in the loop that ran.
    in_optimizer: bool | None = None

    @property
    def raised(self) -> bool | None:
        """resume: the round trip raised (the cell's severity is then `refused`); None otherwise (left out of JSON)."""
        return "raised" in self.kinds or None

    def to_json(self) -> dict[str, Any]:
        data = {"check": self.check, "step": self.step, "message": self.message, "params": list(self.params),
                "on_held_params": self.on_held_params, "kinds": list(self.kinds)}
        facts = {"params_kind": self.params_kind, "scale": self.scale, "ranks_combine": self.ranks_combine,
                 "raised": self.raised, "in_optimizer": self.in_optimizer}
        return {**data, **{k: v for k, v in facts.items() if v is not None}}


@dataclass(frozen=True)
class RoundTrip:
    """A judged save -> load round trip, as the cells of its round-trip group cite it: the cell that ran it, the API
    it went through, what it found (None: it held) and the notes it left."""

    cell: str  # "" until the controller names it
    api: str | None
    problem: Problem | None
    notes: tuple[str, ...] = ()


@dataclass
class Verdict:
    status: Status
    check: str | None = None  # the earliest failed check: the likely root cause
    message: str = ""
    notes: list[str] = field(default_factory=list)
    failures: list[CheckFailure] = field(default_factory=list)  # every failed check, earliest first
    #: Our own code raised (harness, probes, reference), not the stack: the cell says nothing about the stack.
    harness: bool = False
    #: error, crash, timeout: "wrapping" (before the first step) or "training". Registry entries predict it.
    raised_in: str | None = None
    #: Where the optimizer holds a subset of what trains and several correct loops were tried: the one judged.
    convention: str | None = None
    #: What differs from the canonical loop without reaching a weight (the `differs` severity of a pass).
    differences: list[str] = field(default_factory=list)
    #: The round trip this cell ran and judged (None: it ran none, or cited another cell's): its group's later cells
    #: cite it.
    round_trip: RoundTrip | None = None
    #: The cell whose round trip this verdict took as its own (`judge`'s `cited`).
    round_trip_of: str | None = None
    #: Checks that decide the verdict but did not run on this cell (`core.names.UNCHECKED`): a pass is `unproven`.
    unchecked: list[str] = field(default_factory=list)
    #: The tolerances the steps were judged with (`stated_tolerance`); None where no step was judged.
    tolerance: dict[str, Any] | None = None
    #: error: what the stack raised first, in its own words ({type, message}): what `cause` compares.
    error: dict[str, str] | None = None


#: The phases our own code runs in (the pool's rendezvous, the probes' reads, the reference, the scenario's setup).
HARNESS_PHASES = (RENDEZVOUS_PHASE, "setup", "read state after wrap", "reference", "resume: read state after load",
                  "resume: read the saved files")
HARNESS_PHASE_SUFFIXES = (": read grads", ": read params")


def is_harness_phase(phase: str) -> bool:
    return phase in HARNESS_PHASES or phase.endswith(HARNESS_PHASE_SUFFIXES)


def stage_of(step: int | None) -> str:
    return "wrapping" if step is None else "training"


def stage_of_phases(phases: Iterable[str]) -> str:
    """Where a crash or hang happened, from the ranks' last phases (training phases read `step N: ...`)."""
    return "training" if any(re.match(r"step \d+:", phase) for phase in phases) else "wrapping"


def unchanged(have: Any, want: Any) -> bool:
    """Bit-identical as a frozen param must stay: a NaN where the other holds one at the same place is unchanged (the
    packed bytes of bf16-stored 4-bit weights read as floats hold NaN patterns)."""
    return bool(np.array_equal(have, want, equal_nan=True))


def close(have: Any, want: Any, rtol: float, atol: float) -> bool:
    """`np.allclose(have, want, rtol=rtol, atol=atol)`, its common case without its per-call cost (a judge makes
    hundreds of these a cell): every |have - want| <= atol + rtol |want| with `want` finite is numpy's own test
    passing; anything else (infinities, NaNs, a difference) is left to numpy's function."""
    if np.isfinite(want).all() and (np.abs(have - want) <= atol + rtol * np.abs(want)).all():
        return True
    return bool(np.allclose(have, want, rtol=rtol, atol=atol))


def _uniform_scale(pairs: list[tuple[Any, Any]], atol: float) -> float | None:
    """The one factor every pair's got is of its want (e.g. grads summed where a mean was due), if there is one."""
    ratios = []
    for have, want in pairs:
        denominator = float(np.vdot(want, want))
        if denominator == 0.0:
            return None
        ratio = float(np.vdot(have, want)) / denominator
        if not close(have, ratio * want, rtol=SCALE_RTOL, atol=atol * abs(ratio)):
            return None
        ratios.append(ratio)
    if not ratios or max(ratios) - min(ratios) > SCALE_RTOL * abs(ratios[0]):
        return None
    return round(sum(ratios) / len(ratios), 4)


def _names(names: Iterable[str]) -> str:
    names = sorted(names)
    shown = ", ".join(names[:NAMES_SHOWN])
    return shown + (f" and {len(names) - NAMES_SHOWN} more" if len(names) > NAMES_SHOWN else "")


def _clip(text: str) -> str:
    return text if len(text) <= DETAIL_CHARS else "..." + text[-DETAIL_CHARS:]


def _check_flags(records: list[RankRecord], trainable: set[str], init: str) -> Problem | None:
    """The flags after wrapping against the pattern's, and every alias of the bare model (`core.ties`) that wrapping
    or `init` made a param of its own: its two copies no longer share what they learn."""
    changed: dict[str, str] = {}
    untied: dict[str, str] = {}
    for record in records:
        for name, flag in (record.requires_grad or {}).items():
            if name in record.tied:
                untied[name] = ties.untied_reason(name, record.tied[name], init, record.observed)
            if flag != (want := ties.trains(name, trainable, record.tied)):
                changed[name] = f"{name} ({want}->{flag})"
    parts = [f"requires_grad changed by wrapping: {_names(changed.values())}"] if changed else []
    parts.extend(untied[name] for name in sorted(untied))
    if not parts:
        return None
    kinds = ("flag-changed",) * bool(changed) + ("untied",) * bool(untied)
    return Problem("; ".join(parts), tuple(sorted(changed.keys() | untied.keys())), kinds=kinds)


def _tracked(records: list[RankRecord]) -> set[str]:
    """What the stack's optimizer holds: the union over ranks (each may hold its own shard's params)."""
    return set().union(*(set(r.tracked or ()) for r in records))


def _check_tracked(records: list[RankRecord], optimized: set[str]) -> Problem | None:
    tracked = _tracked(records)
    extra, missing = tracked - optimized, optimized - tracked
    parts, kinds = [], []
    if extra:
        parts.append(f"optimizer tracks {len(extra)} unintended: {_names(extra)}")
        kinds.append("tracks-unintended")
    if missing:
        parts.append(f"optimizer misses {len(missing)}: {_names(missing)}")
        kinds.append("misses-trained")
    return Problem("; ".join(parts), tuple(sorted(extra | missing)), kinds=tuple(kinds)) if parts else None


def _check_grads(step: int, got: dict[str, Any], ref: dict[str, Any], tol: Tolerance, room: Room,
                 notes: list[str]) -> Problem | None:
    missing, zeroed, spurious, partial, nonfinite, differ, zero_filled = [], [], [], [], [], [], []
    named: list[str] = []
    differing: list[tuple[Any, Any]] = []
    for name, want in ref.items():
        have = got.get(name)
        if want is None:
            if have is None:
                continue
            (zero_filled if not np.any(have) else spurious).append(name)
        elif have is None:
            missing.append(name)
        elif have.shape != want.shape:
            partial.append(f"{name} {tuple(have.shape)} != {tuple(want.shape)}")
            named.append(name)
        elif not np.all(np.isfinite(have)):
            nonfinite.append(name)
        elif not np.any(have) and np.any(want):
            zeroed.append(name)
        elif not close(have, want, rtol=tol.grad_rtol, atol=tol.grad_atol + room.grad(name)):
            differ.append(f"{name} (max abs diff {np.max(np.abs(have - want)):.2e})")
            named.append(name)
            differing.append((have, want))
    if zero_filled:
        notes.append(f"step {step}: zero-filled grad where the reference has none: {_names(zero_filled)}")
    problems = [(missing, "no-grad", "no grad on trainable"),
                (zeroed, "zeroed", "all-zero grad where the reference has one"),
                (spurious, "spurious", "grad on param that should get none"),
                (partial, "partial", "grad not full"), (nonfinite, "nonfinite", "non-finite grad"),
                (differ, "differs", "grad differs from reference")]
    found = [f"{what}: {_names(names)}" for names, _, what in problems if names]
    params = sorted({*missing, *zeroed, *spurious, *nonfinite, *named})
    if not found:
        return None
    only_differ = len(found) == 1 and bool(differ)
    return Problem(f"step {step}: " + "; ".join(found), tuple(params),
                   scale=_uniform_scale(differing, tol.grad_atol) if only_differ else None,
                   kinds=tuple(kind for names, kind, _ in problems if names))


def _check_norm(step: int, got: StepFacts, peers: list[float | None], want: float, tol: Tolerance, room: Room,
                notes: list[str]) -> Problem | None:
    """`peers`: the norm every rank reported at this step, rank 0 first."""
    norm, source = got.norm, got.norm_source or "?"
    if norm is None:
        notes.append(f"step {step}: grad norm not verified: {source}")
        return None
    atol = 1e-7 + room.norm
    if np.isclose(norm, want, rtol=tol.norm_rtol, atol=atol):
        return None
    # Each rank measured only its own shard: their norms combine (as an L2 sum) to the reference's.
    shards = len(peers) > 1 and all(p is not None for p in peers) and bool(
        np.isclose(np.sqrt(sum(p * p for p in peers)), want, rtol=tol.norm_rtol, atol=atol))
    return Problem(f"step {step}: grad norm {norm:.6g} ({source}) != reference {want:.6g}", (),
                   ranks_combine="l2" if shards else None, kinds=("norm-differs",))


def _check_update(step: int, got: dict[str, Any], ref: dict[str, Any], before: dict[str, Any],
                  tol: Tolerance, room: Room, quiet: dict[str, np.ndarray], lr: float) -> Problem | None:
    """`quiet` marks elements whose reference grad sat within the grad tolerance at some step so far:
    there Adam's first steps are about sign(grad) * lr, so rounding noise may flip them (up to 2 lr a step)."""
    moved_frozen, differ, named = [], [], []
    for name, want in ref.items():
        have = got.get(name)
        if have is None or have.shape != want.shape:
            differ.append(f"{name} (missing or wrong shape)")
            named.append(name)
        elif unchanged(want, before[name]):
            if not unchanged(have, before[name]):
                moved_frozen.append(name)
        elif not close(have, want, rtol=tol.param_rtol, atol=tol.param_atol):
            diff = np.abs(have - want)
            allowed = _param_allowed(tol, room, name, want)
            off = diff > allowed
            if name in quiet:
                # A flip moves the param by up to 2 lr a step, and a low-precision param is then stored rounded:
                # the flip's allowance sits on top of the precision's own param tolerance.
                off &= ~(quiet[name] & (diff <= ADAM_FLIP_STEPS * lr * (step + 1) + allowed))
            if off.any():
                differ.append(f"{name} (max abs diff {np.max(diff[off]):.2e})")
                named.append(name)
    found, kinds = [], []
    if moved_frozen:
        found.append(f"param that must stay fixed changed: {_names(moved_frozen)}")
        kinds.append("held-moved")
    if differ:
        found.append(f"update differs from reference: {_names(differ)}")
        kinds.append("update-differs")
    params = tuple(sorted({*moved_frozen, *named}))
    return Problem(f"step {step}: " + "; ".join(found), params, kinds=tuple(kinds)) if found else None


def _earliest(errors: list[RankError]) -> RankError:
    """The earliest error is the cause; where several ranks raised it, the lowest rank names it (stable reruns)."""
    errors = sorted(errors, key=lambda e: e.at)
    return min((e for e in errors if (e.type, e.message) == (errors[0].type, errors[0].message)), key=lambda e: e.rank)


def _shifted(values: dict[str, Any] | None, ref: dict[str, Any] | None, resumed: dict[str, Any] | None
             ) -> dict[str, Any]:
    """`values` moved by what resuming itself changes in the reference (`resumed` - `ref`), tensor by tensor."""
    out = dict(values or {})
    for name, want in (resumed or {}).items():
        have, base = out.get(name), (ref or {}).get(name)
        if want is None or base is None or have is None:
            if want is None or base is None:  # a grad that no longer accumulates, or one only resuming makes
                out[name] = want if (want is None) != (base is None) else have
            continue
        out[name] = have + (want - base)
    return out


def _accumulates(uninterrupted: StepFacts, ref: StepFacts, resumed_ref: StepFacts) -> bool:
    """Whether the stack let the grads outside the optimizer accumulate as the reference does: its grads of the
    params where accumulating matters sit nearer the reference's than the resumed reference's (a stack that zeroes
    every model grad, as ColossalAI's loop does, has nothing a checkpoint could lose)."""
    near_accumulated = near_fresh = 0.0
    for name, fresh in (resumed_ref.grads or {}).items():
        have, accumulated = (uninterrupted.grads or {}).get(name), (ref.grads or {}).get(name)
        if have is None or fresh is None or accumulated is None or np.array_equal(fresh, accumulated):
            continue
        near_accumulated += float(np.sum(np.abs(have - accumulated)))
        near_fresh += float(np.sum(np.abs(have - fresh)))
    return near_accumulated <= near_fresh


def resumed_expectation(uninterrupted: StepFacts, ref: StepFacts, resumed_ref: StepFacts | None,
                        shift_norm: bool = True) -> StepFacts:
    """What the resumed run's step should show: the uninterrupted run's, where no grad accumulates outside the
    optimizer (`resumed_ref` None: resuming changes nothing). Else no checkpoint holds those grads: the
    uninterrupted run shifted by the difference resuming makes to the reference."""
    if resumed_ref is None or not _accumulates(uninterrupted, ref, resumed_ref):
        return uninterrupted
    norm = uninterrupted.norm
    if shift_norm and norm is not None and ref.norm is not None and resumed_ref.norm is not None:
        norm += resumed_ref.norm - ref.norm
    return StepFacts(_shifted(uninterrupted.grads, ref.grads, resumed_ref.grads), norm, uninterrupted.norm_source,
                     _shifted(uninterrupted.params, ref.params, resumed_ref.params))


def _check_resume(records: list[RankRecord], plan: PlanFacts, tol: Tolerance, rooms: dict[int, Room],
                  lr: float, clips: bool, notes: list[str], convention: str = CANONICAL_LOOP,
                  compare_steps: bool = True, redrawn: list[StepFacts] | None = None,
                  redrawn_rooms: dict[int, Room] | None = None) -> Problem | None:
    """The round trip against the uninterrupted run of the same cell (not the reference: a stack that trains
    wrongly is judged by the other checks; this one asks whether saving and loading changed anything). Grads of
    params no optimizer steps reach no weight and are left out; under `convention` = clipping over the optimizer's
    params, the lost accumulation of those grads does not reach the norm either. `compare_steps`: False where the
    resumed steps drew other dropout masks than the uninterrupted ones (`_resume_redrawn`) and nothing replays them;
    `redrawn`: the reference replaying the resumed run's draws (`RankRecord.reference_redrawn`): the resumed steps
    are judged against it, since the uninterrupted run drew other masks, with `redrawn_rooms` (a low precision's
    spread along it) and Adam's flips where its grads are noise, as the training steps are."""
    resume = records[0].resume
    if resume is None:
        return None
    raised = [r.resume.error for r in records if r.resume is not None and r.resume.error is not None]
    if raised:
        err = _earliest(raised)
        return Problem(f"{err.phase}: {err.type}: {err.message} (rank {err.rank}, {err.where})", (),
                       kinds=("raised",))
    lead, names, trainable = records[0], set(plan.names), set(plan.trainable)
    outside = trainable - set(plan.optimized)
    found: list[str] = []
    kinds: list[str] = []
    named: set[str] = set()

    def finding(kind: str, text: str, params: Iterable[str]) -> None:
        params = sorted(params)
        found.append(f"{text}: {_names(params)}")
        kinds.append(kind)
        named.update(params)

    changed = {n for r in records for n, flag in ((r.resume.requires_grad or {}) if r.resume else {}).items()
               if flag != ties.trains(n, trainable, r.tied)}
    if changed:
        finding("flag-after-load", "requires_grad after load differs from the freeze pattern", changed)
    before = _tracked(records)
    after = set().union(*(set(r.resume.tracked or ()) for r in records if r.resume))
    if after - before:
        finding("tracks-more-after-load", "the resumed optimizer tracks what it did not before the save",
                after - before)
    if before - after:
        finding("tracks-less-after-load", "the resumed optimizer no longer tracks", before - after)
    expected_in_files = trainable if resume.saved_trainable_only else names
    if resume.saved_params is not None and expected_in_files - set(resume.saved_params):
        finding("not-saved", "not in the saved files", expected_in_files - set(resume.saved_params))
    saved_at = lead.steps[resume.saved_after]
    if resume.saved_state is not None:
        # Stepped: it had a grad the optimizer could use. An all-zero grad on a param that did not move (a
        # tracked frozen param read back as zeros) was not stepped: AdamW's decay would have moved it.
        initial = lead.initial or {}
        stepped = {n for n in before & names if (grad := (saved_at.grads or {}).get(n)) is not None
                   and (np.any(grad) or not np.array_equal((saved_at.params or {}).get(n), initial.get(n)))}
        if stepped - set(resume.saved_state):
            finding("state-not-saved", "no optimizer state in the saved files for a param the optimizer stepped",
                    stepped - set(resume.saved_state))
        kept = set(resume.saved_state) & (names - trainable)
        if kept:
            notes.append(f"the saved files hold optimizer state for frozen params: {_names(kept)}")
    differ = []
    for name, want in (saved_at.params or {}).items():
        have = (resume.loaded or {}).get(name)
        exact = name not in trainable or name not in plan.optimized
        if have is None or have.shape != want.shape:
            differ.append(f"{name} (missing or wrong shape)")
        elif not (unchanged(have, want) if exact else
                  close(have, want, rtol=tol.param_rtol, atol=tol.param_atol)):
            differ.append(f"{name} (max abs diff {np.max(np.abs(have - want)):.2e})")
    if differ:
        found.append(f"after load, values differ from what was saved: {_names(differ)}")
        kinds.append("loaded-differs")
        named.update(d.split(" (", 1)[0] for d in differ)
    # A buffer the ranks hold apart (plain BatchNorm's statistics) comes back as any one rank's: the files keep one.
    peers = [record.steps[resume.saved_after].buffers or {} for record in records[1:]
             if resume.saved_after < len(record.steps)]
    lost = [text for name, text in _buffers_changed(saved_at.buffers, resume.loaded_buffers, tol).items()
            if not any(name in peer and not _buffers_changed({name: peer[name]}, resume.loaded_buffers, tol)
                       for peer in peers)]
    if lost:
        found.append(f"after load, buffers differ from what was saved: {_names(lost)}")
        kinds.append("buffer-not-restored")
    quiet: dict[str, Any] = {}
    if redrawn is not None:
        for step in range(resume.saved_after + 1):
            _mark_quiet(quiet, redrawn[step], tol, (redrawn_rooms or {}).get(step, Room()))
        rooms, against = redrawn_rooms or {}, "from the reference drawing the resumed masks"
    else:
        against = "from the uninterrupted run"
    for step in range(resume.saved_after + 1, len(lead.steps) if compare_steps else 0):
        if redrawn is not None:  # other masks: only the reference drawing them says what the step should show
            want_step = redrawn[step]
            _mark_quiet(quiet, want_step, tol, rooms.get(step, Room()))
        else:
            want_step = resumed_expectation(lead.steps[step], (lead.reference or [])[step],
                                            lead.reference_resumed[step] if lead.reference_resumed else None,
                                            shift_norm=convention != CLIP_OPTIMIZED_LOOP)
        got = resume.steps[step] if step < len(resume.steps) else StepFacts()
        if got.params is None:
            found.append(f"the resumed run did not reach the end of step {step}")
            kinds.append("resumed-incomplete")
            break
        room = rooms.get(step, Room())
        for kind, problem in (
                ("resumed-grads", _check_grads(step, _without(got.grads, outside), _without(want_step.grads, outside),
                                               tol, room, [])),
                ("resumed-update", _check_update(step, got.params, want_step.params or {},
                                                 lead.steps[step - 1].params or {}, tol, room, quiet, lr))):
            if problem:
                found.append("resumed " + problem.text.replace("from reference", against))
                kinds.append(kind)
                named.update(problem.params)
        if clips and got.norm is not None and want_step.norm is not None and not np.isclose(
                got.norm, want_step.norm, rtol=tol.norm_rtol, atol=1e-7 + room.norm):
            found.append(f"resumed step {step}: grad norm {got.norm:.6g} != uninterrupted {want_step.norm:.6g}")
            kinds.append("resumed-norm")
    if not found:
        return None
    return Problem("; ".join(found), tuple(sorted(named)), kinds=tuple(dict.fromkeys(kinds)))


def _buffers_changed(want: dict[str, Any] | None, have: dict[str, Any] | None, tol: Tolerance,
                     exact: Callable[[str], bool] = lambda name: True,
                     room: Callable[[str], float] = lambda name: 0.0) -> dict[str, str]:
    """Buffers of `want` that `have` lacks or holds otherwise: name -> the name with how far. Counters (integer
    buffers) and the names `exact` picks must be bit-identical, the rest within the param tolerance (a running mean
    follows the weights, which may differ by rounding) plus `room` (a low-precision cell's measured spread)."""
    if want is None or have is None:
        return {}
    changed = {}
    for name, value in sorted(want.items()):
        got = have.get(name)
        if got is None or got.shape != value.shape:
            changed[name] = f"{name} (missing or wrong shape)"
        elif not unchanged(got, value) and (exact(name) or not np.issubdtype(value.dtype, np.floating)
                                            or not close(got, value, rtol=tol.param_rtol,
                                                         atol=tol.param_atol + room(name))):
            changed[name] = f"{name} (max abs diff {float(np.max(np.abs(got.astype(np.float64) - value))):.2e})"
    return changed


#: What a frozen module's moving buffers mean, and the fixes users apply (each a recipe the matrix can prove).
HELD_BUFFERS_MOVED = ("BatchNorm in train mode updates its running statistics whatever requires_grad says: keep the "
                      "frozen modules in eval (a train() override), use FrozenBatchNorm2d, or declare the buffers "
                      "trained (a pattern's `buffers`)")


def _check_buffers(records: list[RankRecord], plan: PlanFacts, ref_steps: list[StepFacts], tol: Tolerance,
                   notes: list[str]) -> list[tuple[int, str, Problem]]:
    """A frozen module's buffers stay as wrapping left them, on every rank, at every step; rank 0's other buffers
    follow the reference's (exactly where the reference leaves them alone: a rotary cache, a counter; a low-precision
    cell with its precision's measured spread, as params). Other ranks' moving buffers are rank-local by design
    (plain BatchNorm: each rank's statistics come from its own rows): where they differ from rank 0's, a note says
    so."""
    found: list[tuple[int, str, Problem]] = []
    held = set(plan.held_buffers)
    for record in records:
        start = {n: v for n, v in (record.initial_buffers or {}).items() if n in held}
        for step, facts in enumerate(record.steps):
            moved = _buffers_changed(start, facts.buffers, tol)
            if moved:
                found.append((step, "buffers", Problem(
                    f"step {step}: rank {record.rank}: buffers of frozen modules moved: {_names(moved.values())} "
                    f"({HELD_BUFFERS_MOVED})", tuple(sorted(moved)),
                    kinds=("held-buffer-moved",))))
    lead = records[0]
    start = lead.initial_buffers or {}
    mixed = lead.reference_mixed or []
    for step, (got, want) in enumerate(zip(lead.steps, ref_steps)):
        others = {n: v for n, v in (want.buffers or {}).items() if n not in held and n in (got.buffers or {})}
        spread = {n: SPREAD_FACTOR * float(np.max(np.abs(m - others[n]), initial=0.0))
                  for n, m in ((mixed[step].buffers or {}).items() if step < len(mixed) else ())
                  if n in others and m.shape == others[n].shape}
        differ = _buffers_changed(others, got.buffers, tol,
                                  exact=lambda n, w=want: n in start and unchanged(w.buffers[n], start[n]),
                                  room=lambda n, s=spread: s.get(n, 0.0))
        if differ:
            found.append((step, "buffers", Problem(
                f"step {step}: buffers differ from reference: {_names(differ.values())}",
                tuple(sorted(differ)), kinds=("buffer-differs",))))
    for record in records[1:]:
        last = min(len(record.steps), len(lead.steps)) - 1
        if last < 0:
            continue
        mine = {n: v for n, v in (lead.steps[last].buffers or {}).items() if n not in held}
        if apart := _buffers_changed(mine, record.steps[last].buffers, tol):
            notes.append(f"after step {last}, rank {record.rank}'s buffers differ from rank 0's: "
                         f"{_names(apart.values())} (each rank's statistics come from its own rows; a checkpoint keeps "
                         "one rank's)")
    return found


def _norm_at(record: RankRecord, step: int) -> float | None:
    return record.steps[step].norm if step < len(record.steps) else None


def _params_kind(params: Iterable[str], held: set[str], no_grad: set[str]) -> str | None:
    kinds = {"held" if n in held else "no-grad" if n in no_grad else "trained" for n in params}
    return None if not kinds else kinds.pop() if len(kinds) == 1 else "mixed"


def _same(values: list[Any]) -> Any:
    """The value every step agreed on, or None."""
    return values[0] if values and all(v == values[0] for v in values) else None


def judge_records(records: list[RankRecord], precision: str, may_refuse: bool = False,
                  tolerance: dict[str, float] | None = None, lr: float = 1e-2, clips: bool = True,
                  cited: RoundTrip | None = None, init: str = "eager") -> Verdict:
    """Verdict for a cell whose ranks all replied; `tolerance` overrides fields of the precision's.

    `may_refuse`: the freeze pattern leaves nothing to train, so an error before the first step passes.
    `clips`: False for a `no-clip` cell, which has no clip norm to compare (grads and updates still are).
    `init`: the cell's; a tie that `meta` materialization broke is named as such.
    """
    errors = [r.error for r in records if r.error is not None]
    if errors:
        err = _earliest(errors)
        text = f"{err.type}: {err.message} (rank {err.rank}, {err.phase}, {err.where})"
        if may_refuse and err.step is None:
            return Verdict(Status.PASS, None, f"{REFUSAL_NOTE}: {text}", unchecked=["training"])
        ours = is_harness_phase(err.phase) or err.type == FREEZE_CASE_ERROR  # not the stack's doing either way
        return Verdict(Status.ERROR, None, text, harness=ours, raised_in=stage_of(err.step),
                       error={"type": err.type, "message": err.message})
    lead = records[0]
    if lead.reference is None or lead.plan is None or lead.initial is None:
        return Verdict(Status.ERROR, None, "the adapter finished without reporting its state (no probe.wrapped call)",
                       harness=True)
    plan = lead.plan
    notes: list[str] = [] if lead.init_matches_eager else [
        "values after wrapping differ from eager init (materialization or a cast at wrap; training is judged "
        "from the values after wrapping)"]
    tol = dataclasses.replace(FP32, **(tolerance or {}))
    if precision == "fp32" and dtypes.own_low_precision(lead.dtypes):  # judged in the dtypes the model holds
        precision = dtypes.precision(lead.dtypes)
    mixed = lead.reference_mixed if precision != "fp32" else None
    rooms: dict[int, Room] = {}
    for step, ref in enumerate(lead.reference):
        room = rooms[step] = measured_room(ref, mixed[step], lead.dtypes) if mixed else Room()
        if mixed:
            notes.append(f"step {step}: {precision} judged with {SPREAD_FACTOR:g}x its measured spread (widest "
                         f"relative grad spread {room.spread:.2e}, norm room {room.norm:.2e})")
    flags = [(-1, check, problem) for check, problem in (
        ("requires_grad", _check_flags(records, set(plan.trainable), init)),
        ("optimizer", _check_tracked(records, set(plan.optimized)))) if problem]
    # Params that require grad but that no optimizer steps: their grads reach no weight (they may accumulate, be
    # zeroed or stay rank-local under a correct loop); that they never move is the update check's business.
    outside = set(plan.trainable) - set(plan.optimized)
    conventions = {CANONICAL_LOOP: lead.reference, **(lead.reference_conventions or {})}
    # Dropout the reference could not replay: its trained params' grads, norm and updates are not the ranks'; what
    # must hold whatever the masks (held params unmoved and without grads, buffers of frozen modules) is still judged.
    unreplayed = lead.unreplayed or (_drawn_apart(records) if lead.draws_random else None)
    if unreplayed:
        held_names = (set(plan.names) - set(plan.trainable)) | (set(plan.names) - set(plan.optimized))
        conventions = {c: [_held_only(s, held_names) for s in steps] for c, steps in conventions.items()}
        notes.append(f"randomness not replayed: {unreplayed}; trained params' grads, norm and updates not compared")
    tried: dict[str, tuple[list[tuple[int, str, Problem]], list[str]]] = {}
    # Each loop along the reference's own path first: where one matches there, it names the loop the stack follows
    # (its norm may be unverifiable, its later grads still tell); then each again at the stack's own params.
    for at_own_params in ([], [] if unreplayed else lead.reference_at_own_params or []):
        for convention, ref_steps in conventions.items():
            scratch: list[str] = []
            tried[convention] = (_training_failures(lead, records, ref_steps, rooms, tol, lr,
                                                    clips and not unreplayed, outside, at_own_params, scratch),
                                 scratch)
            if not tried[convention][0]:
                break
        else:
            continue
        break
    # The first convention the weights follow; where none does, the one with the fewest failed checks.
    convention = min(tried, key=lambda c: (len({check for _, check, _ in tried[c][0]}), list(tried).index(c)))
    trained, step_notes = tried[convention]
    notes.extend(step_notes)
    failures: list[tuple[int, str, Problem]] = [*flags, *trained]
    differences = [] if unreplayed else _outside_differences(lead, outside, tol, rooms,
                                                             [] if trained else lead.reference_at_own_params or [])
    if len(conventions) > 1:
        if convention != CANONICAL_LOOP and not trained:
            differences.insert(0, f"the weights follow the loop '{convention}', not '{CANONICAL_LOOP}' (the clip "
                                  "norm differs; both are correct loops)")
        elif trained:
            notes.append(f"judged against the loop '{convention}', the closest of the {len(conventions)} correct "
                         "loops tried")
    ran_all = len(lead.steps) == len(lead.reference)
    failures.extend(_ranks_disagree(records, outside, tol, rooms))
    failures.extend(_check_buffers(records, plan, conventions[CANONICAL_LOOP], tol, notes))
    # A resumed run that drew other masks than the uninterrupted one is judged against the reference replaying its
    # own draws (`RankRecord.reference_redrawn`, and in a low precision its mixed twin for the room); without that
    # replay its steps are not compared.
    redrawn = _resume_redrawn(lead) if ran_all and cited is None else None
    uncompared = redrawn is not None and (bool(unreplayed) or lead.reference_redrawn is None
                                          or (mixed is not None and lead.reference_redrawn_mixed is None))
    unchecked = [what for what, missing in (
        ("randomness", bool(unreplayed)),
        ("resumed-steps", uncompared),
        ("grad_norm", clips and any(step.norm is None for step in lead.steps)),
        ("resume", ran_all and cited is None and lead.resume is None),
        ("ranks", any(step.params is None for record in records[1:] for step in record.steps[:len(lead.steps)])),
        ("buffers", bool(plan.buffers) and lead.initial_buffers is None),
    ) if missing]
    stated = {**stated_tolerance(tol, precision, rooms),
              "used": tolerance_used(lead, conventions[convention], rooms, tol, outside)}
    trip_notes: list[str] = []
    if cited is not None:  # its group's round trip, judged on the cell that ran it
        resumed, trip_notes = (cited.problem, list(cited.notes)) if ran_all else (None, [])
        judged = None
    else:
        resumed = _check_resume(records, plan, tol, rooms, lr, clips, trip_notes, convention,
                                compare_steps=not uncompared,
                                redrawn=lead.reference_redrawn if redrawn is not None else None,
                                redrawn_rooms=_redrawn_rooms(lead) if mixed else None) if ran_all else None
        if redrawn is not None:
            trip_notes.append(
                f"resumed step {redrawn} drew its masks from another generator state than the uninterrupted run's "
                "(the stack does not restore it on resume): " + (
                    "the resumed steps' grads, norm and updates not compared (nothing replays the draws)"
                    if uncompared else
                    "the resumed steps judged against the reference replaying the resumed run's draws"))
        judged = (RoundTrip("", lead.resume.api, resumed, tuple(trip_notes))
                  if ran_all and lead.resume is not None else None)
    notes.extend(trip_notes)
    if resumed:
        failures.append(((lead.resume.saved_after if lead.resume else 0) + 1, "resume", resumed))
    notes.extend(n for r in records for n in r.notes)
    matched = convention if len(conventions) > 1 else None
    cited_id = cited.cell if cited is not None and ran_all else None
    if not failures:
        return Verdict(Status.PASS, None, "", notes, convention=matched, differences=differences, round_trip=judged,
                       round_trip_of=cited_id, unchecked=unchecked, tolerance=stated)
    # The earliest step's first check is the root cause; later steps' problems of that check follow it.
    # Every failed check is kept, each with every param it named at any step.
    failures.sort(key=lambda f: (f[0], CHECKS.index(f[1])))
    held = (set(plan.names) - set(plan.trainable)) | (set(plan.names) - set(plan.optimized)) | set(plan.held_buffers)
    no_grad = {n for n in plan.names if all((s.grads or {}).get(n) is None for s in lead.reference)} - held
    tracked = _tracked(records)
    by_check: dict[str, CheckFailure] = {}
    for check in dict.fromkeys(check for _, check, _ in failures):
        mine = [(step, problem) for step, c, problem in failures if c == check]
        params = tuple(sorted({p for _, problem in mine for p in problem.params}))
        by_check[check] = CheckFailure(
            check, mine[0][0], " | ".join(problem.text for _, problem in mine), params, bool(held & set(params)),
            _params_kind(params, held, no_grad), mine[0][1].scale,
            _same([problem.ranks_combine for _, problem in mine]),
            tuple(dict.fromkeys(kind for _, problem in mine for kind in problem.kinds)),
            bool(tracked & set(params)) if params else None)
    first = next(iter(by_check.values()))
    return Verdict(Status.FAIL, first.check, first.message, notes, list(by_check.values()), convention=matched,
                   differences=differences, round_trip=judged, round_trip_of=cited_id, unchecked=unchecked,
                   tolerance=stated)


def _ranks_disagree(records: list[RankRecord], outside: set[str], tol: Tolerance, rooms: dict[int, Room]
                    ) -> list[tuple[int, str, Problem]]:
    """Every other rank's grads and params against rank 0's, step by step, within the cell's tolerances: a replica
    that drifts from rank 0 (an unsynced unfreeze, a rank-local step) trains wrong weights that rank 0 alone hides.
    Grads of params outside the optimizer stay rank-local under correct loops and are left out."""
    found: list[tuple[int, str, Problem]] = []
    lead = records[0]
    for record in records[1:]:
        for step, (mine, theirs) in enumerate(zip(lead.steps, record.steps)):
            room = rooms.get(step, Room())
            grads = [name for name, want in _without(mine.grads, outside).items()
                     if not _agree((theirs.grads or {}).get(name, want), want, tol.grad_rtol,
                                   tol.grad_atol + room.grad(name))]
            params = [name for name, want in (mine.params or {}).items()
                      if not _agree((theirs.params or {}).get(name, want), want, tol.param_rtol,
                                    tol.param_atol + room.param(name))]
            for check, names, what in (("grads", grads, "grads"), ("update", params, "params")):
                if names:
                    found.append((step, check, Problem(f"step {step}: rank {record.rank}'s {what} differ from rank "
                                                       f"0's: {_names(names)}", tuple(sorted(names)),
                                                       kinds=("ranks-differ",))))
    return found


def _agree(have: Any, want: Any, rtol: float, atol: float) -> bool:
    """Two ranks' views of one tensor: both absent (or all-zero where the other is absent), or close."""
    if have is None or want is None:
        present = have if want is None else want
        return present is None or not np.any(present)
    return have.shape == want.shape and (close(have, want, rtol=rtol, atol=atol) or unchanged(have, want))


def stated_tolerance(tol: Tolerance, precision: str, rooms: dict[int, Room]) -> dict[str, Any]:
    """What a row states of how it was judged: the fp32 tolerances every cell gets, and for a low-precision cell the
    room its precision's measured spread added (per tensor: `SPREAD_FACTOR` times that tensor's own relative grad
    spread, at least `LOW_PRECISION_FLOOR`, times the tensor's scale)."""
    stated: dict[str, Any] = {"precision": precision, **dataclasses.asdict(tol)}
    if any(room.spread for room in rooms.values()):
        stated["spread_factor"] = SPREAD_FACTOR
        stated["per_tensor_floor"] = LOW_PRECISION_FLOOR
        stated["widest_relative_grad_spread"] = float(f"{max(room.spread for room in rooms.values()):.3g}")
    return stated


def _mark_quiet(quiet: dict[str, Any], ref: StepFacts, tol: Tolerance, room: Room) -> None:
    """Mark (in place) the elements whose reference grad sits within the grad tolerance at this step: there Adam's
    first steps are about sign(grad) * lr, so rounding noise may flip them (`_check_update`)."""
    for name, grad in (ref.grads or {}).items():
        if grad is not None:
            quiet[name] = quiet.get(name, False) | (np.abs(grad) <= tol.grad_atol + room.grad(name))


def _grad_allowed(tol: Tolerance, room: Room, name: str, want: Any) -> Any:
    """How far a grad may sit from `want`, element by element (`close`'s own bound)."""
    return tol.grad_atol + room.grad(name) + tol.grad_rtol * np.abs(want)


def _param_allowed(tol: Tolerance, room: Room, name: str, want: Any) -> Any:
    """How far a param may sit from `want`, element by element, before Adam's sign flips are allowed for."""
    return tol.param_atol + room.param(name) + tol.param_rtol * np.abs(want)


def _share(got: dict[str, Any] | None, want: dict[str, Any], allowed: Callable[[str, Any], Any],
           skip: dict[str, Any] | None = None) -> float:
    """The largest |got - want| / allowed over the tensors both hold (elements `skip` marks left out)."""
    worst = 0.0
    for name, expected in want.items():
        have = (got or {}).get(name)
        if expected is None or have is None or have.shape != expected.shape:
            continue
        ratio = np.abs(have - expected) / allowed(name, expected)
        if skip is not None and name in skip:
            ratio = np.where(skip[name], 0.0, ratio)
        worst = max(worst, float(np.max(ratio, initial=0.0)))
    return worst


def tolerance_used(lead: RankRecord, ref_steps: list[StepFacts], rooms: dict[int, Room], tol: Tolerance,
                   outside: set[str]) -> dict[str, float]:
    """The largest share of its tolerance any judged element used on rank 0, grads and params apart (1.0: at the
    edge): what a reader weighs a pass by, and what the report's distribution per precision is made of. A step's
    grads count at the stack's own params where those were judged too; params leave out the Adam sign flips of
    near-zero grads that `_check_update` allows."""
    used = {"grads": 0.0, "params": 0.0}
    quiet: dict[str, np.ndarray] = {}
    own = lead.reference_at_own_params or []
    for step, (got, ref) in enumerate(zip(lead.steps, ref_steps)):
        room = rooms.get(step, Room())
        _mark_quiet(quiet, ref, tol, room)

        wants = [ref] + ([own[step]] if step < len(own) and own[step] is not None else [])
        used["grads"] = max(used["grads"], min(_share(_without(got.grads, outside), _without(w.grads, outside),
                                                      functools.partial(_grad_allowed, tol, room)) for w in wants))
        used["params"] = max(used["params"], _share(got.params, ref.params or {},
                                                    functools.partial(_param_allowed, tol, room), quiet))
    return {key: float(f"{value:.3g}") for key, value in used.items()}


def _without(values: dict[str, Any] | None, names: set[str]) -> dict[str, Any]:
    return {n: v for n, v in (values or {}).items() if n not in names}


def _held_only(step: StepFacts, held: set[str]) -> StepFacts:
    """What of a reference step holds whatever dropout drew: no grad where it has none, held params' values."""
    return StepFacts(grads={n: None for n, g in (step.grads or {}).items() if g is None}, norm=step.norm,
                     params={n: v for n, v in (step.params or {}).items() if n in held})


def _drawn_apart(records: list[RankRecord]) -> str | None:
    """Where another rank drew a step's masks from another generator state than rank 0's (the reference replays rank
    0's state for every rank's rows): which, in a line; None where every rank drew from rank 0's."""
    lead = records[0]
    for record in records[1:]:
        for step, (mine, theirs) in enumerate(zip(lead.steps, record.steps)):
            if mine.rng is None or theirs.rng is None or not np.array_equal(mine.rng, theirs.rng):
                return (f"rank {record.rank} drew step {step}'s masks from another generator state than rank 0, "
                        "whose state the reference replays for every rank's rows")
    return None


def _redrawn_rooms(lead: RankRecord) -> dict[int, Room]:
    """A low-precision cell's room along the reference drawing the resumed masks, step by step."""
    return {step: measured_room(ref, mixed) for step, (ref, mixed) in
            enumerate(zip(lead.reference_redrawn or [], lead.reference_redrawn_mixed or []))}


def _resume_redrawn(lead: RankRecord) -> int | None:
    """The first resumed step whose masks came from another generator state than the uninterrupted run's at that
    step (None: none did, or the forward draws no random numbers)."""
    resume = lead.resume
    if not lead.draws_random or resume is None:
        return None
    for step in range(resume.saved_after + 1, min(len(lead.steps), len(resume.steps))):
        mine, theirs = lead.steps[step].rng, resume.steps[step].rng
        if mine is None or theirs is None or not np.array_equal(mine, theirs):
            return step
    return None


def _training_failures(lead: RankRecord, records: list[RankRecord], ref_steps: list[StepFacts],
                       rooms: dict[int, Room], tol: Tolerance, lr: float, clips: bool, outside: set[str],
                       at_own_params: list[StepFacts | None], notes: list[str]) -> list[tuple[int, str, Problem]]:
    """The steps judged against one reference run: grads (but those of `outside`), clip norm, update.
    `at_own_params`: `RankRecord.reference_at_own_params`, or none to judge along the reference's path alone."""
    failures: list[tuple[int, str, Problem]] = []
    if len(lead.steps) < len(ref_steps):
        failures.append((len(lead.steps), "update", Problem(f"ran {len(lead.steps)} of {len(ref_steps)} steps", (),
                                                            kinds=("steps-missing",))))
    before = lead.initial or {}
    quiet: dict[str, np.ndarray] = {}
    updates_held = True  # every update so far within tolerance
    for step, (got, ref) in enumerate(zip(lead.steps, ref_steps)):
        room = rooms.get(step, Room())
        _mark_quiet(quiet, ref, tol, room)
        peers = [_norm_at(r, step) for r in records]
        trained = _without(got.grads, outside)
        grads = _check_grads(step, trained, _without(ref.grads, outside), tol, room, notes)
        norm = _check_norm(step, got, peers, ref.norm, tol, room, notes) if clips else None
        # Params within tolerance still differ by rounding and by Adam's reaction to it (`quiet`), and the next
        # grads with them: where the stack's params held, its grads may instead match the reference's taken at
        # those very params. The norm only without grads outside the optimizer (the canonical loop accumulates
        # theirs, which a step taken afresh lacks).
        own = at_own_params[step] if step < len(at_own_params) and updates_held else None
        if own is not None:
            at_own = _check_grads(step, trained, _without(own.grads, outside), tol, room, []) if grads else None
            # A grad that matches at the params it was taken at is right: only what fails both ways stays (a grad on
            # a frozen param fails both ways and must not keep a trained one's rounding along the other path).
            if grads and (at_own is None or set(at_own.params) < set(grads.params)):
                grads = at_own
            if norm and not outside and own.norm is not None and not _check_norm(step, got, peers, own.norm, tol,
                                                                                  room, []):
                norm = None
        update = _check_update(step, got.params or {}, ref.params or {}, before, tol, room, quiet, lr)
        updates_held &= update is None
        failures.extend((step, check, problem) for check, problem in (
            ("grads", grads), ("grad_norm", norm), ("update", update)) if problem)
        before = ref.params or {}
    return failures


def _outside_differences(lead: RankRecord, outside: set[str], tol: Tolerance, rooms: dict[int, Room],
                         at_own_params: list[StepFacts | None]) -> list[str]:
    """Where the grads of params no optimizer steps differ from the canonical loop's: reaching no weight, a
    difference of loop convention (zeroed, rank-local), said but not failed. `at_own_params`: as the training
    checks take it, where the stack's params held (`RankRecord.reference_at_own_params`)."""
    found = []
    for step, (got, ref) in enumerate(zip(lead.steps, lead.reference or [])):
        mine = {n: v for n, v in (got.grads or {}).items() if n in outside}
        theirs = {n: v for n, v in (ref.grads or {}).items() if n in outside}
        room = rooms.get(step, Room())
        problem = _check_grads(step, mine, theirs, tol, room, []) if theirs else None
        own = at_own_params[step] if step < len(at_own_params) else None
        if problem and own is not None and not _check_grads(
                step, mine, {n: v for n, v in (own.grads or {}).items() if n in outside}, tol, room, []):
            problem = None
        if problem:
            found.append(f"{problem.text} (params outside the optimizer: their grads reach no weight)")
    return found


def judge(run: CellRun, cell: Cell, timeout_s: float, cited: RoundTrip | None = None) -> Verdict:
    """The cell's verdict from everything the pool saw, including hangs and crashes; `cited`: the round trip of
    its group it cites (`Cell.round_trip_of`), judged on the cell that ran it."""
    verdict = _judge_run(run, cell, timeout_s, cited)
    other_stack = stack.mismatch(cell, [s.record for s in run.ranks if s.record is not None])
    if other_stack is not None:  # the verdict would be about a setup the cell does not name
        verdict = Verdict(Status.ERROR, None, other_stack, verdict.notes, harness=True,
                          raised_in=verdict.raised_in or "wrapping")
    elif cast := stack.casts(cell, [s.record for s in run.ranks if s.record is not None]):
        verdict.notes.append(cast)
    if verdict.tolerance is None:  # nothing was judged (a refusal, a hang): the tolerances it would have met
        base = dataclasses.replace(FP32, **(cell.tolerance or {}))
        verdict.tolerance = stated_tolerance(base, cell.precision, {})
    return verdict


def _judge_run(run: CellRun, cell: Cell, timeout_s: float, cited: RoundTrip | None) -> Verdict:
    may_refuse, lr = cell.pattern.may_refuse, cell.hyper.lr
    if run.outcome is Outcome.DONE:
        return judge_records([s.record for s in run.ranks if s.record is not None], cell.precision, may_refuse,
                             cell.tolerance, lr, cell.hyper.clips, cited, cell.key.init)
    if run.outcome is Outcome.TIMEOUT:
        phases = "; ".join(f"rank {s.rank}: {s.phase}" for s in run.ranks)
        return Verdict(Status.TIMEOUT, None, f"no result within {timeout_s:.0f} s ({phases})",
                       harness=all(is_harness_phase(s.phase) for s in run.ranks),
                       raised_in=stage_of_phases(s.phase for s in run.ranks))
    if run.outcome is Outcome.CRASH:
        dead = [s for s in run.ranks if s.exit]
        text = "; ".join(f"rank {s.rank} {s.exit} during {s.phase}" for s in dead) or "a rank closed its pipe"
        return Verdict(Status.CRASH, None, text, raised_in=stage_of_phases(s.phase for s in dead or run.ranks))
    failed = next(s.record for s in run.ranks if s.record is not None and s.record.raised is not None)
    stuck = ", ".join(f"rank {s.rank} ({s.phase})" for s in run.ranks if s.record is None)
    lead = run.ranks[0].record
    if failed.error is None and lead is not None:  # the round trip raised after a finished run: judge the run
        verdict = judge_records([s.record for s in run.ranks if s.record is not None], cell.precision, may_refuse,
                                cell.tolerance, lr, cell.hyper.clips, init=cell.key.init)
        verdict.failures = [dataclasses.replace(f, message=f"{f.message}; left waiting: {stuck}")
                            if f.check == "resume" else f for f in verdict.failures]
        if verdict.failures:
            verdict.message = verdict.failures[0].message
        return verdict
    if failed.error is None and failed.resume is not None and failed.resume.error is not None:
        # A peer's round trip raised while the lead rank still waits inside it (a collective the peer left): the
        # lead's record, which holds the reference, never came; the peer's raise is the cell's resume failure.
        err = failed.resume.error
        text = f"{err.phase}: {err.type}: {err.message} (rank {err.rank}, {err.where}); left waiting: {stuck}"
        failure = CheckFailure("resume", failed.resume.saved_after + 1, text, (), kinds=("raised",))
        return Verdict(Status.FAIL, "resume", text, failures=[failure])
    base = judge_records([failed], cell.precision, may_refuse)
    return Verdict(Status.ERROR, None, f"{base.message}; left waiting: {stuck}", harness=base.harness,
                   raised_in=base.raised_in, error=base.error)


def run_facts(run: CellRun, cell: Cell) -> dict[str, Any]:
    """What the report shows besides the verdict: emulation that engaged, where grads and the norm come from, the
    model's ties."""
    replied = [s.record for s in run.ranks if s.record is not None]
    lead = run.ranks[0].record
    sources = {s.norm_source for s in (lead.steps if lead else []) if s.norm_source}
    # Emulation is what the shim reported engaging; a rank that never replied may have engaged it too.
    engaged = sorted({what for record in replied for what in record.emulated})
    return {"emulation": bool(engaged) or (cell.emulation and len(replied) < len(run.ranks)), "emulated": engaged,
            "grad_access": lead.grad_access if lead else None,
            "grad_norm_source": ", ".join(sorted(sources)) or None,
            "resume_api": lead.resume.api if lead and lead.resume and lead.resume.api else None,
            "observed": stack.observed_stack(replied), "versions": stack.row_versions(replied),
            "tied": ties.stated(next((r.tied for r in replied if r.tied), {}))}


def rank_details(run: CellRun) -> list[dict[str, Any]]:
    """Per-rank stories for the report: last phase, error, exit, stack and log tail where they matter."""
    details = []
    for state in run.ranks:
        entry: dict[str, Any] = {"rank": state.rank, "phase": state.phase}
        error = state.record.error if state.record else None
        if error:
            entry["error"] = {"type": error.type, "message": error.message, "where": error.where, "phase": error.phase}
            entry["traceback"] = _clip(error.traceback)
        if state.exit:
            entry["exit"] = state.exit
        if state.stack:
            entry["stack"] = _clip(state.stack)
        if run.outcome is not Outcome.DONE and state.log_tail:
            entry["log_tail"] = _clip(state.log_tail)
        emulated = state.record.emulated if state.record else None
        if emulated:
            entry["emulated"] = emulated
        details.append(entry)
    return details
