"""Slot accounting and outbox state: the one place that says how an agent slot is taken
and released and how a ``delivery_outbox`` row moves.

An agent's slot counter (``agents_agent.in_flight``) counts its open outbox rows: a
slot is taken in the statement that writes (or re-addresses) a row for the agent and
given back in the statement that acks it.  A row moves pending → delivered (pushed,
``attempts`` + 1) → acked (its outcome recorded, or withdrawn); delivered goes back to
pending when a push did not land (``redeliveries`` + 1) and a reclaim re-addresses an
open row to a survivor (``former_agents`` remembers the dead one).

Every SQL fragment that writes ``in_flight`` or an outbox row's state is here.  The
statements that do more than that (a placement also claims the task, an outcome also
records it) are built elsewhere from these fragments, so each stays ONE statement on
the hot path.  Readers name the tables through :data:`AGENTS` and :data:`OUTBOX` and
the state predicates below.  tests/unit/test_state_owners.py enforces it.

Lock order everywhere (docs/fleet.md, "Lock order"): task and workflow rows → outbox
rows → affinity keys → agent rows, the agent rows last.  A transaction waits for agent
row locks at most ONCE — in one statement that locks every agent row it will write, in
id order — and after that either writes only rows it already holds or takes more
without waiting (``SKIP LOCKED``).  A single reservation waits for one agent row while
holding none (its savepoints let go of the rows it found full).  Two such transactions
never wait for each other in a cycle, whichever tenants and agents they touch: a
placement batch spanning ten tenants, a result batch freeing slots all over the fleet,
a batch of heartbeats and a breaker update all take their agent rows in the one order.
Explicit locks of agent (and workflow) rows are ``FOR NO KEY UPDATE``, the lock their
UPDATE takes anyway: the foreign-key check of a row that references them (``KEY SHARE``,
at commit, in no particular order) never waits for it.
"""

from __future__ import annotations

import uuid

from django.db import connection
from django.utils import timezone

from fleet.executors.fleet.state import breaker
from fleet.models import DeliveryOutbox, OutboxState, TaskStatus

AGENTS = "agents_agent"
OUTBOX = "delivery_outbox"
# The NOTIFY channel the outbox's insert/update trigger signals (migration fleet/0004).
OUTBOX_CHANNEL = "delivery_outbox"

OPEN_STATES = (OutboxState.PENDING, OutboxState.DELIVERED)


# -- slots (on ``agents_agent``) -----------------------------------------------------


def has_free_slot(agent: str) -> str:
    """SQL: the agent row aliased ``agent`` has a free slot."""
    return f"{agent}.in_flight < {agent}.max_concurrency"


def free_slots(agent: str) -> str:
    """SQL: how many free slots the agent row aliased ``agent`` has."""
    return f"{agent}.max_concurrency - {agent}.in_flight"


def take_slots(agent: str, count: str = "1") -> str:
    """SQL SET clause: take ``count`` slots on the agent row aliased ``agent``."""
    return f"in_flight = {agent}.in_flight + {count}"


def give_back_slots(agent: str, count: str = "1") -> str:
    """SQL SET clause: give back ``count`` slots (never below zero: a slot released twice,
    e.g. by a reclaim racing an outcome, must not make room that does not exist)."""
    return f"in_flight = GREATEST({agent}.in_flight - {count}, 0)"


# A dead agent holds no slot: its open rows are reclaimed onto survivors.
SLOTS_CLEARED = "in_flight = 0"


def open_row(row: str) -> str:
    """SQL: the outbox row aliased ``row`` is open (pending or delivered: in-flight work)."""
    return f"{row}.state IN ('pending', 'delivered')"


# -- placement: a slot taken and a packet written, in one statement ------------------


