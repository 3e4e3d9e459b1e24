"""The rank's loop: receive a cell over the pool's pipe, join the default group (or keep it), run it, reply.

Forked by its slot's template (`rank.template`), in its own process session so the pool can kill the
rank with every helper it spawned. The messages on the pipe are `core.messages` (our own processes only).
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import signal
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

from ..core.board import PhaseBoard
from ..core.messages import RENDEZVOUS_PHASE, KeepGroup, Left, Ready, Reply, RunCell
from ..core.records import RankRecord
from .kept import KeptState, collectives, tidy
from .scenario import describe_error, run_cell

#: A collective that waits longer than this is stuck; the controller's cell deadline fires first.
PROCESS_GROUP_TIMEOUT_S = 600
#: How often a rank checks that its template is still its parent.
WATCHDOG_S = 0.5


def _device_for(cell_device: str, local_rank: int) -> torch.device:
    if cell_device == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _connect_store() -> dist.Store:
    """This rank's client of the pool's store, made once at start-up. A fresh TCPStore client per cell
    stalled a join for 5 s now and then: c10d formats the new socket's address with getnameinfo, a
    reverse DNS query for ::ffff:127.0.0.1 that /etc/hosts does not answer."""
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None, False,
                         datetime.timedelta(seconds=PROCESS_GROUP_TIMEOUT_S))


def _init_group(backend: str, device: torch.device, store: dist.Store, index: int) -> None:
    kwargs: dict[str, Any] = {"timeout": datetime.timedelta(seconds=PROCESS_GROUP_TIMEOUT_S)}
    if device.type == "cuda":
        kwargs["device_id"] = device
    # Each cell's keys live under their own prefix (torchrun's per-attempt prefix on its agent store).
    dist.init_process_group(backend, store=dist.PrefixStore(f"/cell_{index}", store),
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]), **kwargs)


def _run_one(board: PhaseBoard, message: RunCell, store: dist.Store, kept: KeptState) -> RankRecord:
    """Join the default group unless this rank kept it from its last cell, then run the cell."""
    rank = int(os.environ["RANK"])
    os.environ["TORCHELASTIC_RESTART_COUNT"] = str(message.index)
    started = time.perf_counter()
    try:
        device = _device_for(message.cell.device, int(os.environ["LOCAL_RANK"]))
        group_kept = dist.is_initialized()
        if not group_kept:
            board.write(RENDEZVOUS_PHASE)
            _init_group("nccl" if device.type == "cuda" else "gloo", device, store, message.index)
        joined_s = time.perf_counter() - started
        board.write("process group ready")
        record = run_cell(message.cell, rank, device, board.write, kept)
        record.phases_s["join"] = joined_s
        record.group_kept = group_kept
        record.collectives = collectives()
        return record
    except Exception as exc:
        return RankRecord(rank=rank, phase=RENDEZVOUS_PHASE, error=describe_error(exc, RENDEZVOUS_PHASE, rank),
                          phases_s={"join": time.perf_counter() - started})


def _end_with_template() -> None:
    """A rank must not outlive its template (which ends with the controller, whatever ended it, SIGKILL
    included), even while busy in a cell: a thread watches the parent; when it is gone, it kills this rank's
    process group (the rank leads its own session, so the framework's helper processes go too)."""
    template = os.getppid()

    def watch() -> None:
        while os.getppid() == template:
            time.sleep(WATCHDOG_S)
        os.killpg(os.getpgrp(), signal.SIGKILL)

    threading.Thread(target=watch, name="freezecompat-watchdog", daemon=True).start()


def serve(conn: Connection, stack_file: str, phase_file: str) -> None:
    """The rank's life, in a process just forked from its slot's template (imports done)."""
    _end_with_template()
    faulthandler.enable()  # a segfault prints every thread's stack into the rank's log
    with open(stack_file, "w") as stacks:
        faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
        store = _connect_store()
        kept = KeptState()
        board = PhaseBoard.open(phase_file)
        conn.send(Ready())
        while True:
            try:
                message = conn.recv()
            except EOFError:
                return
            if not isinstance(message, RunCell):  # Stop
                return
            conn.send(Reply(_run_one(board, message, store, kept)))
            # Kept after a clean cell or a refusal alike on every rank (else the controller forks a fresh one).
            if not isinstance(conn.recv(), KeepGroup):
                return
            started = time.perf_counter()
            tidy(kept)
            conn.send(Left(time.perf_counter() - started))
