"""A pool of pre-started child processes that run task functions, killed at their timeout.

Shared by the server's in-process executor and the DB-less agent, so it imports
no Django model and opens no database connection.  Each child is a fresh
interpreter (``python -I agents/sandbox/task_child.py``), never a fork of the
server process, which holds database sockets and an event loop; nor does it
re-import the parent's main module, as multiprocessing's spawn would.

Each child serves one task at a time over a socket pair, speaking JSON (never
pickle: a child runs tenant code, and the parent must not unpickle what it writes).
A child inherits an allow-listed environment only, and when the parent is root it
runs as an unprivileged user (:mod:`agents.sandbox.task_isolation`).
A task that outlives its timeout gets its child SIGKILLed and replaced; so
does a child that dies on its own.  The pool keeps its capacity either way.

What a task prints (stdout, stderr, ``logging``) goes into one pipe per child, which
the parent reads on its event loop while the task runs, into the run's bounded
:class:`~agents.sandbox.task_log.LogRing`: the log survives a task that times out or
crashes its child, and the caller can tail it while the task runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import struct
import subprocess
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from agents.sandbox.task_child import take_frame
from agents.sandbox.task_isolation import (
    TaskUser,
    task_environment,
    task_python,
    task_user,
    unreachable_for,
)
from agents.sandbox.task_limits import ChildLimits
from agents.sandbox.task_log import LogRing, TaskLog, task_log_bytes

# Not `log`: TaskRunner.run has a parameter of that name (the run's LogRing), which hid the
# module logger there and turned a dead child's broken socket into an AttributeError.
logger = logging.getLogger(__name__)

# The child runs this file as a script: nothing of the server is importable in it.
CHILD_SCRIPT = str(Path(__file__).with_name("task_child.py"))
# A freshly started child must answer its first ping within this long.
CHILD_BOOT_TIMEOUT_S = 60.0
# How long close() waits for an idle child to exit before killing it.
CHILD_EXIT_GRACE_S = 2.0
# One read of a child's output pipe, and how many such reads draining it may take: a
# child's background thread (or a process it left behind) printing without end must not
# keep the parent in a loop.
OUTPUT_READ_BYTES = 64 * 1024
OUTPUT_DRAIN_READS = 64
# How long a run goes before its output is read as it comes (until then it waits in the
# pipe, 64 KiB at most, and is read after the reply).
OUTPUT_WATCH_AFTER_S = 0.05
# One read of a child's replies (a larger one, a big output, takes several).
RECV_BYTES = 256 * 1024

Status = Literal["success", "failure", "timeout"]


@dataclass
class RunOutcome:
    status: Status
    output: dict | None = None
    error_type: str = ""
    error_message: str = ""
    traceback: str = ""
    duration_s: float = 0.0
    output_bytes: int = 0  # the output's JSON text, as the child sent it
    log: TaskLog | None = None  # what the attempt printed (bounded), when it ran at all


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
        if name == "SIGXCPU":  # RLIMIT_CPU (agents/sandbox/task_limits.py)
            return "the task worker process exceeded its CPU time limit (SIGXCPU)"
        return f"the task worker process was killed by {name}"
    return f"the task worker process exited with status {code}"


@dataclass(frozen=True)
class _Launch:
    """How every child of one runner is started: interpreter, environment, user."""

    python: str
    env: dict
    user: TaskUser | None
    limits: ChildLimits | None = None

    def user_kwargs(self) -> dict:
        return self.user.popen_kwargs() if self.user is not None else {}

    def denied(self, exc: OSError) -> str:
        who = "this user" if self.user is None else f"{self.user.name} (uid {self.user.uid})"
        return (
            f"task worker could not start as {who}: {exc}; it must be able to run "
            f"{self.python} and read {CHILD_SCRIPT} (set CLOACINA_TASK_PYTHON to an "
            "interpreter it can run, or open the directories on the way)"
        )


_FROM_ENVIRONMENT = object()


class _Slot:
    """One child process and the parent's end of the socket pair it talks over.

    Frames are ``multiprocessing.connection``'s (a 4-byte big-endian length, or -1 and
    an 8-byte one, then the bytes): the child reads them with ``Connection.recv_bytes``.
    The parent speaks them itself on a non-blocking socket, through the event loop: a
    run costs no thread hop (that hop was a quarter of an agent's CPU per task).
    """

    def __init__(self, index: int, launch: _Launch) -> None:
        self.index = index
        self.launch = launch
        self.process: subprocess.Popen | None = None
        self.sock: socket.socket | None = None
        self.output: int | None = None  # read end of the child's stdout+stderr pipe
        self._watching: asyncio.AbstractEventLoop | None = None
        self._inbox = bytearray()  # bytes read from the child past the last whole frame
        self.fresh = False  # started but not yet known to answer
        # The socket's reader, registered once per child on the loop that runs its tasks
        # (and the thread that runs that loop), not once per reply: uvloop's sock_recv makes
        # and drops a libuv poll handle per call (6 epoll_ctl and an ioctl per task).
        self._reader: asyncio.AbstractEventLoop | None = None
        self._reader_thread: int | None = None
        self._waiter: asyncio.Future | None = None  # a recv() waiting for a whole frame
        self._broken: BaseException | None = None  # EOF or the error that ended the socket

    def spawn(self) -> None:
        parent_sock, child_sock = socket.socketpair()
        output, child_output = os.pipe()
        try:
            # -I: the child sees neither the server's working directory nor PYTHON* variables,
            # only the interpreter's own site-packages plus the package's workflow/ and vendor/.
            self.process = subprocess.Popen(
                [
                    self.launch.python,
                    "-I",
                    CHILD_SCRIPT,
                    str(child_sock.fileno()),
                    str(os.getpid()),
                    # Applied by the child to itself before it answers its first ping.
                    *([self.launch.limits.child_argument()] if self.launch.limits else []),
                ],
                pass_fds=[child_sock.fileno()],
                stdin=subprocess.DEVNULL,
                stdout=child_output,
                stderr=child_output,
                close_fds=True,
                env=self.launch.env,
                **self.launch.user_kwargs(),
            )
        except PermissionError as exc:
            parent_sock.close()
            os.close(output)
            raise RuntimeError(self.launch.denied(exc)) from exc
        except BaseException:
            parent_sock.close()
            os.close(output)
            raise
        finally:
            child_sock.close()
            os.close(child_output)
        os.set_blocking(output, False)
        parent_sock.setblocking(False)
        self.sock, self.output = parent_sock, output
        self._inbox = bytearray()
        self._broken = None
        self.fresh = True

    def read_output(self, ring: LogRing | None, reads: int = OUTPUT_DRAIN_READS) -> None:
        """Move what the child wrote into ``ring`` (None: discard it), without blocking."""
        for _ in range(reads):
            try:
                data = os.read(self.output, OUTPUT_READ_BYTES)
            except OSError:  # BlockingIOError: nothing more for now
                return
            if not data:
                return  # EOF: the child (and whatever it started) has closed it
            if ring is not None:
                ring.append(data)

    def watch_output(self, ring: LogRing) -> None:
        """Read the child's output into ``ring`` whenever there is some (this event loop)."""
        self._watching = asyncio.get_running_loop()
        self._watching.add_reader(self.output, self.read_output, ring, 1)

    def unwatch_output(self) -> None:
        if self._watching is not None and self.output is not None:
            self._watching.remove_reader(self.output)
        self._watching = None

    def close_output(self) -> None:
        # Unwatched first: the descriptor's number is reused by the next child's pipe.
        self.unwatch_output()
        if self.output is not None:
            os.close(self.output)
            self.output = None

    def wait_ready(self, timeout_s: float) -> None:
        """Ping the child, blocking (at start), so its boot never counts against a task."""
        sock = self.sock
        sock.setblocking(True)
        sock.settimeout(timeout_s)
        try:
            sock.sendall(encode_frame(b'{"op":"ping"}'))
            reply = json.loads(_recv_frame_blocking(sock))
        except (TimeoutError, OSError, EOFError) as exc:
            raise RuntimeError(
                f"task worker {self.index} did not start within {timeout_s:g}s"
            ) from exc
        finally:
            sock.settimeout(None)
            sock.setblocking(False)
        if reply.get("op") != "pong":
            raise RuntimeError(f"task worker {self.index} answered {reply!r} to a ping")
        self.fresh = False

    async def wait_ready_async(self, timeout_s: float) -> None:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout_s):
                await loop.sock_sendall(self.sock, encode_frame(b'{"op":"ping"}'))
                reply = json.loads(await self.recv())
        except TimeoutError:
            raise RuntimeError(
                f"task worker {self.index} did not start within {timeout_s:g}s"
            ) from None
        if reply.get("op") != "pong":
            raise RuntimeError(f"task worker {self.index} answered {reply!r} to a ping")
        self.fresh = False

    async def send(self, data: bytes, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """``loop``: the running loop, when the caller has it (each look-up is a getpid).

        A request goes straight into the socket: an idle child's buffer takes a small one
        whole, so no ``sock_sendall`` coroutine (and its loop look-up) is made per task.
        What the buffer does not take (a large context) goes the loop's way, in order."""
        frame = encode_frame(data)
        try:
            sent = self.sock.send(frame)
        except (BlockingIOError, InterruptedError):
            sent = 0
        if sent < len(frame):
            rest = memoryview(frame)[sent:]
            await (loop or asyncio.get_running_loop()).sock_sendall(self.sock, rest)

    async def recv(self, loop: asyncio.AbstractEventLoop | None = None) -> bytes:
        """One frame from the child; EOFError when its end is closed (it died).

        The child writes a small reply as one write (header and body together), so one
        read takes it whole.  The read is done by the slot's reader (:meth:`_on_readable`),
        registered on this loop at the first reply and kept until the child goes.
        """
        frame = take_frame(self._inbox)
        if frame is not None:
            return frame
        if self._broken is not None:
            raise self._broken
        loop = loop or asyncio.get_running_loop()
        if self._reader is not loop:
            self._unregister_reader()  # a runner driven from another loop before
            loop.add_reader(self.sock, self._on_readable)
            self._reader, self._reader_thread = loop, threading.get_ident()
        self._waiter = loop.create_future()
        try:
            return await self._waiter
        finally:
            self._waiter = None

    def expire(self) -> None:
        """The run's timeout (:class:`_RunClock`): the waiting recv() raises TimeoutError."""
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(TimeoutError())

    def _on_readable(self) -> None:
        """The reader: what the child wrote goes into the inbox; a whole frame to recv()."""
        try:
            chunk = self.sock.recv(RECV_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._break(exc)
            return
        if not chunk:
            self._break(EOFError("the task worker closed its end"))
            return
        self._inbox += chunk
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            frame = take_frame(self._inbox)
            if frame is not None:
                waiter.set_result(frame)

    def _break(self, exc: BaseException) -> None:
        # Unregistered at once: a closed end stays readable, and the reader would spin.
        self._broken = exc
        self._unregister_reader()
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)

    def _unregister_reader(self) -> None:
        """Take the socket's reader off its loop, on that loop's thread: closing the socket
        under a live registration is not safe (uvloop holds the socket open while it is
        registered, and the fd's number is reused by the next child's socket).
        ``TaskRunner.close()`` stops idle children from another thread (``to_thread``), so
        from there the removal is handed to the loop and waited for."""
        loop, self._reader = self._reader, None
        if loop is None or loop.is_closed():
            return  # a closed loop dropped its handles with it
        if self._reader_thread == threading.get_ident() or not loop.is_running():
            loop.remove_reader(self.sock)
            return
        done = threading.Event()
        sock = self.sock

        def remove() -> None:
            try:
                loop.remove_reader(sock)
            finally:
                done.set()

        try:
            loop.call_soon_threadsafe(remove)
        except RuntimeError:
            return  # the loop closed meanwhile
        if not done.wait(CHILD_EXIT_GRACE_S):
            logger.warning("task worker %s: its event loop did not release the socket", self.index)

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
        self._unregister_reader()
        self.sock.close()
        self.close_output()
        self.process = self.sock = None
        return code

    def stop(self) -> None:
        """Let an idle child exit on EOF; kill it if it does not."""
        if self.process is None:
            return
        self._unregister_reader()
        self.sock.close()
        try:
            self.process.wait(CHILD_EXIT_GRACE_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.close_output()
        self.process = self.sock = None


def encode_frame(data: bytes) -> bytes:
    """``data`` framed as ``multiprocessing.connection`` frames it (what the child reads)."""
    if len(data) > 0x7FFFFFFF:
        return struct.pack("!iQ", -1, len(data)) + data
    return struct.pack("!i", len(data)) + data


def _recv_frame_blocking(sock: socket.socket) -> bytes:
    def read(n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = sock.recv(n - len(buf))
            if not chunk:
                raise EOFError("the task worker closed its end")
            buf += chunk
        return bytes(buf)

    (size,) = struct.unpack("!i", read(4))
    if size == -1:
        (size,) = struct.unpack("!Q", read(8))
    return read(size)


class TaskRunner:
    """``workers`` child processes; ``await run(...)`` runs one task on a free one.

    ``start`` and ``close`` are blocking (call them from a thread); ``run`` is a
    coroutine of whichever event loop calls it.
    """

    def __init__(
        self,
        workers: int,
        user: TaskUser | None | object = _FROM_ENVIRONMENT,
        python: str | None = None,
        limits: ChildLimits | None = None,
        fresh_child_per_task: bool = False,
        log_bytes: int | None = None,
    ) -> None:
        """``user``: who children run as (default: CLOACINA_TASK_USER or nobody when this
        process is root, else this process's own user); ``python``: their interpreter
        (default: CLOACINA_TASK_PYTHON or this one); ``limits``: rlimits of every child;
        ``fresh_child_per_task``: retire a child after each task (nothing a task leaves
        behind, CPU seconds used included, reaches the next one); ``log_bytes``: how much
        of each run's output is kept (default: CLOACINA_TASK_LOG_BYTES, 256 KiB)."""
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.capacity = workers
        self.limits = limits
        self.fresh_child_per_task = fresh_child_per_task
        self.log_bytes = task_log_bytes() if log_bytes is None else log_bytes
        self.user: TaskUser | None = task_user() if user is _FROM_ENVIRONMENT else user
        launch = _Launch(python or task_python(), task_environment(), self.user, limits)
        self._slots = [_Slot(i, launch) for i in range(workers)]
        self._lock = threading.Lock()  # close() may come from another thread
        self._free: deque[_Slot] = deque()
        self._waiters: deque[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = deque()
        self._busy = 0
        self._started = False

    @property
    def busy(self) -> int:
        """Tasks running or waiting for a slot right now."""
        return self._busy

    def child_pids(self) -> list[int]:
        """Process ids of the live children (for metrics and tests)."""
        return [s.process.pid for s in self._slots if s.process is not None]

    def require_reachable(self, path: Path, what: str) -> None:
        """Fail now, naming the directory, when the task user cannot enter ``path`` (else
        every task would fail to import its package from there)."""
        if self.user is None:
            return
        blocked = unreachable_for(self.user, path)
        if blocked is not None:
            raise RuntimeError(
                f"{what} {path} is closed to the task user {self.user.name} "
                f"(uid {self.user.uid}): it cannot enter {blocked}; make that directory "
                "searchable by it (chmod o+x) or move the cache"
            )

    def start(self) -> None:
        """Start every child and wait until each answers (fails loudly if one cannot start)."""
        if self._started:
            return
        for slot in self._slots:
            slot.spawn()
        for slot in self._slots:
            slot.wait_ready(CHILD_BOOT_TIMEOUT_S)
        with self._lock:
            self._free.extend(self._slots)
            self._started = True

    def close(self) -> None:
        """Stop every child; a task still running is killed (its outcome: TaskRunnerClosed).

        Idempotent.  Idle children exit on EOF; busy ones are SIGKILLed and the
        run that owns them reaps them.
        """
        with self._lock:
            if not self._started:
                return
            self._started = False
            idle, self._free = list(self._free), deque()
            waiters, self._waiters = list(self._waiters), deque()
        for loop, future in waiters:  # runs waiting for a slot: the runner is closed
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_resolve, future, None)
        for slot in self._slots:
            process = slot.process  # read once: the owning run may be reaping it
            if slot in idle:
                slot.stop()
            elif process is not None and process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGKILL)

    def new_log(self) -> LogRing:
        """An empty ring of this runner's size, for a caller that tails a run's output."""
        return LogRing(self.log_bytes)

    async def run(
        self,
        package_dir: Path,
        function: str,
        context_json: str,
        timeout_s: float,
        log: LogRing | None = None,
        *,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> RunOutcome:
        """Run ``function`` ("module:function") of the package unpacked at ``package_dir``;
        what it prints goes into ``log`` (default: a ring of ``log_bytes``) as it runs, and
        into the outcome's ``log`` at the end.  ``loop``: the running loop, when the caller
        has it (on Python 3.11 each look-up is a getpid system call)."""
        if not self._started:
            raise TaskRunnerClosed("the task runner is not running")
        request = json.dumps(
            {
                "op": "run",
                "package_dir": str(package_dir),
                "function": function,
                "context_json": context_json,
            }
        ).encode()
        self._busy += 1
        try:
            slot = await self._take()
            if slot is None:
                return RunOutcome("failure", None, "TaskRunnerClosed", "the task runner was closed")
            try:
                if slot.fresh:
                    await slot.wait_ready_async(CHILD_BOOT_TIMEOUT_S)
                ring = log if log is not None else self.new_log()
                outcome = await self._exchange_logged(slot, request, timeout_s, ring, loop)
                if self.fresh_child_per_task and slot.process is not None and not slot.fresh:
                    self._replace(slot)  # used once: the next task gets a new interpreter
                return outcome
            except asyncio.CancelledError:
                self._replace(slot)  # mid-exchange: its answer would land on the next task
                raise
            except Exception as exc:  # a broken socket, a child that never booted
                logger.exception("task worker %s failed; replacing it", slot.index)
                self._replace(slot)
                return RunOutcome("failure", None, "WorkerCrashed", f"task worker failed: {exc}")
            finally:
                self._give_back(slot)
        finally:
            self._busy -= 1

    async def _take(self) -> _Slot | None:
        with self._lock:
            if not self._started:
                return None
            if self._free:
                # The child freed last, not the one idle longest: its memory is still in
                # the CPU's caches, and the children not needed stay asleep.  Round robin
                # over 16 children ran each task in a cold process.
                return self._free.pop()
            future = asyncio.get_running_loop().create_future()
            self._waiters.append((asyncio.get_running_loop(), future))
        return await future

    def _give_back(self, slot: _Slot) -> None:
        with self._lock:
            if self._started:
                while self._waiters:
                    loop, future = self._waiters.popleft()
                    if not future.done():
                        loop.call_soon_threadsafe(self._hand_over, future, slot)
                        return
                if slot.fresh:  # a replacement still booting: last in line, not next
                    self._free.appendleft(slot)
                else:
                    self._free.append(slot)
                return
        slot.stop()  # closed meanwhile

    def _hand_over(self, future: asyncio.Future, slot: _Slot) -> None:
        if future.done():  # its run was cancelled meanwhile: the next one gets the slot
            self._give_back(slot)
        else:
            future.set_result(slot)

    async def _exchange_logged(
        self,
        slot: _Slot,
        request: bytes,
        timeout_s: float,
        ring: LogRing,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> RunOutcome:
        """:meth:`_exchange` with the child's output read into ``ring`` while it runs."""
        slot.read_output(None)  # left over from between runs: nobody's log
        try:
            outcome = await self._exchange(slot, request, timeout_s, ring, loop)
        finally:
            slot.unwatch_output()
        outcome.log = ring.snapshot()
        return outcome

    async def _exchange(
        self,
        slot: _Slot,
        request: bytes,
        timeout_s: float,
        ring: LogRing,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> RunOutcome:
        started = time.monotonic()
        loop = loop or asyncio.get_running_loop()
        await slot.send(request, loop)
        clock = _RunClock(loop, slot, ring, max(timeout_s, 0.0))
        try:
            try:
                raw = await slot.recv(loop)
            finally:
                clock.stop()
        except TimeoutError:
            slot.read_output(ring)  # up to the kill: where it hung
            self._replace(slot)
            return RunOutcome(
                "timeout",
                None,
                "TaskTimeout",
                f"task exceeded its {timeout_s:g}s timeout",
                "",
                time.monotonic() - started,
            )
        except (EOFError, OSError):
            closing = not self._started  # close() killed it, the task did not crash
            slot.read_output(ring)  # what it printed before it died
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
        slot.read_output(ring)  # flushed before the reply: all of it is in the pipe
        reply = json.loads(raw)
        if reply["status"] == "success":
            output_json = reply["output_json"]
            return RunOutcome(
                "success",
                json.loads(output_json),
                duration_s=duration,
                output_bytes=len(output_json),
            )
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
            slot.spawn()  # booted lazily: its first run pings it (not on a task's clock)
        return code

    def __enter__(self) -> TaskRunner:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _RunClock:
    """A run's two deadlines on one timer at a time: reading the child's output as it comes
    (after ``OUTPUT_WATCH_AFTER_S``), then the task's timeout.

    Most tasks answer before the first and never pay for a reader (two epoll_ctl calls):
    their output waits in the pipe and is read after the reply; a task that fills the pipe
    sooner waits that long once, then is read as it writes.  The timeout fails the
    waiting ``recv()`` itself: ``asyncio.timeout()`` (the current task, its cancellation
    bookkeeping, three loop look-ups) and a second timer were a tenth of the agent's
    Python per task (docs/performance.md, "Round i17-recv")."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, slot: _Slot, ring: LogRing, timeout_s: float
    ) -> None:
        self._loop, self._slot, self._ring = loop, slot, ring
        self._deadline = loop.time() + timeout_s
        if timeout_s > OUTPUT_WATCH_AFTER_S:
            self._timer = loop.call_later(OUTPUT_WATCH_AFTER_S, self._watch)
        else:
            self._timer = loop.call_later(timeout_s, slot.expire)

    def _watch(self) -> None:
        self._slot.watch_output(self._ring)
        self._timer = self._loop.call_at(self._deadline, self._slot.expire)

    def stop(self) -> None:
        self._timer.cancel()


def _resolve(future: asyncio.Future, value: object) -> None:
    if not future.done():
        future.set_result(value)
