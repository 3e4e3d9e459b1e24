"""One cell inside one rank: the steps every framework shares.

build the model -> freeze (before wrapping) -> checkpoint mode -> adapter.run
(with probes) -> on rank 0, the single-process reference. The result is a
`RankRecord` of facts (tensors as float32 numpy arrays); the rank never decides a verdict.
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import importlib.metadata
import time
import traceback
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from .. import models
from ..adapters.base import Adapter, Batch, KeptState, LossOf, ModelView, RunContext, dtypes_of, hold_as, rows_of
from ..core import dtypes
from ..core.cell import Cell
from ..core.freeze import FreezePlan, held_buffers, resolve
from ..core.names import CANONICAL_LOOP, LOOP_CONVENTIONS, headline, import_ref, short_paths
from ..core.phases import kind_of
from ..core.records import INTERPRETER_EXITS, PlanFacts, RankError, RankRecord, ResumeFacts, StepFacts
from ..core.ties import ties_of
from . import reference


def to_numpy(tensors: dict[str, torch.Tensor | None]) -> dict[str, np.ndarray | None]:
    # float32 holds fp32/bf16/fp16 exactly, so bit-identity checks survive the trip.
    return {n: None if t is None else t.detach().to("cpu", torch.float32).numpy().copy() for n, t in tensors.items()}


def buffers_to_numpy(buffers: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """Floating-point buffers as float32 (exact for fp32/bf16/fp16), counters (`num_batches_tracked`) as int64."""
    return {n: t.detach().to("cpu", torch.float32 if t.is_floating_point() else torch.int64).numpy().copy()
            for n, t in buffers.items()}


def read_buffers(view: ModelView) -> dict[str, torch.Tensor] | None:
    """The view's buffers, or None where it cannot read them (the `buffers` check is then not run)."""
    reader = getattr(view, "full_buffers", None)
    return None if reader is None else reader()


