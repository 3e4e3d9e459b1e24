"""Messages on the pipe between the controller and a rank (our own processes only, never a socket).

  controller -> rank: RunCell | Stop
  rank -> controller: Ready, then per cell: Phase* , Reply, Left (its group torn down)
"""

from __future__ import annotations

from dataclasses import dataclass

from .cell import Cell
from .records import RankRecord

#: The environment variable that gives a rank its controller's pid (a rank ends itself when that parent is gone).
CONTROLLER_PID = "FREEZECOMPAT_CONTROLLER_PID"
#: The phase a rank reports while it joins the cell's fresh process group (the harness, not the framework).
RENDEZVOUS_PHASE = "init process group"


@dataclass(frozen=True)
class RunCell:
    index: int  # unique per pool: the cell's key prefix in the pool's store
    cell: Cell


@dataclass(frozen=True)
class Stop:
    pass


@dataclass(frozen=True)
class Ready:
    pid: int
    import_s: float


@dataclass(frozen=True)
class Phase:
    text: str


@dataclass(frozen=True)
class Reply:
    record: RankRecord


@dataclass(frozen=True)
class Left:
    seconds: float  # how long tearing the cell's group down took
