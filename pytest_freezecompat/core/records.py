"""Typed records: what a rank saw of a cell, what the pool saw of the ranks, and the report's row.

Rank records cross a local pipe (pickled between our own processes); report rows become JSON.
Arrays are float32 numpy arrays, typed `Any` here so that `core` stays stdlib-only.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from typing import Any

from .cell import CellKey
from .names import LATER_AXES

#: What a framework may raise is anything, `BaseException` subclasses included (torch DCP's CheckpointException);
#: only these, the interpreter's own exits, are never the stack's error.
INTERPRETER_EXITS = (KeyboardInterrupt, SystemExit, GeneratorExit)

#: The error type a rank records when a user's `@freeze_case` function breaks its contract (their code: it
#: says nothing about the stack, like our own harness raising).
FREEZE_CASE_ERROR = "FreezeCaseError"


class Status(str, enum.Enum):
    """A cell's raw status: what happened, before any registry says why."""

    PASS = "pass"  # every check held
    FAIL = "fail"  # it ran; a check failed
    ERROR = "error"  # it raised
    TIMEOUT = "timeout"  # a hang
    CRASH = "crash"  # a rank died
    SKIP = "skip"  # decided at planning


STATUSES = tuple(s.value for s in Status)
FAILING = (Status.FAIL.value, Status.ERROR.value, Status.CRASH.value, Status.TIMEOUT.value)


class Outcome(str, enum.Enum):
    """How the pool saw a cell end."""

    DONE = "done"  # every rank replied
    TIMEOUT = "timeout"
    CRASH = "crash"
    STUCK_AFTER_ERROR = "stuck-after-error"  # one rank raised, a peer never replied
    RENDEZVOUS_HANG = "rendezvous-hang"  # joining the default group hung (the harness; retried once)


@dataclass
class RankError:
    type: str
    message: str  # first line
    full_message: str
    rank: int
    where: str  # file:line in function, of the innermost frame
    phase: str
    traceback: str
    at: float  # ranks share a clock: the earliest error is the cause, the rest its echoes
    #: The training step it was raised in; None before the first step (wrapping, setup: a refusal).
    step: int | None = None


@dataclass
class StepFacts:
    """One step as a rank saw it (every rank keeps its training steps' tensors; only rank 0 its resumed ones')."""

    grads: dict[str, Any] | None = None
    norm: float | None = None
    norm_source: str | None = None
    params: dict[str, Any] | None = None
    #: After the step: every buffer (BatchNorm's running statistics, counters as integers), by the bare model's name.
    buffers: dict[str, Any] | None = None
    #: The CPU generator's state (uint8) when the step's first loss call began: what dropout drew its masks from, for
    #: the reference to replay; None on an accelerator (its own generator drew them) or where no loss ran.
    rng: Any | None = None
    #: How many times the cell's loss ran in the step, and over how many rows the first time (a pipeline's
    #: micro-batches or a tensor-parallel rank's whole batch are not one data-parallel rank's rows).
    forwards: int = 0
    rows: int | None = None


@dataclass
class ResumeFacts:
    """The model-checkpoint round trip as a rank saw it (`adapters.loop.train`): saved after step `saved_after`
    through the stack's own API, torn down, rebuilt and frozen as a user's script does, loaded, trained on.

    Rank 0 keeps the tensors. `saved_params` / `saved_state`: the bare model's names whose values, and whose
    optimizer state, the saved files hold (None where the adapter cannot read its files back)."""

    api: str = ""
    saved_after: int = 0
    saved_params: tuple[str, ...] | None = None
    saved_state: tuple[str, ...] | None = None
    saved_trainable_only: bool = False  # an adapter-only save (peft): frozen params come from the base model
    requires_grad: dict[str, bool] | None = None  # after load
    tracked: tuple[str, ...] | None = None  # the resumed optimizer's set, after load
    loaded: dict[str, Any] | None = None  # rank 0: full params after load, before the next step
    loaded_buffers: dict[str, Any] | None = None  # rank 0: buffers after load, before the next step
    steps: list[StepFacts] = field(default_factory=list)  # by step number; the steps before the save stay empty
    #: Raised while saving, loading or in a resumed step: the round trip failed (the run before it is judged).
    error: RankError | None = None


@dataclass(frozen=True)
class PlanFacts:
    """The cell's `FreezePlan`, by original parameter name."""

    names: tuple[str, ...]
    trainable: tuple[str, ...]
    optimized: tuple[str, ...]
    unused: tuple[str, ...]
    #: Every buffer of the bare model, and those that must not move: a buffer of a module whose params are all frozen
    #: (the nearest module above it that has params decides), unless the pattern declares it trained.
    buffers: tuple[str, ...] = ()
    held_buffers: tuple[str, ...] = ()