def reserve_one_sql(candidates: str, order: str, skip_locked: bool) -> str:
    """Take one slot on the best candidate (``candidates``: SQL over ``agents_agent a``,
    ranked by ``order``, the selection's ``Choice.order``), as the CTE body ``reserved``.
    The UPDATE re-checks the state and the capacity on the locked row, so two reservations
    never overfill an agent; ``last_selected_at`` is the least-recently-selected key's
    memory.

    ``skip_locked``: pass over candidates locked by concurrent reservations.  Without it
    the best candidate is chosen without a lock and only the UPDATE waits, on that one
    row: a blocking ``FOR UPDATE`` in the ranking would lock a row, find it full once its
    lock came, keep it and wait for the next — two such reservations, ranking two agents
    in opposite orders, deadlock."""
    lock = "FOR NO KEY UPDATE OF a SKIP LOCKED" if skip_locked else ""
    return f"""
    UPDATE agents_agent AS r
    SET {take_slots("r")}, last_selected_at = clock_timestamp(), {breaker.probe_taken("r")}
    WHERE r.id = (
        SELECT a.id FROM agents_agent a
        WHERE {candidates}
        ORDER BY {order}
        LIMIT 1 {lock}
    ) AND r.state = 'live' AND {has_free_slot("r")} AND {breaker.admits("r")}
    RETURNING r.id, r.name, r.target_triple
    """


def lock_in_order_sql(candidates: str) -> str:
    """SQL: lock every agent row ``candidates`` selects (SQL over ``agents_agent a``), in
    id order — a placement batch's one wait for agent rows, before it reserves any."""
    return (
        f"SELECT a.id FROM agents_agent a WHERE {candidates} ORDER BY a.id FOR NO KEY UPDATE OF a"
    )


def any_candidate_sql(candidates: str) -> str:
    return f"SELECT EXISTS (SELECT 1 FROM agents_agent a WHERE {candidates})"


# After ``reserved``: the chosen agent only (a reclaim re-addresses the row itself).
RESERVED_AGENT = "SELECT id, name, target_triple FROM reserved"

# After ``reserved``: the packet addressed to the chosen agent, stamped with its triple
# and the artifact built for it, and the task naming the agent.
ENQUEUE_ON_RESERVED = """
, packet AS (
    INSERT INTO delivery_outbox (tenant_id, agent_id, task_execution_id, assignment, state, payload,
                                 attempts, created_at, updated_at, former_agents)
    SELECT %(o_tenant)s, r.id, %(o_task)s, %(o_assignment)s, 'pending',
           %(o_payload)s::jsonb || jsonb_build_object(
               'target_triple', r.target_triple,
               'artifact_digest', coalesce(%(o_digests)s::jsonb ->> r.target_triple, %(o_digest)s)
           ),
           0, now(), now(), '[]'::jsonb
    FROM reserved r
    RETURNING agent_id
), assigned AS (
    UPDATE fleet_taskexecution t SET agent_id = p.agent_id FROM packet p
    WHERE t.id = %(o_task)s AND t.assignment = %(o_assignment)s
)
, relax AS (
    -- The dispatch need not survive a database crash on its own (a lost one leaves the
    -- task Ready: it runs again); the outcome's synchronous commit flushes it anyway.
    SELECT set_config('synchronous_commit', 'off', true)
)
SELECT id, name, target_triple FROM reserved, relax
"""

