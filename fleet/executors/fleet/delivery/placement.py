"""Placing work on the fleet: THE placement path, for one task, a batch, and reclaim.

One Ready task is placed in ONE transaction: claim → context → reserve → enqueue.

Either all of it commits (the task is Running, an agent slot is reserved, the
packet is in ``delivery_outbox`` addressed to that agent and the task names
the agent) or, when no agent has room, the claim is released with the reason
(back to Ready, no attempt used).  A crash in between leaves nothing behind:
no claim without a packet, no slot without a row.

The agent is chosen by :mod:`fleet.executors.fleet.routing.selection` (the task's selectors, its
group/affinity bindings).  A task no agent could ever take (NoMatchingAgent, a
selector that cannot be used, an input context over the configured maximum) fails
at once, through the result handler and without retries: waiting would never help.
A context too large for one WebSocket frame travels by reference
(:mod:`fleet.executors.fleet.delivery.context_ref`).

The reservation is one routine for 1..N slots (:func:`reserve`): a task with
selectors or bindings, a lone task, or a reclaimed packet takes one slot in one
statement (:func:`reserve_agent`, with what the slot is for folded into the same
statement); plain tasks of one package placed together take N slots in one
statement (the batch form, :data:`fleet.executors.fleet.state.ledger.RESERVE_AND_ENQUEUE`).  The SQL that
takes the slot and writes the packet is the ledger's (:mod:`fleet.executors.fleet.state.ledger`).
:mod:`fleet.executors.fleet.delivery.batch_placement` claims batches and :mod:`fleet.executors.fleet.delivery.liveness`
reclaims a dead agent's packets through this module.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field

from django.db import connection, transaction
from django.utils import timezone

from artifacts.models import WorkflowPackage
from artifacts.store.queries import resolve_artifact, runnable_triples
from fleet.engine import ready_queue
from fleet.engine.claims import (
    CLAIM_SET,
    RESULT_GRACE_S,
    Claim,
    ClaimedWork,
    claim_work,
    release_claim,
    write_deferred,
)
from fleet.engine.context import build_task_context, encode_context
from fleet.engine.events import ExecutionStatus
from fleet.engine.results import TaskReport, result_handler
from fleet.executors.fleet.delivery import context_ref, local_sockets
from fleet.executors.fleet.delivery.outbox import PackageRef, work_packet
from fleet.executors.fleet.routing import affinity, selection
from fleet.executors.fleet.routing.candidates import (
    ReservedAgent,
    candidate_params,
    candidates_sql,
    group_candidate_params,
    group_candidates_sql,
    tenants_candidates_sql,
)
from fleet.executors.fleet.routing.metrics import SELECTION_FAILURE
from fleet.executors.fleet.routing.selectors import (
    CANDIDATES,
    UNCONSTRAINED,
    Choice,
    SelectorError,
    Selectors,
    best_score_per_tenant,
    tiebreak,
)
from fleet.executors.fleet.state import ledger
from fleet.models import Outcome, TaskExecution, TaskOutcome, TaskStatus
from fleet.platform.config import get_config

log = logging.getLogger(__name__)


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


def place_task(task_execution_id: uuid.UUID, claimer: str) -> Placed | NoAgent | NotClaimed:
    """Claim the task and hand it to an agent through the outbox (see module docstring)."""
    with transaction.atomic():
        claimed = claim_work([task_execution_id], claimer, deadline=False)
        if not claimed:
            return NotClaimed()
        prepared = prepare(claimed[0])
        if isinstance(prepared, Unroutable):
            return prepared
        return place_prepared(prepared)


@dataclass(frozen=True)
class Prepared:
    """A claimed task with everything its packet needs, before an agent is chosen.

    (Split from :func:`place_task` so that :mod:`fleet.executors.fleet.delivery.batch_placement` can
    place many claims in one transaction and reserve the plain ones together.)
    """

    claim: Claim
    package: WorkflowPackage
    triples: frozenset[str] | None
    request: selection.Request
    payload: dict
    digests: dict[str, str] | None


def prepare(work: ClaimedWork) -> Prepared | Unroutable:
    """Build the claimed task's packet from what its claim statement read (its context, its
    execution's package: :func:`fleet.engine.claims.claim_work`), in the caller's
    transaction; a task no agent could ever take fails here (:class:`Unroutable`)."""
    claim, package, context = work.claim, work.package, work.context
    triples = runnable_triples(package)
    # Everything is ready before the reservation: the agent's row stays locked
    # (other dispatches skip it, its results and beats wait) only for one
    # statement and the commit.
    context_json = encode_context(context)
    oversize = context_ref.too_large(context_json, get_config().max_context_bytes)
    if oversize:
        return _fail(claim, "ContextTooLarge", oversize, "context_too_large")
    try:
        request = selection.request_for(
            claim.tenant_id, claim.routing, claim.workflow_execution_id, work.workflow_name, context
        )
    except SelectorError as exc:
        return _fail(claim, "InvalidSelector", str(exc), "invalid_selector")
    ref = PackageRef(digest=package.digest, kind=package.kind, target_triple="")
    payload = context_ref.packet_context(
        work_packet(claim, context_json, ref, work.tenant_name), context_json
    )
    return Prepared(claim, package, triples, request, payload, _digests_by_triple(package, triples))


def place_prepared(prepared: Prepared, wait: bool = True) -> Placed | NoAgent | Unroutable:
    """Choose the agent of one prepared claim and enqueue its packet (the caller's
    transaction), or release the claim / fail the task saying why.  ``wait=False``: the
    caller already locked its agent rows (:func:`lock_up_front`), so candidates locked by
    others are passed over, never waited for (see :func:`reserve_agent`)."""
    claim = prepared.claim
    write_deferred([claim])  # a batch's claim only locked so far: written before the rest
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
            wait=wait,
        ),
    )
    if isinstance(outcome, selection.NoMatchingAgent):
        return _fail(claim, outcome.error_type, outcome.reason)
    if isinstance(outcome, selection.NoFreeAgent):
        release_claim(claim.task_execution_id, claim.assignment, outcome.reason)
        return NoAgent(claim.tenant_id, outcome.reason)
    agent = outcome.agent
    return Placed(claim.tenant_id, claim.assignment, agent.id, agent.name)


# -- the reservation: 1..N slots, each form one statement -----------------------------

# Rounds of SKIP LOCKED before one blocking attempt: a row locked by a concurrent
# reservation may still have room once that transaction commits.
SKIP_LOCKED_ROUNDS = 2


def reserve_agent(
    tenant_id: int,
    triples: Iterable[str] | None = None,
    then_sql: str = ledger.RESERVED_AGENT,
    then_params: dict | None = None,
    choice: Choice | None = None,
    wait: bool = True,
) -> ReservedAgent | None:
    """Take ONE slot on the best agent for the tenant, or None when no agent has room.

    ``triples`` limits the choice to agents of those target triples (None: any);
    ``choice`` adds the task's selectors (None: none).  ``then_sql`` runs in the same
    statement after the reservation (the CTE ``reserved`` holds the chosen agent), so
    a caller can insert what the slot is for without holding the agent's row lock any
    longer than the statement and the commit (:func:`enqueue_on_best_agent`).  Runs in
    the caller's transaction; the slot is given back when the outbox row is acked
    (:mod:`fleet.executors.fleet.state.ledger`).

    ``wait``: after the SKIP LOCKED rounds, wait for a candidate locked by a concurrent
    reservation.  Only a transaction that holds no other agent row may wait (the lock
    order, ledger module docstring); a placement batch that locked its agents up front
    passes False.
    """
    choice = choice or UNCONSTRAINED
    params = {**choice.params, **candidate_params(tenant_id, triples), **(then_params or {})}
    candidates = candidates_sql(choice)
    order = choice.order.replace(CANDIDATES, candidates)
    with connection.cursor() as cursor:
        for _ in range(SKIP_LOCKED_ROUNDS):
            sql = ledger.reserve_one_sql(candidates, order, skip_locked=True)
            row = _attempt(cursor, f"WITH reserved AS ({sql}) {then_sql}", params)
            if row is not None:
                return ReservedAgent(*row)
            cursor.execute(ledger.any_candidate_sql(candidates), params)
            if not cursor.fetchone()[0]:
                return None  # nothing to wait for: every candidate is full or absent
        if not wait:
            return None  # the free candidates are another transaction's right now
        # Candidates exist but are locked by concurrent reservations: wait for one; the
        # UPDATE re-checks the free slot on the committed row.
        sql = ledger.reserve_one_sql(candidates, order, skip_locked=False)
        row = _attempt(cursor, f"WITH reserved AS ({sql}) {then_sql}", params)
        return ReservedAgent(*row) if row is not None else None


def _attempt(cursor, sql: str, params: dict) -> tuple | None:
    """Run one reservation statement in a savepoint; its row, or None with the savepoint
    rolled back.  A statement that took nothing may still hold the lock of a row it found
    full once the lock came (the recheck after a lock wait keeps the lock): rolling back
    lets it go, so a reservation never waits for an agent while holding another it did not
    take — the wait cycle two reservations would otherwise deadlock in."""
    with transaction.atomic():
        cursor.execute(sql, params)
        row = cursor.fetchone()
        if row is None:
            transaction.set_rollback(True)
        return row


def enqueue_on_best_agent(
    claim: Claim,
    payload: dict,
    triples: Iterable[str] | None,
    digest: str,
    digests_by_triple: dict[str, str] | None = None,
    choice: Choice | None = None,
    wait: bool = True,
) -> ReservedAgent | None:
    """Reserve a slot on the best agent and insert the packet addressed to it, in ONE
    statement (inside the dispatch transaction); None when no agent has room.

    The packet is stamped with the chosen agent's triple and the digest built for
    it (``digests_by_triple``; else ``digest``).  One statement matters: the
    agent's row stays locked from the reservation to the commit, and every other
    dispatch, result and heartbeat of that agent waits for it.  ``choice``: the
    task's compiled selectors (:mod:`fleet.executors.fleet.routing.selectors`; None: none).
    """
    return reserve_agent(
        claim.tenant_id,
        triples,
        then_sql=ledger.ENQUEUE_ON_RESERVED,
        then_params={
            "o_tenant": claim.tenant_id,
            "o_task": claim.task_execution_id,
            "o_assignment": claim.assignment,
            "o_payload": json.dumps(payload),
            "o_digests": json.dumps(digests_by_triple or {}),
            "o_digest": digest,
        },
        choice=choice,
        wait=wait,
    )


@dataclass(frozen=True)
class Delivered(Placed):
    """Placed on an agent whose socket this process holds: the row is already delivered,
    the caller pushes ``packet`` (or, if it cannot, puts the row back to pending)."""

    outbox_id: int = 0
    packet: dict = field(default_factory=dict)
    waited_s: float = 0.0  # Ready → placed (the dispatch latency metric)


def _reserve_many_sql(prelocked: bool) -> str:
    return ledger.RESERVE_AND_ENQUEUE.format(
        candidates=tenants_candidates_sql(UNCONSTRAINED),
        best=best_score_per_tenant(Selectors()),
        tiebreak=tiebreak(Selectors(), best="a.best_score"),
        lock="FOR NO KEY UPDATE OF a SKIP LOCKED" if prelocked else "FOR NO KEY UPDATE OF a",
        claim_set=CLAIM_SET,
    )


# The wait reason reported for tasks that got no slot when the real one could not be
# read (fleet/executors/fleet/routing/candidates.py, no_capacity_reason).
NO_SLOT = "no free agent slot"


# Built once: the statement is the same for every batch (its values are parameters).
_RESERVE_MANY = {prelocked: _reserve_many_sql(prelocked) for prelocked in (False, True)}


def lock_up_front(groups: list[Prepared]) -> None:
    """Take every lock the placement of these prepared claims may wait for, each kind in
    its one global order, before reserving any (ledger module docstring, "Lock order"):
    the binding keys of their tasks, then every agent row any of them may be placed on,
    in id order, in one statement.  A batch placing several groups (tenants, packages,
    tasks with selectors) in one transaction calls this first and then reserves with
    ``wait=False`` / ``prelocked=True``: it waits for agent rows once, in id order, as
    every other writer of agent rows does, so it cannot deadlock with them."""
    keyed: dict[int, list] = {}
    for prepared in groups:
        keyed.setdefault(prepared.claim.tenant_id, []).extend(prepared.request.keys)
    affinity.lock_many(list(keyed.items()))
    params = group_candidate_params((p.claim.tenant_id, p.triples) for p in groups)
    with connection.cursor() as cursor:
        cursor.execute(ledger.lock_in_order_sql(group_candidates_sql()), params)


class Reservation:
    """The statement of :func:`reserve_and_enqueue`, sent; its rows are read by
    :meth:`placed`, which may come after the commit (the rows arrive with it)."""

    def __init__(self, group: list[Prepared], prelocked: bool) -> None:
        first = group[0]
        params = {
            **UNCONSTRAINED.params,
            **candidate_params(first.claim.tenant_id, first.triples),
            "tenants": sorted({p.claim.tenant_id for p in group}),
            "me": local_sockets.server_id(),
            "grace": RESULT_GRACE_S,
            "claimer": first.claim.deferred_claimer,
            "tasks": [p.claim.task_execution_id for p in group],
            "assignments": [p.claim.assignment for p in group],
            "payloads": [json.dumps(p.payload) for p in group],
            "task_tenants": [p.claim.tenant_id for p in group],
            "digests": [json.dumps(p.digests or {}) for p in group],
            "digest": [p.package.digest for p in group],
        }
        self._prepared = {p.claim.task_execution_id: p for p in group}
        self._cursor = connection.cursor()
        try:
            self._cursor.execute(_RESERVE_MANY[prelocked], params)
        except BaseException:
            self._cursor.close()
            raise

    def placed(self) -> dict[uuid.UUID, Placed]:
        """Task id → Placed (a :class:`Delivered` for a local agent) for the tasks that got
        a slot (their claims written with their agents); the others are still Ready, never
        claimed."""
        try:
            rows = self._cursor.fetchall()
        finally:
            self._cursor.close()
        placed: dict[uuid.UUID, Placed] = {}
        for task_execution_id, agent_id, name, local, outbox_id, triple, digest, waited_s in rows:
            prepared = self._prepared[task_execution_id]
            claim = prepared.claim
            if not local:
                placed[task_execution_id] = Placed(
                    claim.tenant_id, claim.assignment, agent_id, name
                )
                continue
            # The row's payload: what was sent, with the triple and artifact the row holds.
            packet = {**prepared.payload, "target_triple": triple, "artifact_digest": digest}
            packet["outbox_id"] = outbox_id
            placed[task_execution_id] = Delivered(
                claim.tenant_id, claim.assignment, agent_id, name,
                outbox_id=outbox_id, packet=packet, waited_s=float(waited_s or 0.0),
            )  # fmt: skip
        return placed


def reserve_and_enqueue(group: list[Prepared], prelocked: bool = False) -> Reservation:
    """Reserve N slots for plain tasks that can run on the same target triples (any
    tenants, any packages) and insert their packets, in one statement (the caller's
    transaction), each tenant's tasks on its own agents.  The group's claims are deferred
    (its tasks locked by :func:`fleet.engine.claims.lock_work`): a placed task's claim is
    written with its agent, and a task that got no slot stays Ready, unwritten (no attempt
    used, its assignment untouched).  Read the result with
    :meth:`Reservation.placed`, before or after the commit.
    ``prelocked``: the caller locked the agents (:func:`lock_up_front`); an agent locked
    by another transaction is then passed over rather than waited for."""
    return Reservation(group, prelocked)


def reserve_for_reclaim(
    task_execution_id: uuid.UUID, task: dict, triples, wait: bool = True
) -> ReservedAgent | None:
    """One slot for a reclaimed packet on a live agent that the task's selectors accept
    (None: none now); ``task`` holds its tenant_id, routing, workflow_execution_id and
    workflow_execution__workflow_name.  The caller re-addresses the row.  ``wait``: as
    for :func:`reserve_agent` (False when the caller holds another agent row)."""
    tenant_id = task["tenant_id"]
    routing = task["routing"] or {}
    if not routing:
        return reserve_agent(tenant_id, triples, wait=wait)
    payload_affinity = str(routing.get("affinity") or "").startswith("payload:")
    try:
        request = selection.request_for(
            tenant_id, routing, task["workflow_execution_id"],
            task["workflow_execution__workflow_name"],
            build_task_context(task_execution_id) if payload_affinity else {},
        )  # fmt: skip
    except SelectorError:  # it was placed once, so this cannot happen; never strand the work
        return reserve_agent(tenant_id, triples, wait=wait)
    outcome = selection.select(
        request,
        triples,
        lambda choice: reserve_agent(tenant_id, triples, choice=choice, wait=wait),
    )
    return outcome.agent if isinstance(outcome, selection.Chosen) else None


def _fail(claim: Claim, error_type: str, message: str, metric: str = "") -> Unroutable:
    """Fail the claimed run for good (no retry: nothing would change) through the handler."""
    if metric:
        SELECTION_FAILURE.labels(reason=metric).inc()
    write_deferred([claim])  # the failure is fenced on the claim: it must be written first
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
        TaskOutcome.objects.filter(
            task_execution_id=task_execution_id, assignment=assignment, applied=True
        )
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
