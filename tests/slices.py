"""What the real 2-rank slice tests share: a warm pool, one cell of the built-in matrix, a run judged as the matrix
judges it. Imported as `slices` (tests/ is on sys.path: pytest's prepend import mode puts it there for conftest.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from pytest_freezecompat.controller.pool import RankPool
from pytest_freezecompat.core.cell import Cell
from pytest_freezecompat.core.records import RankState
from pytest_freezecompat.spec import matrix as spec
from pytest_freezecompat.spec import plan
from pytest_freezecompat.verdict.checks import Verdict, judge

#: Seconds a cell may take: room for a cold rank start and a round trip on a busy 2-core runner.
TIMEOUT_S = 120.0
WORLD_SIZE = 2


def rank_pool(*modules: str) -> Iterator[RankPool]:
    """A fixture's body (`yield from`): warm ranks preloading `modules`, shut down with their folder however it ends.
    For a pool that needs what no other test module's has (a folder on sys.path); the rest share `SharedPools`."""
    ranks = RankPool(WORLD_SIZE, list(modules))
    try:
        yield ranks
    finally:
        ranks.shutdown()


class SharedPools:
    """One warm pool per set of preloaded modules for the whole test session, as the matrix keeps one for a whole
    slice: each test module of an environment would otherwise start its framework's ranks again (~10 s of imports
    on a 2-core machine). Cells leave nothing behind in warm ranks (the engine's guarantee), so sharing is safe."""

    def __init__(self) -> None:
        self._pools: dict[tuple[str, ...], RankPool] = {}

    def get(self, *modules: str) -> RankPool:
        """The session's pool preloading exactly `modules`, made on first use (its ranks start with its first cell)."""
        if modules not in self._pools:
            self._pools[modules] = RankPool(WORLD_SIZE, list(modules))
        return self._pools[modules]

    def shutdown(self) -> None:
        """Every pool's ranks and folder, even where one's shutdown raises (that error is raised after the rest)."""
        with contextlib.ExitStack() as stack:
            for ranks in self._pools.values():
                stack.callback(ranks.shutdown)


def matrix_cell(framework: str, **axes: str) -> Cell:
    """The one CPU cell the axes select, written as --freeze-matrix-select would pick it, so tests run real cells."""
    matrix = spec.load()
    select = ",".join(f"{axis}={value}" for axis, value in {"framework": framework, **axes}.items())
    (found,) = plan.plan(matrix, plan.Selection.parse(select, matrix), world_size=WORLD_SIZE, device="cpu")
    return found


def judged(pool: RankPool, cell: Cell, timeout_s: float = TIMEOUT_S) -> tuple[Verdict, list[RankState]]:
    """Run `cell` and judge it by the engine's own checks, as the matrix does; the ranks' states for the details."""
    result = pool.run(cell, timeout_s)
    return judge(result, cell, timeout_s), result.ranks