@dataclass
class RankRecord:
    """Facts one rank reports for one cell; the rank never decides a verdict."""

    rank: int
    phase: str = "setup"
    notes: list[str] = field(default_factory=list)
    emulated: list[str] = field(default_factory=list)  # shim patches that really engaged
    #: The stack as the adapter read it from what the framework built (`Probe.observed`), fact -> value.
    observed: dict[str, str] = field(default_factory=dict)
    #: Installed versions of torch and the cell's distributions, as this rank imported them.
    versions: dict[str, str] = field(default_factory=dict)
    steps: list[StepFacts] = field(default_factory=list)
    grad_access: str | None = None
    requires_grad: dict[str, bool] | None = None
    tracked: tuple[str, ...] | None = None
    initial: dict[str, Any] | None = None  # rank 0: params after wrapping
    #: Every rank: buffers after wrapping; None where the adapter's view cannot read buffers.
    initial_buffers: dict[str, Any] | None = None
    #: The stack's model normalises over the whole batch (it holds SyncBatchNorm, as ColossalAI's DDP plugins make of
    #: a plain BatchNorm): the reference then runs the whole batch, not each rank's rows.
    syncs_norms: bool = False
    #: rank 0: what in the model draws random numbers in its forward (dropout with its p, or "the forward" where no
    #: module says which); empty where the forward draws none.
    draws_random: list[str] = field(default_factory=list)
    #: rank 0: params that some ranks' rows reach and others' do not, in the same step (`reference.rank_divergent`).
    rank_divergent: list[str] = field(default_factory=list)
    #: rank 0: why the reference could not replay those draws as the ranks made them (None: it replayed them, or
    #: there were none); the checks against the reference then leave the trained params unjudged.
    unreplayed: str | None = None
    plan: PlanFacts | None = None
    #: The bare model's aliases, each with its tensor's first name (`core.ties`), read before wrapping.
    tied: dict[str, str] = field(default_factory=dict)
    #: The bare model's own storage dtype per param (`core.dtypes`), read before wrapping.
    dtypes: dict[str, str] = field(default_factory=dict)
    reference: list[StepFacts] | None = None  # rank 0: the single-process reference's steps
    #: rank 0, low-precision cells: the same reference run as mixed precision does (the precision's own spread); a
    #: model that holds its own low-precision params: the reference upcast to fp32 (the spread its dtypes cost)
    reference_mixed: list[StepFacts] | None = None
    #: rank 0, where grads accumulate outside the optimizer: the reference resumed after the save (no grad
    #: survives a checkpoint), so the round trip is judged by what resuming itself changes.
    reference_resumed: list[StepFacts] | None = None
    #: rank 0, where the forward draws random numbers and the resumed run drew from other generator states than the
    #: uninterrupted one (the stack does not restore it): the reference replaying the resumed run's states after the
    #: save, so the round trip is judged by what resuming changes, not by other masks.
    reference_redrawn: list[StepFacts] | None = None
    #: rank 0, low-precision cells with `reference_redrawn`: the same as mixed precision runs it (its spread).
    reference_redrawn_mixed: list[StepFacts] | None = None
    #: rank 0, where the optimizer holds a subset of what trains and the cell clips: the reference under each
    #: other correct form of the loop (`core.names.LOOP_CONVENTIONS`), by its name.
    reference_conventions: dict[str, list[StepFacts]] | None = None
    #: rank 0, by step: the reference's grads and clip norm at the params the stack itself held after the step
    #: before, where those are not the reference's own (None at step 0 and where they are). Params within
    #: tolerance still differ by rounding and Adam's reaction to it; a step's grads are judged at the params they
    #: were taken at, as well as along the reference's own path.
    reference_at_own_params: list[StepFacts | None] | None = None
    init_matches_eager: bool = True
    error: RankError | None = None
    resume: ResumeFacts | None = None
    #: Seconds per phase kind (`core.phases`), this rank's view.
    phases_s: dict[str, float] = field(default_factory=dict)
    group_kept: bool = False  # the cell ran on the default group this rank kept from its last cell
    #: Group name -> collectives this rank issued on it by the cell's end (the controller compares ranks).
    collectives: dict[str, int] = field(default_factory=dict)

    @property
    def raised(self) -> RankError | None:
        """What this rank raised: in the run, or in the round trip after it."""
        return self.error or (self.resume.error if self.resume else None)


#: A rank's phase between cells (it waits for the next one).
WAITING_PHASE = "waiting for cell"


@dataclass
class RankState:
    """What the pool knows of one rank at the end of a cell."""

    rank: int
    phase: str = WAITING_PHASE
    record: RankRecord | None = None
    exit: str | None = None
    stack: str = ""
    log_tail: str = ""


@dataclass
class CellRun:
    """What the pool saw of one cell: per-rank states and how it ended."""

    outcome: Outcome
    ranks: list[RankState]
    fresh_start_s: float | None = None  # the pool was (re)started for this cell, taking this long
    notes: list[str] = field(default_factory=list)
    rendezvous_retries: int = 0  # joining the default group hung, so the ranks were replaced and it ran again
    dispatch_s: float = 0.0  # from sending the cell to the last reply, as the controller saw it
    tidy_s: float | None = None  # rank 0 tidying the cell away (None when the ranks were replaced instead)


