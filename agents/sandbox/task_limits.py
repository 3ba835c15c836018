"""Resource limits on a task child (``setrlimit`` of CPU seconds, address space, open files).

The child applies them to itself as it boots (agents/sandbox/task_child.py), before it
answers its first ping, so no tenant code ever runs without them.  Not the parent: with
``prlimit`` it would need CAP_SYS_RESOURCE to limit a child running as another user, and
``preexec_fn`` is unsafe in a process with threads.  A child only ever lowers its own
limits (never above the hard limits it inherited).  The limits are per process: CPU seconds
accumulate over everything a child runs, so a runner with limits should start a fresh
child for every task (``TaskRunner(..., fresh_child_per_task=True)``).

What a task sees when it hits one:

* CPU seconds: SIGXCPU at the limit (SIGKILL one second later if it ignores it); the
  run fails with ``WorkerCrashed`` "exceeded its CPU time limit".
* Address space: allocations fail; the task gets ``MemoryError`` (its failure).
* Open files: ``open()`` fails with EMFILE (``OSError: Too many open files``).

Core dumps are always off in a limited child: a dump of tenant code would land on the
host's disk.  Stdlib only (shared by the server and the DB-less agent).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

# Below these the interpreter cannot start the child at all (measured with margin):
# the boot would fail with a confusing error instead of the task.
MIN_ADDRESS_SPACE_BYTES = 128 * 1024 * 1024
MIN_OPEN_FILES = 16
# The hard CPU limit sits this far above the soft one: SIGXCPU first, SIGKILL if ignored.
CPU_HARD_MARGIN_S = 1


@dataclass(frozen=True)
class ChildLimits:
    """Limits of one task child; None leaves that resource as the parent's."""

    cpu_seconds: int | None = None
    address_space_bytes: int | None = None
    open_files: int | None = None

    def __post_init__(self) -> None:
        if self.cpu_seconds is not None and self.cpu_seconds < 1:
            raise ValueError(f"cpu_seconds must be >= 1, got {self.cpu_seconds}")
        if (
            self.address_space_bytes is not None
            and self.address_space_bytes < MIN_ADDRESS_SPACE_BYTES
        ):
            raise ValueError(
                f"address_space_bytes must be >= {MIN_ADDRESS_SPACE_BYTES} (the interpreter "
                f"needs it to start), got {self.address_space_bytes}"
            )
        if self.open_files is not None and self.open_files < MIN_OPEN_FILES:
            raise ValueError(f"open_files must be >= {MIN_OPEN_FILES}, got {self.open_files}")

    def rlimits(self) -> dict[str, tuple[int, int]]:
        """Resource name (``RLIMIT_*``) → (soft, hard), core dumps off included."""
        limits = {"RLIMIT_CORE": (0, 0)}
        if self.cpu_seconds is not None:
            limits["RLIMIT_CPU"] = (self.cpu_seconds, self.cpu_seconds + CPU_HARD_MARGIN_S)
        if self.address_space_bytes is not None:
            limits["RLIMIT_AS"] = (self.address_space_bytes, self.address_space_bytes)
        if self.open_files is not None:
            limits["RLIMIT_NOFILE"] = (self.open_files, self.open_files)
        return limits

    def child_argument(self) -> str:
        """The limits as the task child's third argument (it applies them to itself)."""
        return json.dumps({name: list(pair) for name, pair in self.rlimits().items()})

    def describe(self) -> dict[str, int | None]:
        """The limits as plain values (metrics, logs)."""
        return {
            "cpu_seconds": self.cpu_seconds,
            "address_space_bytes": self.address_space_bytes,
            "open_files": self.open_files,
        }
