"""The hooks an executor registers for its side effects on the engine's own writes.

The engine (scheduler, result handler, recovery) knows no executor and no executor's
table.  An executor whose running tasks hold something until their outcome is
recorded — the fleet: an outbox packet and a slot on an agent — registers a
:class:`SettleHook` at startup (:func:`register_settle_hook`; the fleet's is
``fleet.executors.fleet.delivery.outbox_ack.OUTBOX_SETTLE_HOOK``, registered by ``FleetConfig.ready``
because any server process may receive a fleet outcome).  The result handler folds
the hook's SQL into its own statements, so the ack and the slot release stay inside
the outcome's statement and transaction: no extra round trip, the locks in the same
order.  With no hook registered the fragments are empty.
"""

from __future__ import annotations

import abc
import uuid
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class SettleHook(abc.ABC):
    """An executor's share of settling a task (it reached an outcome, or was cancelled)."""

    @abc.abstractmethod
    def settle_ctes(self, settling: str, release: bool) -> str:
        """SQL: common table expressions, each written ``, name AS (…)``, that settle the
        executor's side of the task rows in relation ``settling`` (columns
        ``task_execution_id``, ``assignment``) inside the engine's statement.  The first
        is named ``held``, with one column ``holder``: what those rows held.  With
        ``release`` the fragment frees it too; without, the engine collects the holders
        and passes them to :meth:`release` before the commit (a batch of outcomes)."""

    @abc.abstractmethod
    def release(self, holders: list) -> None:
        """Free what ``holders`` (as returned by ``held``) held, in the caller's transaction."""

    @abc.abstractmethod
    def withdraw_undelivered(self, workflow_execution_id: uuid.UUID) -> int:
        """On cancel, in the caller's transaction: Running tasks of the execution whose
        work never left the executor are Skipped; returns how many."""

    @abc.abstractmethod
    def holds_sql(self, task: str) -> str:
        """SQL predicate on the task row aliased ``task``: the executor holds its current
        assignment (recovery leaves such a task to the executor)."""

    def runs_lost(self, holders: list) -> None:  # noqa: B027 - optional: most executors need nothing
        """Runs held by ``holders`` (the task rows' ``agent_id``, one entry per run) got no
        outcome by their result deadline and were declared lost (the fleet counts it
        against those agents' circuit breakers).  Called after the outcomes committed."""


NO_HOLDS = ", held AS (SELECT NULL::uuid AS holder WHERE false)"

_settle_hook: SettleHook | None = None


def register_settle_hook(hook: SettleHook | None) -> None:
    """Install ``hook`` (None removes it).  One executor holds work between claim and
    outcome; registering the same hook again is a no-op."""
    global _settle_hook
    _settle_hook = hook


def settle_hook() -> SettleHook | None:
    return _settle_hook


class PerHook(Generic[T]):
    """A value built from the registered hook's fragments (the engine's hot statements),
    built once and again only when another hook is registered: an identity check per use,
    no formatting.  Two threads racing a rebuild build the same value."""

    def __init__(self, build: Callable[[], T]) -> None:
        self._build = build
        self._hook: object = object()  # matches no hook: built on first use
        self._value: T | None = None

    def __call__(self) -> T:
        hook = _settle_hook
        if self._hook is not hook:
            self._value, self._hook = self._build(), hook
        return self._value  # type: ignore[return-value]  # set just above on first use


def settle_ctes(settling: str, release: bool) -> str:
    """The registered hook's fragment, or the empty ``held`` relation."""
    hook = _settle_hook
    return NO_HOLDS if hook is None else hook.settle_ctes(settling, release)


def release(holders: list) -> None:
    hook = _settle_hook
    if holders and hook is not None:
        hook.release(holders)


def withdraw_undelivered(workflow_execution_id: uuid.UUID) -> int:
    hook = _settle_hook
    return 0 if hook is None else hook.withdraw_undelivered(workflow_execution_id)


def holds_sql(task: str) -> str:
    hook = _settle_hook
    return "false" if hook is None else hook.holds_sql(task)


def runs_lost(holders: list) -> None:
    hook = _settle_hook
    if holders and hook is not None:
        hook.runs_lost(holders)
