"""The controller's side of the rank templates (`rank.template`): start them once, fork ranks from them.

A template is the pool's child; the ranks it forks are the template's children, so the controller
learns of a rank's exit from its template (`Exited`), and `ForkedRank` offers the part of
`subprocess.Popen` the pool uses (pid, poll, returncode, wait).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from multiprocessing import Pipe
from multiprocessing.connection import Connection
from multiprocessing.reduction import send_handle
from pathlib import Path

from ..core.messages import Exited, Fork, Forked, Stop, TemplateReady

#: A template is broken if it does not answer a fork request this fast (a fork takes milliseconds).
FORK_TIMEOUT_S = 30.0
POLL_S = 0.05


def describe_exit(returncode: int) -> str:
    """A process's end as `subprocess` reports it (negative: the signal), in words."""
    if returncode < 0:
        return f"killed by signal {signal.Signals(-returncode).name}"
    return f"exited with code {returncode}"


class TemplateError(RuntimeError):
    """A template could not start or stopped answering."""


class Template:
    """One rank slot's template process. A template whose frameworks leave a thread is refused (another
    thread's locks would stay held in every fork); one whose user modules do is replaced by the pool."""

    def __init__(self, rank: int, env: dict[str, str], preload: list[str], user_modules: list[str],
                 log_path: Path) -> None:
        self.rank = rank
        self.log_path = log_path
        self.exits: dict[int, int] = {}
        self._conn, child_end = Pipe()
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pytest_freezecompat.rank.template", str(child_end.fileno()),
                 ",".join(preload), ",".join(user_modules)],
                env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                pass_fds=(child_end.fileno(),), start_new_session=True)
        child_end.close()
        self.unreadable = False  # set when a read was interrupted: exits are then told by /proc

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_ready(self, deadline: float) -> TemplateReady:
        while not self._conn.poll(0.2):
            if not self.alive:
                raise TemplateError(describe_exit(self.proc.returncode))
            if time.monotonic() > deadline:
                raise TemplateError("silent while importing")
        message = self._conn.recv()
        if not isinstance(message, TemplateReady):
            raise TemplateError(f"sent {type(message).__name__} before it was ready")
        if message.threads > 1 and message.threads_from is None:  # a fork copies only the calling thread
            names = ", ".join(message.other_threads)
            raise TemplateError(f"runs {message.threads} threads after its imports ({names}); "
                                "it cannot fork ranks safely")
        return message

    def _take(self, message: object) -> object:
        if isinstance(message, Exited):
            self.exits[message.pid] = message.returncode
        return message

    def drain(self) -> None:
        """Read what the template said (exits) without waiting."""
        if self.unreadable:
            return
        try:
            while self._conn.poll(0):
                self._take(self._conn.recv())
        except (EOFError, OSError):
            pass
        except KeyboardInterrupt:  # Ctrl-C mid-message: the rest of the stream cannot be trusted (a read could block)
            self.unreadable = True
            raise

    def fork(self, request: Fork) -> tuple[ForkedRank, Connection]:
        """A fresh rank and the controller's end of its pipe."""
        parent_end, child_end = Pipe()
        try:
            self._conn.send(request)
            send_handle(self._conn, child_end.fileno(), self.proc.pid)
            deadline = time.monotonic() + FORK_TIMEOUT_S
            while True:
                if not self._conn.poll(POLL_S):
                    if not self.alive or time.monotonic() > deadline:
                        raise TemplateError("did not fork a rank")
                    continue
                message = self._take(self._conn.recv())
                if isinstance(message, Forked):
                    return ForkedRank(message.pid, self), parent_end
        except (EOFError, OSError) as exc:
            parent_end.close()
            raise TemplateError(f"lost while forking a rank ({exc})") from exc
        except KeyboardInterrupt:
            self.unreadable = True
            raise
        finally:
            child_end.close()

    def stop(self) -> None:
        try:
            self._conn.send(Stop())
        except OSError:
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self._conn.close()


class ForkedRank:
    """A rank forked by a template, seen through it: what the pool uses of `subprocess.Popen`."""

    def __init__(self, pid: int, template: Template) -> None:
        self.pid = pid
        self.template = template
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.template.drain()
            if self.pid in self.template.exits:
                self.returncode = self.template.exits.pop(self.pid)
            elif ((not self.template.alive or self.template.unreadable)
                  and not Path(f"/proc/{self.pid}").exists()):
                # The template died first (the rank's watchdog then killed its process group) or can no
                # longer be read: gone, by SIGKILL (the pool's, or the watchdog's).
                self.returncode = -signal.SIGKILL
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"rank {self.pid}", timeout or 0)
            time.sleep(0.01)
        assert self.returncode is not None
        return self.returncode