# N slots and N packets in one statement: plain tasks of one or more tenants (each task
# with its tenant, and its package's digests), the candidates of every tenant among them
# ({candidates}).  The agents are locked in id order, all tenants at once ({lock}:
# ``FOR NO KEY UPDATE OF a``) — waiting for a result batch that is releasing slots rather
# than skipping its agents as full; a batch that locked its agents up front
# (``lock_in_order_sql``) passes ``SKIP LOCKED`` instead, so it never waits a second time,
# out of order.  Each tenant's free slots are dealt to its own tasks by the selection's
# own ranking ({best}: the best healthy score per tenant, for {tiebreak}), its first key
# applied per slot: the n-th slot of an agent is taken when that agent has
# ``free - n + 1`` slots left, so the slots go most-free-first as the agents fill, ties
# broken by the rest of the ranking (health, host score, least recently selected, id) —
# spread like consecutive single reservations.  A half-open agent is dealt one slot at
# most: its breaker's probe (fleet/executors/fleet/state/breaker.py).  A packet for an
# agent whose socket THIS process holds is written as delivered (its result clock
# started) and pushed by the caller right after the commit; the others are pending, for
# the relay that holds their socket.  The caller builds the pushed packet from the payload
# it sent and the two keys added here, read back from the row as written (returning the
# whole payload cost a jsonb output and a JSON parse per task).
RESERVE_AND_ENQUEUE = (
    """
WITH locked AS (
    SELECT a.* FROM agents_agent a WHERE {candidates} ORDER BY a.id {lock}
), scored AS (
    SELECT a.*, {best} AS best_score FROM locked a
), ranked AS (
    SELECT a.id, a.tenant_id, a.name, a.target_triple, """
    + breaker.slot_cap("a", free_slots("a"))
    + """ AS free,
           a.connected_to = %(me)s AS local,
           row_number() OVER (PARTITION BY a.tenant_id ORDER BY {tiebreak}) AS rank
    FROM scored a
), todo AS (
    SELECT u.*, row_number() OVER (PARTITION BY u.tenant_id ORDER BY u.i) AS k,
           count(*) OVER (PARTITION BY u.tenant_id) AS wanted
    FROM unnest(%(tasks)s::uuid[], %(assignments)s::int[], %(payloads)s::jsonb[],
                %(task_tenants)s::bigint[], %(digests)s::jsonb[], %(digest)s::text[])
         WITH ORDINALITY AS u(task_execution_id, assignment, payload, tenant_id, digests, digest, i)
), wanted AS (
    SELECT DISTINCT tenant_id, wanted FROM todo
), slots AS (
    SELECT r.id, r.tenant_id, r.name, r.target_triple, r.local,
           row_number() OVER (PARTITION BY r.tenant_id ORDER BY r.free - s.n DESC, r.rank) AS k
    FROM ranked r JOIN wanted c ON c.tenant_id = r.tenant_id
    CROSS JOIN LATERAL generate_series(1, LEAST(r.free, c.wanted)) AS s(n)
), work AS (
    SELECT w.task_execution_id, w.assignment, w.payload, w.tenant_id, w.digests, w.digest,
           s.id AS agent_id, s.name, s.target_triple, s.local
    FROM todo w JOIN slots s ON s.tenant_id = w.tenant_id AND s.k = w.k
), reserved AS (
    UPDATE agents_agent r SET """
    + take_slots("r", "c.n")
    + ", "
    + breaker.probe_taken("r")
    + """, last_selected_at = clock_timestamp()
    FROM (SELECT agent_id, count(*) AS n FROM work GROUP BY agent_id) c
    WHERE r.id = c.agent_id
), packets AS (
    INSERT INTO delivery_outbox (tenant_id, agent_id, task_execution_id, assignment, state, payload,
                                 attempts, delivered_at, created_at, updated_at, former_agents)
    SELECT w.tenant_id, w.agent_id, w.task_execution_id, w.assignment,
           CASE WHEN w.local THEN 'delivered' ELSE 'pending' END,
           w.payload || jsonb_build_object(
               'target_triple', w.target_triple,
               'artifact_digest', coalesce(w.digests ->> w.target_triple, w.digest)
           ),
           CASE WHEN w.local THEN 1 ELSE 0 END, CASE WHEN w.local THEN now() END,
           now(), now(), '[]'::jsonb
    FROM work w
    RETURNING id, task_execution_id, payload ->> 'target_triple' AS target_triple,
              payload ->> 'artifact_digest' AS artifact_digest
), assigned AS (
    -- The claim, written here with the agent it names: the caller's transaction locked the
    -- task rows Ready and read them as claimed (fleet/engine/claims.py, lock_work), so
    -- each placed task gets ONE new row version ({claim_set}: the claims owner's SET
    -- clause; ``assignment`` becomes the one its packet carries).  A task that got no slot
    -- is not written at all: still Ready, its attempt and assignment untouched; the
    -- caller writes why it waits once it has read the result.
    UPDATE fleet_taskexecution t SET {claim_set}, agent_id = w.agent_id,
        result_deadline = CASE WHEN w.local
                               THEN now() + make_interval(secs => t.timeout_s + %(grace)s) END
    FROM work w
    -- No ``status`` test: the rows are this transaction's, locked Ready (the assignment
    -- is the fence), and with one the planner read every Ready task through
    -- task_ready_idx to find the batch's (2.0 → 4.2 ms a statement of 16 with 1,000 Ready).
    WHERE t.id = w.task_execution_id AND t.assignment = w.assignment - 1
    RETURNING t.id, extract(epoch FROM now() - t.ready_at) AS waited_s
), relax AS (
    -- As for a single dispatch: a lost one leaves the tasks Ready (they run again), and
    -- the outcome's synchronous commit flushes it anyway.
    SELECT set_config('synchronous_commit', 'off', true)
)
SELECT w.task_execution_id, w.agent_id, w.name, w.local, p.id, p.target_triple,
       p.artifact_digest, a.waited_s
FROM work w JOIN packets p ON p.task_execution_id = w.task_execution_id JOIN assigned a ON a.id = w.task_execution_id, relax
"""
)


