"""A lone placement in ONE round trip, on the event loop's own connection (issue 17, the idle
pickup).

The usual placement (:mod:`fleet.executors.fleet.delivery.batch_placement`) runs on a
delivery thread and takes two round trips: BEGIN + the claim, whose answer Python needs to
build the packet (the context, byte for byte the shared builder's), then the reservation +
COMMIT.  With the hops from the event loop to the thread and back that was half of an idle
pickup.  Here a task that the dispatch places alone is claimed, given an agent slot and its
packet in one statement (:data:`fleet.executors.fleet.state.ledger.CLAIM_AND_RESERVE`), sent
in autocommit on one async connection of the loop (the statement is its own transaction:
nothing is pushed before it has committed), so the placement is one round trip and no
thread hop.

The statement builds the packet itself, so it takes only the tasks whose packet it can
build exactly as :func:`fleet.executors.fleet.delivery.placement.prepare` does:

* plain (no routing keys: no selector, no group or affinity binding) and a python package
  (any agent triple, one artifact);
* no dependencies, and an input context whose values are strings, integers, booleans or
  nulls — one level, no floats: its canonical JSON (``encode_context``: compact, keys in
  the stored order, the same string escapes as PostgreSQL's) is then the stored text with
  the separators compacted, which the statement writes key by key;
* a context within the frame (no ``context_ref``) and ``CLOACINA_MAX_CONTEXT_BYTES``, and an
  ordinary timeout (its float text is Python's ``repr``).

Anything else, a task that is not Ready (or is being claimed elsewhere), and a task no
agent has a free slot for now — the statement then writes nothing — is answered None, and
the caller places it the usual way (which also says why it waits or fails it).  The pushed
packet is the stored one: ``work_packet`` around the context, triple and artifact as the
row holds them (the context is the statement's own text, the shared builder's byte for
byte: tests/integration/test_fleet_one_trip.py); it is not built a second time here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid

import psycopg

from agents.protocol import hop_trace
from fleet.engine.claims import CLAIM_SET, RESULT_GRACE_S, Claim
from fleet.executors.fleet.delivery import context_ref, local_sockets
from fleet.executors.fleet.delivery.outbox import PackageRef, work_packet
from fleet.executors.fleet.delivery.pg import connect_async
from fleet.executors.fleet.delivery.placement import Delivered, Placed
from fleet.executors.fleet.routing.candidates import candidate_params, tenants_candidates_sql
from fleet.executors.fleet.routing.metrics import SELECTION_SUCCESS, observe_selections
from fleet.executors.fleet.routing.selectors import (
    UNCONSTRAINED,
    Selectors,
    best_score_per_tenant,
    tiebreak,
)
from fleet.executors.fleet.state import ledger
from fleet.platform.config import get_config

log = logging.getLogger(__name__)

# The task row by its primary key alone, locked as the claim needs it: any other condition
# here would let the planner reach it through another index (tenant and status: every Ready
# task of the tenant under a backlog).  The row is only locked for the statement when it is
# not taken (``due`` below filters it), and nothing else is locked then.
_TASK = """
    SELECT t.id, t.workflow_execution_id, t.tenant_id, t.task_name, t.function, t.timeout_s,
           t.priority, t.ready_at, t.status, t.routing, t.dependencies
    FROM fleet_taskexecution t WHERE t.id = %(task)s
    FOR UPDATE SKIP LOCKED
