"""The loop a task-runner child process runs: import the task's function, call it, report.

Run as a script by :mod:`agents.sandbox.task_runner` (``python -I task_child.py
FD PARENT_PID``), so it imports only the standard library: nothing of the server
is on the child's path, only the package's workflow/ and vendor/.

Imports are cached per package directory: when a child switches from one
package to another, the first package's modules are set aside (not thrown
away) and the second's are put back, so two packages may both ship a module
``steps`` and each task sees its own.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import logging
import os
import signal
import struct
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from types import ModuleType

# How often a child checks that the process that started it is still alive.
PARENT_CHECK_INTERVAL_S = 1.0
PR_SET_DUMPABLE = 4
# How the ``logging`` records of a task read in its log (the parent keeps stdout and
# stderr, these included, in the attempt's bounded log: agents/sandbox/task_log.py).
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class InvalidTaskOutput(Exception):
    """The task returned something that is not a JSON object (or None)."""


class _PackageImports:
    """Which package's modules are in ``sys.modules`` right now, and the others' set aside."""

    def __init__(self) -> None:
        self.active: str | None = None
        self.active_paths: list[str] = []
        self.stash: dict[str, dict[str, ModuleType]] = {}

    def activate(self, package_dir: str) -> None:
        if package_dir == self.active:
            return
        if self.active is not None:
            self.stash[self.active] = self._take_modules(self.active)
            for path in self.active_paths:
                while path in sys.path:
                    sys.path.remove(path)
        # workflow/ first, then vendor/: the package's own code wins over what it vendors.
        paths = [os.path.join(package_dir, "workflow"), os.path.join(package_dir, "vendor")]
        sys.path[:0] = paths
        sys.modules.update(self.stash.pop(package_dir, {}))
        importlib.invalidate_caches()
        self.active, self.active_paths = package_dir, paths

    @staticmethod
    def _take_modules(package_dir: str) -> dict[str, ModuleType]:
        prefix = os.path.join(package_dir, "")
        taken = {}
        for name, module in list(sys.modules.items()):
            origin = getattr(module, "__file__", None) or ""
            locations = list(getattr(module, "__path__", None) or [])
            if origin.startswith(prefix) or any(str(p).startswith(prefix) for p in locations):
                taken[name] = sys.modules.pop(name)
        return taken


def _resolve(spec: str):
    module_name, sep, attr_path = spec.partition(":")
    if not sep or not module_name or not attr_path:
        raise ValueError(f"function {spec!r} is not of the form 'module:function'")
    target = importlib.import_module(module_name)
    for attr in attr_path.split("."):
        target = getattr(target, attr)
    if not callable(target):
        raise TypeError(f"{spec} is not callable")
    return target


def _encode_output(result: object) -> str:
    if result is None:
        result = {}
    if not isinstance(result, dict):
        raise InvalidTaskOutput(
            f"task output must be a JSON object (dict) or None, got {type(result).__name__}"
        )
    try:
        return json.dumps(result, allow_nan=False)
    except ValueError as exc:
        raise InvalidTaskOutput(f"task output is not valid JSON: {exc}") from None
    except TypeError as exc:
        raise InvalidTaskOutput(f"task output is not JSON-serialisable: {exc}") from None


def capture_output() -> None:
    """Make what a task prints reach the parent as it happens, in order: stdout and stderr
    flush at each line (both are the one pipe the parent reads), and ``logging`` records
    (INFO and up, unless the task configures logging itself) go to stderr."""
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True, errors="backslashreplace")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(logging.INFO)


def _flush_output() -> None:
    # Before the reply: the parent reads the pipe up to the reply, so what the task wrote
    # without a final newline must be in the pipe by then.
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # the task closed or broke it: nothing more to send
            pass


def run_task(imports: _PackageImports, request: dict) -> dict:
    """Run one task request; always returns a reply (never raises)."""
    try:
        imports.activate(request["package_dir"])
        context = json.loads(request["context_json"])
        func = _resolve(request["function"])
        result = func(context)
        if inspect.iscoroutine(result):
            result = asyncio.run(result)
        return {"status": "success", "output_json": _encode_output(result)}
    except InvalidTaskOutput as exc:
        return {
            "status": "failure",
            "error_type": "InvalidTaskOutput",
            "error_message": str(exc),
            "traceback": "",
        }
    except BaseException as exc:  # noqa: B036 - SystemExit in a task is the task's failure too
        return {
            "status": "failure",
            "error_type": type(exc).__name__,
            "error_message": str(exc),
            "traceback": traceback.format_exc(),
        }


def _exit_when_orphaned(parent_pid: int) -> None:
    # A SIGKILLed parent cannot close our socket for us while a task is still running;
    # polling it means a killed server or agent leaves no task processes behind.
    while True:
        time.sleep(PARENT_CHECK_INTERVAL_S)
        try:
            os.kill(parent_pid, 0)
        except ProcessLookupError:
            os._exit(0)
        except PermissionError:
            pass


def _not_dumpable() -> None:
    # Every task child of a server runs as the same unprivileged user: without this, a
    # task in one child could ptrace another child or read its /proc/<pid>/mem and so
    # see another tenant's task input.  Non-dumpable, its /proc entries belong to root.
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux
        pass


def apply_limits(spec: str) -> None:
    """Lower this process's resource limits to ``spec`` (JSON: ``RLIMIT_*`` name → [soft,
    hard], from agents/sandbox/task_limits.py), never above the hard limit inherited."""
    import resource  # local: only limited children need it

    for name, (soft, hard) in json.loads(spec).items():
        which = getattr(resource, name)
        _, inherited = resource.getrlimit(which)
        if inherited != resource.RLIM_INFINITY:
            hard = min(hard, inherited)
            soft = min(soft, hard)
        resource.setrlimit(which, (soft, hard))


# One read of the parent's socket: a small request (the common case) and its header come
# in one read, not the two (header, then body) of ``Connection.recv_bytes``.
REQUEST_READ_BYTES = 64 * 1024


def take_frame(inbox: bytearray) -> bytes | None:
    """The first whole frame in ``inbox``, removed from it; None until one has arrived.
    The parent (agents/sandbox/task_runner.py) reads the child's replies with this too."""
    if len(inbox) < 4:
        return None
    (size,) = struct.unpack_from("!i", inbox)
    start = 4
    if size == -1:
        if len(inbox) < 12:
            return None
        (size,) = struct.unpack_from("!Q", inbox, 4)
        start = 12
    end = start + size
    if len(inbox) < end:
        return None
    frame = bytes(inbox[start:end])
    del inbox[:end]
    return frame


