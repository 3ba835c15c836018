"""Placing one Ready task on the fleet, in ONE transaction: claim → context → reserve → enqueue.

Either all of it commits (the task is Running, an agent slot is reserved, the
packet is in ``delivery_outbox`` addressed to that agent and the task names
the agent) or, when no agent has room, the claim is released with the reason
(back to Ready, no attempt used).  A crash in between leaves nothing behind:
no claim without a packet, no slot without a row.

The agent is chosen by :mod:`fleet.routing.selection` (the task's selectors, its
group/affinity bindings).  A task no agent could ever take (NoMatchingAgent, a
selector that cannot be used, an input context over the configured maximum) fails
at once, through the result handler and without retries: waiting would never help.
A context too large for one WebSocket frame travels by reference
(:mod:`fleet.delivery.context_ref`).
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections import OrderedDict
from dataclasses import dataclass

from django.db import connection, transaction
from django.utils import timezone

from artifacts.models import WorkflowPackage
from artifacts.queries import resolve_artifact, runnable_triples
from cloacina_site.config import get_config
from fleet.delivery import context_ref
from fleet.delivery.outbox import PackageRef, enqueue_on_best_agent, work_packet
from fleet.engine import ready_queue
from fleet.engine.claims import Claim, claim_task, release_claim
from fleet.engine.context import build_task_context, encode_context
from fleet.engine.events import ExecutionStatus
from fleet.engine.results import TaskReport, result_handler
from fleet.models import Outcome, TaskExecution, TaskOutcome, TaskStatus
from fleet.routing import selection
from fleet.routing.metrics import SELECTION_FAILURE
from fleet.routing.selectors import SelectorError

log = logging.getLogger(__name__)

EXECUTION_CACHE_SIZE = 4096


@dataclass(frozen=True)
class Placed:
    tenant_id: int
    assignment: int
    agent_id: uuid.UUID
    agent_name: str


@dataclass(frozen=True)
class NoAgent:
    tenant_id: int
    reason: str


@dataclass(frozen=True)
class NotClaimed:
    reason: str = "not Ready: claimed elsewhere, finished, or not due yet"
    status: ExecutionStatus = ExecutionStatus.SUPERSEDED


@dataclass(frozen=True)
class Unroutable(NotClaimed):
    """Claimed, then failed for good: no agent could ever run it (the reason says why)."""

    status: ExecutionStatus = ExecutionStatus.FAILED


class _ExecutionInfo:
    """workflow execution → (package, tenant name, workflow name); immutable for an
    execution's life."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cache: OrderedDict[uuid.UUID, tuple[WorkflowPackage, str, str]] = OrderedDict()

    def get(self, workflow_execution_id: uuid.UUID) -> tuple[WorkflowPackage, str, str]:
        with self._lock:
            hit = self._cache.get(workflow_execution_id)
            if hit is not None:
                self._cache.move_to_end(workflow_execution_id)
                return hit
        with connection.cursor() as cursor:
            cursor.execute(
                """
                SELECT p.id, p.tenant_id, p.kind, p.digest, p.host_triple, t.name,
                       e.workflow_name
                FROM fleet_workflowexecution e
                JOIN workflow_packages p ON p.id = e.package_id
                JOIN fleet_tenant t ON t.id = e.tenant_id
                WHERE e.id = %s
                """,
                [workflow_execution_id],
            )
            pk, tenant_id, kind, digest, host_triple, tenant_name, workflow = cursor.fetchone()
        # Only the fields dispatch reads (the manifest can be large).
        package = WorkflowPackage(
            id=pk, tenant_id=tenant_id, kind=kind, digest=digest, host_triple=host_triple
        )
        value = (package, tenant_name, workflow)
        with self._lock:
            self._cache[workflow_execution_id] = value
            while len(self._cache) > EXECUTION_CACHE_SIZE:
                self._cache.popitem(last=False)
        return value


_executions = _ExecutionInfo()


def place_task(task_execution_id: uuid.UUID, claimer: str) -> Placed | NoAgent | NotClaimed:
    """Claim the task and hand it to an agent through the outbox (see module docstring)."""
    with transaction.atomic():
        claim = claim_task(task_execution_id, claimer, deadline=False)
        if claim is None:
            return NotClaimed()
        prepared = prepare(claim)
        if isinstance(prepared, Unroutable):
            return prepared
        return place_prepared(prepared)


@dataclass(frozen=True)
class Prepared:
    """A claimed task with everything its packet needs, before an agent is chosen.

    (Split from :func:`place_task` so that :mod:`fleet.delivery.batch_placement` can
    place many claims in one transaction and reserve the plain ones together.)
    """

    claim: Claim
    package: WorkflowPackage
    triples: frozenset[str] | None
    request: selection.Request
    payload: dict
    digests: dict[str, str] | None