# A lone plain task claimed AND placed in ONE statement, sent on its own (autocommit: the
# statement is the transaction, one round trip: fleet/executors/fleet/delivery/one_trip.py).
# {task}: the task row, found by its primary key alone and locked ``FOR UPDATE SKIP LOCKED``.
# It is a query of its own so that the planner cannot start from another table or index:
# with the statistics a young database has, the joined form was planned as a scan of every
# execution (3–4 ms a pickup).  {due}: that row if it is Ready, due and eligible (plain,
# python, no dependencies, a context the statement can encode byte for byte as the shared
# builder does — its columns include ``ctx``, that text); when it is not, the task row was
# only locked for the statement and nothing else is.  Lock order as
# everywhere: the task row, then its execution's row if it is still Pending (to start it),
# then the tenant's candidate agents in id order — ``locked`` is gated on ``starting`` so
# that the workflow row is locked before any agent row, and on ``due`` so that a task not
# taken locks no agent.  The best agent is the batch form's choice for one task (most free
# slots, then the selection's ranking).  With an agent the task row is written ONCE: the
# claim ({claim_set}: the claims owner's) and the agent it names in the same UPDATE (the
# two-statement placement writes it twice).  Without one nothing is written: the task stays
# Ready, its attempt and assignment untouched, and the caller places it the usual way (which
# says why it waits).  The packet is built here from the claim's own columns; its keys and
# values are what ``placement.prepare`` builds and RESERVE_AND_ENQUEUE stores.
CLAIM_AND_RESERVE = (
    """
WITH task AS MATERIALIZED (
    {task}
), due AS MATERIALIZED (
    {due}
), starting AS MATERIALIZED (
    SELECT w.id FROM fleet_workflowexecution w
    WHERE w.id = (SELECT workflow_execution_id FROM due) AND w.status = 'Pending'
    FOR NO KEY UPDATE
), locked AS (
    SELECT a.* FROM agents_agent a
    WHERE {candidates}
      AND EXISTS (SELECT 1 FROM due) AND (SELECT count(*) FROM starting) >= 0
    ORDER BY a.id FOR NO KEY UPDATE OF a
), scored AS (
    SELECT a.*, {best} AS best_score FROM locked a
), chosen AS MATERIALIZED (
    SELECT a.id, a.name, a.target_triple, a.connected_to = %(me)s AS local FROM scored a
    ORDER BY """
    + breaker.slot_cap("a", free_slots("a"))
    + """ DESC, {tiebreak}
    LIMIT 1
), reserved AS (
    UPDATE agents_agent r SET """
    + take_slots("r")
    + ", "
    + breaker.probe_taken("r")
    + """, last_selected_at = clock_timestamp()
    WHERE r.id = (SELECT id FROM chosen)
), claimed AS (
    UPDATE fleet_taskexecution t SET {claim_set}, agent_id = c.id,
        result_deadline = CASE WHEN c.local
                               THEN now() + make_interval(secs => t.timeout_s + %(grace)s) END
    FROM due d, chosen c
    WHERE t.id = d.id
    RETURNING t.id, t.assignment, t.attempt, extract(epoch FROM now() - t.ready_at) AS waited_s
), running AS (
    UPDATE fleet_workflowexecution w SET status = 'Running', started_at = now()
    FROM starting s
    WHERE w.id = s.id AND w.status = 'Pending' AND EXISTS (SELECT 1 FROM claimed)
), packets AS (
    INSERT INTO delivery_outbox (tenant_id, agent_id, task_execution_id, assignment, state, payload,
                                 attempts, delivered_at, created_at, updated_at, former_agents)
    SELECT d.tenant_id, c.id, k.id, k.assignment,
           CASE WHEN c.local THEN 'delivered' ELSE 'pending' END,
           jsonb_build_object(
               'task_execution_id', d.id::text, 'assignment', k.assignment,
               'attempt', k.attempt, 'workflow_execution_id', d.workflow_execution_id::text,
               'task_name', d.task_name, 'function', d.function, 'context_json', d.ctx,
               'artifact_digest', d.digest, 'package_kind', d.kind,
               'target_triple', c.target_triple, 'timeout_s', d.timeout_json,
               'tenant', d.tenant_name
           ),
           CASE WHEN c.local THEN 1 ELSE 0 END, CASE WHEN c.local THEN now() END,
           now(), now(), '[]'::jsonb
    FROM due d, chosen c, claimed k
    -- The pushed packet's triple, artifact and context as the row holds them (the first
    -- two as RESERVE_AND_ENQUEUE returns them).
    RETURNING id, payload ->> 'target_triple' AS target_triple,
              payload ->> 'artifact_digest' AS artifact_digest,
              payload ->> 'context_json' AS context_json
), relax AS (
    -- As for every placement: a lost one leaves the task Ready (it runs again), and the
    -- outcome's synchronous commit flushes it anyway.
    SELECT set_config('synchronous_commit', 'off', true)
)
SELECT d.id, d.workflow_execution_id, d.tenant_id, d.task_name, d.function, k.assignment,
       k.attempt, d.timeout_s, d.priority, p.artifact_digest, d.kind, d.tenant_name,
       p.context_json, c.id, c.name, c.local, p.id, p.target_triple, k.waited_s
FROM relax, due d
LEFT JOIN chosen c ON true LEFT JOIN claimed k ON true LEFT JOIN packets p ON true
"""
)


