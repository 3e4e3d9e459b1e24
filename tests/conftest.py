"""Shared fixtures: paths to the small test matrices, and pytester runs in a subprocess."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from slices import SharedPools

TESTS = Path(__file__).parent
SPECS = TESTS / "specs"


class ShimProbe:
    """Records what a CUDA-on-CPU shim reports engaging, as the rank's Recorder does."""

    def __init__(self) -> None:
        self.emulated_patches: list[str] = []

    def emulated(self, what: str) -> None:
        self.emulated_patches.append(what)


@pytest.fixture(scope="session")
def shared_pools() -> Iterator[SharedPools]:
    """Warm 2-rank pools the real-run test modules share (`slices.SharedPools`), shut down once the session ends."""
    from slices import SharedPools  # torch and the engine load only for a session that runs real cells

    pools = SharedPools()
    try:
        yield pools
    finally:
        pools.shutdown()


@pytest.fixture
def small_spec() -> Path:
    return SPECS / "small.toml"


@pytest.fixture
def run_matrix(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch):
    """Run `pytest --freeze-matrix ...` in a fresh subprocess; return (result, report or None)."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.delenv("FREEZECOMPAT_ENVIRONMENT", raising=False)

    def run(*args: str, report_dir: str = "report", cache: bool = False):
        result = pytester.runpytest_subprocess("--freeze-matrix", f"--freeze-matrix-report={report_dir}",
                                               *(() if cache else ("-p", "no:cacheprovider")), *args)
        path = pytester.path / report_dir / "matrix.json"
        return result, (json.loads(path.read_text()) if path.exists() else None)

    return run


@pytest.fixture
def run_user(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch):
    """Plain `pytest` (no --freeze-matrix) on the user's test files; return (result, report or None)."""
    monkeypatch.delenv("FREEZECOMPAT_ENVIRONMENT", raising=False)

    def run(*args: str):
        result = pytester.runpytest_subprocess("--freeze-matrix-report=report", "-p", "no:cacheprovider", *args)
        path = pytester.path / "report" / "matrix.json"
        return result, (json.loads(path.read_text()) if path.exists() else None)

    return run
