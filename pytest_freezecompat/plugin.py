"""pytest hooks only: options, one item per matrix cell, report data per cell, summary.

The work lives in `controller.runner` (plan, pool, judge, report), imported only when a matrix
run starts (as pytest-xdist loads its controller): with the plugin installed, a plain `pytest`
run imports neither torch nor the controller.
"""

from __future__ import annotations

import importlib.util
import json
import shlex
import signal
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from . import options as settings
from .core.cell import Cell
from .core.names import SEVERITIES, clip
from .core.records import STATUSES, display_status

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from .controller.runner import MatrixRun

#: The report attribute that carries a cell's whole record to the process that writes the report (xdist
#: serializes a report's attributes); junitxml gets a few scalars (`MatrixItem._keep`).
RECORD_ATTRIBUTE = "freeze_matrix_cell"
#: Summary columns: what pytest counts (pass, the failures, skip), then xfail (`known`) and strict xpass (`fixed?`).
SUMMARY_COLUMNS = (*STATUSES, "known", "fixed?")
COLUMN_MARKUP = {"pass": {"green": True}, "fail": {"red": True}, "error": {"red": True}, "timeout": {"red": True},
                 "crash": {"red": True}, "skip": {"yellow": True}, "known": {"yellow": True},
                 "fixed?": {"red": True}}
#: A terminal line of a failed cell: the first failure's message, cut at a boundary (the JSON has it all).
TERMINAL_MESSAGE_CHARS = 600


def pytest_addoption(parser: pytest.Parser) -> None:
    settings.add_options(parser)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "freeze_matrix: a cell of the freeze compatibility matrix")
    config.pluginmanager.register(MatrixSession(config), "freeze-matrix-session")


def _check_writable(options: settings.Options, config: pytest.Config) -> None:
    from .report.directory import ReportDirError, check_writable

    if not hasattr(config, "workerinput"):  # xdist workers never write the report
        try:
            check_writable(options.report_dir)
        except ReportDirError as exc:
            raise pytest.UsageError(f"--freeze-matrix-report: {exc}") from None


def _check_selection(options: settings.Options) -> None:
    """A bad selection or matrix file is one line before collection starts (the matrix loads without torch)."""
    from .spec.matrix import SpecError, load
    from .spec.plan import Selection, SelectionError

    try:
        Selection.parse(options.select, load(options.spec_path))
    except (SpecError, SelectionError) as exc:
        raise pytest.UsageError(str(exc)) from None


def _start_run(config: pytest.Config, options: settings.Options) -> MatrixRun:
    missing = [name for name in ("torch", "numpy") if importlib.util.find_spec(name) is None]
    if missing:  # before the controller's imports, which need both
        raise pytest.UsageError(f"the freeze matrix runs its cells on torch and numpy; {' and '.join(missing)} "
                                "not installed here: pip install torch numpy (or 'pytest-freezecompat[torch]')")
    from .controller.runner import MatrixRun
    from .spec.known_issues import KnownIssueError
    from .spec.matrix import SpecError, load
    from .spec.plan import SelectionError

    _check_writable(options, config)
    try:
        spec = load(options.spec_path)
        if options.environment is not None and not any(fw.release_in(options.environment)
                                                       for fw in spec.frameworks.values()):
            raise SelectionError(f"--freeze-matrix-environment: unknown environment {options.environment!r}; "
                                 f"valid: {', '.join(spec.environments)}, or <framework>@<release>")
        return MatrixRun(spec, options)
    except (SpecError, SelectionError, KnownIssueError) as exc:
        raise pytest.UsageError(str(exc)) from None


class Terminated(KeyboardInterrupt):
    """SIGTERM (CI cancellation, `timeout`, a scheduler), handled as Ctrl-C is: finished cells stay in the
    report, the ranks are ended and the pool's folder removed, and pytest exits 2 (interrupted)."""


def _on_sigterm(signum: int, frame: Any) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: a second one must not cut the report short
    raise Terminated("SIGTERM received: stopping as for Ctrl-C")


