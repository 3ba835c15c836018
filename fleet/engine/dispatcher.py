"""The Dispatcher: every TaskReadyEvent goes to the one configured default executor.

There is no per-task routing: which machine runs a task is the executor's
business.  The configured key is hard-matched against the registered
executors at boot (:meth:`Dispatcher.configure`), so a typo fails loudly.

An executor that raises :class:`~fleet.engine.events.ExecutionFailed` gets its
task failed by policy (:mod:`fleet.engine.execution_failures`): a failed
attempt, retried or failed as the task's retry policy says, never left Running.
"""

from __future__ import annotations

import asyncio
import logging

from fleet.engine.events import (
    ExecutionFailed,
    ExecutionResult,
    ExecutorNotFound,
    NoCapacity,
    TaskReadyEvent,
)
from fleet.engine.execution_failures import record_execution_failure
from fleet.engine.executor import TaskExecutor

log = logging.getLogger(__name__)


class Dispatcher:
    def __init__(self, claimer: str) -> None:
        """``claimer``: this server's claimer id (the one its executors claim under), under
        which an executor's failure before its own claim is recorded (see :meth:`dispatch`)."""
        self._executors: dict[str, TaskExecutor] = {}
        self._default_key: str | None = None
        self._claimer = claimer

    def register_executor(self, key: str, executor: TaskExecutor) -> None:
        executor.key = key
        self._executors[key] = executor

    def is_registered(self, key: str) -> bool:
        return key in self._executors

    def valid_keys(self) -> list[str]:
        return sorted(self._executors)

    def registered(self) -> dict[str, TaskExecutor]:
        """Every registered executor by key (the default and the idle ones), for metrics."""
        return dict(self._executors)

    @property
    def default_key(self) -> str | None:
        return self._default_key

    def configure(self, default_key: str) -> TaskExecutor:
        """Select the default executor; raise ExecutorNotFound listing the valid keys."""
        if default_key not in self._executors:
            raise ExecutorNotFound(default_key, self.valid_keys())
        self._default_key = default_key
        return self._executors[default_key]

    @property
    def executor(self) -> TaskExecutor:
        if self._default_key is None:
            raise ExecutorNotFound("<unset>", self.valid_keys())
        return self._executors[self._default_key]

    def resolve_executor_key(self, task_name: str) -> str:
        """The key that would handle ``task_name``: always the default (no per-task routing)."""
        return self.executor.key

    def has_capacity(self) -> bool:
        return self.executor.has_capacity()

    async def dispatch(self, event: TaskReadyEvent) -> ExecutionResult:
        executor = self.executor
        if not executor.has_capacity():
            raise NoCapacity(f"executor {executor.name!r} is at capacity")
        try:
            return await executor.execute(event)
        except ExecutionFailed as failure:
            log.warning(
                "executor %r could not run task %s (%s): %s",
                executor.name,
                event.task_execution_id,
                event.task_name,
                failure,
            )
            return await asyncio.to_thread(record_execution_failure, event, failure, self._claimer)
