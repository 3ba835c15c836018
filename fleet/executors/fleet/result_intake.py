"""Outcomes reported by agents: checked against the packet they name, then handed to the
one result handler (:mod:`fleet.engine.results`).

:func:`apply_result` applies one outcome in a transaction of its own (the REST
endpoint).  :func:`apply_results` applies many in ONE transaction (the results of
the delivery sockets, :mod:`fleet.executors.fleet.result_batches`): one synchronous commit and
one WAL flush for all of them, one query for all the checks, each outcome through
the same handler (without a savepoint each: a failing result fails the batch, which
is then applied result by result), and the agents' slot counters released once at
the end, in one order, so a batch holds those hot rows only for its last statement
and the commit.

Each outcome an agent reports about a packet addressed to it also feeds that agent's
circuit breaker (:mod:`fleet.executors.fleet.state.breaker`), in the same transaction:
a refusal is a failure, any other outcome a success.
"""

from __future__ import annotations

import logging
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

from django.db import DatabaseError, connection, transaction
from pydantic import BaseModel, ConfigDict, Field

from agents.sandbox.task_log import TaskLog
from fleet.engine import ready_queue
from fleet.engine.outcome_batches import apply_in_batch, batch_transaction
from fleet.engine.results import (
    Applied,
    TaskReport,
    deferred_slot_releases,
    release_slots,
)
from fleet.executors.fleet.delivery.metrics import RESULTS
from fleet.executors.fleet.delivery.rendezvous import Outcome as Wake
from fleet.executors.fleet.delivery.rendezvous import announce_many, rendezvous
from fleet.executors.fleet.state import breaker, ledger

log = logging.getLogger(__name__)

UNKNOWN_AGENT = "unknown agent"


MAX_BIGINT = 2**63 - 1  # delivery_outbox.id
MAX_INT = 2**31 - 1  # fleet_taskexecution.assignment


MAX_LOG_BYTES = 2**62  # bytes a task wrote in all (a bigint column)


class LogIn(BaseModel):
    """What the attempt printed: the tail the agent kept, and how much it wrote in all."""

    model_config = ConfigDict(from_attributes=True)

    text: str = ""
    bytes: int = Field(0, ge=0, le=MAX_LOG_BYTES, strict=True)
    truncated_bytes: int = Field(0, ge=0, le=MAX_LOG_BYTES, strict=True)

    def task_log(self) -> TaskLog:
        return TaskLog(self.text, self.bytes, min(self.truncated_bytes, self.bytes))


# An agent's report of one outcome (a ``result`` frame's fields, or the REST body).  A
# plain pydantic model, not a ninja ``Schema``: a Schema validates through a Python wrapper
# (``DjangoGetter``) field by field, 25 µs of CPU per result against 2.3 µs here, and every
# result of the fleet is validated on the event loop (docs/performance.md, "Hand-offs").
# ninja takes a pydantic model as a body all the same.  (A comment, not a docstring: the
# OpenAPI schema would publish a docstring as the body's description.)
class ResultIn(BaseModel):
    model_config = ConfigDict(from_attributes=True)
    outbox_id: int = Field(..., ge=1, le=MAX_BIGINT, strict=True)
    task_execution_id: uuid.UUID
    assignment: int = Field(..., ge=1, le=MAX_INT, strict=True)
    outcome: Literal["success", "failure", "refused", "timeout"]
    output: Any = None
    error_type: str = Field("", max_length=200)
    error_message: str = ""
    traceback: str = ""
    log: LogIn | None = None


Answer = tuple[int, dict]

# Per result: the reporting agent's name when it is of that tenant (else NULL); whether
# the packet it names was addressed to it (now, or before a reclaim); the task's workflow
# execution; the agent now holding the task when that is the reporter's own process
# under a newer registration (same instance_id) — the outcome it owes under its old id
# counts for the new one: applied once, never lost to the fence; and whether the agent
# the outcome counts for has breaker state a success must clear (else the batch skips
# the breaker's statement: a healthy agent's success writes nothing).
_AGENTS_AND_PACKETS = f"""
SELECT r.i, a.name, a.id IS NOT NULL AND EXISTS (
    SELECT 1 FROM {ledger.OUTBOX} o
    WHERE o.id = r.outbox AND o.tenant_id = a.tenant_id AND o.task_execution_id = r.task
      AND o.assignment = r.assignment
      AND (o.agent_id = a.id OR o.former_agents @> jsonb_build_array(a.id::text))
), t.workflow_execution_id, h.id, coalesce(CASE WHEN h.id IS NOT NULL
    THEN {breaker.has_something_to_forget_sql("h")}
    ELSE {breaker.has_something_to_forget_sql("a")} END, false)
FROM unnest(%(tenants)s::bigint[], %(agents)s::uuid[], %(outboxes)s::bigint[],
            %(tasks)s::uuid[], %(assignments)s::bigint[]) WITH ORDINALITY
     AS r(tenant, agent, outbox, task, assignment, i)
LEFT JOIN {ledger.AGENTS} a ON a.id = r.agent AND a.tenant_id = r.tenant
LEFT JOIN fleet_taskexecution t ON t.id = r.task
LEFT JOIN {ledger.AGENTS} h ON h.id = t.agent_id AND h.id <> a.id
     AND h.tenant_id = a.tenant_id AND h.instance_id = a.instance_id
"""


