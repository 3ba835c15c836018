"""An executor that runs every task in a fresh child process under hard resource limits.

The built-in ``default`` executor keeps a few warm children and reuses them: fast, but
a task that leaks memory, spins the CPU or leaves files open hands that on to the next
task in the same child, and a runaway can take the host's memory with it.  This one
gives each task a new interpreter with ``setrlimit`` limits on CPU seconds, address
space and open files (agents/sandbox/task_limits.py), and retires it afterwards.  The
cost is a child start per task (tens of milliseconds), not on the task's timeout clock.

Everything else is the in-process executor's: the same claim (fencing token), package
cache, context builder, timeout, result handler, and the same sandbox — the child runs
``python -I`` with an allow-listed environment and, when the server is root, as an
unprivileged user (agents/sandbox/task_isolation.py), so tenant code reaches neither the
database nor the secret key (docs/threat-model.md).

Register it in ``$CLOACINA_HOME/config.toml`` (docs/executors.md)::

    [server]
    default_executor = "limited"

    [executors.limited]
    class = "examples.executors.subprocess_limits:SubprocessLimitsExecutor"
    options = { workers = 2, cpu_seconds = 60, memory_mb = 512, open_files = 256 }

Options (all optional):

* ``workers``: tasks run at once (default: the server's ``worker_processes``).
* ``cpu_seconds``: CPU time per task (default 300); past it the task fails with
  ``WorkerCrashed`` "exceeded its CPU time limit".
* ``memory_mb``: address space per task in MiB (default 1024, at least 128); past it the
  task's allocations raise ``MemoryError``.
* ``open_files``: file descriptors per task (default 256, at least 16).

The module is loaded by dotted path: run ``serve`` from the repository root (``python
manage.py serve`` puts it on ``sys.path``) or add the repository to ``PYTHONPATH``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from agents.sandbox.task_limits import ChildLimits
from agents.sandbox.task_runner import TaskRunner
from fleet.engine.events import ExecutorMetrics
from fleet.executors.inprocess import InProcessExecutor
from fleet.platform.config import Config

DEFAULT_CPU_SECONDS = 300
DEFAULT_MEMORY_MB = 1024
DEFAULT_OPEN_FILES = 256
OPTIONS = frozenset({"workers", "cpu_seconds", "memory_mb", "open_files"})
MIB = 1024 * 1024


class SubprocessLimitsExecutor(InProcessExecutor):
    """Each task in its own child process, with CPU, memory and open-file limits."""

    def __init__(self, workers: int, claimer: str, cache_root: Path, limits: ChildLimits) -> None:
        super().__init__(
            workers,
            claimer,
            cache_root,
            runner=TaskRunner(workers, limits=limits, fresh_child_per_task=True),
        )
        self.limits = limits

    @classmethod
    def from_config(
        cls, options: Mapping[str, Any], *, key: str, claimer: str, config: Config
    ) -> SubprocessLimitsExecutor:
        unknown = sorted(set(options) - OPTIONS)
        if unknown:
            raise ValueError(
                f"unknown option(s) {', '.join(unknown)}; known: {', '.join(sorted(OPTIONS))}"
            )
        limits = ChildLimits(
            cpu_seconds=_positive_int(options, "cpu_seconds", DEFAULT_CPU_SECONDS),
            address_space_bytes=_positive_int(options, "memory_mb", DEFAULT_MEMORY_MB) * MIB,
            open_files=_positive_int(options, "open_files", DEFAULT_OPEN_FILES),
        )
        workers = _positive_int(options, "workers", config.worker_processes)
        # The in-process executor's cache: the one directory of $CLOACINA_HOME the task
        # user may enter when serve runs as root (fleet/platform/isolation.py), and safe
        # to share with other server processes (a per-digest flock guards each unpack).
        return cls(workers, claimer, config.home / "packages", limits)

    def metrics(self) -> ExecutorMetrics:
        figures = super().metrics()
        figures.extra.update(
            {f"limit_{name}": value for name, value in self.limits.describe().items()}
        )
        return figures


def _positive_int(options: Mapping[str, Any], name: str, default: int) -> int:
    value = options.get(name, default)
    # bool is an int in Python; "true" as a CPU limit is a mistake, not 1 second.
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value
