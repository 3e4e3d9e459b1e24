"""The controller's side of a matrix run: plan once, run cells on the warm pool, keep the report.

`plugin.py` only wires pytest hooks to this object. Under xdist every worker plans the
same cells and runs its share on its own pool; only the controller (which sees every
worker's reports) writes the report.
"""

from __future__ import annotations

import dataclasses
import functools
import shlex
import time
import traceback
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ..core.cell import Cell
from ..core.names import KEY_AXES, short_paths
from ..core.phases import KINDS
from ..core.records import CellRecord, CellRun, Status
from ..options import DEFAULT_WORLD_SIZE, Options
from ..report import schema
from ..report.directory import Folded, ReportDirectory
from ..spec import known_issues, locks
from ..spec.matrix import Spec, default_spec_path
from ..spec.plan import (
    Selection,
    UserCase,
    missing_needs,
    needs_reason,
    needs_summary,
    plan,
    user_cells,
    why_not_importable,
)
from ..verdict import checks, classify, severity
from .pool import PoolError, RankPool

#: Fold the journal into matrix.json/md/html this often during a run (each cell is in the journal at once),
#: and never spend more than a tenth of the run on it (a fold of thousands of cells takes a while).
REPORT_EVERY_S = 5.0
FOLD_SHARE = 0.1


def detect_device(world_size: int) -> tuple[str, str]:
    """(device, backend): NCCL on CUDA when enough GPUs are visible, else gloo on CPU."""
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return "cuda", "nccl"
    return "cpu", "gloo"


def repro_command(cell: Cell, options: Options) -> str:
    """The one-cell command, options written `--opt=value`: a path after a space moves pytest's rootdir
    (pytest#8846)."""
    args = ["pytest", "--freeze-matrix",
            "--freeze-matrix-select=" + cell.key.selection()]
    if options.spec_path and Path(options.spec_path).resolve() != default_spec_path().resolve():
        args.append(f"--freeze-matrix-spec={options.spec_path}")
    if options.world_size != DEFAULT_WORLD_SIZE:
        args.append(f"--freeze-matrix-world-size={options.world_size}")
    return shlex.join(args)


def _record(cell: Cell, repro: str, status: Status, message: str, **fields: Any) -> CellRecord:
    """A report row for `cell`: its key and where it ran, plus what happened."""
    return CellRecord(key=cell.key, environment=cell.environment, world_size=cell.world_size,
                      precision=cell.precision, emulation=fields.pop("emulation", False), status=status.value,
                      message=message, repro=repro,
                      rule_known_issue=cell.known_issue, user_model=cell.user_model is not None or None, **fields)


def _phases(run: CellRun, judge_s: float) -> dict[str, float]:
    """Where the cell's time went (`core.phases.KINDS`): rank 0's phases, and what only the controller saw."""
    lead = run.ranks[0].record
    spent = dict(lead.phases_s) if lead else {}
    spent["dispatch"] = max(0.0, run.dispatch_s - sum(spent.values()))
    if run.fresh_start_s is not None:
        spent["restart"] = run.fresh_start_s
    if run.tidy_s is not None:
        spent["tidy"] = run.tidy_s
    spent["judge"] = judge_s
    return {kind: round(spent[kind], 4) for kind in (*KINDS, "other") if kind in spent}