class Check(NamedTuple):
    agent_name: str | None  # None: not an agent of this tenant
    addressed: bool  # the packet was addressed to the reporter (now or before a reclaim)
    workflow_execution_id: uuid.UUID | None
    successor_id: uuid.UUID | None  # the reporter's own process, registered anew
    breaker_to_clear: bool = False  # a success must reset the breaker of the agent it counts for


def _check(
    items: list[tuple[int, uuid.UUID, ResultIn]], before_read: Callable[[], None] | None = None
) -> list[Check]:
    """What :func:`_record` needs to know of each item, in one query.  ``before_read`` runs
    between sending it and reading its rows (a pipelined transaction's sync)."""
    with connection.cursor() as cursor:
        cursor.execute(
            _AGENTS_AND_PACKETS,
            {
                "tenants": [tenant for tenant, _agent, _body in items],
                "agents": [agent for _tenant, agent, _body in items],
                "outboxes": [body.outbox_id for *_, body in items],
                "tasks": [body.task_execution_id for *_, body in items],
                "assignments": [body.assignment for *_, body in items],
            },
        )
        if before_read is not None:
            before_read()
        rows = {
            int(i): Check(name, bool(ok), workflow, successor, clear)
            for i, name, ok, workflow, successor, clear in cursor.fetchall()
        }
    return [rows[i + 1] for i in range(len(items))]


def _report(agent_id: uuid.UUID, body: ResultIn, check: Check) -> TaskReport | Answer:
    """The report to apply, or the 404 answer of a result that names no packet of this agent."""
    if check.agent_name is None:
        return 404, {"detail": UNKNOWN_AGENT}
    if not check.addressed:
        detail = (
            f"work packet {body.outbox_id} (task {body.task_execution_id}, assignment "
            f"{body.assignment}) was never addressed to this agent"
        )
        return 404, {"detail": detail}
    return TaskReport(
        task_execution_id=body.task_execution_id,
        assignment=body.assignment,
        outcome=body.outcome,
        output=body.output,
        error_type=body.error_type,
        error_message=body.error_message,
        traceback=body.traceback,
        agent_id=check.successor_id or agent_id,
        agent_name=check.agent_name,
        log=body.log.task_log() if body.log is not None else None,
    )


def _record_all(
    items: list[tuple[uuid.UUID, ResultIn, Check]],
) -> list[tuple[int, dict, Applied | None]]:
    """Apply the results that name a packet of their agent, in the given order (the
    batch's current successes as one set: :func:`apply_in_batch`); the answer of each."""
    reports = [_report(agent_id, body, check) for agent_id, body, check in items]
    to_apply = [i for i, report in enumerate(reports) if isinstance(report, TaskReport)]
    applied = dict(zip(to_apply, apply_in_batch([reports[i] for i in to_apply]), strict=True))
    answers: list[tuple[int, dict, Applied | None]] = []
    for i, report in enumerate(reports):
        if i in applied:
            answers.append(
                (200, {"applied": applied[i].applied, "reason": applied[i].reason}, applied[i])
            )
        else:
            answers.append((*report, None))
    return answers


def _breaker_feed(
    items: list[tuple[uuid.UUID, ResultIn, Check]],
) -> tuple[list[uuid.UUID], list[uuid.UUID]]:
    """The agents whose breakers the reports feed: (refused, succeeded).  Only reports about
    a packet addressed to the reporter count (anything else proves nothing about the
    agent), and a success only when that agent has breaker state to clear."""
    refused, succeeded = [], []
    for agent_id, body, check in items:
        if check.agent_name is None or not check.addressed:
            continue
        agent = check.successor_id or agent_id
        if body.outcome == "refused":
            refused.append(agent)
        elif check.breaker_to_clear:
            succeeded.append(agent)
    return refused, succeeded