def buffer_owners(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """Each buffer -> the params that decide whether it is a frozen module's (`core.freeze.held_buffers`): its own
    module's, else those of the nearest module above it that has params."""
    params_of = {name: tuple(f"{name}.{p}" if name else p for p, _ in module.named_parameters())
                 for name, module in model.named_modules()}
    owners: dict[str, tuple[str, ...]] = {}
    for name, module in model.named_modules():
        for local, _ in module.named_buffers(recurse=False):
            owner = name
            while owner and not params_of.get(owner):
                owner = owner.rpartition(".")[0]
            owners[f"{name}.{local}" if name else local] = params_of.get(owner, ())
    return owners


#: The phases of the round trip start with it (`core.phases` charges them to `resume`).
RESUME_PHASE = "resume"


class Recorder:
    """The `Probe` a rank hands to its adapter: it records facts and reports progress."""

    def __init__(self, rank: int, send_phase: Callable[[str], None]) -> None:
        self.rank = rank
        self._send_phase = send_phase
        self.record = RankRecord(rank=rank)
        self.step: int | None = None  # the training step under way; None during setup
        self.initial_params: dict[str, torch.Tensor] | None = None
        self.initial_buffers: dict[str, torch.Tensor] | None = None
        self._phase_started = time.perf_counter()
        self._resumed = False

    def phase(self, text: str) -> None:
        """Resumed phases read `resume: ...` (a hang report says which run hung)."""
        if self._resumed and not text.startswith(RESUME_PHASE):
            text = f"{RESUME_PHASE}: {text}"
        self._charge_phase()
        self.record.phase = text
        self._send_phase(text)

    def _charge_phase(self) -> None:
        """Charge the time since the last phase began to that phase's kind."""
        now = time.perf_counter()
        kind = kind_of(self.record.phase)
        self.record.phases_s[kind] = self.record.phases_s.get(kind, 0.0) + now - self._phase_started
        self._phase_started = now

    def finished(self) -> None:
        self._charge_phase()

    def note(self, text: str) -> None:
        self.record.notes.append(text)

    def emulated(self, what: str) -> None:
        if what not in self.record.emulated:
            self.record.emulated.append(what)

    def _step(self, step: int) -> StepFacts:
        steps = self.record.resume.steps if self.resumed else self.record.steps
        while len(steps) <= step:
            steps.append(StepFacts())
        return steps[step]

    @property
    def resumed(self) -> bool:
        """The run under way is the round trip's resumed one (its steps are recorded apart)."""
        return self._resumed

    def saved(self, api: str, step: int, contents: object) -> None:
        resume = self.record.resume = ResumeFacts(api=api, saved_after=step)
        params, state = getattr(contents, "params", None), getattr(contents, "optimizer_state", None)
        resume.saved_params = None if params is None else tuple(sorted(params))
        resume.saved_state = None if state is None else tuple(sorted(state))
        resume.saved_trainable_only = bool(getattr(contents, "trainable_only", False))

    def save_failed(self, api: str, step: int, exc: BaseException) -> None:
        self.record.resume = ResumeFacts(api=api, saved_after=step,
                                         error=describe_error(exc, self.record.phase, self.rank, self.step))

    def resuming(self, what: str) -> None:
        if self.record.resume is None:
            self.record.resume = ResumeFacts()
        self._resumed = True
        self.phase(what)

    def run_ended(self) -> None:
        """The stack's runs are over: what follows (rank 0's reference) is no part of the round trip."""
        self._resumed = False

    def loaded(self, view: ModelView) -> None:
        self.phase("read state after load")
        resume = self.record.resume
        assert resume is not None, "loaded() before resuming()"
        resume.requires_grad = view.requires_grad_flags()
        resume.tracked = tuple(sorted(view.tracked_names()))
        params = view.full_params()
        buffers = read_buffers(view)
        if self.rank == 0:
            resume.loaded = to_numpy(params)
            resume.loaded_buffers = None if buffers is None else buffers_to_numpy(buffers)

    def observed(self, fact: str, value: object) -> None:
        self.record.observed[fact] = str(value)

    def wrapped(self, view: ModelView) -> None:
        self.phase("read state after wrap")
        self.record.grad_access = view.grad_access
        self.record.requires_grad = view.requires_grad_flags()
        self.record.tracked = tuple(sorted(view.tracked_names()))
        params = view.full_params()
        self.initial_params = {n: t.detach().to("cpu", torch.float32).clone() for n, t in params.items()}
        module = getattr(view, "module", None)
        self.record.syncs_norms = isinstance(module, nn.Module) and any(
            isinstance(m, nn.SyncBatchNorm) for m in module.modules())
        buffers = read_buffers(view)
        self.initial_buffers = None if buffers is None else {n: t.detach().to("cpu").clone()
                                                             for n, t in buffers.items()}
        self.record.initial_buffers = None if buffers is None else buffers_to_numpy(buffers)
        if self.rank == 0:
            self.record.initial = to_numpy(params)

    def step_started(self, step: int) -> None:
        self.step = step

    def loss_started(self, batch: Batch, on_cpu: bool) -> None:
        """A loss call of the step under way: the first one records the CPU generator's state (what dropout draws
        from, `on_cpu`) and its rows; every one is counted."""
        if self.step is None:
            return
        entry = self._step(self.step)
        if not entry.forwards:
            entry.rng = torch.get_rng_state().numpy().copy() if on_cpu else None
            entry.rows = next((len(value) for value in batch.values() if isinstance(value, torch.Tensor)), None)
        entry.forwards += 1

    def _keeps_tensors(self) -> bool:
        """Rank 0 keeps every step's tensors; every other rank its training steps' too, so that the controller
        judges each rank's grads and params against rank 0's (a replica that drifts is as wrong as rank 0)."""
        return self.rank == 0 or not self.resumed

    def after_backward(self, step: int, view: ModelView) -> None:
        self.phase(f"step {step}: read grads")
        grads = view.full_grads()
        if self._keeps_tensors():
            self._step(step).grads = to_numpy(grads)

    def clipped(self, step: int, total_norm: float | None, source: str) -> None:
        entry = self._step(step)
        entry.norm = None if total_norm is None else float(total_norm)
        entry.norm_source = source

    def after_step(self, step: int, view: ModelView) -> None:
        self.phase(f"step {step}: read params")
        params = view.full_params()
        buffers = read_buffers(view)
        if self._keeps_tensors():
            self._step(step).params = to_numpy(params)
            self._step(step).buffers = None if buffers is None else buffers_to_numpy(buffers)


def installed_versions(distributions: tuple[str, ...]) -> dict[str, str]:
    """What this process would import: a row's verdict is about these versions, whatever the environment pinned."""
    return {name: _installed_version(name) for name in dict.fromkeys(distributions)}


@functools.cache
def _installed_version(name: str) -> str:
    """Once per process: a rank serves many cells, and reading the installed metadata walks `sys.path`."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def describe_error(exc: BaseException, phase: str, rank: int, step: int | None = None) -> RankError:
    frames = traceback.extract_tb(exc.__traceback__)
    where = f"{frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}" if frames else "?"
    return RankError(type=type(exc).__name__, message=short_paths(headline(str(exc))),
                     full_message=short_paths(str(exc)), rank=rank, where=short_paths(where), phase=phase,
                     traceback=short_paths("".join(traceback.format_exception(exc))), at=time.time(), step=step)


def _construct(cell: Cell, device: str | torch.device | None = None, initialize: bool = True) -> nn.Module:
    """The bare model in train mode: the tiny reference model, or the user's factory (seeded). `train()` is called as
    every training loop and trainer calls it before stepping, so a model's own override (frozen BatchNorm kept in
    eval, the usual fix) runs for the stack's model and the reference's alike."""
    if cell.user_model is None:
        model = models.build(cell.key.model, seed=cell.hyper.seed, features=cell.pattern.features, device=device,
                             initialize=initialize)
    else:
        torch.manual_seed(cell.hyper.seed)
        with torch.device(device) if device is not None else contextlib.nullcontext():
            model = import_ref(cell.user_model.factory)()
        if cell.user_model.blocks:  # FSDP's units and checkpointing's wrappers (`models.block_modules`)
            model._no_split_modules = list(cell.user_model.blocks)
    model.train()
    evaluated = [glob for group in cell.pattern.eval for glob in cell.groups.get(group, ())]
    for name, module in model.named_modules():
        if any(fnmatch.fnmatchcase(name, glob) for glob in evaluated):
            module.eval()
    return model


def _builder(cell: Cell) -> Callable[..., nn.Module]:
    def build_model(device: str | torch.device | None = None, initialize: bool = True) -> nn.Module:
        model = _construct(cell, device, initialize)
        # The modes checkpointing wraps the model's blocks in; an adapter declares any others as its own.
        if cell.key.checkpoint in models.CHECKPOINT_MODES:
            models.apply_checkpointing(model, cell.key.checkpoint)
        return model

    return build_model


def _data(cell: Cell) -> tuple[list[Batch], LossOf]:
    global_batch = cell.hyper.batch_per_rank * cell.world_size
    if cell.user_model is None:
        batches = models.make_batches(cell.key.model, seed=cell.hyper.seed, steps=cell.hyper.steps,
                                      global_batch=global_batch, features=cell.pattern.features)
        return batches, reference.tiny_loss
    make_batch = import_ref(cell.user_model.batch)
    batches = [make_batch(global_batch, step) for step in range(cell.hyper.steps)]
    return batches, _scalar_loss(cell.user_model.loss)


class FreezeCaseError(Exception):
    """A user's `@freeze_case` function broke its contract: blame the declaration, not the framework.
    (Its name is `core.records.FREEZE_CASE_ERROR`, which the verdict reads.)"""


def _scalar_loss(ref: str) -> LossOf:
    """The user's loss, refusing (in one line naming it) anything but a scalar tensor."""
    user_loss = import_ref(ref)

    def loss(model: nn.Module, batch: Batch) -> torch.Tensor:
        value = user_loss(model, batch)
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            got = (f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor)
                   else type(value).__name__)
            raise FreezeCaseError(f"freeze_case loss {ref} returned {got}; it must return a scalar tensor")
        return value

    return loss