class _Requests:
    """The parent's requests, framed as ``multiprocessing.connection`` frames them (a
    4-byte big-endian length, or -1 and an 8-byte one, then the bytes), read from the
    socket in as few reads as they arrived in."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.inbox = bytearray()

    def next(self) -> bytes:
        """The next request; EOFError when the parent closed its end."""
        while True:
            frame = take_frame(self.inbox)
            if frame is not None:
                return frame
            chunk = os.read(self.fd, REQUEST_READ_BYTES)
            if not chunk:
                raise EOFError("the parent closed the socket")
            self.inbox += chunk


def serve(conn: Connection, parent_pid: int, limits: str = "") -> None:
    """The child's main loop: one JSON request in, one JSON reply out, until EOF."""
    if limits:
        apply_limits(limits)  # before the first ping is answered: no task runs unlimited
    _not_dumpable()
    # Ctrl-C in a terminal reaches the whole process group; the parent decides when we stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_when_orphaned, args=(parent_pid,), daemon=True).start()
    capture_output()
    imports = _PackageImports()
    requests = _Requests(conn.fileno())
    while True:
        try:
            request = json.loads(requests.next())
        except (EOFError, OSError):
            return
        if request.get("op") == "ping":
            reply = {"op": "pong"}
        else:
            reply = run_task(imports, request)
            _flush_output()
        try:
            conn.send_bytes(json.dumps(reply).encode())
        except (BrokenPipeError, OSError):
            return


if __name__ == "__main__":
    serve(Connection(int(sys.argv[1])), int(sys.argv[2]), *sys.argv[3:4])