def _release_and_feed(
    held: list[uuid.UUID],
    items: list[tuple[uuid.UUID, ResultIn, Check]],
    pipeline_tail: Callable[[], None] | None = None,
) -> None:
    """Last before the commit: free the slots the settled packets ``held`` and feed the
    reporters' breakers (refusals count against them, other outcomes for them).

    These are the transaction's only writes of agent rows, and it takes their locks in
    one statement, in id order (the ledger's lock order): the slot release's own when
    it covers every agent the breakers may write, else one lock of them all first.
    When the slot release is all there is (no breaker to feed: the common case), it is
    queued to travel with the COMMIT (``pipeline_tail``): nothing reads its result."""
    refused, succeeded = _breaker_feed(items)
    if not refused and not succeeded:
        if pipeline_tail is not None:
            pipeline_tail()
        release_slots(held)
        return
    if not {*refused, *succeeded} <= set(held):
        ledger.lock_agents([*held, *refused, *succeeded])
    release_slots(held)
    breaker.record_failures(refused, breaker.Cause.REFUSAL)
    breaker.record_successes(succeeded)


def _after_commit(recorded: list[tuple[ResultIn, Applied]]) -> None:
    """Once the outcomes are committed: offer the newly Ready tasks, wake the dispatchers
    waiting for these outcomes (here or, by NOTIFY, in other processes), count them."""
    ready_queue.submit([event for _body, applied in recorded for event in applied.ready])
    announce_many(
        [
            (body.task_execution_id, Wake(body.assignment, applied.status, applied.reason))
            for body, applied in recorded
            if applied.applied
        ]
    )
    # One labelled child per kind of outcome in the batch, not a label lookup per result.
    counts = Counter((body.outcome, applied.applied) for body, applied in recorded)
    for (outcome, was_applied), n in counts.items():
        RESULTS.labels(outcome=outcome, applied=str(was_applied).lower()).inc(n)


def apply_result(tenant_id: int, agent_id: uuid.UUID, body: ResultIn) -> Answer:
    """One result in a transaction of its own (REST); the answer the agent gets."""
    with transaction.atomic():
        (check,) = _check([(tenant_id, agent_id, body)])
        with deferred_slot_releases() as held:
            ((status, answer, applied),) = _record_all([(agent_id, body, check)])
        _release_and_feed(held, [(agent_id, body, check)])
    if applied is not None:
        _after_commit([(body, applied)])
    return status, answer


def apply_results(items: list[tuple[int, uuid.UUID, ResultIn]]) -> list[Answer]:
    """Several results in ONE transaction (see the module docstring); the answers in the
    order of ``items``, each what :func:`apply_result` would have answered.

    Should the batch fail — a deadlock with another server's batch, the database going
    away — nothing of it is committed, and each result is applied again in a
    transaction of its own.
    """
    coming = 0
    try:
        try:
            # BEGIN goes out with the intake check, COMMIT with the slot release: three round
            # trips for a batch of successes (check, outcomes, release), not five.
            with batch_transaction() as tx:
                checks = _check(items, before_read=tx.sync)
                # Workflow by workflow, task by task: every batch takes the task and workflow
                # rows in one order, so two batches (two servers) cannot deadlock on them.
                order = sorted(
                    range(len(items)),
                    key=lambda i: (
                        str(checks[i].workflow_execution_id or ""),
                        str(items[i][2].task_execution_id),
                    ),
                )
                with deferred_slot_releases() as held:
                    answers = _record_all([(items[i][1], items[i][2], checks[i]) for i in order])
                    done = dict(zip(order, answers, strict=True))
                _release_and_feed(
                    held, [(items[i][1], items[i][2], checks[i]) for i in order], tx.pipeline_tail
                )
                # The COMMIT goes out as the block ends: a capacity probe from now on may read
                # these slots free before their waiters wake (capacity_estimate.CapacityEstimate).
                coming = rendezvous.commit_coming(len(items))
        except DatabaseError:
            log.warning(
                "a batch of %d results failed; applying them one by one",
                len(items),
                exc_info=True,
            )
            return [apply_result(*item) for item in items]
        _after_commit([(items[i][2], done[i][2]) for i in order if done[i][2] is not None])
    finally:
        rendezvous.commit_done(coming)
    return [done[i][:2] for i in range(len(items))]
