"""Many outcomes in ONE transaction: one synchronous commit, one WAL flush for them all.

:func:`apply_in_batch` applies the batch's current successes as a set
(:mod:`fleet.engine.success_sets`: one statement for N of them) and every other outcome
through :class:`~fleet.engine.results.TaskResultHandler` as if alone.
:func:`batch_transaction` is the transaction both batchers use (the fleet's
socket results, :mod:`fleet.executors.fleet.result_intake`, and the in-process executor's
outcomes, :func:`apply_reports`), its ``BEGIN`` and ``COMMIT`` travelling with the first and
last statements; should a batch fail, nothing of it is committed and its outcomes are
applied again one by one.
"""

from __future__ import annotations

import logging
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from django.db import DatabaseError, connection

from fleet.engine import success_sets
from fleet.engine.results import (
    Applied,
    TaskReport,
    deferred_slot_releases,
    release_slots,
    result_handler,
)
from fleet.models import Outcome
from fleet.platform.pipelined_tx import pipelined_atomic

log = logging.getLogger(__name__)


class BatchFailed(DatabaseError):
    """A batch must be rolled back and its outcomes applied one by one."""


@contextmanager
def without_savepoints() -> Iterator[None]:
    """Within one batch, the handler's own atomic blocks make no savepoint: two round trips
    less per outcome.  An outcome whose handler fails then fails the whole batch (nothing of
    it is committed), and every outcome is applied again in a transaction of its own."""
    features = connection.features
    features.uses_savepoints = False  # this thread's connection only
    try:
        yield
    finally:
        del features.uses_savepoints  # back to the class's (True)


@contextmanager
def batch_transaction() -> Iterator[pipelined_atomic]:
    """ONE transaction for a batch of outcomes (:func:`without_savepoints`): one commit, one
    WAL flush for them all.  Raises :class:`DatabaseError` (nothing committed) if any
    outcome failed, for the caller to apply them one by one.  Callers apply the outcomes
    workflow by workflow, task by task: every batch, here or in another server, then takes
    the task and workflow rows in one order, and two batches cannot deadlock.

    Its ``BEGIN`` travels with the batch's first statement and its ``COMMIT`` with the last
    (:mod:`fleet.platform.pipelined_tx`): the caller calls ``tx.sync()`` between sending its
    first statement and reading it, and may call ``tx.pipeline_tail()`` before statements
    whose results nobody reads before the commit.  Two round trips fewer per batch; the
    commit is as synchronous as ever, and nobody is answered before it."""
    with pipelined_atomic() as tx, without_savepoints():
        yield tx
        if connection.needs_rollback:  # an outcome's error was caught in its handler
            raise BatchFailed("an outcome of the batch left its transaction unusable")


def apply_in_batch(
    reports: list[TaskReport], before_first_read: Callable[[], None] | None = None
) -> list[Applied]:
    """Apply ``reports`` (in the caller's batch transaction and
    :func:`deferred_slot_releases` block; in the order the caller sorted them) and return
    what each did.  The successes of tasks named once in the batch go first, as one set
    (:func:`success_sets.complete_current`); everything else — failures, refusals, a task
    named twice, a success that was not current — then goes through the per-row handler
    in the given order, which fences and records it exactly as for a report alone.  A lone
    success takes the per-row path too: a set of one saves nothing, and the per-row
    handler answers a concurrent duplicate's unique violation itself.

    ``before_first_read`` runs between sending the batch's first statement and reading it
    (a pipelined transaction's sync, which also leaves pipeline mode before the per-row
    path's ORM work); it must be idempotent."""
    prepared = [result_handler.prepare(report) for report in reports]
    named = Counter(report.task_execution_id for report in reports)
    candidates = [
        i
        for i, (report, _output) in enumerate(prepared)
        if report.outcome == Outcome.SUCCESS and named[report.task_execution_id] == 1
    ]
    if len(candidates) < 2:  # nothing to fold: the per-row path (its own savepoint, if any)
        candidates = []
    done = success_sets.complete_current(
        [prepared[i] for i in candidates], before_read=before_first_read
    )
    if before_first_read is not None:
        before_first_read()  # no set was sent: out of pipeline mode before the per-row path
    applied = {i: result for i, result in zip(candidates, done, strict=True) if result is not None}
    for i, report in enumerate(reports):
        if i not in applied:
            applied[i] = result_handler.apply(report)
    return [applied[i] for i in range(len(reports))]


def apply_reports(reports: list[tuple[uuid.UUID, TaskReport]]) -> list[Applied]:
    """:meth:`TaskResultHandler.apply` for several (workflow execution id, report) pairs in
    one transaction (:func:`batch_transaction`); should the batch fail, each is applied in a
    transaction of its own (a database that is away raises from there)."""
    order = sorted(
        range(len(reports)),
        key=lambda i: (str(reports[i][0]), str(reports[i][1].task_execution_id)),
    )
    try:
        # BEGIN goes out with the batch's first statement (most often its set of
        # successes), COMMIT with the slot release when there is one to free.
        with batch_transaction() as tx:
            # What the tasks held (an executor's slots) is freed once, last, in one order.
            with deferred_slot_releases() as held:
                applied = apply_in_batch([reports[i][1] for i in order], tx.sync)
                done = dict(zip(order, applied, strict=True))
            tx.pipeline_tail()
            release_slots(held)
    except DatabaseError:
        log.warning(
            "a batch of %d outcomes failed; applying them one by one", len(reports), exc_info=True
        )
        return [result_handler.apply(report) for _workflow, report in reports]
    return [done[i] for i in range(len(reports))]