class CellFailure(Exception):
    """A cell whose status is not pass; its text is the cell's message plus the repro command."""


class MatrixItem(pytest.Item):
    def __init__(self, *, cell: Cell, run: MatrixRun, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.cell = cell
        self.run = run
        self.extra_keyword_matches.update(filter(None, cell.key.as_dict().values()))
        self.add_marker(pytest.mark.freeze_matrix)
        self.record: dict[str, Any] | None = None
        if cell.skip:
            self.add_marker(pytest.mark.skip(reason=cell.skip))
            self._keep(run.skip_record(cell, self.repro))

    @property
    def repro(self) -> str:
        if self.cell.user_model is None:
            from .controller.runner import repro_command

            return repro_command(self.cell, self.run.options)
        return shlex.join(["pytest", self.nodeid])

    def _keep(self, record: dict[str, Any]) -> None:
        """The record rides on the report (`RECORD_ATTRIBUTE`); junitxml sees a few scalars a dashboard can use."""
        self.record = record
        values = {"severity": record.get("severity"), "status": record["status"], "check": record.get("check"),
                  "cause": record.get("cause"), "convention": record.get("convention"),
                  "known_issue": (record.get("known_issue") or {}).get("id"), "repro": record["repro"],
                  "emulation": bool(record.get("emulation"))}
        self.user_properties.extend((name, value) for name, value in values.items() if value is not None)

    def runtest(self) -> None:
        record = self.run.run_cell(self.cell, self.repro)
        self._keep(record)
        if self.cell.user_model is not None:
            self._judge_own_model(record)
            return
        known = record.get("known_issue") or {}
        if known.get("expected") or known.get("fixed"):  # known: xfail; fixed?: strict xpass, so stale entries show
            self.add_marker(pytest.mark.xfail(reason=f"known issue {known['id']}: {known.get('link', '')}",
                                              strict=True))
        if record["status"] != "pass":
            raise CellFailure(record)

    def _judge_own_model(self, record: dict[str, Any]) -> None:
        """A user's own model fails their run on the severities they fail on, a known issue or not (an xfail would
        hide silent harm in a green CI); any other cell that is not a clean pass is an xfail saying why."""
        from .verdict.severity import fails_run, recorded

        fail_on = self.run.options.fail_on
        if fails_run(record, fail_on):
            raise CellFailure(record)
        if record["status"] != "pass" or recorded(record) in ("unproven", "costly"):
            known = (record.get("known_issue") or {}).get("id")
            self.add_marker(pytest.mark.xfail(reason=f"{recorded(record)}" + (f" ({known})" if known else "")
                                              + f": not in --freeze-matrix-fail-on={','.join(fail_on)}"))
            raise CellFailure(record)

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> str:
        if isinstance(excinfo.value, CellFailure):
            record = excinfo.value.args[0]
            lines = [f"{record.get('severity', '?').upper()} ({record['status']})"
                     + (f" [{record['check']}]" if record.get("check") else "")
                     + f": {clip(record['message'], TERMINAL_MESSAGE_CHARS)}"]
            # Every other failed check too: a cell can fail the optimizer set *and* move a frozen param.
            lines += [f"also [{failure['check']}]: {clip(failure.get('message', ''), TERMINAL_MESSAGE_CHARS)}"
                      for failure in record.get("failures", [])[1:]]
            for rank in record.get("rank_details", []):
                if "stack" in rank or "exit" in rank or "log_tail" in rank:
                    lines.append(f"--- rank {rank['rank']} ({rank.get('exit') or rank['phase']}) ---")
                    lines.append(rank.get("stack") or rank.get("log_tail", ""))
            lines.append(f"reproduce: {record['repro']}")
            return "\n".join(lines)
        return super().repr_failure(excinfo, style=style)

    def reportinfo(self) -> tuple[Path, int, str]:
        return self.path, 0, f"freeze-matrix {self.cell.id}"


class MatrixCollector(pytest.Collector):
    """The built-in matrix, one more child of the session, collected after the test files: a project whose files
    declared `@freeze_case` models gets it only when asked, and then without thousands of deselections."""

    def __init__(self, *, run: MatrixRun, wanted: Callable[[], bool], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.run = run
        self.wanted = wanted

    def collect(self) -> list[pytest.Item]:
        if not self.wanted():
            return []
        return [MatrixItem.from_parent(self, name=cell.id, cell=cell, run=self.run) for cell in self.run.cells
                if cell.user_model is None]


def _declares_cases(path: Path) -> bool:
    """Whether a test file may declare `@freeze_case` models (read as text: nothing else is imported)."""
    try:
        return "freeze_case" in path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False


def _own_bad_cells(report: Path, results: dict[str, dict[str, Any]]) -> list[str]:
    """What `advise` says of each cell of a user's own model this run found not safe, from the written report (where
    a red cell carries its entry's workarounds and the nearest safe setups, proved)."""
    from .advice.answer import not_safe

    own = {cell_id for cell_id, record in results.items() if record.get("user_model")}
    if not own:
        return []
    try:
        return not_safe([cell for cell in json.loads(report.read_text())["cells"] if cell["id"] in own])
    except (OSError, ValueError, KeyError) as exc:
        return [f"(the report could not be read back for advice: {exc})"]


class FreezeCaseCollector(pytest.Collector):
    """A `@freeze_case` factory in a test module: one item per cell of the user's case."""

    def __init__(self, *, declaration: Any, run: MatrixRun, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.declaration = declaration
        self.run = run

    def collect(self) -> list[pytest.Item]:
        from .spec.plan import SelectionError
        from .user import CaseError, build_case

        if not self.run.runs_user_models(self.declaration.frameworks):
            return []  # no framework of this environment trains user models: nothing to build or check
        try:
            cells = self.run.add_user_case(build_case(self.declaration))
        except (CaseError, SelectionError) as exc:
            raise self.CollectError(f"{self.path}: freeze_case {self.name}: {exc}") from None
        return [MatrixItem.from_parent(self, name=cell.id, cell=cell, run=self.run) for cell in cells]


class MatrixSession:
    """The plugin's state for one pytest process: the matrix run, created when first needed."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self._previous_sigterm: Any = None
        self._session_started = False
        self._run: MatrixRun | None = None
        self._report_line = ""
        self._report_paths: list[Path] = []
        self._own_bad: list[str] = []
        self._builtin_left = False
        self.options = settings.resolve(config)
        if self.options.matrix:  # the run checks its selection as it plans
            self._begin()
        elif self.options.select:  # user cases start the run only when collected: check it now
            _check_selection(self.options)

    def _begin(self) -> MatrixRun:
        self._run = _start_run(self.config, self.options)
        if self._session_started:
            self._take_sigterm()
        return self._run

    def _take_sigterm(self) -> None:
        """SIGTERM stops the run as Ctrl-C does, its report written. Only from the session's start: before it, other
        plugins are still importing (a SIGTERM there escaped pytest as a traceback, seen on a GPU machine whose
        hypothesis plugin loads for seconds), no cell has run and no rank exists, so the default death loses nothing."""
        if self._previous_sigterm is None:
            try:
                self._previous_sigterm = signal.signal(signal.SIGTERM, _on_sigterm)
            except ValueError:  # not the main thread (pytest embedded somewhere): the caller's handlers stay
                pass

    def pytest_sessionstart(self, session: pytest.Session) -> None:
        self._session_started = True
        if self._run is not None:
            self._take_sigterm()

    @property
    def _matrix_on(self) -> bool:
        return self._run is not None and self._run.options.matrix

    @property
    def run(self) -> MatrixRun:
        return self._run if self._run is not None else self._begin()

    def pytest_ignore_collect(self, collection_path: Path, config: pytest.Config) -> bool | None:
        """`pytest --freeze-matrix` alone looks only into test files that declare `@freeze_case` models (their
        cells run, the rest of those files is deselected); name test paths to run them whole."""
        if not self._matrix_on or config.args_source == pytest.Config.ArgsSource.ARGS or collection_path.is_dir():
            return None
        return None if collection_path.suffix == ".py" and _declares_cases(collection_path) else True

    def pytest_collection_modifyitems(self, session: pytest.Session, config: pytest.Config,
                                      items: list[pytest.Item]) -> None:
        """Under `--freeze-matrix`: the project's own models when it declares some (the built-in matrix beside them
        only with --freeze-matrix-builtin), else the built-in matrix; without named paths, matrix cells alone."""
        if not self._matrix_on:
            return
        if config.args_source == pytest.Config.ArgsSource.ARGS:
            return
        dropped = [item for item in items if not isinstance(item, MatrixItem)]
        if dropped:
            items[:] = [item for item in items if isinstance(item, MatrixItem)]
            config.hook.pytest_deselected(items=dropped)

    def pytest_pycollect_makeitem(self, collector: pytest.Collector, name: str, obj: object) -> Any:
        declaration = getattr(obj, "__freeze_case__", None)
        if declaration is None:
            return None
        self._builtin_left = not self.options.builtin
        return FreezeCaseCollector.from_parent(collector, name=name, declaration=declaration, run=self.run)

    @pytest.hookimpl(wrapper=True)
    def pytest_make_collect_report(self, collector: pytest.Collector) -> Any:
        report = yield
        if report.failed and isinstance(collector, pytest.Module) and _declares_cases(collector.path):
            # Its cases are unknown: its collection error is the run's answer, never the built-in matrix instead.
            self._builtin_left = not self.options.builtin
        # The built-in matrix is one more child of the session, collected like a test file.
        if isinstance(collector, pytest.Session) and report.passed and self._matrix_on:
            report.result.append(MatrixCollector.from_parent(collector, name="freeze-matrix", nodeid="freeze-matrix",
                                                              run=self.run, wanted=lambda: not self._builtin_left))
        return report

    def pytest_report_header(self, config: pytest.Config) -> list[str] | None:
        """What decides the results, before the first cell: as pytest-timeout and pytest-benchmark do."""
        if not self._matrix_on:
            return None
        from .report import schema

        run, options = self.run, self.options
        where = f"environment {options.environment}" if options.environment else "every framework installed here"
        lines = [f"freeze-matrix: {where}, {run.device}/{run.backend}, world size "
                 f"{options.world_size}, timeout {options.timeout_s:g} s, spec {run.spec.path}"]
        missing = run.missing_frameworks()  # said once at the end, for the cells the run would have had
        versions = []
        for name in dict.fromkeys(cell.key.framework for cell in run.cells if cell.key.framework not in missing):
            info = run.environment(next(c.environment for c in run.cells if c.key.framework == name))
            versions.append(f"{name} {info['frameworks'].get(name) or '?'}")
        lines.append(f"freeze-matrix stacks: torch {schema.distribution_version('torch') or '?'}; frameworks: "
                     f"{', '.join(versions) or 'none'}")
        return lines

    def pytest_report_collectionfinish(self, config: pytest.Config, start_path: Path,
                                       items: Sequence[pytest.Item]) -> list[str] | None:
        """How many cells of which models will run, once collection has found the project's own."""
        if not self._matrix_on:
            return None
        cells = Counter(item.cell.user_model is not None for item in items if isinstance(item, MatrixItem))
        said = [f"{cells[True]} of your @freeze_case models"] if cells[True] else []
        said += [f"{cells[False]} of the built-in matrix"] if cells[False] or not (cells[True] or self._builtin_left) \
            else []
        return [f"freeze-matrix cells: {', '.join(said) or 'none'}"]

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
        report = yield
        if isinstance(item, MatrixItem) and item.record is not None and (
                call.when == "call" or (call.when == "setup" and report.skipped)):
            setattr(report, RECORD_ATTRIBUTE, item.record)
        return report

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        # In the xdist controller this sees every worker's reports; without xdist, our own.
        record = getattr(report, RECORD_ATTRIBUTE, None)
        if record is not None:
            self.run.collect(record)

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        """Options that selected nothing are a usage error, not an empty run (exit 5) nobody can explain."""
        if hasattr(self.config, "workerinput"):
            return
        if self._run is not None and (problem := self._run.selection_problem()):
            raise pytest.UsageError(problem)
        given = settings.given_on_command_line(self.config)
        if self._run is None and given:
            raise pytest.UsageError(f"{given[0]} does nothing without --freeze-matrix (the built-in matrix) or a "
                                    "test file with @freeze_case cases: add --freeze-matrix")

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self._run is None:
            return
        self._run.close()
        if hasattr(session.config, "workerinput"):  # xdist workers leave the report to the controller
            return
        try:
            folded = self._run.write_report(final=True)
        except OSError as exc:
            self._report_line = f"report NOT written: {exc} (this run's cells: {self._run.report.journal_path})"
            return
        if folded is not None:
            kept = f"; {folded.from_other_runs} kept from earlier or concurrent runs" if folded.from_other_runs else ""
            aside = f"; an unreadable matrix.json was moved to {folded.set_aside}" if folded.set_aside else ""
            aside += f"; {folded.unusable_lines} damaged journal line(s) left out" if folded.unusable_lines else ""
            self._report_paths = [folded.path, folded.path.with_suffix(".md"), folded.path.with_suffix(".html")]
            self._own_bad = _own_bad_cells(folded.path, self._run.results)
            self._report_line = (f"{folded.cells} cells in the report, {len(self._run.results)} from this run"
                                 f"{kept}{aside}")

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        if self._previous_sigterm is not None:
            signal.signal(signal.SIGTERM, self._previous_sigterm)

    def pytest_terminal_summary(self, terminalreporter: Any, config: pytest.Config) -> None:
        if hasattr(config, "workerinput") or self._run is None or not self._run.results:
            return
        from .verdict.severity import fails_run

        counts: dict[str, Counter[str]] = {}
        for record in self.run.results.values():  # as pytest counts them: `known` xfailed, `fixed?` failed
            failed_own = record.get("user_model") and fails_run(record, self.options.fail_on)  # known or not
            shown = record["status"] if failed_own else display_status(record)
            counts.setdefault(f"{record['framework']}/{record['plugin']}", Counter())[shown] += 1
        columns = [c for c in SUMMARY_COLUMNS if c in STATUSES or any(c in n for n in counts.values())]
        rows = [["framework/plugin", *columns], *([name, *(str(n.get(c, 0)) for c in columns)]
                                                   for name, n in counts.items())]
        if len(counts) > 1:
            rows.append(["total", *(str(sum(n.get(c, 0) for n in counts.values())) for c in columns)])
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        terminalreporter.section("freeze matrix")
        for index, row in enumerate(rows):
            terminalreporter.write(row[0].ljust(widths[0]), bold=index == 0 or row[0] == "total")
            for column, value, width in zip(columns, row[1:], widths[1:]):
                markup = COLUMN_MARKUP[column] if index and value != "0" else {}
                terminalreporter.write("  " + value.rjust(width), bold=index == 0, **markup)
            terminalreporter.line("")
        harm = Counter(record.get("severity") for record in self.run.results.values())
        terminalreporter.write_line("how bad: " + " · ".join(f"{harm[v]} {v}" for v in SEVERITIES if harm[v]),
                                    bold=True, red=bool(harm["silent"]))
        if self._own_bad:
            terminalreporter.section("your models: not safe, why, and what to do instead", red=True)
            for line in self._own_bad:
                terminalreporter.write_line(line)
        if self._builtin_left:
            terminalreporter.write_line("built-in matrix: not run (your @freeze_case models ran; "
                                        "--freeze-matrix-builtin adds it)")
        for why in (*self.run.missing_frameworks(reported_only=True).values(),
                    *self.run.missing_packages().values()):
            terminalreporter.write_line(f"skipped: {why}", yellow=True)  # one line per framework, per package
        if self._report_paths:
            terminalreporter.write_line(f"report: {self._report_line}")
            for path in self._report_paths:
                terminalreporter.write_line(f"  {path}")
        else:
            terminalreporter.write_line(self._report_line, red=self._report_line.startswith("report NOT"))