def _facts(steps: list[reference.ReferenceStep]) -> list[StepFacts]:
    return [StepFacts(grads=to_numpy(s.grads), norm=s.norm, params=to_numpy(s.params),
                      buffers=buffers_to_numpy(s.buffers)) for s in steps]


#: Rank 0's references and eager inits for the rank's life: cells that differ only in how the stack ran share them.
_REFERENCES: reference.Memo[list[StepFacts]] = reference.Memo()
_EAGER: reference.Memo[dict[str, torch.Tensor]] = reference.Memo(size=64)
#: Which modules of a model (built as a pattern's `eval` leaves it) couple a batch's rows (`reference.coupled_modules`).
_COUPLED: reference.Memo[list[str]] = reference.Memo(size=64)
#: What in a model (built likewise) draws random numbers in its forward (`reference.random_draws`).
_DRAWN: reference.Memo[list[str]] = reference.Memo(size=64)
#: Which params of a model (built likewise, on the cell's batches) only some ranks' rows reach (`rank_divergent`).
_DIVERGENT: reference.Memo[list[str]] = reference.Memo(size=64)


def _rank_divergent(bare: Callable[[], tuple[nn.Module, LossOf]], batches: list[Batch], world_size: int,
                    notes: list[str]) -> list[str]:
    """`reference.rank_divergent` on a fresh model; a model whose every param cannot take a grad alone (a layer that
    refuses one) is said in a note, not an error of the cell: the names are information, no check reads them."""
    try:
        return reference.rank_divergent(*bare(), batches, world_size)
    except Exception as exc:  # a user's model may raise anything outside its training setup
        notes.append(f"rank-divergent params not looked for: {type(exc).__name__}: {headline(str(exc))}")
        return []


