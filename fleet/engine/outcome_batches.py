"""Many outcomes in ONE transaction: one synchronous commit, one WAL flush for them all.

Each outcome still goes through :class:`~fleet.engine.results.TaskResultHandler` as if
alone.  :func:`batch_transaction` is the transaction both batchers use (the fleet's
socket results, :mod:`fleet.executors.fleet.result_intake`, and the in-process executor's outcomes,
:func:`apply_reports`); should a batch fail, nothing of it is committed and its
outcomes are applied again one by one.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from django.db import DatabaseError, connection, transaction

from fleet.engine.results import (
    Applied,
    TaskReport,
    deferred_slot_releases,
    release_slots,
    result_handler,
)

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
def batch_transaction() -> Iterator[None]:
    """ONE transaction for a batch of outcomes (:func:`without_savepoints`): one commit, one
    WAL flush for them all.  Raises :class:`DatabaseError` (nothing committed) if any
    outcome failed, for the caller to apply them one by one.  Callers apply the outcomes
    workflow by workflow, task by task: every batch, here or in another server, then takes
    the task and workflow rows in one order, and two batches cannot deadlock."""
    with transaction.atomic(), without_savepoints():
        yield
        if connection.needs_rollback:  # an outcome's error was caught in its handler
            raise BatchFailed("an outcome of the batch left its transaction unusable")


def apply_reports(reports: list[tuple[uuid.UUID, TaskReport]]) -> list[Applied]:
    """:meth:`TaskResultHandler.apply` for several (workflow execution id, report) pairs in
    one transaction (:func:`batch_transaction`); should the batch fail, each is applied in a
    transaction of its own (a database that is away raises from there)."""
    order = sorted(
        range(len(reports)),
        key=lambda i: (str(reports[i][0]), str(reports[i][1].task_execution_id)),
    )
    try:
        with batch_transaction():
            # What the tasks held (an executor's slots) is freed once, last, in one order.
            with deferred_slot_releases() as held:
                done = {i: result_handler.apply(reports[i][1]) for i in order}
            release_slots(held)
    except DatabaseError:
        log.warning(
            "a batch of %d outcomes failed; applying them one by one", len(reports), exc_info=True
        )
        return [result_handler.apply(report) for _workflow, report in reports]
    return [done[i] for i in range(len(reports))]
