"""A pool of pre-started child processes that run task functions, killed at their timeout.

Shared by the server's in-process executor and the DB-less agent, so it imports
no Django model and opens no database connection.  Each child is a fresh
interpreter (``python -I agents/runtime/task_child.py``), never a fork of the
server process, which holds database sockets and an event loop; nor does it
re-import the parent's main module, as multiprocessing's spawn would.

Each child serves one task at a time over a socket pair, speaking JSON (never
pickle: a child runs tenant code, and the parent must not unpickle what it writes).
A task that outlives its timeout gets its child SIGKILLed and replaced; so
does a child that dies on its own.  The pool keeps its capacity either way.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Literal

log = logging.getLogger(__name__)

# The child runs this file as a script: nothing of the server is importable in it.
CHILD_SCRIPT = str(Path(__file__).with_name("task_child.py"))
# A freshly started child must answer its first ping within this long.
CHILD_BOOT_TIMEOUT_S = 60.0
# How long close() waits for an idle child to exit before killing it.
CHILD_EXIT_GRACE_S = 2.0

Status = Literal["success", "failure", "timeout"]


@dataclass
class RunOutcome:
    status: Status
    output: dict | None = None
    error_type: str = ""
    error_message: str = ""
    traceback: str = ""
    duration_s: float = 0.0


class TaskRunnerClosed(RuntimeError):
    """run() was called on a runner that is not started or already closed."""


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "the task worker process stopped answering"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"the task worker process was killed by {name}"
    return f"the task worker process exited with status {code}"


class _Slot:
    """One child process and the parent's end of the socket pair it talks over."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.process: subprocess.Popen | None = None
        self.conn: Connection | None = None
        self.fresh = False  # started but not yet known to answer

    def spawn(self) -> None:
        parent_sock, child_sock = socket.socketpair()
        try:
            # -I: the child sees neither the server's working directory nor PYTHON* variables,
            # only the interpreter's own site-packages plus the package's workflow/ and vendor/.
            self.process = subprocess.Popen(
                [sys.executable, "-I", CHILD_SCRIPT, str(child_sock.fileno()), str(os.getpid())],
                pass_fds=[child_sock.fileno()],
                stdin=subprocess.DEVNULL,
                close_fds=True,
            )
        finally:
            child_sock.close()
        self.conn = Connection(parent_sock.detach())
        self.fresh = True

    def wait_ready(self, timeout_s: float) -> None:
        """Ping the child so its boot time never counts against a task's timeout."""
        self.conn.send_bytes(b'{"op":"ping"}')
        if not self.conn.poll(timeout_s):
            raise RuntimeError(f"task worker {self.index} did not start within {timeout_s:g}s")
        reply = json.loads(self.conn.recv_bytes())
        if reply.get("op") != "pong":
            raise RuntimeError(f"task worker {self.index} answered {reply!r} to a ping")
        self.fresh = False

    def kill(self) -> int | None:
        """SIGKILL the child (if still alive), reap it and return its exit status."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            try:
                os.kill(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        code = self.process.wait()
        self.conn.close()
        self.process = self.conn = None
        return code

    def stop(self) -> None:
        """Let an idle child exit on EOF; kill it if it does not."""
        if self.process is None:
            return
        self.conn.close()
        try:
            self.process.wait(CHILD_EXIT_GRACE_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process = self.conn = None


class TaskRunner:
    """``workers`` child processes; ``await run(...)`` runs one task on a free one."""

    def __init__(self, workers: int) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.capacity = workers
        self._slots = [_Slot(i) for i in range(workers)]
        self._free: queue.SimpleQueue[_Slot | None] = queue.SimpleQueue()
        # One thread per slot does the blocking pipe I/O; the event loop never blocks.
        self._threads: ThreadPoolExecutor | None = None
        self._busy = 0
        self._lock = threading.Lock()
        self._started = False

    @property
    def busy(self) -> int:
        """Tasks running or waiting for a slot right now."""
        return self._busy

    def child_pids(self) -> list[int]:
        """Process ids of the live children (for metrics and tests)."""
        return [s.process.pid for s in self._slots if s.process is not None]

    def start(self) -> None:
        """Start every child and wait until each answers (fails loudly if one cannot start)."""
        if self._started:
            return
        for slot in self._slots:
            slot.spawn()
        for slot in self._slots:
            slot.wait_ready(CHILD_BOOT_TIMEOUT_S)
            self._free.put(slot)
        self._threads = ThreadPoolExecutor(self.capacity, thread_name_prefix="task-runner")
        self._started = True

    def close(self) -> None:
        """Stop every child; a task still running is killed (its outcome: TaskRunnerClosed).

        Idempotent.  Idle children exit on EOF; busy ones are SIGKILLed and the
        thread that owns them reaps them.
        """
        if not self._started:
            return
        self._started = False
        idle = []
        while True:
            try:
                slot = self._free.get_nowait()
            except queue.Empty:
                break
            if slot is not None:
                idle.append(slot)
        self._free.put(None)  # wakes any run waiting for a slot: the runner is closed
        for slot in self._slots:
            process = slot.process  # read once: the owning thread may be reaping it
            if slot in idle:
                slot.stop()
            elif process is not None and process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGKILL)
        if self._threads is not None:
            self._threads.shutdown(wait=True)

    async def run(
        self, package_dir: Path, function: str, context_json: str, timeout_s: float
    ) -> RunOutcome:
        """Run ``function`` ("module:function") of the package unpacked at ``package_dir``."""
        if not self._started or self._threads is None:
            raise TaskRunnerClosed("the task runner is not running")
        request = json.dumps(
            {
                "op": "run",
                "package_dir": str(package_dir),
                "function": function,
                "context_json": context_json,
            }
        ).encode()
        with self._lock:
            self._busy += 1
        try:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._threads, self.run_sync, request, timeout_s)
        finally:
            with self._lock:
                self._busy -= 1

    def run_sync(self, request: bytes, timeout_s: float) -> RunOutcome:
        """Blocking: take a free slot, run, give the slot back (replaced if it had to die)."""
        slot = self._free.get()
        if slot is None:
            self._free.put(None)
            return RunOutcome("failure", None, "TaskRunnerClosed", "the task runner was closed")
        try:
            if slot.fresh:
                slot.wait_ready(CHILD_BOOT_TIMEOUT_S)
            return self._exchange(slot, request, timeout_s)
        except Exception as exc:  # a broken pipe, a child that never booted: keep the slot usable
            log.exception("task worker %s failed; replacing it", slot.index)
            self._replace(slot)
            return RunOutcome("failure", None, "WorkerCrashed", f"task worker failed: {exc}")
        finally:
            if self._started:
                self._free.put(slot)
            else:
                slot.stop()

    def _exchange(self, slot: _Slot, request: bytes, timeout_s: float) -> RunOutcome:
        started = time.monotonic()
        slot.conn.send_bytes(request)
        if not slot.conn.poll(max(timeout_s, 0.0)):
            self._replace(slot)
            return RunOutcome(
                "timeout",
                None,
                "TaskTimeout",
                f"task exceeded its {timeout_s:g}s timeout",
                "",
                time.monotonic() - started,
            )
        try:
            raw = slot.conn.recv_bytes()
        except (EOFError, OSError):
            closing = not self._started  # close() killed it, the task did not crash
            code = self._replace(slot)
            if closing:
                return RunOutcome(
                    "failure",
                    None,
                    "TaskRunnerClosed",
                    "the task runner was closed while the task ran",
                    "",
                    time.monotonic() - started,
                )
            return RunOutcome(
                "failure",
                None,
                "WorkerCrashed",
                f"{_describe_exit(code)} while running the task",
                "",
                time.monotonic() - started,
            )
        duration = time.monotonic() - started
        reply = json.loads(raw)
        if reply["status"] == "success":
            return RunOutcome("success", json.loads(reply["output_json"]), duration_s=duration)
        return RunOutcome(
            "failure",
            None,
            reply.get("error_type", "Error"),
            reply.get("error_message", ""),
            reply.get("traceback", ""),
            duration,
        )

    def _replace(self, slot: _Slot) -> int | None:
        code = slot.kill()
        if self._started:
            slot.spawn()
        return code

    def __enter__(self) -> TaskRunner:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