# -- reclaim: an open row of a dead agent moves to a survivor ------------------------


def readdress_row(row: DeliveryOutbox, survivor_id: uuid.UUID, payload: dict) -> None:
    """Re-address the open ``row`` to ``survivor_id`` (whose slot the caller reserved):
    pending again, for the relay that holds the survivor's socket (the NOTIFY wakes it)."""
    DeliveryOutbox.objects.filter(pk=row.pk).update(
        agent_id=survivor_id,
        state=OutboxState.PENDING,
        delivered_at=None,
        received_at=None,
        redeliveries=0,  # a new agent gets its own share of pushes
        updated_at=timezone.now(),
        payload=payload,
        former_agents=[*row.former_agents, str(row.agent_id)],
    )


def close_row(row_id: int) -> None:
    """Ack a row that is no longer work (its task moved on without it); its dead agent
    holds no slot any more, so none is given back."""
    now = timezone.now()
    DeliveryOutbox.objects.filter(pk=row_id).update(
        state=OutboxState.ACKED, acked_at=now, updated_at=now
    )


# -- the relay: pending → delivered, and back when a push could not be made ----------

# The agents with pending rows whose socket the roster puts on server ``me``: what a relay
# round asks first, by ``connected_to`` (no id sent; an idle round reads no row, through the
# pending rows of ``outbox_state_age_idx``).  The relay keeps those whose socket it holds.
PENDING_HERE = f"""
SELECT DISTINCT o.agent_id FROM delivery_outbox o JOIN {AGENTS} a ON a.id = o.agent_id
WHERE o.state = 'pending' AND a.connected_to = %(me)s AND a.state IN ('live', 'draining')
"""

