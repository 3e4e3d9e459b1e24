"""A rank slot's template: import torch and the frameworks once, then fork a fresh rank whenever asked.

Started by the controller's pool as `python -m pytest_freezecompat.rank.template FD PRELOAD USER_MODULES`,
one per rank slot, with that slot's environment (RANK, LOCAL_RANK, ...). A (re)start of the pool forks each
rank from its template in milliseconds instead of spawning an interpreter that re-imports everything
(seconds; ColossalAI or Megatron ~6-10 s here).

Why forking is safe here: the template runs one thread (it checks, and reports the count; the pool
refuses to fork from a template with more), has initialised no CUDA (nothing here touches a device),
made no process group, store or socket, and its only open files are its log and its pipe. Inductor's
compile-worker pool (started by some imports) is off (`TORCHINDUCTOR_COMPILE_THREADS=1` in the pool's
environment). Each forked rank gets its own session and process group, its own temp dir, log and stack
file, and its own pipe to the controller (passed over the template's pipe as a file descriptor).
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import os
import shutil
import signal
import sys
import tempfile
import threading
import traceback
from multiprocessing.connection import Connection, wait
from multiprocessing.reduction import recv_handle
from pathlib import Path
from typing import NoReturn

from ..core.messages import CONTROLLER_PID, GPU_VISIBLE, Exited, Fork, Forked, Stop, TemplateReady

#: How often the template checks that its controller is still its parent.
WATCHDOG_S = 0.5


def _warm_up() -> None:
    """Do once what every fresh rank would do first and slowly: a meta-device init goes through torch._refs
    and loads dynamo (~0.4 s in each new process); checkpointed forward/backward, AdamW and clipping have
    first-use costs of their own. On the CPU only, with no process group: nothing here may be shared state.
    Where a GPU is visible, no backward: the first one starts autograd's thread for each device (and CUDA's own),
    which a fork does not copy, and a forked rank's backward then refuses to run (PyTorch's "Autograd and Fork")."""
    import torch

    from .. import models
    from .reference import tiny_loss

    meta = models.build("tiny-gpt", seed=0, features=("lora", "vision"), device="meta", initialize=False)
    meta.to_empty(device="cpu")
    if os.environ.get(GPU_VISIBLE) == "1":  # asked in the controller: here even NVML would start a thread
        return
    for mode in models.CHECKPOINT_MODES:
        model = models.build("tiny-gpt", seed=0, features=("lora",))
        models.apply_checkpointing(model, mode)
        optimizer = torch.optim.AdamW(model.parameters())
        tiny_loss(model, models.make_batches("tiny-gpt", seed=0, steps=1, global_batch=2)[0]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()


#: Threads a fork may leave behind: jemalloc's background thread (some wheels' allocator, seen on a GPU machine's
#: image) is stopped and its state reset in the child by jemalloc's own fork handler (src/background_thread.c,
#: `background_thread_postfork_child`: "reset to disabled for child"), so a rank forked beside it starts clean.
FORK_SAFE_THREADS = frozenset({"jemalloc_bg_thd"})


def _other_thread_names() -> tuple[str, ...]:
    """The names of this process's threads but the calling one and those a fork may leave (`FORK_SAFE_THREADS`)."""
    me = str(threading.get_native_id())
    tasks = Path("/proc/self/task")
    names = []
    for task in sorted(tasks.iterdir()) if tasks.is_dir() else ():
        if task.name != me:
            with contextlib.suppress(OSError):
                names.append((task / "comm").read_text().strip())
    return tuple(name for name in names if name not in FORK_SAFE_THREADS)


def _threads() -> int:
    """This process's threads that a fork would lose, the calling one included."""
    return 1 + len(_other_thread_names())


def _become_rank(request: Fork, rank_fd: int, closing: list[int]) -> NoReturn:
    """In the forked child: a session, files and environment of its own, then the rank's loop; never returns."""
    code = 0
    try:
        for fd in closing:
            os.close(fd)
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.setsid()
        log = os.open(request.log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.environ.update(request.env)
        os.makedirs(request.env["TMPDIR"], exist_ok=True)
        tempfile.tempdir = None  # tempfile reads TMPDIR again
        from . import main

        main.serve(Connection(rank_fd), request.stack_path, request.phase_path)
    except BaseException:  # whatever it is, the log says it and the exit code shows it
        traceback.print_exc()
        code = 1
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _reap(conn: Connection, children: set[int]) -> None:
    """Tell the controller about every rank that ended (it is not their parent and cannot wait for them)."""
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        children.discard(pid)
        conn.send(Exited(pid, os.waitstatus_to_exitcode(status)))


def _end(children: set[int], pool_folder: Path | None) -> NoReturn:
    """Take every forked rank (and its helpers: each leads its own process group) down with the template."""
    for pid in children:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
    if pool_folder is not None:
        shutil.rmtree(pool_folder, ignore_errors=True)
    os._exit(0)


def _import_user_modules(names: list[str]) -> str | None:
    """Import users' `@freeze_case` modules (and what they import: transformers, peft...) so that forks have
    them; the first one that leaves a thread running stops this (returned: the pool then does without)."""
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as exc:  # the cell that needs it reports the error itself
            print(f"preload of {name} failed: {exc!r}", file=sys.stderr)
        if _threads() > 1:
            return name
    return None


def serve(conn: Connection, preload: list[str], user_modules: list[str]) -> NoReturn:
    import torch

    from . import main  # noqa: F401 - the rank's own modules, imported once for every fork

    torch.set_num_threads(1)
    for name in preload:
        try:
            module = importlib.import_module(name)
            if hasattr(module, "warm_up"):  # an adapter's own first uses (`adapters.base`: the contract)
                module.warm_up()
        except Exception as exc:  # the cell that needs it reports the import error itself
            print(f"preload of {name} failed: {exc!r}", file=sys.stderr)
    _warm_up()
    threads_from = _import_user_modules(user_modules) if _threads() == 1 else None
    # What the imports made lives as long as every rank: out of the collector's sight, so a full collection
    # (each cell's tidy, and the automatic ones) scans only what a cell made. With a framework imported
    # one took ~0.1-0.35 s, most of a warm cell's time. Frozen before the fork, it stays shared too.
    gc.freeze()
    conn.send(TemplateReady(_other_thread_names(), threads_from))

    controller = int(os.environ[CONTROLLER_PID])
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a rank's exit wakes the loop below at once
    children: set[int] = set()
    pool_folder: Path | None = None
    stopped = False
    try:
        while os.getppid() == controller and not stopped:
            ready = wait([conn, wake_read], timeout=WATCHDOG_S)
            if wake_read in ready:
                os.read(wake_read, 512)
            _reap(conn, children)
            if conn not in ready:
                continue
            message = conn.recv()
            stopped = isinstance(message, Stop)
            if isinstance(message, Fork):
                rank_fd = recv_handle(conn)
                pool_folder = Path(message.log_path).parent
                pid = os.fork()
                if pid == 0:
                    _become_rank(message, rank_fd, [conn.fileno(), wake_read, wake_write])
                os.close(rank_fd)
                children.add(pid)
                conn.send(Forked(pid))
    except (EOFError, OSError):  # the pipe closed: the controller is gone, even if we are not reparented yet
        pass
    # Stopped by the pool (which removes its folder), or the controller is gone, whatever ended it: nothing of
    # ours outlives it.
    _end(children, None if stopped else pool_folder)


if __name__ == "__main__":
    serve(Connection(int(sys.argv[1])), *([m for m in arg.split(",") if m] for arg in sys.argv[2:4]))
