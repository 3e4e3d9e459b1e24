"""A report directory that several runs share, and that no run can lose or overwrite.

One rule for every partial, concurrent or killed run: the report is a merge by cell id.
Each run appends one JSON line per finished cell to its own journal (`journal/<run>.jsonl`,
on disk before the next cell starts, a few microseconds a cell) and, every few seconds and at the
end, folds the existing `matrix.json` and every journal into a new matrix.json/md/html under
an exclusive lock. A cell of an earlier run that this run did not run stays, with its own
`finished_at`; for a cell run twice, the newer result wins. A run holds a lock on its journal
while it lives: a journal whose lock is free belongs to a run that died (even by SIGKILL), and
the next fold takes its cells in and deletes it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core.records import with_later_axes
from . import schema, write

JOURNALS = "journal"
LOCK_FILE = ".lock"
#: Another run holds the lock for one fold at most (well under a second); past this something is wrong.
LOCK_WAIT_S = 60.0
Row = dict[str, Any]
GITIGNORE = "# written by pytest-freezecompat: run output, not sources\n*\n"


class ReportDirError(OSError):
    """The report directory cannot be used; the message is one line naming it."""


def check_writable(directory: Path) -> None:
    """Refuse, before anything runs, a report path that is a file or where we cannot write.

    Tried for real (the kernel decides: permissions, read-only mounts, /proc), and nothing is left behind."""
    existing, created = directory.absolute(), []
    while not existing.exists():
        created.append(existing)
        existing = existing.parent
    if not existing.is_dir():
        raise ReportDirError(f"{directory}: {existing} is a file, not a directory")
    try:
        for folder in reversed(created):
            folder.mkdir()
        tempfile.TemporaryFile(dir=directory).close()
    except OSError as exc:
        raise ReportDirError(f"{directory}: cannot write there ({exc.strerror or exc})") from None
    finally:
        for folder in created:  # deepest first
            with contextlib.suppress(OSError):
                folder.rmdir()


@dataclass(frozen=True)
class Folded:
    """What one fold wrote: cells in the report, and how many came from other runs (earlier or concurrent)."""

    path: Path
    cells: int
    from_other_runs: int
    set_aside: Path | None = None  # an unreadable matrix.json found there, renamed rather than dropped
    unusable_lines: int = 0  # journal lines that parse but are no report row (a damaged file), left out


def _try_lock(handle: Any) -> bool:
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _read_journal(path: Path) -> Iterator[dict[str, Any]]:
    """Every complete line (a line cut short by a kill is skipped); JSON that is no table comes as `{}`."""
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue
        yield entry if isinstance(entry, dict) else {}


class ReportDirectory:
    """This run's view of a shared report directory: its journal, and folds of everything into the report."""

    def __init__(self, path: Path, *, self_ignoring: bool = False) -> None:
        self.path = path
        self.self_ignoring = self_ignoring
        self.run_id = f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
        self._journal: Any = None
        self._environments_written: set[str] = set()
        self.mine: set[str] = set()

    @property
    def journal_path(self) -> Path:
        return self.path / JOURNALS / f"{self.run_id}.jsonl"

    def _open(self) -> None:
        (self.path / JOURNALS).mkdir(parents=True, exist_ok=True)
        if self.self_ignoring and not (self.path / ".gitignore").exists():
            (self.path / ".gitignore").write_text(GITIGNORE)
        with self._locked():  # a fold must never see this journal before its lock is taken
            self._journal = open(self.journal_path, "a", encoding="utf-8", buffering=1)  # open while the run lives
            fcntl.flock(self._journal, fcntl.LOCK_EX)  # held while this run lives: "alive" to other runs

    def append(self, row: dict[str, Any], environment: dict[str, Any]) -> None:
        """One finished cell, on disk before the next starts (a line-buffered append, no fold)."""
        if self._journal is None:
            self._open()
        if row["environment"] not in self._environments_written:
            self._journal.write(json.dumps({"environment": row["environment"], "info": environment}) + "\n")
            self._environments_written.add(row["environment"])
        self._journal.write(json.dumps({"cell": row}) + "\n")
        self.mine.add(row["id"])

    @contextmanager
    def _locked(self) -> Iterator[None]:
        with open(self.path / LOCK_FILE, "a") as lock:
            deadline = time.monotonic() + LOCK_WAIT_S
            while not _try_lock(lock):
                if time.monotonic() > deadline:
                    raise ReportDirError(f"{self.path}: another run has held {LOCK_FILE} for {LOCK_WAIT_S:.0f} s")
                time.sleep(0.05)
            yield

    def fold(self, rebuild: Callable[[list[Row]], list[Row]]) -> Folded | None:
        """Merge matrix.json and every journal into a new report; `rebuild(rows)` re-derives row fields
        that depend on other rows (the cause, from each column's control). Deletes journals of dead runs."""
        if not (self.path / JOURNALS).is_dir():
            return None
        with self._locked():
            environments, cells, set_aside = self._existing()
            finished: list[Path] = []
            unusable = 0
            for journal in sorted((self.path / JOURNALS).glob("*.jsonl")):
                mine = journal == self.journal_path
                with open(journal, "a") as handle:
                    ended = not mine and _try_lock(handle)
                    for entry in _read_journal(journal):
                        # Only rows a report may hold: one damaged line must not make matrix.json unreadable.
                        if "cell" in entry and schema.cell_problem(row := entry["cell"]) is None:
                            if row.get("finished_at", "") >= cells.get(row["id"], {}).get("finished_at", ""):
                                cells[row["id"]] = with_later_axes(row)
                        elif type(entry.get("environment")) is str and type(entry.get("info")) is dict:
                            environments[entry["environment"]] = entry["info"]
                        else:
                            unusable += 1
                if ended:
                    finished.append(journal)
            if not cells:
                return None
            rows = rebuild(list(cells.values()))
            write.write(self.path, write.build(environments, rows))
            for journal in finished:
                journal.unlink(missing_ok=True)
        return Folded(self.path / "matrix.json", len(rows), len(set(cells) - self.mine), set_aside, unusable)

    def _existing(self) -> tuple[dict[str, Any], dict[str, Row], Path | None]:
        """The report as it is now; one that cannot be read is renamed aside, never silently dropped."""
        path = self.path / "matrix.json"
        if not path.exists():
            return {}, {}, None
        try:
            report = schema.load(path)
        except schema.ReportError:
            aside = path.with_name(f"matrix.unreadable-{self.run_id}.json")
            os.replace(path, aside)
            return {}, {}, aside
        return dict(report["environments"]), {cell["id"]: cell for cell in report["cells"]}, None

    def close(self, rebuild: Callable[[list[Row]], list[Row]]) -> Folded | None:
        """The last fold, then this run's journal goes (its cells are in matrix.json now)."""
        folded = self.fold(rebuild)
        if self._journal is not None:
            self._journal.close()
            self.journal_path.unlink(missing_ok=True)
            self._journal = None
        return folded