def resumed_states(record: RankRecord, rng: list[torch.Tensor] | None) -> list[torch.Tensor] | None:
    """The generator states the round trip's run drew from, by step: the uninterrupted run's up to the save, the
    resumed run's after it; None where nothing is replayed, where they are the uninterrupted run's (the stack
    restored the generator) or where a resumed step cannot be replayed (`unreplayable`)."""
    resume = record.resume
    if rng is None or resume is None or len(resume.steps) < len(rng):
        return None
    after = resume.steps[resume.saved_after + 1:len(rng)]
    if not after or unreplayable(after, 1, record.steps[0].rows or 0) is not None:
        return None
    states = [*rng[:resume.saved_after + 1], *(torch.from_numpy(step.rng) for step in after)]
    return None if all(torch.equal(a, b) for a, b in zip(states, rng)) else states


def unreplayable(steps: list[StepFacts], world_size: int, rows_per_rank: int) -> str | None:
    """Why a per-rank replay cannot draw the masks the ranks drew (None: it can): each rank's step must run the
    cell's loss once, on the CPU generator, over one data-parallel rank's rows."""
    for step, facts in enumerate(steps):
        if not facts.forwards:
            return f"the stack's own forward ran step {step} (not the cell's loss), so no generator state was read"
        if facts.rng is None:
            return (f"step {step} drew its masks on the accelerator's generator; the reference replays on CPU "
                    "(a CPU run replays them)")
        if facts.forwards > 1:
            return (f"the cell's loss ran {facts.forwards} times in step {step} (micro-batches); the replay draws "
                    "each rank's rows at once")
        if facts.rows != rows_per_rank:
            return (f"the loss took {facts.rows} rows in step {step}, not one of {world_size} data-parallel ranks' "
                    f"{rows_per_rank} (tensor or pipeline parallelism); the replay runs data-parallel ranks")
    return None