@dataclass
class CellRecord:
    """One row of `matrix.json` (schema 1): the cell's key, where it ran, its verdict and its story."""

    key: CellKey  # flattened into the row: its id and one field per axis
    environment: str
    world_size: int
    precision: str
    emulation: bool
    status: str
    repro: str
    check: str | None = None  # the earliest failed check
    message: str = ""
    #: Every failed check, earliest first: {check, step, message, params, on_held_params, and the facts
    #: registry entries predict where measured: params_kind, scale, ranks_combine}.
    failures: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    grad_access: str | None = None
    grad_norm_source: str | None = None
    rank_details: list[dict[str, Any]] = field(default_factory=list)
    duration_s: float = 0.0
    emulated: list[str] | None = None
    pool_start_s: float | None = None
    #: error, crash, timeout: "wrapping" (before the first step) or "training".
    raised_in: str | None = None
    #: Why it is red (`verdict.cause`): freeze / stack / both / harness; set where the report is written.
    cause: str | None = None
    #: The registry entry a matrix rule names for this cell (the registry decides whether it explains it).
    rule_known_issue: str | None = None
    known_issue: dict[str, Any] | None = None  # filled by `spec.known_issues.annotate_cell`
    #: Times the cell was rerun because joining its fresh process group hung (a harness event, counted).
    rendezvous_retries: int | None = None
    #: Seconds per phase kind (`core.phases.KINDS`): rank 0's phases plus what the controller saw.
    phases_s: dict[str, float] | None = None
    #: True when the cell ran on ranks (and a default group) kept from a clean earlier cell.
    group_kept: bool | None = None
    #: True for a user's `@freeze_case` cell: its model and patterns are not the registry's names.
    user_model: bool | None = None
    #: The model-checkpoint API the `resume` check went through (None: no round trip, e.g. a refusal).
    resume_api: str | None = None
    #: Where the optimizer holds a subset of what trains: the correct loop (`core.names.LOOP_CONVENTIONS`) the
    #: cell was judged against (the one its weights followed, or the closest).
    convention: str | None = None
    #: What differs from the canonical loop without reaching a weight (a pass with these is `differs`).
    differences: list[str] = field(default_factory=list)
    #: The cell whose save -> load round trip this one cites (its round-trip group's, run once): its `resume`
    #: result and `resume_api` are that cell's.
    round_trip_of: str | None = None
    #: How bad it is for the user (`verdict.severity`): `core.names.SEVERITIES`.
    severity: str | None = None
    #: Checks that decide the verdict but did not run on this cell (`core.names.UNCHECKED`): a pass is `unproven`.
    unchecked: list[str] = field(default_factory=list)
    #: How the steps were judged (`verdict.checks.stated_tolerance`); None where no step was judged (a refusal).
    tolerance: dict[str, Any] | None = None
    #: error: what the stack raised first, in its own words ({type, message}); `verdict.cause` compares it.
    error: dict[str, str] | None = None
    #: The commit of this package the cell ran at (`-dirty`: with uncommitted changes), so a stitched report shows it.
    commit: str | None = None
    #: The stack as it ran (`RankRecord.observed`, rank 0's; where ranks saw different values, each rank's, joined).
    observed: dict[str, str] = field(default_factory=dict)
    #: Installed versions of torch, the framework and its companions, as the ranks imported them.
    versions: dict[str, str] = field(default_factory=dict)
    #: The model's tied and shared params as the ranks built it (`core.ties.stated`): `head.weight = tok_emb.weight`.
    tied: list[str] = field(default_factory=list)

    @property
    def id(self) -> str:
        return self.key.id

    def to_json(self) -> dict[str, Any]:
        """Plain JSON types; optional fields that are unset are left out."""
        data = {**asdict(self), **self.key.as_dict(), "id": self.id}
        del data["key"]
        for optional in ("emulated", "pool_start_s", "raised_in", "cause", "rule_known_issue", "known_issue",
                         "rendezvous_retries", "phases_s", "group_kept", "user_model", "resume_api", "convention",
                         "round_trip_of", "severity", "tolerance", "error", "commit"):
            if data[optional] is None:
                del data[optional]
        for listed in ("differences", "unchecked", "observed", "versions", "tied"):
            if not data[listed]:
                del data[listed]
        return data


def with_later_axes(row: dict[str, Any]) -> dict[str, Any]:
    """`row` (in place) with every axis added after it was written, at the one value it had then (`LATER_AXES`:
    every cell clipped); readers of report rows that may predate an axis pass them through this first."""
    for axis, value in LATER_AXES.items():
        row.setdefault(axis, value)
    return row


def display_status(cell: dict[str, Any]) -> str:
    """What tables show for a report row: `known` / `fixed?` where the registry says so, else the raw status."""
    known = cell.get("known_issue") or {}
    if known.get("expected"):
        return "known"
    if known.get("fixed"):
        return "fixed?"
    return cell["status"]