class MatrixRun:
    def __init__(self, spec: Spec, options: Options) -> None:
        self.spec = spec
        self.options = options
        self.device, self.backend = detect_device(options.world_size)
        self.selection = Selection.parse(options.select, spec)
        self.cells: list[Cell] = []
        if options.matrix:
            self.cells = plan(spec, self.selection, world_size=options.world_size, device=self.device,
                              environment=options.environment)
        known_path = spec.path.parent / known_issues.FILE_NAME
        self.known = (known_issues.load(known_path) if known_path.exists()
                      else known_issues.Registry(known_path, ()))
        self.known.check_against(spec)
        self.known.require(c.known_issue for c in self.cells if c.known_issue)
        self._environment_info: dict[str, dict[str, Any]] = {}
        self.results: dict[str, dict[str, Any]] = {}
        #: Round-trip group -> the round trip its first judged cell ran; the group's later cells cite it.
        self.round_trips: dict[str, checks.RoundTrip] = {}
        self.user_values: dict[str, set[str]] = {}  # the models and patterns user cases add to the axes
        #: Frameworks a user case would run on but that are not installed here -> why (no cell of theirs is planned).
        self.frameworks_left_out: dict[str, str] = {}
        self._pool: RankPool | None = None
        self._pool_error: str | None = None
        self.report = ReportDirectory(options.report_dir, self_ignoring=options.report_dir_is_default)
        self._last_fold = 0.0
        self._fold_s = 0.0

    def runs_user_models(self, frameworks: Sequence[str] | None = None) -> bool:
        """Whether any framework here (of those named, if any) trains user models."""
        env = self.options.environment
        return any(fw.user_models and (env is None or fw.release_in(env)) and (not frameworks or fw.name in frameworks)
                   for fw in self.spec.frameworks.values())

    def missing_frameworks(self, *, reported_only: bool = False) -> dict[str, str]:
        """Frameworks with cells in this run that cannot be imported here -> their cells' skip reason; with
        `reported_only`, of the cells that reported (not those deselected, e.g. a built-in matrix left out)."""
        missing: dict[str, str] = dict(self.frameworks_left_out)
        reported = {record["framework"] for record in self.results.values()}
        for name in dict.fromkeys(cell.key.framework for cell in self.cells
                                  if not reported_only or cell.key.framework in reported):
            if why_not_importable(self.spec.frameworks[name].import_name):
                missing[name] = next(c.skip for c in self.cells if c.key.framework == name and c.skip)
        return missing

    def missing_packages(self) -> dict[str, str]:
        """Packages that plugins of this run's cells need and that are not importable here -> one line naming the
        cells skipped for want of it and what installs it (read from the cells' records: xdist workers' too)."""
        importable = functools.cache(why_not_importable)
        skipped: dict[tuple[str, str], list[str]] = {}
        for record in self.results.values():
            fw, plugin = self.spec.frameworks[record["framework"]], record["plugin"]
            needs = missing_needs(fw, plugin, importable)
            if needs and record["message"] == needs_reason(plugin, needs):  # not its framework's skip
                for module, pip in needs.items():
                    skipped.setdefault((module, pip), []).append(f"{fw.name}/{plugin}")
        return {module: needs_summary(module, pip, plugins) for (module, pip), plugins in sorted(skipped.items())}

    def add_user_case(self, case: UserCase) -> list[Cell]:
        # --freeze-matrix-select narrows user cases as it narrows the built-in matrix.
        every = user_cells(self.spec, case, world_size=self.options.world_size, device=self.device,
                           environment=self.options.environment)
        # A framework not installed here runs none of a user's cells: said once at the run's end (`missing_frameworks`)
        # rather than as a report section of skipped cells.
        absent = {c.key.framework: c.skip for c in every
                  if c.skip and why_not_importable(self.spec.frameworks[c.key.framework].import_name)}
        self.frameworks_left_out.update(absent)
        every = [cell for cell in every if cell.key.framework not in absent]
        for cell in every:
            self.user_values.setdefault("model", set()).add(cell.key.model)
            self.user_values.setdefault("freeze", set()).add(cell.key.freeze)
        cells = [cell for cell in every if self.selection.keeps_key(cell.key)]
        self.cells.extend(cells)
        return cells

    def selection_problem(self) -> str | None:
        """Once collected: a selected model or pattern that no cell of the spec or of a user case has."""
        return self.selection.unknown_to(self.spec, self.user_values)

    # -- running cells (in whichever process runs the item) --------------------------------
    def _get_pool(self) -> RankPool:
        if self._pool is None:
            ran = [c for c in self.cells if c.skip is None]
            self._pool = RankPool(self.options.world_size, sorted({c.adapter_module for c in ran}),
                                  sorted({m for c in ran if c.user_model for m in c.user_model.modules}))
        return self._pool

    def run_cell(self, cell: Cell, repro: str) -> dict[str, Any]:
        """Run one cell and return its report row (the rank facts judged here, in the controller)."""
        started = time.perf_counter()
        if self._pool_error:
            return self._annotated(_record(cell, repro, Status.ERROR, self._pool_error))
        shares = cell.round_trip and not self.options.every_round_trip
        cited = self.round_trips.get(cell.round_trip) if shares else None
        try:
            run = self._get_pool().run(dataclasses.replace(cell, round_trip_of=cited.cell) if cited else cell,
                                       self.options.timeout_s)
        except PoolError as exc:
            self._pool_error = f"rank pool could not start: {exc}"
            return self._annotated(_record(cell, repro, Status.ERROR, self._pool_error))
        except Exception as exc:  # our own bug: the cell still gets its row, and the next one a fresh pool
            self.close()
            where = traceback.extract_tb(exc.__traceback__)[-1]
            return self._annotated(_record(
                cell, repro, Status.ERROR, f"the controller raised {type(exc).__name__}: {exc} "
                f"({short_paths(where.filename)}:{where.lineno} in {where.name})", cause="harness"))
        judging = time.perf_counter()
        verdict = checks.judge(run, cell, self.options.timeout_s, cited)
        if verdict.round_trip is not None and cell.round_trip:  # set only where the cell cited none
            self.round_trips[cell.round_trip] = dataclasses.replace(verdict.round_trip, cell=cell.key.id)
        facts = checks.run_facts(run, cell)
        if verdict.round_trip_of is not None and cited is not None:
            facts["resume_api"] = cited.api
        judge_s = time.perf_counter() - judging
        record = _record(cell, repro, verdict.status, verdict.message, check=verdict.check,
                         failures=[failure.to_json() for failure in verdict.failures],
                         cause="harness" if verdict.harness else None, raised_in=verdict.raised_in,
                         notes=run.notes + verdict.notes, rank_details=checks.rank_details(run),
                         duration_s=round(time.perf_counter() - started, 3),
                         pool_start_s=None if run.fresh_start_s is None else round(run.fresh_start_s, 3),
                         rendezvous_retries=run.rendezvous_retries or None, phases_s=_phases(run, judge_s),
                         group_kept=all(s.record is not None and s.record.group_kept for s in run.ranks) or None,
                         convention=verdict.convention, differences=verdict.differences,
                         round_trip_of=verdict.round_trip_of, unchecked=verdict.unchecked,
                         tolerance=verdict.tolerance, error=verdict.error, **facts)
        return self._annotated(record)

    def skip_record(self, cell: Cell, repro: str) -> dict[str, Any]:
        return self._annotated(_record(cell, repro, Status.SKIP, cell.skip or ""))

    def _annotated(self, record: CellRecord) -> dict[str, Any]:
        """The row as JSON, tied to the registry entry that explains it (its raw status never changes)."""
        record.commit = self.environment(record.environment)["run"].get("commit")
        row = record.to_json()
        row["finished_at"] = datetime.now(timezone.utc).isoformat(timespec="milliseconds")
        row["severity"] = severity.severity_of(row)  # the fold sets it again once `cause` knows the harness
        known_issues.annotate_cell(row, self.environment(record.environment), self.known)
        return row

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()

    # -- the report (controller only) -------------------------------------------------------
    def collect(self, record: dict[str, Any]) -> None:
        """A finished cell: into the journal now, into matrix.json/md/html at the next fold."""
        self.results[record["id"]] = record
        self.report.append(record, self.environment(record["environment"]))
        if time.monotonic() - self._last_fold > max(REPORT_EVERY_S, self._fold_s / FOLD_SHARE):
            self.write_report()

    def environment(self, name: str) -> dict[str, Any]:
        """Versions of an environment's stack, as this process sees them (cached: metadata scans are slow)."""
        if name not in self._environment_info:
            frameworks = {fw.name: fw.import_name for fw in self.spec.frameworks.values() if fw.release_in(name)}
            axes = {axis: self.spec.values(axis) for axis in KEY_AXES}
            self._environment_info[name] = schema.environment_info(
                frameworks, self.device, self.backend, axes=axes, words=self.spec.words(list(frameworks)),
                run=schema.run_info(self.options.command, self.options.rootdir),
                # only a run in a named environment (nox's) was built from its lock; a user's own is not ours
                lock=locks.state(self.spec.path, name) if self.options.environment else None)
        return self._environment_info[name]

    def write_report(self, *, final: bool = False) -> Folded | None:
        """Fold this run's cells (and any other run's) into the report directory."""
        started = time.monotonic()
        folded = self.report.close(classify) if final else self.report.fold(classify)
        self._last_fold = time.monotonic()
        self._fold_s = self._last_fold - started
        return folded