"""

# That task if it is of the caller's tenant, Ready, due and plain (no routing keys, no
# dependencies), with an ordinary timeout, a python package and a context the statement
# encodes (module docstring), with ``ctx``: the context's canonical JSON, written key by
# key.  jsonb_each walks the object in the order its text (which the shared builder
# parses) lists the keys; to_json(key) and a string's jsonb text escape exactly as Python's
# json.dumps(ensure_ascii=False) does (", \, \b \f \n \r \t, other controls as \u00XX,
# nothing else); an integer's text is Python's int's.  A timeout of 0.001–1e9 s prints the
# same shortest digits in both, and Python's float adds ".0" to an integral one.
_DUE = """
    SELECT t.id, t.workflow_execution_id, t.tenant_id, t.task_name, t.function, t.timeout_s,
           t.priority, t.ready_at, p.digest, p.kind, tn.name AS tenant_name, x.ctx,
           (CASE WHEN t.timeout_s::text ~ '^[0-9]+$' THEN t.timeout_s::text || '.0'
                 ELSE t.timeout_s::text END)::jsonb AS timeout_json
    FROM task t
    JOIN fleet_workflowexecution e ON e.id = t.workflow_execution_id
    JOIN workflow_packages p ON p.id = e.package_id
    JOIN fleet_tenant tn ON tn.id = e.tenant_id
    CROSS JOIN LATERAL (
        SELECT CASE
            WHEN e.input_context IS NULL OR e.input_context = 'null'::jsonb THEN '{}'
            WHEN jsonb_typeof(e.input_context) <> 'object' THEN NULL
            ELSE (
                SELECT CASE WHEN bool_and(
                           jsonb_typeof(f.value) IN ('string', 'boolean', 'null')
                           OR (jsonb_typeof(f.value) = 'number'
                               AND f.value::text ~ '^-?[0-9]{1,18}$'))
                       IS FALSE THEN NULL
                       ELSE '{' || coalesce(string_agg(to_json(f.key)::text || ':' || f.value::text,
                                                       ',' ORDER BY f.n), '') || '}' END
                FROM jsonb_each(e.input_context) WITH ORDINALITY AS f(key, value, n)
            ) END
        OFFSET 0  -- built once per row, not once per mention below
    ) AS x(ctx)
    WHERE t.tenant_id = ANY(%(tenants)s::bigint[]) AND t.status = 'Ready'
      AND (t.ready_at IS NULL OR t.ready_at <= statement_timestamp())
      AND (t.routing IS NULL OR t.routing = '{}'::jsonb)
      AND jsonb_array_length(t.dependencies) = 0
      AND t.timeout_s BETWEEN 0.001 AND 1e9
      AND p.kind = 'python' AND x.ctx IS NOT NULL
      AND char_length(x.ctx) <= %(inline_chars)s AND octet_length(x.ctx) <= %(max_bytes)s
"""

_STATEMENT = ledger.CLAIM_AND_RESERVE.format(
    task=_TASK.strip(),
    due=_DUE.strip(),
    candidates=tenants_candidates_sql(UNCONSTRAINED),
    best=best_score_per_tenant(Selectors()),
    tiebreak=tiebreak(Selectors(), best="a.best_score"),
    claim_set=CLAIM_SET,
)

# No task has this id: the statement run for it (``LoopPlacer.warm``) takes and writes nothing.
NO_TASK = uuid.UUID(int=0)

# A context this long (characters) always fits a frame inline: each escapes to at most 6
# bytes (context_ref.inline_size's bound), so no ``context_ref`` is ever needed.
_INLINE_CHARS = (context_ref.INLINE_MAX_BYTES - 2) // 6


def params(task_execution_id: uuid.UUID, tenant_id: int, claimer: str) -> dict:
    """The statement's parameters for one task of ``tenant_id``."""
    return {
        **UNCONSTRAINED.params,
        **candidate_params(tenant_id, None),
        "task": task_execution_id,
        "tenants": [tenant_id],
        "me": local_sockets.server_id(),
        "claimer": claimer,
        "grace": RESULT_GRACE_S,
        "inline_chars": _INLINE_CHARS,
        "max_bytes": get_config().max_context_bytes,
    }


async def place_one(
    conn: psycopg.AsyncConnection, task_execution_id: uuid.UUID, tenant_id: int, claimer: str
) -> Placed | None:
    """Claim and place the task in one statement on ``conn`` (autocommit); None when the
    statement did not take it (module docstring): the caller places it the usual way."""
    started = time.perf_counter()
    hop_trace.mark("placing", task_execution_id)
    cursor = await conn.execute(_STATEMENT, params(task_execution_id, tenant_id, claimer))
    row = await cursor.fetchone()
    if row is None or row[13] is None:
        return None  # not taken (not eligible, not Ready, or no free slot): nothing written
    hop_trace.mark("committed", task_execution_id)
    observe_selections(time.perf_counter() - started, 1)
    SELECTION_SUCCESS.labels(step=UNCONSTRAINED.step).inc()
    return _placed(row)


