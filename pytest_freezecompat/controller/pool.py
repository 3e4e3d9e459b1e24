"""Warm rank processes: start once, serve cell after cell, and survive hangs and crashes.

A fresh launch costs seconds (torch alone ~1.3 s here, the big frameworks far
more); a warm rank runs a cell in a fraction of that. Ranks are forked from one
template per rank slot that imported everything once (`rank.template`), so a
restart takes milliseconds, not a new interpreter. Ranks join their default group
at their first cell (keys under the cell's prefix in the pool's rendezvous store,
owned by the controller, listening on loopback only, joined once per rank) and keep
it while cells end cleanly and the ranks agree on the collectives they ran
(`rank.kept`). A cell that errors, hangs, crashes a rank or errors on one rank only
ends with every rank's story; the ranks are then killed (whole process groups, so
framework helper processes go too) and fresh ones forked for the next cell.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

from ..core.board import PhaseBoard
from ..core.cell import Cell
from ..core.messages import (
    CONTROLLER_PID,
    GPU_VISIBLE,
    RENDEZVOUS_PHASE,
    Fork,
    KeepGroup,
    Left,
    Ready,
    Reply,
    RunCell,
    Stop,
)
from ..core.names import short_paths
from ..core.records import WAITING_PHASE, CellRun, Outcome, RankRecord, RankState
from .templates import ForkedRank, Template, TemplateError, describe_exit

#: Framework imports on a busy 2-core machine take up to ~30 s; a rank silent for this long is broken.
STARTUP_TIMEOUT_S = 180.0
#: After one rank reported an error, how long the others get to report theirs before we call them stuck.
#: A peer that raises too (the same refusal, or a collective failing) does so within milliseconds on these
#: tiny models (255 such cells of four error-heavy slices, torch FSDP1, ColossalAI's TorchFSDP and Gemini,
#: Megatron 0.8 PP=2: median 0.6 ms, longest 7 ms); one that waits in a collective for the rank that raised
#: never will (66 Megatron cells waited out a 1 s grace each). The stuck rank's stack is taken either way.
ERROR_GRACE_S = 0.25
#: How long a rank gets to start writing its stack after SIGUSR1 before we read the file.
STACK_DUMP_WAIT_S = 10.0
#: How often the stack files are looked at while a dump starts and finishes (faulthandler writes a small process's
#: stacks in well under a millisecond; a stuck rank's cell waited 0.2 s polls twice, ~0.4 s of every such cell).
STACK_POLL_S = 0.02
#: How often the controller wakes to check for dead ranks while waiting.
POLL_S = 0.2
#: Joining a fresh gloo group takes milliseconds. It used to stall now and then: every fresh TCPStore
#: client formatted its socket address (::ffff:127.0.0.1) with getnameinfo, a reverse DNS query the
#: resolver sometimes waited 5 s or more on. Ranks now connect to the pool's store once, at start-up, so
#: a join does no DNS; a join stuck this long is still retried once, and the retry is counted and reported.
RENDEZVOUS_TIMEOUT_S = 30.0
#: Tidying a clean cell away (its garbage, the groups it made) takes milliseconds; past this the ranks are
#: replaced before the next cell, so a stuck teardown is never blamed on the next cell.
TIDY_TIMEOUT_S = 20.0
LOG_TAIL_LINES = 25
#: A SIGKILLed rank is reaped by its template within milliseconds; past this we go on without its exit code.
KILL_WAIT_S = 5.0


def _gpu_visible() -> bool:
    """Asked here, in the controller: in a template even NVML's device count starts a driver thread."""
    import torch

    return torch.cuda.is_available()


class PoolError(RuntimeError):
    """The pool could not be started: every cell it would serve fails the same way."""


def _loopback_store(timeout_s: float) -> tuple[Any, int]:
    """The pool's rendezvous store, listening on 127.0.0.1 only (torchrun's agent-store role). One per
    pool generation: each rank connects once at start-up, and each cell gets its own key prefix."""
    import torch.distributed as dist

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)
    port = listener.getsockname()[1]
    # The store takes the listening socket over (and closes it when it goes). The libuv server of
    # torch < 2.6 cannot take a socket it did not open, hence the classic server.
    store = dist.TCPStore("127.0.0.1", port, None, True, datetime.timedelta(seconds=timeout_s),
                          wait_for_workers=False, master_listen_fd=listener.detach(), use_libuv=False)
    return store, port


