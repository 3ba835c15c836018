"""Wall-clock marks of a task's hops from Ready to the agent's ``received`` (off by default).

Set ``CLOACINA_HOP_TRACE`` to a file path and every process that marks a hop (the
server and the agents, which import this Django-free module alike) appends one line
per mark to it: ``<epoch seconds> <hop> <task id or -> <outbox id or ->``.  Server and
agents on one machine share ``time.time()``, the clock PostgreSQL's ``now()`` reads, so
the marks line up with each other and with the task's ``ready_at`` / ``received_at``.
``manage.py fleetbench --pickup-hops N`` turns them into a table (fleet/bench/pickup_hops.py).

Each mark is one ``write`` to a file opened ``O_APPEND`` (a line never interleaves with
another process's).  Unset, :func:`mark` is a global lookup and a return: it stays on the
hot path at no cost worth measuring.
"""

from __future__ import annotations

import gc
import os
import time

ENV = "CLOACINA_HOP_TRACE"

_fd: int | None = None


def trace_to(path: str) -> None:
    """Trace this process's hops to ``path`` from now on (empty: stop).  Called at import
    with ``CLOACINA_HOP_TRACE``; tests call it directly."""
    global _fd
    if _fd is not None:
        os.close(_fd)
        _fd = None
    if path:
        _fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    if _fd is not None and _watch_gc not in gc.callbacks:
        gc.callbacks.append(_watch_gc)
    elif _fd is None and _watch_gc in gc.callbacks:
        gc.callbacks.remove(_watch_gc)


GC_PAUSE_MIN_S = 0.0005  # collections at least this long are traced (a hop's outliers)

_gc_started = 0.0


def _watch_gc(phase: str, info: dict) -> None:
    """Trace each garbage collection long enough to show in a hop (``gc<generation>``, the
    process id in the task column, its milliseconds in the outbox column), so a p99 can
    be matched to one."""
    global _gc_started
    if phase == "start":
        _gc_started = time.perf_counter()
        return
    pause = time.perf_counter() - _gc_started
    if pause >= GC_PAUSE_MIN_S and _fd is not None:
        line = f"{time.time():.6f} gc{info['generation']} {os.getpid()} {pause * 1000.0:.3f}\n"
        os.write(_fd, line.encode())


trace_to(os.environ.get(ENV, ""))


def enabled() -> bool:
    return _fd is not None


def mark(hop: str, task: object = None, outbox: object = None) -> None:
    """Record that ``task`` (its task execution id) or ``outbox`` (its packet's outbox id)
    passed ``hop`` now; a no-op unless tracing is on."""
    if _fd is None:
        return
    line = f"{time.time():.6f} {hop} {task if task is not None else '-'} "
    line += f"{outbox if outbox is not None else '-'}\n"
    os.write(_fd, line.encode())


def mark_many(hop: str, tasks: list) -> None:
    """:func:`mark` for each of ``tasks`` at one instant."""
    if _fd is None:
        return
    stamp = f"{time.time():.6f} {hop} "
    os.write(_fd, "".join(f"{stamp}{task} -\n" for task in tasks).encode())
