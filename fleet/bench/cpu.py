"""CPU seconds used by the server under test and by the database server.

Wall-clock throughput depends on whatever else the machine runs; CPU time per
task does not, so the benchmark reports both.  The database's CPU is that of
the PostgreSQL server we are connected to: its postmaster and every backend.
"""

from __future__ import annotations

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