def _reference(cell: Cell, adapter: Adapter, plan: FreezePlan, initial: dict[str, torch.Tensor],
               buffers: dict[str, torch.Tensor] | None, batches: list[Batch], loss: LossOf, record: RankRecord) -> None:
    own = adapter.reference_model(cell) is not None  # the framework's own model (e.g. Megatron's GPTModel)

    def bare() -> tuple[nn.Module, LossOf]:
        """A fresh single-process model for each reference run (no grads or dtype left from another)."""
        if own:
            model_and_loss = adapter.reference_model(cell)
            assert model_and_loss is not None
            return model_and_loss
        model = _construct(cell, "cpu", initialize=False)
        # A model that holds its own low-precision params runs as the stack's build held them (`deepspeed.zero.Init`
        # builds it in its config's dtype); an fp32 model's cast is the cell's precision, which the mixed reference
        # follows.
        if dtypes.own_low_precision(dtypes_of(model.named_parameters())):
            hold_as(model, record.dtypes)
        return model, loss

    # Everything a reference reads but the values: which model (and loss) `bare` builds, and how it trains. A model
    # whose rows are coupled (plain BatchNorm in train mode) is replayed as data parallelism runs it: each rank's rows
    # alone, the grads averaged (`reference.run`'s `shards`).
    model = (cell.adapter if own else None, cell.key.model, cell.user_model, cell.pattern.features, cell.hyper.seed,
             record.dtypes)
    built = reference.digest(model, cell.pattern, dict(cell.groups))
    coupled = [] if record.syncs_norms else _COUPLED.get(built, lambda: reference.coupled_modules(bare()[0]))
    record.draws_random = _DRAWN.get(built, lambda: reference.random_draws(
        *bare(), rows_of(batches[0], 0, cell.world_size)))
    record.rank_divergent = _DIVERGENT.get(reference.digest(built, cell.world_size), lambda: _rank_divergent(
        bare, batches, cell.world_size, record.notes)) if cell.world_size > 1 and not own else []
    if record.rank_divergent:
        shown = f"{', '.join(record.rank_divergent[:4])}{' ...' if len(record.rank_divergent) > 4 else ''}"
        record.notes.append(f"rank-divergent: in one step some ranks' rows reach params that others' do not ({shown}): "
                            "DDP needs find_unused_parameters, and stacks that reduce only the grads a rank produced "
                            "(FSDP2, ZeRO-1/2/3) pair them across ranks; the reference runs the whole batch, as a "
                            "correct run averages them")
    if record.draws_random:
        record.unreplayed = unreplayable(record.steps, cell.world_size, cell.hyper.batch_per_rank)
    replays = bool(record.draws_random) and record.unreplayed is None
    rng = [torch.from_numpy(step.rng) for step in record.steps] if replays else None
    shards = cell.world_size if coupled or replays else 1
    if coupled:
        record.notes.append(f"reference: each rank's {cell.hyper.batch_per_rank} rows through the model alone, grads "
                            f"averaged, as data parallelism computes it (plain BatchNorm in train mode normalises "
                            f"each rank's rows apart: {', '.join(coupled[:3])}{' ...' if len(coupled) > 3 else ''}); "
                            "buffers judged against rank 0's rows")
    if record.draws_random:
        drawn = f"{', '.join(record.draws_random[:3])}{' ...' if len(record.draws_random) > 3 else ''}"
        record.notes.append(
            f"reference: the forward draws random numbers ({drawn}); each rank's rows replayed from the CPU generator "
            "state the ranks drew each step's first loss from, grads averaged, as data parallelism computes it"
            if replays else f"reference: the forward draws random numbers ({drawn}) that it cannot replay as the ranks "
                            f"drew them: {record.unreplayed}")
    trains = (model, plan.names, plan.trainable, plan.optimized, plan.unused, dict(plan.rows), cell.hyper, shards)
    reads = reference.digest(*trains, initial, buffers or {}, batches, rng or [])  # once: the values' bytes are hashed

    def facts(compute_dtype: torch.dtype | None = None, resumed_after: int | None = None,
              convention: str = CANONICAL_LOOP, redrawn: list[torch.Tensor] | None = None) -> list[StepFacts]:
        """`redrawn`: generator states by step in place of the run's (the resumed run's, after its load)."""
        key = reference.digest(reads, compute_dtype, resumed_after, convention, redrawn or [])
        return _REFERENCES.get(key, lambda: _facts(reference.run(
            cell, plan, initial, batches, *bare(), compute_dtype=compute_dtype, resumed_after=resumed_after,
            convention=convention, buffers=buffers, shards=shards, rng=redrawn or rng)))

    record.reference = facts()
    if cell.precision in reference.LOW_PRECISION:
        record.reference_mixed = facts(compute_dtype=reference.LOW_PRECISION[cell.precision])
    elif dtypes.own_low_precision(record.dtypes):  # the reference runs the model as held; this is its spread
        record.reference_mixed = facts(compute_dtype=torch.float32)
    # The optimizer holds a subset of what trains: the loop's other correct forms give the optimizer's params
    # other updates only through the clip norm (without clipping, only grads that reach no weight differ).
    outside = set(plan.trainable) - set(plan.optimized)
    if outside and cell.hyper.clips:
        record.reference_conventions = {convention: facts(convention=convention)
                                        for convention in LOOP_CONVENTIONS if convention != CANONICAL_LOOP}
    # Grads that accumulate outside any checkpoint: trainable params outside the user's optimizer set that the
    # stack's optimizer does not track either (a stack that tracks every param, C7, steps and zeroes them all).
    stale = outside - set(record.tracked or ())
    if record.resume is not None and stale:
        record.reference_resumed = facts(resumed_after=record.resume.saved_after)
    redrawn = resumed_states(record, rng)
    if record.resume is not None and redrawn is not None:
        resumed_after = record.resume.saved_after if stale else None
        record.reference_redrawn = facts(resumed_after=resumed_after, redrawn=redrawn)
        if cell.precision in reference.LOW_PRECISION:
            record.reference_redrawn_mixed = facts(reference.LOW_PRECISION[cell.precision], resumed_after,
                                                   redrawn=redrawn)

    def one_step(values: dict[str, torch.Tensor], step: int) -> StepFacts:
        """The reference's `step` from `values`: its grads and clip norm (its update is never read)."""
        drawn = [rng[step]] if rng is not None else None
        key = reference.digest(*trains, values, buffers or {}, batches[step], drawn or [])
        [taken] = _REFERENCES.get(key, lambda: [StepFacts(grads=to_numpy(s.grads), norm=s.norm)
                                                for s in reference.run(cell, plan, values, [batches[step]], *bare(),
                                                                       buffers=buffers, shards=shards, rng=drawn)])
        return taken

    record.reference_at_own_params = [None, *(_at_own_params(record, step, one_step, outside)
                                              for step in range(1, min(len(record.steps), len(record.reference))))]
    eager = _EAGER.get(reference.digest(model), lambda: _eager_values(cell, adapter))
    record.init_matches_eager = all(torch.equal(values, initial[name]) for name, values in eager.items())


