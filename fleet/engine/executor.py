"""The TaskExecutor interface every execution backend implements."""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from fleet.engine.events import ExecutionResult, ExecutorMetrics, TaskReadyEvent
from fleet.platform.config import Config


@dataclass(frozen=True)
class PeriodicJob:
    """A background job an executor needs (run by `serve` with APScheduler, sync, in a thread)."""

    name: str
    func: Callable[[], None]
    interval_s: float
    leader_only: bool = False  # run only in the process holding the leader advisory lock


class TaskExecutor(abc.ABC):
    """An execution backend (docs/executors.md walks through writing one).

    ``execute`` owns a task from claim to outcome: it claims the task
    (``fleet.engine.claims``, with ``claimer`` as the claimer so the server's recovery
    sweeps know whose claim it is), runs it, and hands the outcome to the one result
    handler.  When it cannot run a claimed task it may raise
    :class:`~fleet.engine.events.ExecutionFailed`; the dispatcher then records the
    failure and the task's retry policy decides (retry or fail).
    """

    key: str = ""

    @classmethod
    def from_config(
        cls, options: Mapping[str, Any], *, key: str, claimer: str, config: Config
    ) -> TaskExecutor:
        """Build this executor from its ``[executors.<key>]`` entry (at boot).

        The default is ``cls(claimer=claimer, config=config, **options)``; override it to
        check options or to take other constructor arguments.  Raise ``TypeError`` or
        ``ValueError`` for bad options: the boot error names the key and your message.
        """
        return cls(claimer=claimer, config=config, **options)

    @abc.abstractmethod
    async def execute(self, event: TaskReadyEvent) -> ExecutionResult:
        """Run the task named by ``event`` to an outcome (claiming it first)."""

    @abc.abstractmethod
    def has_capacity(self) -> bool:
        """Whether another task could start now (best effort; claims are the real guard)."""

    @abc.abstractmethod
    def metrics(self) -> ExecutorMetrics: ...

    @property
    def name(self) -> str:
        return self.key or type(self).__name__

    async def start(self) -> None:  # noqa: B027 - optional hook
        """Start pools, listeners, … (called once the event loop runs)."""

    async def stop(self) -> None:  # noqa: B027 - optional hook
        """Release resources on shutdown."""

    def hand_over(self) -> None:  # noqa: B027 - optional hook
        """The server is stopping (SIGTERM), before anything else stops: let go of what
        another server can take over at once (the fleet executor takes no more agent
        sockets).  Called on the event loop's thread; must not block."""

    def add_capacity_listener(self, listener: Callable[[], None]) -> None:
        """Have ``listener`` called (on the event loop) each time a slot frees up.

        The dispatch loop waits for capacity on this instead of polling, so the
        next task starts the moment a run ends, not at the next poll.
        """
        self.__dict__.setdefault("_capacity_listeners", []).append(listener)

    def capacity_freed(self) -> None:
        """Executors call this (on the event loop thread) when a run gives back its slot."""
        for listener in self.__dict__.get("_capacity_listeners", ()):
            listener()

    def periodic_jobs(self) -> list[PeriodicJob]:
        """Background jobs this executor needs (sweepers, relays' safety nets, …)."""
        return []