# ``agents``: those of PENDING_HERE whose sockets the relay holds; a binary parameter, not
# text that escapes each id (~1.5 against ~9 ms per 5,000 ids).
TAKE_PENDING = """
WITH due AS MATERIALIZED (  -- picked once: a LIMIT … SKIP LOCKED subquery must not re-run
    SELECT o.id FROM delivery_outbox o
    WHERE o.state = 'pending' AND o.agent_id = ANY(%(agents)b)
    ORDER BY o.id
    LIMIT %(batch)s
    FOR UPDATE SKIP LOCKED
)
UPDATE delivery_outbox o SET
    state = 'delivered', delivered_at = now(), received_at = NULL,
    attempts = o.attempts + 1, updated_at = now()
FROM due, agents_agent a
WHERE o.id = due.id AND a.id = o.agent_id AND a.connected_to = %(me)s
  AND a.state IN ('live', 'draining')
RETURNING o.id, o.agent_id, o.task_execution_id, o.assignment, o.attempts, o.payload
"""

UNTAKE = """
UPDATE delivery_outbox SET state = 'pending', delivered_at = NULL, updated_at = now()
WHERE id = ANY(%s::bigint[]) AND state = 'delivered'
"""


# -- confirmations: the agent holds the packet (``received_at``) ---------------------

MARK_RECEIVED = """
UPDATE delivery_outbox SET received_at = now()
WHERE agent_id = %s AND id = ANY(%s) AND state = 'delivered' AND received_at IS NULL
"""

MARK_RUNNING_RECEIVED = """
UPDATE delivery_outbox SET received_at = now()
WHERE agent_id = %s AND task_execution_id = ANY(%s::uuid[]) AND state = 'delivered' AND received_at IS NULL
"""

# The socket writer's batched forms.  Confirmations never wait for a row lock: a packet
# being acked by a result batch right now is skipped and confirmed on a later round
# (``received_at`` on an acked row is only the late receipt it is).  Waiting instead
# queued every confirmation — and the latency they measure — behind result batches, and
# two writers locking outbox rows in different orders can deadlock.
RECEIVED_MANY = """
UPDATE delivery_outbox o SET received_at = now()
FROM (
    SELECT w.id FROM delivery_outbox w
    JOIN unnest(%(agents)s::uuid[], %(ids)s::bigint[]) AS r(agent_id, id)
      ON w.id = r.id AND w.agent_id = r.agent_id
    WHERE w.state <> 'pending' AND w.received_at IS NULL
    FOR UPDATE OF w SKIP LOCKED
) wanted
WHERE o.id = wanted.id
RETURNING o.id
"""

RUNNING_MANY = """
WITH wanted AS (
    SELECT o.id FROM delivery_outbox o
    JOIN unnest(%(agents)s::uuid[], %(tasks)s::uuid[]) AS r(agent_id, task_execution_id)
      ON o.agent_id = r.agent_id AND o.task_execution_id = r.task_execution_id
    WHERE o.state = 'delivered' AND o.received_at IS NULL
    FOR UPDATE OF o SKIP LOCKED
)
UPDATE delivery_outbox o SET received_at = now() FROM wanted w WHERE o.id = w.id
"""

# A reconnected agent's ``hello`` (``{held}``: its (task_execution_id, assignment) list): rows it
# holds count as received, delivered rows it does not hold go back to pending.
HELLO_CONFIRM = """
UPDATE delivery_outbox o SET received_at = coalesce(o.received_at, now())
FROM ({held}) AS h
WHERE o.agent_id = %s AND o.state = 'delivered'
  AND o.task_execution_id = h.task_execution_id AND o.assignment = h.assignment
"""

