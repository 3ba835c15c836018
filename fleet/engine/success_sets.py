"""A batch's current successes applied as a set: one statement for N of them.

The result handler (:mod:`fleet.engine.results`) applies an outcome per statement; in a
batch of results that made the outcome statement a third of all statements per task and
most of the database's CPU.  :func:`complete_current` applies the commonest outcome — a
success for the task's current assignment — for many distinct tasks at once:

1. ONE statement fences each task on its assignment (and reporting agent), completes it
   with its output, records the outcome, and finds which tasks have undecided
   dependents.  When none has, the same statement lowers each workflow's open-task
   counter and settles the executor's side through the settle hook's fragment
   (:mod:`fleet.engine.hooks`: the fleet acks the packets and hands back the agents
   that held them).
2. Otherwise the dependents are decided task by task (:func:`scheduler.settle`, which
   must read their dependencies in a later statement than it locks them), and ONE more
   statement closes every workflow and settles every task.
3. ONE statement finishes every workflow whose counter reached zero.

Locks, in the order of docs/fleet.md ("Lock order"): the task rows in id order, their
dependents, the workflow rows in id order, the outbox rows; the agents' slots are left
to the batch's one release at its end.  A report that is not current (stale, a
duplicate, a reclaimed task) is left alone here and comes back as ``None``: the caller
applies it through the per-row path, which records why it was refused.
"""

from __future__ import annotations

import uuid
from collections import defaultdict
from collections.abc import Callable
from typing import NamedTuple

from django.db import connection

from fleet.engine import hooks, scheduler
from fleet.engine.events import ExecutionStatus
from fleet.engine.results import (
    HEAD_CTE,
    Applied,
    TaskHead,
    TaskReport,
    hand_over_holders,
    result_handler,
)
from fleet.models import WORKFLOW_TERMINAL

# The workflows of relation ``n`` (columns id, n) locked in id order and their open-task
# counters lowered by n.
_CLOSE = """, wlocked AS (
    SELECT w.id FROM fleet_workflowexecution w JOIN n ON n.id = w.id
    ORDER BY w.id FOR NO KEY UPDATE OF w
), closed AS (
    UPDATE fleet_workflowexecution w SET open_tasks = GREATEST(w.open_tasks - n.n, 0)
    FROM n, wlocked WHERE w.id = n.id AND wlocked.id = w.id
    RETURNING w.id, w.open_tasks, w.status
)"""

# What the settled tasks held, on one row of a set statement's answer and NULL on the others
# (:func:`_holders` finds it).  On every row, a batch of N successes loaded N² agent ids
# into Python (a uuid object each): under load, when batches are largest, that was most
# of the set's client-side cost (docs/performance.md, "Round i17-burst3").
_HOLDERS = "CASE WHEN row_number() OVER () = 1 THEN (SELECT array_agg(holder) FROM held) END"

# Step 1.  ``locked`` takes the task rows in id order, re-checking the fence on the newest
# row version after any wait (a reclaim that committed meanwhile drops the row); the
# UPDATE repeats the fence.  Workflows are closed and tasks settled only when no task of
# the set has an undecided dependent (``leaves``): else step 2 does both, after the
# dependents are locked, so the workflow rows are never taken before them.
_COMPLETE_SET = """
WITH r AS (
    SELECT * FROM unnest(%(tasks)s::uuid[], %(assignments)s::integer[], %(agents)s::uuid[],
                         %(agent_names)s::text[], %(outputs)s::text[])
        AS r(task, assignment, agent, agent_name, output)
), locked AS (
    SELECT t.id FROM fleet_taskexecution t JOIN r ON r.task = t.id
    WHERE t.status = 'Running' AND t.assignment = r.assignment
      AND (r.agent IS NULL OR t.agent_id = r.agent)
    ORDER BY t.id FOR NO KEY UPDATE OF t
), done AS (
    UPDATE fleet_taskexecution t SET status = 'Completed', output_context = r.output::jsonb,
        finished_at = now(), error_type = '', error_message = '', traceback = ''
    FROM r, locked
    WHERE locked.id = t.id AND r.task = t.id AND t.status = 'Running'
      AND t.assignment = r.assignment AND (r.agent IS NULL OR t.agent_id = r.agent)
    RETURNING t.id, t.assignment, t.agent_id, t.attempt, t.workflow_execution_id,
        t.task_name, r.agent_name
), recorded AS (
    INSERT INTO fleet_taskoutcome (task_execution_id, assignment, attempt, outcome, applied,
        ignored_reason, agent_name, error_type, error_message, received_at)
    SELECT id, assignment, attempt, 'success', true, '', agent_name, '', '', now() FROM done
){head}, leaves AS (
    SELECT NOT EXISTS (SELECT 1 FROM head WHERE has_dependents) AS leaves_only
), n AS (
    SELECT workflow_execution_id AS id, count(*)::integer AS n FROM head
    WHERE (SELECT leaves_only FROM leaves) GROUP BY workflow_execution_id
){close}, settling AS (
    SELECT id AS task_execution_id, assignment FROM head WHERE (SELECT leaves_only FROM leaves)
){settle}
SELECT h.id, h.assignment, h.agent_id, h.attempt, h.workflow_execution_id, h.task_name,
    h.has_dependents, c.open_tasks, c.status, {holders}
FROM head h LEFT JOIN closed c ON c.id = h.workflow_execution_id
"""

