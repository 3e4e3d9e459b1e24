"""Each finding's upstream-ready report (`findings/<id>.md`, beside its reproducer), as `freezecompat finding` prints
it: the text a maintainer reads is the file in the repository, so the command prints it whole, never a rewording."""

from __future__ import annotations

from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Protocol


class Reproduced(Protocol):
    """A registry entry that ships a reproducer (`spec.known_issues.Entry`)."""

    id: str
    kind: str
    reproducer: str | None


class FindingError(Exception):
    """An unknown entry or a missing report: one line."""


def findings_dir() -> Path:
    """The packaged reports (wheel installs) or, in a source checkout, the repo's `findings/`."""
    packaged = resources.files("pytest_freezecompat") / "_findings"
    if packaged.is_dir():
        return Path(str(packaged))
    return Path(__file__).resolve().parents[2] / "findings"


def listing(entries: Sequence[Reproduced], directory: Path) -> list[str]:
    """One line per entry: id, kind, and its report's title or that it has none yet."""
    lines = []
    for entry in entries:
        path = directory / f"{entry.id}.md"
        title = (path.read_text().splitlines() or ["(empty)"])[0].lstrip("# ") if path.is_file() else (
            "no upstream report yet")
        lines.append(f"{entry.id} [{entry.kind}]: {title}")
    return lines


def report(entries: Sequence[Reproduced], directory: Path, entry_id: str) -> str:
    """The report of one entry, whole."""
    found = {entry.id: entry for entry in entries}
    if entry_id not in found:
        raise FindingError(f"no finding {entry_id!r}; the entries with a reproducer: {', '.join(found)}")
    path = directory / f"{entry_id}.md"
    if not path.is_file():
        raise FindingError(f"{entry_id} has no upstream report yet ({path.name}); its reproducer: "
                           f"{found[entry_id].reproducer}")
    return path.read_text()