def _at_own_params(record: RankRecord, step: int, one_step: Callable[[dict[str, torch.Tensor], int], StepFacts],
                   outside: set[str]) -> StepFacts | None:
    """The reference's `step` taken at the params the stack held after the step before; None where those are
    the reference's own (bit for bit) or not a full set of them. The grads of `outside` params (trainable, in no
    optimizer) add up over steps in the canonical loop: theirs are the reference's sums, moved by what taking the
    step at the stack's params instead of the reference's changes."""
    assert record.reference is not None
    own, along = record.steps[step - 1].params, record.reference[step - 1].params or {}
    if not own or set(own) != set(along) or any(own[n].shape != along[n].shape for n in own):
        return None
    if all(np.array_equal(own[n], along[n]) for n in own):
        return None
    taken = one_step({name: torch.from_numpy(value) for name, value in own.items()}, step)
    summed = {n: g for n, g in (record.reference[step].grads or {}).items() if n in outside and g is not None}
    if not summed:
        return taken
    afresh = one_step({name: torch.from_numpy(value) for name, value in along.items()}, step).grads or {}
    grads = dict(taken.grads or {})
    for name, total in summed.items():
        if grads.get(name) is not None and afresh.get(name) is not None:
            grads[name] = total + grads[name] - afresh[name]
    return StepFacts(grads=grads, norm=taken.norm)