HELLO_REQUEUE = """
UPDATE delivery_outbox o SET state = 'pending', delivered_at = NULL,
    received_at = NULL, updated_at = now()
WHERE o.agent_id = %s AND o.state = 'delivered'
  AND (o.task_execution_id, o.assignment) NOT IN ({held})
"""


# -- redelivery: delivered rows nobody confirmed -------------------------------------

# Delivered rows of living agents that no ``received`` answered in time; the fourth
# column says the row had its share of pushes to this agent.
UNCONFIRMED = """
SELECT o.id, o.task_execution_id, o.assignment, o.redeliveries + 1 >= %(max_pushes)s, a.name,
       o.agent_id
FROM delivery_outbox o JOIN agents_agent a ON a.id = o.agent_id
WHERE a.state IN ('live', 'draining') AND o.state = 'delivered' AND o.received_at IS NULL
  AND o.delivered_at < now() - make_interval(secs => %(seconds)s)
ORDER BY o.id
FOR UPDATE OF o SKIP LOCKED
"""

REQUEUE_UNCONFIRMED = """
UPDATE delivery_outbox SET state = 'pending', delivered_at = NULL,
    redeliveries = redeliveries + 1, updated_at = now()
WHERE id = ANY(%s) AND state = 'delivered' AND received_at IS NULL
"""

# A row whose run could not be declared lost (the task moved on without it): closed,
# and its agent's slot given back.
CLOSE_STALE = f"""
WITH acked AS (
    UPDATE delivery_outbox SET state = 'acked', acked_at = now(), updated_at = now()
    WHERE id = %s AND state <> 'acked' RETURNING agent_id
)
UPDATE agents_agent a SET {give_back_slots("a")} WHERE id IN (SELECT agent_id FROM acked)
"""


# -- settling: an outcome acks its packet and gives its slot back --------------------

# Ack the packets of the settling (task, assignment) rows ({settling}: a relation with
# task_execution_id and assignment); the agents they were on are returned as ``held``.
# Locked after the task and workflow rows, the agent row last.  An outcome proves its agent
# held the packet: a confirmation not yet written is written by the ack (in the version
# the ack writes anyway), and the socket writer drops its own (socket_writes, settled),
# one row version and one row lock less per packet whose outcome beat its confirmation.
SETTLE_ACK = """, held AS (
    UPDATE delivery_outbox o SET state = 'acked', acked_at = now(), updated_at = now(),
        received_at = coalesce(o.received_at, now())
    FROM {settling} s WHERE o.task_execution_id = s.task_execution_id
      AND o.assignment = s.assignment AND o.state <> 'acked'
    RETURNING o.agent_id AS holder
)"""
SETTLE_FREE = f""", freed AS (
    UPDATE agents_agent a SET {give_back_slots("a")}
    WHERE id IN (SELECT holder FROM held)
)"""

# Every agent row once, in id order (the result batch's one wait for agent rows: see the
# module docstring), each slot counter lowered by the number of its packets acked.
_RELEASE_SLOTS = f"""
WITH n AS (
    SELECT agent_id, count(*) AS n FROM unnest(%s::uuid[]) AS r(agent_id) GROUP BY agent_id
), locked AS (
    SELECT a.id FROM agents_agent a JOIN n ON n.agent_id = a.id ORDER BY a.id FOR NO KEY UPDATE OF a
)
UPDATE agents_agent a SET {give_back_slots("a", "n.n")}
FROM n, locked WHERE a.id = n.agent_id AND locked.id = a.id
"""

# The agent rows a transaction is about to write, locked in id order in one statement,
# when they are more than one statement's worth (a result batch whose breaker updates
# touch agents its slot release does not).
_LOCK_AGENTS = """
SELECT a.id FROM agents_agent a WHERE a.id = ANY(%s::uuid[]) ORDER BY a.id FOR NO KEY UPDATE OF a
"""

