"""CPU seconds used by the server under test and by the database server.

Wall-clock throughput depends on whatever else the machine runs; CPU time per
task does not, so the benchmark reports both.  The database's CPU is that of
the PostgreSQL server we are connected to: its postmaster and every backend.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import psutil
from django.db import connection


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) used so far by ``pid`` and its descendants; 0 if gone."""
    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0.0
    total = 0.0
    for process in processes:
        try:
            times = process.cpu_times()
            total += times.user + times.system
        except psutil.Error:
            pass  # exited between listing and reading
    return total


def database_server_pid() -> int | None:
    """The postmaster of the PostgreSQL server this process is connected to, if local."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        backend = cursor.fetchone()[0]
    try:
        return psutil.Process(backend).ppid()
    except psutil.Error:
        return None  # a remote database: its CPU is not ours to see


class CpuMeter:
    def __init__(self, server_pid: int) -> None:
        self.pids = {"server": server_pid}
        db = database_server_pid()
        if db is not None:
            self.pids["database"] = db

    def sample(self) -> dict[str, float]:
        return {name: tree_cpu_seconds(pid) for name, pid in self.pids.items()}

    @staticmethod
    def used(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
        return {name: after[name] - before.get(name, 0.0) for name in after}


@dataclass
class CpuWindow:
    """CPU each process group used over a stretch of wall time (:meth:`open`, then
    :meth:`close`)."""

    meter: CpuMeter
    before: dict[str, float]
    started: float
    used: dict[str, float] | None = None
    wall_s: float = 0.0

    @classmethod
    def open(cls, meter: CpuMeter) -> CpuWindow:
        return cls(meter, meter.sample(), time.monotonic())

    def close(self) -> CpuWindow:
        self.used = self.meter.used(self.before, self.meter.sample())
        self.wall_s = time.monotonic() - self.started
        return self

    def rates(self) -> dict[str, float]:
        """CPU seconds per wall second, per group."""
        assert self.used is not None, "close() the window first"
        return {name: used / self.wall_s for name, used in self.used.items() if self.wall_s > 0}

    def above(self, background: CpuWindow) -> dict[str, float]:
        """CPU this window used beyond what ``background``'s rates (a window with nothing
        submitted: ticks, heartbeats, probes) account for over the same wall time.

        A lone task's own CPU is a few milliseconds, while a server with nothing to do still
        spends some 30 ms a second; over an idle phase paced 20 ms apart that is about one
        millisecond per task that is not the task's."""
        assert self.used is not None, "close() the window first"
        rates = background.rates()
        return {
            name: max(0.0, used - rates.get(name, 0.0) * self.wall_s)
            for name, used in self.used.items()
        }
