"""The fleet's settle hook: an outcome acks its outbox row and releases the agent slot
(and a run lost past its result deadline counts against its agent's circuit breaker).

A row is acked exactly when the outcome for its (task, assignment) is
recorded, in the same transaction, so until then it is in-flight work that
the liveness sweeper can move to a survivor.  The engine knows no outbox: the
result handler folds :data:`OUTBOX_SETTLE_HOOK`'s fragments into its own
statements (fleet/engine/hooks.py), so the ack and the slot release cost no
statement of their own on the hot path.  The fragments and statements are the
ledger's (:mod:`fleet.executors.fleet.state.ledger`, the one owner of slots and outbox state).
"""

from __future__ import annotations

import uuid

from fleet.engine.hooks import SettleHook, register_settle_hook
from fleet.executors.fleet.state import breaker, ledger


class OutboxSettleHook(SettleHook):
    """The fleet executor's side of an outcome: ack the packet, free the agent's slot."""

    def settle_ctes(self, settling: str, release: bool) -> str:
        return ledger.settle_ctes(settling, release)

    def release(self, holders: list) -> None:
        ledger.release_slots(holders)

    def withdraw_undelivered(self, workflow_execution_id: uuid.UUID) -> int:
        return ledger.withdraw_undelivered(workflow_execution_id)

    def holds_sql(self, task: str) -> str:
        return ledger.holds_sql(task)

    def runs_lost(self, holders: list) -> None:
        breaker.record_failures(holders, breaker.Cause.RESULT_TIMEOUT)


OUTBOX_SETTLE_HOOK = OutboxSettleHook()


def register() -> None:
    """Register the fleet's settle hook with the engine (idempotent)."""
    register_settle_hook(OUTBOX_SETTLE_HOOK)