_ACK_AND_RELEASE = f"""
WITH acked AS (
    UPDATE delivery_outbox SET state = 'acked', acked_at = now(), updated_at = now()
    WHERE task_execution_id = %s AND assignment = %s AND state <> 'acked'
    RETURNING agent_id
)
UPDATE agents_agent a SET {give_back_slots("a")}
WHERE id IN (SELECT agent_id FROM acked)
"""

# The workflow row is locked first (the cancel writes it next): as in an outcome, task
# rows → workflow row → outbox rows → agent rows, never an agent row before the workflow.
_WITHDRAW_UNDELIVERED = f"""
WITH workflow AS (
    SELECT id FROM fleet_workflowexecution WHERE id = %s FOR NO KEY UPDATE
), rows AS (
    UPDATE delivery_outbox o SET state = 'acked', acked_at = now(), updated_at = now()
    FROM fleet_taskexecution t
    WHERE o.task_execution_id = t.id AND o.assignment = t.assignment AND o.state = 'pending'
      AND t.workflow_execution_id = (SELECT id FROM workflow) AND t.status = 'Running'
    RETURNING o.agent_id, o.task_execution_id
), n AS (
    SELECT agent_id, count(*) AS cnt FROM rows GROUP BY agent_id
), locked AS (  -- in id order, as every writer of several agent rows (module docstring)
    SELECT a.id FROM agents_agent a JOIN n ON n.agent_id = a.id ORDER BY a.id FOR NO KEY UPDATE OF a
), freed AS (
    UPDATE agents_agent a SET {give_back_slots("a", "n.cnt")}
    FROM n, locked WHERE a.id = n.agent_id AND locked.id = a.id
)
UPDATE fleet_taskexecution SET status = %s, finished_at = now(), error_message = 'cancelled'
WHERE id IN (SELECT task_execution_id FROM rows)
"""


def settle_ctes(settling: str, release: bool) -> str:
    """The CTEs an outcome statement appends: ack the packets of ``settling`` and, when
    ``release``, give their slots back in the same statement (else the caller frees the
    ``held`` agents with :func:`release_slots`, in agent id order, before its commit)."""
    return SETTLE_ACK.format(settling=settling) + (SETTLE_FREE if release else "")


def holds_sql(task: str) -> str:
    """SQL: the task row aliased ``task`` has a packet (so an agent holds its run)."""
    return (
        f"EXISTS (SELECT 1 FROM delivery_outbox o"
        f" WHERE o.task_execution_id = {task}.id AND o.assignment = {task}.assignment)"
    )


def ack_and_release(task_execution_id: uuid.UUID, assignment: int) -> bool:
    """Ack the row of this assignment and free the slot it reserved on its agent."""
    with connection.cursor() as cursor:
        cursor.execute(_ACK_AND_RELEASE, [task_execution_id, assignment])
        return cursor.rowcount > 0


def release_slots(agent_ids: list[uuid.UUID]) -> None:
    """Free one slot per entry of ``agent_ids`` (in the caller's transaction)."""
    if agent_ids:
        with connection.cursor() as cursor:
            cursor.execute(_RELEASE_SLOTS, [list(agent_ids)])


def lock_agents(agent_ids: list[uuid.UUID]) -> None:
    """Lock these agent rows in id order, in one statement (in the caller's transaction),
    before writing them in several statements (module docstring)."""
    if agent_ids:
        with connection.cursor() as cursor:
            cursor.execute(_LOCK_AGENTS, [sorted(set(agent_ids))])


def withdraw_undelivered(workflow_execution_id: uuid.UUID) -> int:
    """On cancel: tasks whose packet was never delivered are Skipped and their rows acked
    (their slots given back)."""
    with connection.cursor() as cursor:
        cursor.execute(_WITHDRAW_UNDELIVERED, [workflow_execution_id, TaskStatus.SKIPPED])
        return cursor.rowcount


# -- housekeeping ---------------------------------------------------------------------

PRUNE_ACKED = """
DELETE FROM delivery_outbox WHERE id IN (
    SELECT id FROM delivery_outbox
    WHERE state = 'acked' AND acked_at < now() - make_interval(secs => %s)
    LIMIT %s
)
"""