# Step 2's closing statement: every workflow's counter lowered by the tasks it settled
# (completed + skipped dependents), every completed task settled by the hook.
_CLOSE_SET = """
WITH n AS (
    SELECT * FROM unnest(%(workflows)s::uuid[], %(counts)s::integer[]) AS n(id, n)
){close}, settling AS (
    SELECT * FROM unnest(%(tasks)s::uuid[], %(assignments)s::integer[])
        AS s(task_execution_id, assignment)
){settle}
SELECT c.id, c.open_tasks, c.status, {holders}
FROM (SELECT 1) AS one LEFT JOIN closed c ON true
"""


class _Statements(NamedTuple):
    complete: str
    close: str


def _build() -> _Statements:
    # Always the holding form: the freeing form frees one slot per agent, not one per
    # packet, and a set may hold several packets of one agent.
    settle = hooks.settle_ctes("settling", release=False)
    return _Statements(
        _COMPLETE_SET.format(head=HEAD_CTE, close=_CLOSE, settle=settle, holders=_HOLDERS),
        _CLOSE_SET.format(close=_CLOSE, settle=settle, holders=_HOLDERS),
    )


_statements = hooks.PerHook(_build)  # built once per registered settle hook


Closed = dict[uuid.UUID, tuple[int, str]]  # workflow → (open tasks, status) after closing


def complete_current(
    items: list[tuple[TaskReport, str]], before_read: Callable[[], None] | None = None
) -> list[Applied | None]:
    """Apply each (report, output JSON) — successes of distinct tasks, as
    :meth:`TaskResultHandler.prepare` returned them — if it names the task's current
    assignment (and holder); ``None`` for each that does not, for the per-row path.

    Runs in the caller's transaction; what the settled tasks held goes to the batch's
    slot release (:func:`fleet.engine.results.hand_over_holders`).  ``before_read`` runs
    between sending the set's statement and reading its rows (a pipelined transaction's
    sync: its BEGIN travels with the statement)."""
    if not items:
        return []
    tasks = [report.task_execution_id for report, _output in items]
    if len(set(tasks)) != len(tasks):
        raise ValueError("complete_current takes at most one report per task")
    statements = _statements()
    with connection.cursor() as cursor:
        cursor.execute(statements.complete, _complete_params(items))
        if before_read is not None:
            before_read()
        rows = cursor.fetchall()
        heads = {
            row[0]: TaskHead(row[0], "Completed", *row[1:6], has_dependents=row[6]) for row in rows
        }
        results = {task: Applied(True, ExecutionStatus.COMPLETED) for task in heads}
        for report, _output in items:
            head = heads.get(report.task_execution_id)
            if head is not None:
                result_handler.store_log(cursor, head, report)
        if any(head.has_dependents for head in heads.values()):
            closed, held = _settle_and_close(cursor, statements, heads, results)
        else:
            closed = {row[4]: (row[7], row[8]) for row in rows}
            held = _holders(rows, 9)
    hand_over_holders(list(held or []))
    scheduler.finish_many(
        [
            workflow
            for workflow, (open_tasks, status) in closed.items()
            if open_tasks == 0 and status not in WORKFLOW_TERMINAL
        ]
    )
    return [results.get(task) for task in tasks]


def _complete_params(items: list[tuple[TaskReport, str]]) -> dict:
    return {
        "tasks": [report.task_execution_id for report, _output in items],
        "assignments": [report.assignment for report, _output in items],
        "agents": [report.agent_id for report, _output in items],
        "agent_names": [report.agent_name[:200] for report, _output in items],
        "outputs": [output for _report, output in items],
    }


def _settle_and_close(
    cursor, statements: _Statements, heads: dict[uuid.UUID, TaskHead], results: dict
) -> tuple[Closed, list | None]:
    """Step 2: decide the dependents workflow by workflow, task by task (each dependent
    locked, then its dependencies read afresh), then close and settle all in one statement."""
    counts: dict[uuid.UUID, int] = defaultdict(int)
    for head in sorted(heads.values(), key=lambda h: (h.workflow_execution_id, h.id)):
        skipped = 0
        if head.has_dependents:
            ready, skipped = scheduler.settle(head)
            results[head.id].ready = ready
        counts[head.workflow_execution_id] += 1 + skipped
    workflows = sorted(counts)
    cursor.execute(
        statements.close,
        {
            "workflows": workflows,
            "counts": [counts[workflow] for workflow in workflows],
            "tasks": list(heads),
            "assignments": [head.assignment for head in heads.values()],
        },
    )
    rows = cursor.fetchall()
    closed = {row[0]: (row[1], row[2]) for row in rows if row[0] is not None}
    return closed, _holders(rows, 3)


def _holders(rows: list[tuple], column: int) -> list | None:
    """The ``_HOLDERS`` column's one value among ``rows`` (None: nothing was held)."""
    return next((row[column] for row in rows if row[column] is not None), None)
