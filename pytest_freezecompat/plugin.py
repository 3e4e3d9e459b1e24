"""pytest hooks only: options, one item per matrix cell, report data per cell, summary.

The work lives in `controller.runner` (plan, pool, judge, report), imported only when a matrix
run starts (as pytest-xdist loads its controller): with the plugin installed, a plain `pytest`
run imports neither torch nor the controller.
"""

from __future__ import annotations

import math
import os
import shlex
import signal
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from .core.cell import Cell
from .core.records import STATUSES

if TYPE_CHECKING:
    from .controller.runner import MatrixRun, Options

CELL_PROPERTY = "freeze_matrix_cell"
#: A warm cell takes well under a second; framework imports on the first cell of a pool take up to a minute.
DEFAULT_TIMEOUT_S = 120.0
#: Below a second a cell cannot even join its process group; a day is longer than any CI allows.
TIMEOUT_RANGE_S = (1.0, 86400.0)
DEFAULT_REPORT_DIR = ".freeze-matrix"
ENVIRONMENT_VARIABLE = "FREEZECOMPAT_ENVIRONMENT"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("freeze-matrix", "partial-freeze compatibility matrix (pytest-freezecompat)")
    group.addoption("--freeze-matrix", action="store_true", help="run the freeze compatibility matrix")
    group.addoption("--freeze-matrix-select", default="", metavar="AXIS=VALUE,...",
                    help="keep only cells with these exact axis values (repeat an axis for alternatives), "
                         "e.g. framework=torch,freeze=embedding")
    group.addoption("--freeze-matrix-timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="S",
                    help=f"seconds one cell may take before it is a timeout (default {DEFAULT_TIMEOUT_S:.0f})")
    group.addoption("--freeze-matrix-world-size", type=int, default=2, metavar="N",
                    help="ranks per cell (default 2)")
    group.addoption("--freeze-matrix-spec", default=None, metavar="FILE",
                    help="matrix file to use instead of the packaged one")
    group.addoption("--freeze-matrix-report", default=None, metavar="DIR",
                    help=f"where matrix.json and matrix.md go (default {DEFAULT_REPORT_DIR}/ under the rootdir, "
                         "a directory that ignores itself in git)")
    group.addoption("--freeze-matrix-environment", default=os.environ.get(ENVIRONMENT_VARIABLE), metavar="NAME",
                    help=f"run only the frameworks this environment owns (default ${ENVIRONMENT_VARIABLE}; "
                         "unset: every framework, non-importable ones skipped)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "freeze_matrix: a cell of the freeze compatibility matrix")
    config.pluginmanager.register(MatrixSession(config), "freeze-matrix-session")


def _options(config: pytest.Config) -> Options:
    from .controller.runner import Options
    from .report.directory import ReportDirError, check_writable

    world_size = config.getoption("freeze_matrix_world_size")
    if world_size < 1:
        raise pytest.UsageError("--freeze-matrix-world-size must be at least 1")
    timeout_s = config.getoption("freeze_matrix_timeout")
    low, high = TIMEOUT_RANGE_S
    if not (math.isfinite(timeout_s) and low <= timeout_s <= high):
        raise pytest.UsageError(f"--freeze-matrix-timeout must be between {low:.0f} and {high:.0f} seconds, "
                                f"got {timeout_s}")
    report_dir = config.getoption("freeze_matrix_report")
    options = Options(
        matrix=config.getoption("freeze_matrix"), select=config.getoption("freeze_matrix_select"),
        timeout_s=timeout_s, world_size=world_size, spec_path=config.getoption("freeze_matrix_spec"),
        report_dir=Path(report_dir) if report_dir else config.rootpath / DEFAULT_REPORT_DIR,
        report_dir_is_default=report_dir is None, environment=config.getoption("freeze_matrix_environment"),
        command=shlex.join(["pytest", *config.invocation_params.args]), rootdir=config.rootpath,
    )
    if not hasattr(config, "workerinput"):  # xdist workers never write the report
        try:
            check_writable(options.report_dir)
        except ReportDirError as exc:
            raise pytest.UsageError(f"--freeze-matrix-report: {exc}") from None
    return options


def _start_run(config: pytest.Config) -> MatrixRun:
    from .controller.runner import MatrixRun
    from .spec.known_issues import KnownIssueError
    from .spec.matrix import SpecError, load
    from .spec.plan import SelectionError

    options = _options(config)
    try:
        spec = load(options.spec_path)
        if options.environment is not None and options.environment not in spec.environments:
            raise SelectionError(f"--freeze-matrix-environment: unknown environment {options.environment!r}; "
                                 f"valid: {', '.join(spec.environments)}")
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
        self.extra_keyword_matches.update(cell.key.as_dict().values())
        self.add_marker(pytest.mark.freeze_matrix)
        if cell.skip:
            self.add_marker(pytest.mark.skip(reason=cell.skip))
            self.user_properties.append((CELL_PROPERTY, run.skip_record(cell, self.repro)))

    @property
    def repro(self) -> str:
        if self.cell.user_model is None:
            from .controller.runner import repro_command

            return repro_command(self.cell, self.run.options)
        return shlex.join(["pytest", self.nodeid])

    def runtest(self) -> None:
        record = self.run.run_cell(self.cell, self.repro)
        self.user_properties.append((CELL_PROPERTY, record))
        known = record.get("known_issue") or {}
        if known.get("expected") or known.get("fixed"):  # known: xfail; fixed?: strict xpass, so stale entries show
            self.add_marker(pytest.mark.xfail(reason=f"known issue {known['id']}: {known.get('link', '')}",
                                              strict=True))
        if record["status"] != "pass":
            raise CellFailure(record)

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> str:
        if isinstance(excinfo.value, CellFailure):
            record = excinfo.value.args[0]
            lines = [f"{record['status'].upper()}" + (f" [{record['check']}]" if record.get("check") else "")
                     + f": {record['message']}"]
            # Every other failed check too: a cell can fail the optimizer set *and* move a frozen param.
            lines += [f"also [{failure['check']}]: {failure['message']}" for failure in record.get("failures", [])[1:]]
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
    """The built-in matrix, one more child of the session."""

    def __init__(self, *, run: MatrixRun, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.run = run

    def collect(self) -> list[pytest.Item]:
        return [MatrixItem.from_parent(self, name=cell.id, cell=cell, run=self.run) for cell in self.run.cells
                if cell.user_model is None]


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
        self._run: MatrixRun | None = None
        self._report_line = ""
        if config.getoption("freeze_matrix"):
            self._begin()

    def _begin(self) -> MatrixRun:
        self._run = _start_run(self.config)
        if self._previous_sigterm is None:
            try:
                self._previous_sigterm = signal.signal(signal.SIGTERM, _on_sigterm)
            except ValueError:  # not the main thread (pytest embedded somewhere): the caller's handlers stay
                pass
        return self._run

    @property
    def _matrix_on(self) -> bool:
        return self._run is not None and self._run.options.matrix

    @property
    def run(self) -> MatrixRun:
        return self._run if self._run is not None else self._begin()

    def pytest_ignore_collect(self, collection_path: Path, config: pytest.Config) -> bool | None:
        """`pytest --freeze-matrix` alone runs just the matrix; name test paths to run them as well."""
        return True if self._matrix_on and config.args_source != pytest.Config.ArgsSource.ARGS else None

    def pytest_pycollect_makeitem(self, collector: pytest.Collector, name: str, obj: object) -> Any:
        declaration = getattr(obj, "__freeze_case__", None)
        if declaration is None:
            return None
        return FreezeCaseCollector.from_parent(collector, name=name, declaration=declaration, run=self.run)

    @pytest.hookimpl(wrapper=True)
    def pytest_make_collect_report(self, collector: pytest.Collector) -> Any:
        report = yield
        # The built-in matrix is one more child of the session, collected like a test file.
        if isinstance(collector, pytest.Session) and report.passed and self._matrix_on:
            report.result.append(MatrixCollector.from_parent(collector, name="freeze-matrix", nodeid="freeze-matrix",
                                                              run=self.run))
        return report

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        # In the xdist controller this sees every worker's reports; without xdist, our own.
        record = dict(report.user_properties).get(CELL_PROPERTY)
        if record is not None and (report.when == "call" or (report.when == "setup" and report.skipped)):
            self.run.collect(record)

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
            self._report_line = (f"report: {folded.path} (+ .md, .html): {folded.cells} cells, "
                                 f"{len(self._run.results)} from this run{kept}{aside}")

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        if self._previous_sigterm is not None:
            signal.signal(signal.SIGTERM, self._previous_sigterm)

    def pytest_terminal_summary(self, terminalreporter: Any, config: pytest.Config) -> None:
        if hasattr(config, "workerinput") or self._run is None or not self._run.results:
            return
        counts: dict[tuple[str, str], Counter] = {}
        for record in self.run.results.values():
            counts.setdefault((record["framework"], record["plugin"]), Counter())[record["status"]] += 1
        terminalreporter.section("freeze matrix")
        width = max(len(f"{fw}/{plugin}") for fw, plugin in counts)
        terminalreporter.write_line(f"{'framework/plugin':<{width}}  " + " ".join(f"{s:>7}" for s in STATUSES))
        for (fw, plugin), counter in counts.items():
            terminalreporter.write_line(f"{fw + '/' + plugin:<{width}}  "
                                        + " ".join(f"{counter.get(s, 0):>7}" for s in STATUSES))
        for why in self.run.missing_frameworks().values():
            terminalreporter.write_line(f"skipped: {why}", yellow=True)  # one line per framework
        terminalreporter.write_line(self._report_line, red=self._report_line.startswith("report NOT"))
