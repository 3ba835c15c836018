"""Claiming Ready tasks: one atomic statement, so no two server processes run the same task.

A claim moves the task Ready → Running, bumps ``assignment`` (the fencing
token every outcome must name) and ``attempt``, and moves the workflow
Pending → Running.  ``release_claim`` undoes a claim that never ran (no agent,
a refusal) without using up an attempt.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from django.db import connection

from artifacts.models import WorkflowPackage
from fleet.engine.context import merge_context

# "Due" compares ready_at (written from the server's clock) with statement_timestamp(), not
# now(): now() is frozen at the start of the enclosing transaction, so a claim made
# inside a longer transaction would not see a task that became due during it.

# Extra time beyond a task's own timeout before a run with no outcome is declared lost.
RESULT_GRACE_S = 30.0

_CLAIM_COLUMNS = """
    t.id, t.workflow_execution_id, t.tenant_id, t.task_name, t.function, t.assignment,
    t.attempt, t.timeout_s, t.routing, t.priority
"""


@dataclass(frozen=True)
class Claim:
    """What the claimer needs to run one task (the fencing token is ``assignment``)."""

    task_execution_id: uuid.UUID
    workflow_execution_id: uuid.UUID
    tenant_id: int
    task_name: str
    function: str
    assignment: int
    attempt: int
    timeout_s: float
    routing: dict
    priority: int
    # Non-empty: the task row is only LOCKED by this transaction, still Ready, and this
    # claim (``assignment``, ``attempt``: the values it will have) is written by the
    # statement that places it, as this claimer (:func:`lock_work`, :func:`write_deferred`).
    deferred_claimer: str = ""


def _claims(rows, deferred_claimer: str = "") -> list[Claim]:
    # Raw cursors hand jsonb back as text (Django decodes JSONField itself).
    return [
        Claim(
            *row[:8],
            json.loads(row[8]) if isinstance(row[8], str) else row[8],
            row[9],
            deferred_claimer,
        )
        for row in rows
    ]


# What a claim writes on the task row ``t`` (its fencing token bumped, the claimer named); the
# fleet's one-trip placement folds it into the statement that also names the agent
# (fleet/executors/fleet/state/ledger.py, CLAIM_AND_RESERVE).
CLAIM_SET = (
    "status = 'Running', assignment = t.assignment + 1, attempt = t.attempt + 1, "
    "claimed_by = %(claimer)s, claimed_at = now(), started_at = now(), wait_reason = ''"
)

# The executions a claim starts (the tasks in ``claimed``), moved Pending → Running.  They
# are locked in id order like every writer of several workflow rows (a result batch's):
# two batches claiming tasks of the same new executions must not lock them in opposite
# orders and deadlock.  Shared by the claim and the claim's lock without its write.
_START_EXECUTIONS = """starting AS (
    SELECT w.id FROM fleet_workflowexecution w
    WHERE w.id IN (SELECT workflow_execution_id FROM claimed) AND w.status = 'Pending'
    ORDER BY w.id FOR NO KEY UPDATE
), running AS (
    UPDATE fleet_workflowexecution w SET status = 'Running', started_at = now()
    FROM starting s WHERE w.id = s.id AND w.status = 'Pending'
)"""

# One statement, one round trip: claim, move the workflow Pending → Running, and
# (when the claim is its own transaction) let its commit skip the WAL flush.  A
# claim need not survive a database crash on its own: a lost claim leaves the
# task Ready, so it simply runs again (at-least-once), and the outcome's commit
# is synchronous, which flushes the WAL, claim included, before it.
_CLAIM_SQL = """
WITH relax AS (
    SELECT set_config('synchronous_commit',
                      CASE WHEN %(relax)s THEN 'off' ELSE current_setting('synchronous_commit') END,
                      true) AS v
), due AS MATERIALIZED (
    -- Evaluated exactly once: inside "t.id IN (…)" the planner may re-run a LIMIT …
    -- SKIP LOCKED subquery for every candidate row, each run picking other rows, and
    -- claim more tasks than the limit (seen: three claims from LIMIT 1).
    {due}
), claimed AS (
    UPDATE fleet_taskexecution AS t SET
        {claim_set},
        result_deadline = CASE WHEN %(deadline)s
                               THEN now() + make_interval(secs => t.timeout_s + %(grace)s) END
    FROM relax
    WHERE t.id IN (SELECT id FROM due)
    RETURNING {columns}
), {start_executions}
{select}
"""
_CLAIMED = "SELECT * FROM claimed"
# A claim with everything its run needs, in the claim's own statement (one round trip, not
# three): the context's parts (the execution's input, the task's dependencies and, only
# when it has any, (task_name, dependencies, output) of every task of the execution, as
# fleet/engine/context.py's _CONTEXT_SQL reads them) and the execution's package, tenant
# name and workflow name.  The statement's snapshot holds every upstream output: the
# result that made the task Ready committed them with it, before the claim could see it.
_CLAIMED_WITH_INPUTS = """
SELECT c.*, e.input_context,
       CASE WHEN jsonb_array_length(c.dependencies) > 0 THEN (
           SELECT jsonb_agg(jsonb_build_array(o.task_name, o.dependencies, o.output_context))
           FROM fleet_taskexecution o WHERE o.workflow_execution_id = c.workflow_execution_id
       ) END,
       p.id, p.tenant_id, p.kind, p.digest, p.host_triple, tn.name, e.workflow_name
