"""A git revision checked out beside this one, for the benchmarks' before vs after runs (stdlib only)."""

from __future__ import annotations

import contextlib
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def worktree(revision: str) -> Iterator[Path]:
    """A checkout of `revision` in a temporary folder, removed afterwards."""
    folder = Path(tempfile.mkdtemp(prefix="freezecompat-before-"))
    subprocess.run(["git", "worktree", "add", "-q", "--detach", str(folder), revision], cwd=ROOT, check=True)
    try:
        yield folder
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(folder)], cwd=ROOT, check=False)