def _tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def refused_alike(records: list[RankRecord]) -> bool:
    """Every rank raised the same exception type in the same phase of the cell (not while joining): a refusal the
    stack made everywhere at once, which leaves the ranks as a clean cell does once the collectives agree and
    `tidy` has run (its groups, garbage and torch globals; a framework's global state sits in context managers
    that exit on the way out, or in the kept state). Replacing the ranks after each such cell cost the next cell
    its first uses in a fresh process: 185 restarts in torch 2.13's 715 cells, each cell after one 1.5-2.6x
    slower than a warm one."""
    errors = [record.raised for record in records]
    return (all(error is not None and error.phase != RENDEZVOUS_PHASE for error in errors)
            and len({(error.type, error.phase) for error in errors if error is not None}) == 1)


def _collectives_disagree(records: list[RankRecord]) -> str | None:
    """Why the ranks' groups cannot be kept: a group on which ranks ran different numbers of collectives
    (a stray one would meet the next cell's first), or None."""
    for name in sorted({name for record in records for name in record.collectives}):
        counts = {record.rank: record.collectives[name] for record in records if name in record.collectives}
        if len(set(counts.values())) > 1:
            ran = ", ".join(f"rank {rank}: {count}" for rank, count in counts.items())
            return f"the ranks ran different numbers of collectives on process group {name} ({ran})"
    return None


#: Memory-backed (tmpfs) where Linux has it: the pool's folder holds its ranks' TMPDIRs, so the round trips' saves
#: (a cell's whole checkpoint, Megatron's with an fsync per file) write to memory, not the disk.
MEMORY_FOLDER = Path("/dev/shm")


def workdir_root() -> str | None:
    """Where a pool makes its folder (logs, stacks, the ranks' TMPDIRs): the caller's TMPDIR where one is set (several
    hosts need a shared one), else memory where the machine has it, else the system's temporary folder."""
    if os.environ.get("TMPDIR") or not (MEMORY_FOLDER.is_dir() and os.access(MEMORY_FOLDER, os.W_OK)):
        return None
    return str(MEMORY_FOLDER)


