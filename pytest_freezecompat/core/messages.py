"""Messages on the pipes between the controller, its rank templates and the ranks (our own processes only,
never a network socket).

  controller -> template: Fork (+ the rank's end of a fresh pipe, passed as a file descriptor) | Stop
  template -> controller: TemplateReady, then Forked per Fork, Exited per rank that ended
  controller -> rank: RunCell, then KeepGroup after a clean cell | Stop
  rank -> controller: Ready, then per cell: Reply, and after KeepGroup: Left (the cell tidied away)
A rank's phases during a cell go to its `core.board.PhaseBoard`, not the pipe.
"""

from __future__ import annotations

from dataclasses import dataclass

from .cell import Cell
from .records import RankRecord

#: The environment variable that gives a rank its controller's pid (a rank ends itself when that parent is gone).
CONTROLLER_PID = "FREEZECOMPAT_CONTROLLER_PID"
#: "1" where the controller sees a GPU: a template then takes no backward (`rank.template._warm_up`).
GPU_VISIBLE = "FREEZECOMPAT_GPU_VISIBLE"
#: The phase a rank reports while it joins the cell's fresh process group (the harness, not the framework).
RENDEZVOUS_PHASE = "init process group"


@dataclass(frozen=True)
class TemplateReady:
    #: The names (Linux's `comm`) of the template's threads after its imports, but the one that forks: a fork copies
    #: only that one, so any other refuses the template (and names itself in the one line that says so).
    other_threads: tuple[str, ...]
    #: The user module whose import left a thread running (the template then forks nothing), or None.
    threads_from: str | None = None

    @property
    def threads(self) -> int:
        return 1 + len(self.other_threads)


@dataclass(frozen=True)
class Fork:
    """Fork a rank: its environment on top of the template's, its log, stack and phase files."""

    env: dict[str, str]
    log_path: str
    stack_path: str
    phase_path: str


@dataclass(frozen=True)
class Forked:
    pid: int


@dataclass(frozen=True)
class Exited:
    pid: int
    returncode: int  # as `subprocess` gives it: negative for a signal


@dataclass(frozen=True)
class RunCell:
    index: int  # unique per pool: the cell's key prefix in the pool's store
    cell: Cell


@dataclass(frozen=True)
class Stop:
    pass


@dataclass(frozen=True)
class Ready:
    """The rank is connected to the pool's store and waits for cells."""


@dataclass(frozen=True)
class Reply:
    record: RankRecord


@dataclass(frozen=True)
class KeepGroup:
    """The cell ended cleanly on every rank: tidy it away and keep the default group for the next one."""


@dataclass(frozen=True)
class Left:
    seconds: float  # how long tidying the cell away took
