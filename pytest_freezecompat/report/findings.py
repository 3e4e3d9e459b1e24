"""Each finding's upstream-ready report (`findings/<id>.md`, beside its reproducer), as `freezecompat finding` prints
it: the text a maintainer reads is the file in the repository, so the command prints it whole, never a rewording."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from ..spec.known_issues import Entry, KnownIssueError, Registry


def findings_dir() -> Path:
    """The packaged reports (wheel installs) or, in a source checkout, the repo's `findings/`."""
    packaged = resources.files("pytest_freezecompat") / "_findings"
    if packaged.is_dir():
        return Path(str(packaged))
    return Path(__file__).resolve().parents[2] / "findings"


def with_reproducers(registry: Registry) -> list[Entry]:
    """The entries that ship a standalone reproducer: findings, and the triaged entries that keep theirs."""
    return [entry for entry in registry.entries if entry.reproducer]


def report_path(entry: Entry, directory: Path) -> Path:
    return directory / f"{entry.id}.md"


def listing(registry: Registry, directory: Path) -> list[str]:
    """One line per entry with a reproducer: id, kind, and the report's title or that it has none yet."""
    lines = []
    for entry in with_reproducers(registry):
        path = report_path(entry, directory)
        title = (path.read_text().splitlines() or ["(empty)"])[0].lstrip("# ") if path.is_file() else (
            "no upstream report yet")
        lines.append(f"{entry.id} [{entry.kind}]: {title}")
    return lines


def report(registry: Registry, directory: Path, entry_id: str) -> str:
    """The report of one entry, whole; a one-line `KnownIssueError` for an unknown id or a missing report."""
    entries = {entry.id: entry for entry in with_reproducers(registry)}
    if entry_id not in entries:
        raise KnownIssueError(f"no finding {entry_id!r}; the entries with a reproducer: {', '.join(entries)}")
    path = report_path(entries[entry_id], directory)
    if not path.is_file():
        raise KnownIssueError(f"{entry_id} has no upstream report yet ({path.name}); its reproducer: "
                              f"{entries[entry_id].reproducer}")
    return path.read_text()