class RankPool:
    def __init__(self, world_size: int, preload: list[str], user_modules: Sequence[str] = ()) -> None:
        self.world_size = world_size
        self.preload = preload
        #: Modules of users' `@freeze_case` functions: imported in the templates too, unless one leaves a
        #: thread running (then they are left to each rank, as before the templates; `_start_templates`).
        self.user_modules = list(user_modules)
        self._workdir = Path(tempfile.mkdtemp(prefix="freezecompat-pool-", dir=workdir_root()))
        self._templates: list[Template] = []
        self._procs: list[ForkedRank] = []
        self._conns: list[Connection] = []
        self._boards: list[PhaseBoard] = []
        self._generation = 0
        self._cell_index = 0
        self._store: Any = None

    # -- lifecycle -------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.poll() is None for p in self._procs)

    def _paths(self, rank: int) -> tuple[Path, Path]:
        stem = self._workdir / f"gen{self._generation}-rank{rank}"
        return stem.with_suffix(".log"), stem.with_suffix(".stack")

    def _phase_path(self, rank: int) -> Path:
        return self._workdir / f"gen{self._generation}-rank{rank}.phase"

    def _environment(self) -> dict[str, str]:
        return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
                # Inductor's compile-worker pool (a subprocess and a reader thread, started by some imports)
                # would make the template unsafe to fork; the matrix compiles nothing.
                "TORCHINDUCTOR_COMPILE_THREADS": "1",
                GPU_VISIBLE: "1" if _gpu_visible() else "0",
                "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1", "TORCHELASTIC_USE_AGENT_STORE": "True",
                "WORLD_SIZE": str(self.world_size), "LOCAL_WORLD_SIZE": str(self.world_size), "NODE_RANK": "0",
                "GROUP_RANK": "0", "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
                "PYTHONUNBUFFERED": "1", CONTROLLER_PID: str(os.getpid())}

    def _start_templates(self, deadline: float) -> None:
        """One template per rank slot, with the slot's environment, each importing the frameworks once."""
        self._stop_templates()
        env = self._environment()
        self._templates = [Template(rank, {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}, self.preload,
                                    self.user_modules, self._workdir / f"template-rank{rank}.log")
                           for rank in range(self.world_size)]
        for template in self._templates:
            try:
                ready = template.wait_ready(deadline)
            except TemplateError as exc:
                tail = _tail(template.log_path, 5).replace("\n", " | ")
                self._stop_templates()
                raise PoolError(f"rank {template.rank} failed to start ({exc}): {tail}") from None
            if ready.threads_from is not None:  # a user's module started a thread: it cannot be in a template
                self.user_modules = []
                self._start_templates(deadline)
                return

    def _stop_templates(self) -> None:
        for template in self._templates:
            template.stop()
        self._templates = []

    def start(self) -> float:
        """Fork `world_size` fresh ranks from the templates (started first if needed); returns seconds taken."""
        self.close()
        self._generation += 1
        started = time.perf_counter()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        if not self._templates or not all(t.alive for t in self._templates):
            self._start_templates(deadline)
        self._store, port = _loopback_store(STARTUP_TIMEOUT_S)
        for rank, template in enumerate(self._templates):
            log_path, stack_path = self._paths(rank)
            self._boards.append(PhaseBoard.create(self._phase_path(rank), WAITING_PHASE))
            request = Fork({"MASTER_PORT": str(port), "TMPDIR": str(log_path.with_suffix(".tmp"))},
                           str(log_path), str(stack_path), str(self._phase_path(rank)))
            try:
                proc, conn = template.fork(request)
            except TemplateError as exc:
                self.close()
                self._stop_templates()
                raise PoolError(f"rank {rank}'s template {exc}") from None
            self._procs.append(proc)
            self._conns.append(conn)
        for rank, conn in enumerate(self._conns):
            while not conn.poll(POLL_S):
                if self._procs[rank].poll() is not None or time.monotonic() > deadline:
                    why = (describe_exit(self._procs[rank].returncode) if self._procs[rank].poll() is not None
                           else f"silent for {STARTUP_TIMEOUT_S:.0f} s")
                    tail = _tail(self._paths(rank)[0], 5).replace("\n", " | ")
                    self.close()
                    raise PoolError(f"rank {rank} failed to start ({why}): {tail}")
            ready = conn.recv()
            if not isinstance(ready, Ready):
                self.close()
                raise PoolError(f"rank {rank} sent {type(ready).__name__} before it was ready")
        return time.perf_counter() - started

    def restart(self) -> float:
        """Replace the ranks (as after a crash); returns seconds taken."""
        started = time.perf_counter()
        self.close()
        self.start()
        return time.perf_counter() - started

    def shutdown(self) -> None:
        """Close for good: ranks, templates and their log/stack folder."""
        self.close()
        self._stop_templates()
        shutil.rmtree(self._workdir, ignore_errors=True)

    def close(self) -> None:
        for conn in self._conns:
            try:
                conn.send(Stop())
            except OSError:
                pass
        for proc in self._procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            with contextlib.suppress(subprocess.TimeoutExpired):  # its template reports the exit at once
                proc.wait(timeout=KILL_WAIT_S)
        for conn in self._conns:
            conn.close()
        for board in self._boards:
            board.close()
        self._procs, self._conns, self._boards = [], [], []
        self._store = None  # after the ranks are gone: the server stops and its port is released

    # -- one cell ----------------------------------------------------------------------------
    def run(self, cell: Cell, timeout_s: float) -> CellRun:
        notes = []
        for attempt in (1, 2):
            fresh_start_s = None if self.alive else self.start()
            self._cell_index += 1
            states = [RankState(rank) for rank in range(self.world_size)]
            dispatched = time.perf_counter()
            outcome = self._dispatch(cell, states, time.monotonic() + timeout_s)
            dispatch_s = time.perf_counter() - dispatched
            for state, board in zip(states, self._boards):
                state.phase = board.read()
            tidy_s: list[float] = []
            if outcome is Outcome.DONE:
                self._keep_or_replace(states, notes, tidy_s)
            else:
                self._collect_stories(states)
                self.close()
            if outcome is not Outcome.RENDEZVOUS_HANG or attempt == 2:
                break
            notes.append(f"joining the cell's process group hung for {RENDEZVOUS_TIMEOUT_S:.0f} s "
                         "(before the framework ran); pool restarted and the cell retried")
        retries = attempt - 1
        if outcome is Outcome.RENDEZVOUS_HANG:
            outcome = Outcome.TIMEOUT
        return CellRun(outcome, states, fresh_start_s, notes, retries, dispatch_s, tidy_s[0] if tidy_s else None)

    def _dispatch(self, cell: Cell, states: list[RankState], deadline: float) -> Outcome:
        for conn, board in zip(self._conns, self._boards):
            board.write(WAITING_PHASE)  # the rank waits for this cell; its last cell's phase is gone
            conn.send(RunCell(self._cell_index, cell))
        pending = set(range(self.world_size))
        first_error_at: float | None = None
        rendezvous_deadline = time.monotonic() + RENDEZVOUS_TIMEOUT_S
        while pending:
            now = time.monotonic()
            if now > deadline:  # a rank's recorded error outranks the timeout it led to
                return Outcome.TIMEOUT if first_error_at is None else Outcome.STUCK_AFTER_ERROR
            if now > rendezvous_deadline and any(self._boards[r].read() == RENDEZVOUS_PHASE for r in pending):
                return Outcome.RENDEZVOUS_HANG
            if first_error_at is not None and now - first_error_at > ERROR_GRACE_S:
                return Outcome.STUCK_AFTER_ERROR
            # after an error, wake when the grace ends (not a whole poll later)
            left = POLL_S if first_error_at is None else first_error_at + ERROR_GRACE_S - now
            ready = wait([self._conns[r] for r in pending], timeout=max(0.0, min(POLL_S, left)))
            for conn in ready:
                rank = self._conns.index(conn)
                try:
                    message = conn.recv()
                except (EOFError, OSError):
                    self._procs[rank].wait(timeout=5)
                    return Outcome.CRASH
                if isinstance(message, Reply):
                    states[rank].record = message.record
                    pending.discard(rank)
                    if message.record.raised is not None and first_error_at is None:
                        first_error_at = time.monotonic()
            if any(self._procs[r].poll() is not None for r in pending):
                return Outcome.CRASH
        return Outcome.DONE

    def _keep_or_replace(self, states: list[RankState], notes: list[str], tidy_s: list[float]) -> None:
        """After a finished cell: keep the ranks (and their default group) if it ended cleanly on every rank, or
        every rank refused it alike (`refused_alike`), and they agree on the collectives they ran; else replace
        them before the next cell (a fork)."""
        records = [state.record for state in states if state.record is not None]
        if any(record.raised is not None for record in records) and not refused_alike(records):
            self.close()
            return
        disagreement = _collectives_disagree(records)
        problem = disagreement or self._not_tidied(tidy_s)
        if problem:
            notes.append(f"{problem}; the ranks were replaced before the next cell")
            self.close()

    def _not_tidied(self, seconds: list[float]) -> str | None:
        """Ask every rank to tidy the cell away and wait for its Left; None when all did, else what went wrong
        (every rank's part: one rank dying makes a peer's tidy fail too). Each rank's time is appended to `seconds`."""
        for conn in self._conns:
            conn.send(KeepGroup())
        deadline = time.monotonic() + TIDY_TIMEOUT_S
        problems = [problem for rank in range(self.world_size) if (problem := self._tidied(rank, deadline, seconds))]
        return ", ".join(problems) or None

    def _tidied(self, rank: int, deadline: float, seconds: list[float]) -> str | None:
        conn, proc = self._conns[rank], self._procs[rank]
        died = f"rank {rank} {{}} while tidying the cell away"
        while not conn.poll(POLL_S):
            if proc.poll() is not None:
                return died.format(describe_exit(proc.returncode))
            if time.monotonic() > deadline:
                return f"rank {rank} did not tidy the cell away within {TIDY_TIMEOUT_S:.0f} s"
        try:
            message = conn.recv()
        except (EOFError, OSError):
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
            return died.format("closed its pipe" if proc.poll() is None else describe_exit(proc.returncode))
        if not isinstance(message, Left):
            return f"rank {rank} sent {type(message).__name__} instead of tidying the cell away"
        seconds.append(message.seconds)
        return None

    def _collect_stories(self, states: list[RankState]) -> None:
        """Exit codes, Python stacks of live ranks (SIGUSR1 -> faulthandler) and log tails."""
        asked = []
        for state, proc in zip(states, self._procs):
            if proc.poll() is None and state.record is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGUSR1)
                asked.append((proc, self._paths(state.rank)[1]))

        def waiting() -> bool:  # a live rank whose dump has not started (a rank that died meanwhile has none)
            return any(proc.poll() is None and (not path.exists() or path.stat().st_size == 0)
                       for proc, path in asked)

        def sizes() -> list[int]:
            return [path.stat().st_size if path.exists() else 0 for _, path in asked]

        # On a loaded machine a dump can take a while to start; wait for each file, then until none grows.
        deadline = time.monotonic() + STACK_DUMP_WAIT_S
        while waiting() and time.monotonic() < deadline:
            time.sleep(STACK_POLL_S)
        written = None
        while written != (written := sizes()) and time.monotonic() < deadline:
            time.sleep(STACK_POLL_S)
        for state, proc in zip(states, self._procs):
            log_path, stack_path = self._paths(state.rank)
            if proc.poll() is not None:
                state.exit = describe_exit(proc.returncode)
            elif state.record is None:
                state.stack = short_paths(stack_path.read_text(errors="replace")) if stack_path.exists() else ""
            state.log_tail = short_paths(_tail(log_path))