FROM claimed c
JOIN fleet_workflowexecution e ON e.id = c.workflow_execution_id
JOIN fleet_tenant tn ON tn.id = e.tenant_id
JOIN workflow_packages p ON p.id = e.package_id
"""
_ONE_DUE = """
    SELECT id FROM fleet_taskexecution
    WHERE id = %(task_execution_id)s AND status = 'Ready'
      AND (ready_at IS NULL OR ready_at <= statement_timestamp())
    FOR UPDATE SKIP LOCKED
"""
_MANY_DUE = """
    SELECT id FROM fleet_taskexecution
    WHERE status = 'Ready' AND (ready_at IS NULL OR ready_at <= statement_timestamp())
    ORDER BY priority DESC, ready_at NULLS FIRST
    LIMIT %(limit)s FOR UPDATE SKIP LOCKED
"""
_THESE_DUE = """
    SELECT id FROM fleet_taskexecution
    WHERE id = ANY(%(task_execution_ids)s::uuid[]) AND status = 'Ready'
      AND (ready_at IS NULL OR ready_at <= statement_timestamp())
    FOR UPDATE SKIP LOCKED
"""


def _claim_sql(due: str, columns: str, select: str) -> str:
    return _CLAIM_SQL.format(
        due=due, columns=columns, select=select, claim_set=CLAIM_SET,
        start_executions=_START_EXECUTIONS,
    )  # fmt: skip


# The claim's statement without its write: the due rows LOCKED (as the claim locks them),
# read as the claim would return them (``assignment`` and ``attempt`` one up), and their
# executions started all the same.  For a placement that writes the claim in the statement
# that names the agent (fleet/executors/fleet/state/ledger.py, RESERVE_AND_ENQUEUE): the
# task row gets ONE new version per placement instead of two (claim, then agent), and a
# task that finds no slot none at all (it was claimed and released: two).
_LOCK_SQL = """
WITH due AS MATERIALIZED (
    {due}
), claimed AS MATERIALIZED (
    SELECT t.id, t.workflow_execution_id, t.tenant_id, t.task_name, t.function,
           t.assignment + 1 AS assignment, t.attempt + 1 AS attempt, t.timeout_s, t.routing,
           t.priority, t.dependencies
    FROM fleet_taskexecution t WHERE t.id IN (SELECT id FROM due)
), {start_executions}
{select}
"""
_LOCK_THESE_WITH_INPUTS = _LOCK_SQL.format(
    due=_THESE_DUE, select=_CLAIMED_WITH_INPUTS, start_executions=_START_EXECUTIONS
)

# The deferred claims of rows this transaction locked (:func:`lock_work`), written: for the
# tasks that are placed one by one, or failed, rather than by the batch's reservation.  The
# assignment fence makes a second call a no-op (the rows are locked Ready, so no ``status``
# test, which would lead the planner to read every Ready task through task_ready_idx).
_WRITE_DEFERRED = f"""
UPDATE fleet_taskexecution t SET {CLAIM_SET}, result_deadline = NULL
FROM unnest(%(tasks)s::uuid[], %(assignments)s::int[]) AS c(id, assignment)
WHERE t.id = c.id AND t.assignment = c.assignment - 1
"""


_CLAIM_ONE = _claim_sql(_ONE_DUE, _CLAIM_COLUMNS, _CLAIMED)
_CLAIM_MANY = _claim_sql(_MANY_DUE, _CLAIM_COLUMNS, _CLAIMED)
_CLAIM_THESE = _claim_sql(_THESE_DUE, _CLAIM_COLUMNS, _CLAIMED)
_CLAIM_THESE_WITH_INPUTS = _claim_sql(
    _THESE_DUE, _CLAIM_COLUMNS + ", t.dependencies", _CLAIMED_WITH_INPUTS
)


@dataclass(frozen=True)
class ClaimedWork:
    """A claim with what its run needs: the task's context (exactly what
    :func:`fleet.engine.context.build_task_context` builds), the execution's package (only
    the fields dispatch reads: the manifest can be large), tenant name and workflow."""

    claim: Claim
    context: dict
    package: WorkflowPackage
    tenant_name: str
    workflow_name: str


# The package fields the claim statement reads.  The instance is built as Django builds a
# row's (``from_db``): the others deferred, not given defaults — half the cost of the
# keyword constructor, which computed each default (``built_at``'s ``timezone.now()``) for
# every claimed task, and a field nobody read is loaded if someone ever does.
_PACKAGE_FIELDS = ("id", "tenant_id", "kind", "digest", "host_triple")


def _claimed_work(row: tuple, deferred_claimer: str = "") -> ClaimedWork:
    claim = _claims([row[:10]], deferred_claimer)[0]
    # row[10] is the task's dependencies, again with the context's parts.
    input_context, dependencies, tasks = row[11], row[10], row[12]
    package_id, package_tenant, kind, digest, host_triple, tenant_name, workflow = row[13:20]
    package = WorkflowPackage.from_db(
        connection.alias, _PACKAGE_FIELDS, (package_id, package_tenant, kind, digest, host_triple)
    )
    context = merge_context(input_context, dependencies, tasks)
    return ClaimedWork(claim, context, package, tenant_name, workflow)


def _run_claim(
    sql: str, params: dict, before_read: Callable[[], None] | None = None
) -> list[tuple]:
    params["relax"] = not connection.in_atomic_block
    params["grace"] = RESULT_GRACE_S
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        if before_read is not None:
            before_read()
        return cursor.fetchall()


def claim_task(task_execution_id: uuid.UUID, claimer: str, deadline: bool = True) -> Claim | None:
    """Claim one Ready task; None when someone else got it first (or it is not due yet).

    ``deadline=False`` leaves ``result_deadline`` unset: the fleet starts the
    result-wait clock only once a packet is actually delivered to an agent.
    """
    rows = _run_claim(
        _CLAIM_ONE,
        {"task_execution_id": task_execution_id, "claimer": claimer, "deadline": deadline},
    )
    return _claims(rows)[0] if rows else None


def claim_tasks(
    task_execution_ids: list[uuid.UUID], claimer: str, deadline: bool = True
) -> list[Claim]:
    """:func:`claim_task` for several tasks in one statement: the ones still Ready and due
    (and not locked by someone claiming them right now), in no particular order."""
    return _claims(
        _run_claim(
            _CLAIM_THESE,
            {
                "task_execution_ids": list(task_execution_ids),
                "claimer": claimer,
                "deadline": deadline,
            },
        )
    )


def claim_work(
    task_execution_ids: list[uuid.UUID],
    claimer: str,
    deadline: bool = True,
    before_read: Callable[[], None] | None = None,
) -> list[ClaimedWork]:
    """:func:`claim_tasks` with each claim's context and its execution's package, tenant and
    workflow, all in the claim's one statement (what an executor reads next, without two
    more round trips).  ``before_read`` runs between sending the statement and reading its
    rows (a pipelined transaction's sync: fleet/platform/pipelined_tx.py)."""
    rows = _run_claim(
        _CLAIM_THESE_WITH_INPUTS,
        {"task_execution_ids": list(task_execution_ids), "claimer": claimer, "deadline": deadline},
        before_read,
    )
    return [_claimed_work(row) for row in rows]


def lock_work(
    task_execution_ids: list[uuid.UUID],
    claimer: str,
    before_read: Callable[[], None] | None = None,
) -> list[ClaimedWork]:
    """:func:`claim_work` without writing the claims: the tasks still Ready and due are
    locked (until the caller's transaction ends) and returned as claimed, each Claim's
    ``deferred_claimer`` set.  The caller writes each claim in the statement that places
    the task, or with :func:`write_deferred` before anything else writes the task."""
    if not claimer:
        raise ValueError("a deferred claim needs its claimer")
    params = {"task_execution_ids": list(task_execution_ids)}
    with connection.cursor() as cursor:
        cursor.execute(_LOCK_THESE_WITH_INPUTS, params)
        if before_read is not None:
            before_read()
        rows = cursor.fetchall()
    return [_claimed_work(row, claimer) for row in rows]


def write_deferred(claims: list[Claim]) -> None:
    """Write the deferred ones of these claims (:func:`lock_work`) as their claimers, in the
    caller's transaction (which holds their rows); the others are already written."""
    by_claimer: dict[str, list[Claim]] = {}
    for claim in claims:
        if claim.deferred_claimer:
            by_claimer.setdefault(claim.deferred_claimer, []).append(claim)
    with connection.cursor() as cursor:
        for claimer, deferred in by_claimer.items():
            cursor.execute(
                _WRITE_DEFERRED,
                {
                    "claimer": claimer,
                    "tasks": [c.task_execution_id for c in deferred],
                    "assignments": [c.assignment for c in deferred],
                },
            )


def claim_ready_tasks(claimer: str, limit: int, deadline: bool = True) -> list[Claim]:
    """Claim up to ``limit`` due Ready tasks, highest priority then oldest first (SKIP LOCKED)."""
    return _claims(
        _run_claim(_CLAIM_MANY, {"limit": limit, "claimer": claimer, "deadline": deadline})
    )


def due_ready_task_events(limit: int) -> list[tuple]:
    """(id, workflow_execution_id, task_name, attempt + 1, tenant_id, priority) of due Ready
    tasks, unlocked: each tenant's highest priority then oldest first, the tenants
    interleaved (every tenant's first task, then every tenant's second, …), so that a
    tenant with a huge backlog cannot fill ``limit`` and hide another tenant's work."""
    with connection.cursor() as cursor:
        cursor.execute(
            """
            SELECT id, workflow_execution_id, task_name, attempt + 1, tenant_id, priority FROM (
                SELECT id, workflow_execution_id, task_name, attempt, tenant_id, priority, ready_at,
                       row_number() OVER (PARTITION BY tenant_id
                                          ORDER BY priority DESC, ready_at NULLS FIRST) AS turn
                FROM fleet_taskexecution
                WHERE status = 'Ready' AND (ready_at IS NULL OR ready_at <= statement_timestamp())
            ) due
            ORDER BY turn, priority DESC, ready_at NULLS FIRST LIMIT %s
            """,
            [limit],
        )
        return cursor.fetchall()


def release_set(task: str, reason: str) -> str:
    """SQL SET clause: the claimed task row aliased ``task`` back to Ready without using up an
    attempt, ``reason`` (SQL) its wait reason.  :func:`release_claim`'s, and the fleet's
    reservation folds it into its statement for the tasks that got no slot."""
    return (
        f"status = 'Ready', attempt = GREATEST({task}.attempt - 1, 0), wait_reason = {reason}, "
        "agent_id = NULL, claimed_by = '', result_deadline = NULL"
    )


_RELEASE = f"""
UPDATE fleet_taskexecution SET {release_set("fleet_taskexecution", "%s")},
    refusals = refusals + %s
WHERE id = %s AND assignment = %s AND status = 'Running'
"""


def release_claim(
    task_execution_id: uuid.UUID, assignment: int, reason: str, refused: bool = False
) -> bool:
    """Put a claimed-but-not-run task back to Ready without using up an attempt.

    The assignment stays bumped, so any outcome for the released run is fenced off.
    """
    with connection.cursor() as cursor:
        cursor.execute(_RELEASE, [reason, 1 if refused else 0, task_execution_id, assignment])
        return cursor.rowcount == 1


def note_wait_reason(released: list[tuple[uuid.UUID, int]], reason: str) -> None:
    """Say why these Ready (task id, assignment) tasks wait, unless they moved on since; a
    row that already says so is not written again (a task waiting through many placement
    rounds for the same reason gets no new row version per round)."""
    with connection.cursor() as cursor:
        cursor.execute(
            """
            UPDATE fleet_taskexecution t SET wait_reason = %s
            FROM unnest(%s::uuid[], %s::int[]) AS r(id, assignment)
            WHERE t.id = r.id AND t.assignment = r.assignment AND t.status = 'Ready'
              AND t.wait_reason <> %s
            """,
            [reason, [r[0] for r in released], [r[1] for r in released], reason],
        )