def _eager_values(cell: Cell, adapter: Adapter) -> dict[str, torch.Tensor]:
    """The values the cell's model takes when built eagerly, as a user builds it without any framework."""
    own = adapter.reference_model(cell)
    if own is not None:
        eager = own[0]
        models.init_weights(eager, cell.hyper.seed)
    else:
        eager = _construct(cell, "cpu")
    return {name: param.detach().float().clone() for name, param in eager.named_parameters()}


def run_cell(cell: Cell, rank: int, device: torch.device, send_phase: Callable[[str], None],
             kept: KeptState) -> RankRecord:
    recorder = Recorder(rank, send_phase)
    record = recorder.record
    record.versions = installed_versions(("torch", *cell.distributions))
    torch.manual_seed(cell.hyper.seed)
    batches, loss = _data(cell)
    plans: list[FreezePlan] = []
    owners: list[dict[str, tuple[str, ...]]] = []

    def resolve_plan(model: nn.Module) -> FreezePlan:
        """The bare model's plan; its ties are read here too, before any wrapper or materialization can break them."""
        ties = ties_of(model.named_parameters(remove_duplicate=False))
        plan = resolve(cell.pattern, cell.groups, [n for n, _ in model.named_parameters()], ties)
        if not plans:
            record.tied = ties
            record.dtypes = dtypes_of(model.named_parameters())
            if dtypes.own_low_precision(record.dtypes):
                record.observed["model_dtypes"] = dtypes.summary(record.dtypes, plan.trainable)
        plans.append(plan)
        owners.append(buffer_owners(model))
        return plan

    def drawn_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
        recorder.loss_started(batch, on_cpu=torch.device(device).type == "cpu")
        return loss(model, batch)

    adapter: Adapter | None = None
    try:
        ctx = RunContext(cell=cell, rank=rank, world_size=cell.world_size, device=device, probe=recorder,
                         batches=batches, build_model=_builder(cell), resolve_plan=resolve_plan, loss=drawn_loss,
                         shim=import_ref(cell.shim) if cell.shim else None, kept=kept)
        adapter = import_ref(cell.adapter)()
        adapter.run(ctx)
    except BaseException as exc:  # a framework may raise anything; the controller classifies it
        if isinstance(exc, INTERPRETER_EXITS):
            raise
        if recorder.resumed and record.resume is not None:  # the run before the round trip is judged as it was
            record.resume.error = describe_error(exc, record.phase, rank, recorder.step)
        else:
            record.error = describe_error(exc, record.phase, rank, recorder.step)
    if plans:
        plan = plans[0]
        trained_buffers = [glob for group in cell.pattern.buffers for glob in cell.groups.get(group, ())]
        record.plan = PlanFacts(plan.names, tuple(sorted(plan.trainable)), tuple(sorted(plan.optimized)),
                                tuple(sorted(plan.unused)), tuple(sorted(owners[0])),
                                held_buffers(owners[0], plan.trainable, trained_buffers))
    recorder.run_ended()
    if rank == 0 and adapter is not None and plans and recorder.initial_params is not None and record.error is None:
        recorder.phase("reference")
        try:
            _reference(cell, adapter, plans[0], recorder.initial_params, recorder.initial_buffers, batches, loss,
                       record)
        except Exception as exc:  # our own reference failing is an error of the cell, named as such
            record.error = describe_error(exc, "reference", rank)
    recorder.finished()
    return record