def _placed(row: tuple) -> Placed:
    (task_id, workflow_id, tenant_id, task_name, function, assignment, attempt, timeout_s,
     priority, digest, kind, tenant_name, ctx, agent_id, agent_name, local, outbox_id, triple,
     waited_s) = row  # fmt: skip
    claim = Claim(
        task_id, workflow_id, tenant_id, task_name, function, assignment, attempt, timeout_s,
        {}, priority,
    )  # fmt: skip
    if not local:
        return Placed(tenant_id, assignment, agent_id, agent_name)
    # The packet pushed is the packet stored (the batch path's way): its context, triple and
    # artifact as the row holds them.  The context is the statement's own text, the shared
    # builder's byte for byte (tests/integration/test_fleet_one_trip.py): it is not built
    # a second time here.
    ref = PackageRef(digest=digest, kind=kind, target_triple=triple)
    packet = work_packet(claim, ctx, ref, tenant_name)
    packet["outbox_id"] = outbox_id
    return Delivered(
        tenant_id, assignment, agent_id, agent_name,
        outbox_id=outbox_id, packet=packet, waited_s=float(waited_s or 0.0),
    )  # fmt: skip


async def open_placer_connection() -> psycopg.AsyncConnection:
    """The loop's placement connection, its one statement prepared and planned generically
    from its first run.  psycopg would prepare it only at its sixth run, and PostgreSQL
    would then plan it for each set of parameters five more times (1.2–1.4 ms a plan,
    against 0.04 ms to bind the kept plan) before it kept a generic plan: ten slower
    pickups after every start and every reconnect.  The generic plan reaches every row by
    its key whatever the statistics (tests/integration/test_fleet_one_trip.py), so nothing
    is gained by a plan made for the parameters."""
    conn = await connect_async("cloacina-placement")
    await conn.execute("SET plan_cache_mode = force_generic_plan")
    conn.prepare_threshold = 0
    return conn


class LoopPlacer:
    """The event loop's connection for lone placements (opened on first use, dropped on any
    error: the next placement opens a fresh one, and this one goes the usual way)."""

    def __init__(self, claimer: str) -> None:
        self.claimer = claimer
        self._conn: psycopg.AsyncConnection | None = None
        self._opening = asyncio.Lock()  # one connection, whoever asks first (warm or place)
        self.placed = 0  # placements made here (the others went the usual way)

    async def warm(self) -> None:
        """Open the connection and run the statement once for no task, so that the first
        pickup finds it connected, its statement prepared and planned and the backend's
        caches of the tables filled (the first run on a new connection took 6–7 ms against
        0.6 ms after).  The statement finds no task and writes nothing."""
        try:
            conn = await self._connection()
            await conn.execute(_STATEMENT, params(NO_TASK, 0, self.claimer))
        except (psycopg.Error, OSError) as exc:
            log.info("warming the placement connection failed (%s); the first use opens it", exc)
            await self.close()

    async def place(self, task_execution_id: uuid.UUID, tenant_id: int) -> Placed | None:
        """:func:`place_one` on this loop's connection; None also when the database could
        not be asked (the usual path then tries, and reports what it finds)."""
        if not tenant_id:
            return None  # the event did not say (the statement is scoped to the tenant)
        try:
            conn = await self._connection()
            placed = await place_one(conn, task_execution_id, tenant_id, self.claimer)
        except (psycopg.Error, OSError) as exc:
            # Committed or not, the usual path finds out: a task this statement placed is no
            # longer Ready there (NotClaimed), as after any lost answer.
            log.warning("one-trip placement of %s failed (%s); the usual path places it",
                        task_execution_id, exc)  # fmt: skip
            await self.close()
            return None
        if placed is not None:
            self.placed += 1
        return placed

    async def _connection(self) -> psycopg.AsyncConnection:
        async with self._opening:
            if self._conn is None or self._conn.closed or self._conn.broken:
                await self.close()
                self._conn = await open_placer_connection()
            return self._conn

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                await conn.close()