def prepare(claim: Claim, context: dict | None = None) -> Prepared | Unroutable:
    """Build the claimed task's context (unless the caller built it, e.g. with
    ``build_task_contexts`` for a batch) and packet, in the caller's transaction; a task
    no agent could ever take fails here (:class:`Unroutable`)."""
    package, tenant_name, workflow = _executions.get(claim.workflow_execution_id)
    triples = runnable_triples(package)
    # Everything is ready before the reservation: the agent's row stays locked
    # (other dispatches skip it, its results and beats wait) only for one
    # statement and the commit.
    if context is None:
        context = build_task_context(claim.task_execution_id)
    context_json = encode_context(context)
    oversize = context_ref.too_large(context_json, get_config().max_context_bytes)
    if oversize:
        return _fail(claim, "ContextTooLarge", oversize, "context_too_large")
    try:
        request = selection.request_for(
            claim.tenant_id, claim.routing, claim.workflow_execution_id, workflow, context
        )
    except SelectorError as exc:
        return _fail(claim, "InvalidSelector", str(exc), "invalid_selector")
    ref = PackageRef(digest=package.digest, kind=package.kind, target_triple="")
    payload = context_ref.packet_context(
        work_packet(claim, context_json, ref, tenant_name), context_json
    )
    return Prepared(claim, package, triples, request, payload, _digests_by_triple(package, triples))


def place_prepared(prepared: Prepared) -> Placed | NoAgent | Unroutable:
    """Choose the agent of one prepared claim and enqueue its packet (the caller's
    transaction), or release the claim / fail the task saying why."""
    claim = prepared.claim
    outcome = selection.select(
        prepared.request,
        prepared.triples,
        lambda choice: enqueue_on_best_agent(
            claim,
            prepared.payload,
            prepared.triples,
            prepared.package.digest,
            prepared.digests,
            choice=choice,
        ),
    )
    if isinstance(outcome, selection.NoMatchingAgent):
        return _fail(claim, outcome.error_type, outcome.reason)
    if isinstance(outcome, selection.NoFreeAgent):
        release_claim(claim.task_execution_id, claim.assignment, outcome.reason)
        return NoAgent(claim.tenant_id, outcome.reason)
    agent = outcome.agent
    return Placed(claim.tenant_id, claim.assignment, agent.id, agent.name)


def _fail(claim: Claim, error_type: str, message: str, metric: str = "") -> Unroutable:
    """Fail the claimed run for good (no retry: nothing would change) through the handler."""
    if metric:
        SELECTION_FAILURE.labels(reason=metric).inc()
    applied = result_handler.apply(
        TaskReport(
            claim.task_execution_id, claim.assignment, Outcome.FAILURE,
            error_type=error_type, error_message=message, retryable=False,
        )
    )  # fmt: skip
    # Dependents (skipped, or Ready by trigger rule) are offered once this commits.
    transaction.on_commit(lambda: ready_queue.submit(applied.ready))
    log.warning(
        "task %s (%s) failed: %s: %s", claim.task_execution_id, claim.task_name, error_type, message
    )
    return Unroutable(f"{error_type}: {message}")


def _digests_by_triple(package: WorkflowPackage, triples) -> dict[str, str] | None:
    """Native packages: the artifact to ship per agent triple (None: python, one for all)."""
    if triples is None:
        return None
    digests = {}
    for triple in triples:
        artifact = resolve_artifact(package, triple)
        if artifact is not None:
            digests[triple] = artifact.digest
    return digests


def run_status(task_execution_id: uuid.UUID, assignment: int) -> ExecutionStatus | None:
    """What became of this run according to the database; None while it is still open.

    A run past its result deadline is declared lost here (through the result
    handler, so the task's retry policy applies).
    """
    task = (
        TaskExecution.objects.filter(pk=task_execution_id)
        .values("status", "assignment", "result_deadline")
        .first()
    )
    if task is None:
        return ExecutionStatus.SUPERSEDED
    if task["status"] == TaskStatus.RUNNING and task["assignment"] == assignment:
        deadline = task["result_deadline"]
        if deadline is None or deadline > timezone.now():
            return None
        applied = result_handler.apply(
            TaskReport(
                task_execution_id, assignment, Outcome.LOST, error_type="ResultLost",
                error_message=f"no outcome reported by the result deadline {deadline.isoformat()}",
            )
        )  # fmt: skip
        ready_queue.submit(applied.ready)
        return applied.status if applied.applied else run_status(task_execution_id, assignment)
    outcome = (
        TaskOutcome.objects.filter(task_id=task_execution_id, assignment=assignment, applied=True)
        .values_list("outcome", flat=True)
        .first()
    )
    if outcome is None:
        return ExecutionStatus.SUPERSEDED
    if outcome == Outcome.SUCCESS:
        return ExecutionStatus.COMPLETED
    if task["assignment"] == assignment and task["status"] == TaskStatus.FAILED:
        return ExecutionStatus.FAILED
    if outcome == Outcome.REFUSED:
        return ExecutionStatus.REQUEUED
    return ExecutionStatus.RETRY
