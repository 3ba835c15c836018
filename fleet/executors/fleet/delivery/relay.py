"""The outbox relay: one per server process, pushing pending rows to the agents whose
delivery socket THIS process holds.

Wake-ups come from the ``delivery_outbox`` NOTIFY (payload: the agent id) via
the listener, from a consumer registering a socket, and from a short poll, so
a lost notification costs at most ``RELAY_POLL_S``.  A row this process itself
committed as pending for an agent whose socket is here wakes the relay directly
(:meth:`Relay.wake_for`, called by the executor right after the placement's
commit): no NOTIFY → LISTEN round trip on the way to a local socket.  Each round asks
which agents connected here have pending rows (by ``connected_to``: no list of sockets
sent) and takes a batch of theirs with one ``UPDATE … FOR UPDATE SKIP LOCKED … RETURNING``
(pending → delivered, attempts + 1), so rows of agents that are not here (or nowhere)
never block the rows behind them.  The task's result-wait clock starts
at delivery: ``result_deadline = now + timeout_s + RESULT_GRACE_S``.

Every few polls the relay also reconciles its sockets with the roster: a
socket whose agent was declared dead is closed 4404, one superseded by a newer
connection (here or on another server) 4408, and one whose API key was revoked
or whose tenant was deactivated 4401 — a socket is bound to the key it was
opened with, not only to the key that registered its agent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid

import psycopg

from fleet.engine.claims import RESULT_GRACE_S
from fleet.executors.fleet.delivery import local_sockets
from fleet.executors.fleet.delivery.metrics import DISPATCH_LATENCY
from fleet.executors.fleet.delivery.pg import connect_async
from fleet.executors.fleet.delivery.waiting import wait_event
from fleet.executors.fleet.state import ledger

log = logging.getLogger(__name__)

RELAY_POLL_S = 0.5  # safety-net poll when no notification arrives
RELAY_BATCH = 200  # rows per UPDATE … RETURNING
RECONCILE_EVERY_S = 1.0  # compare local sockets with the roster this often
RECONNECT_MAX_S = 5.0
# Sockets registering wake the relay (a reconnecting agent may have pending rows) at most
# this often: in a connect storm every hello woke a round of its own (a query each, ~4 % of
# the server's CPU per connect at 2,000 agents), though a new agent holds nothing.
SOCKET_WAKE_S = 0.05

CLOSE_BAD_KEY = 4401
CLOSE_UNKNOWN_AGENT = 4404
CLOSE_SUPERSEDED = 4408

_START_CLOCK = """
UPDATE fleet_taskexecution t
SET result_deadline = now() + make_interval(secs => t.timeout_s + %(grace)s)
FROM unnest(%(tasks)s::uuid[], %(assignments)s::int[], %(attempts)s::int[])
     AS d(task_execution_id, assignment, attempts)
WHERE t.id = d.task_execution_id AND t.assignment = d.assignment AND t.status = 'Running'
RETURNING d.attempts, extract(epoch FROM now() - t.ready_at)
"""

# The local sockets the roster no longer backs (their agent dead, stopped or unknown, or
# connected elsewhere or anew), with what the roster says.  Compared in the database, every
# socket of the process each second: it returns the few to close, not a row per socket (at
# 5,000 sockets, reading 5,000 rows a second was a quarter of an idle server's CPU), and
# takes the ids as binary parameters (ledger.TAKE_PENDING says why).
_STALE_SOCKETS = f"""
SELECT s.id, COALESCE(a.state, 'dead'), COALESCE(a.connected_to, ''),
       COALESCE(a.connection_generation, -1)
FROM unnest(%(ids)b::uuid[], %(generations)b::bigint[]) AS s(id, generation)
LEFT JOIN {ledger.AGENTS} a ON a.id = s.id
WHERE a.id IS NULL OR a.state IN ('dead', 'stopped') OR a.connected_to <> %(me)s
   OR a.connection_generation <> s.generation
"""

# The agents the roster says are connected to this server, counted and summed as
# local_sockets.roster_hash sums the sockets here: when both agree, no socket here is stale
# and the per-socket comparison above is skipped (at 5,000 sockets it cost ~5 % of a core,
# each second).  They differ while sockets open (before the hello) or close, and when
# something is stale: then the comparison runs.
ROSTER_DIGEST = f"""
SELECT count(*), COALESCE(sum(
    ('x' || left(md5(a.id::text || '/' || a.connection_generation), 15))::bit(60)::bigint
), 0)
FROM {ledger.AGENTS} a
WHERE a.connected_to = %(me)s AND a.state NOT IN ('dead', 'stopped')
"""

_ACTIVE_KEYS = """
SELECT k.id FROM fleet_apikey k JOIN fleet_tenant t ON t.id = k.tenant_id
WHERE k.id = ANY(%s::bigint[]) AND k.revoked_at IS NULL AND t.is_active
"""


def _observe_latency(rows: list[tuple]) -> None:
    for attempts, seconds in rows:
        if attempts == 1 and seconds is not None:
            DISPATCH_LATENCY.observe(max(float(seconds), 0.0))


class Relay:
    def __init__(self, poll_s: float = RELAY_POLL_S, batch: int = RELAY_BATCH) -> None:
        self.poll_s = poll_s
        self.batch = batch
        self.wake = asyncio.Event()
        self.pushed = 0
        self.rounds = 0  # rounds run (tests wait for the first one)
        self._task: asyncio.Task | None = None
        self._conn: psycopg.AsyncConnection | None = None
        self._last_reconcile = 0.0
        self._socket_wake: asyncio.TimerHandle | None = None

    # -- wake-ups (called on the event loop) ----------------------------------------
    def on_notify(self, payload: str) -> None:
        """A row became pending for agent ``payload``: wake if its socket is here."""
        try:
            agent_id = uuid.UUID(payload)
        except ValueError:
            return
        if local_sockets.get(agent_id) is not None:
            self.wake.set()

    def wake_for(self, agent_id: uuid.UUID) -> bool:
        """A row this process just committed as pending for ``agent_id``: wake now if the
        agent's socket is here (the NOTIFY would say the same one round trip later).
        Returns whether it woke."""
        if local_sockets.get(agent_id) is None:
            return False
        self.wake.set()
        return True

    def on_socket(self, _socket: local_sockets.LocalSocket) -> None:
        """A socket registered: one round within ``SOCKET_WAKE_S`` for all that do by then."""
        if self._socket_wake is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # not on the event loop: wake now
            self.wake.set()
            return
        self._socket_wake = loop.call_later(SOCKET_WAKE_S, self._sockets_registered)

    def _sockets_registered(self) -> None:
        self._socket_wake = None
        self.wake.set()

    def kick(self) -> None:
        self.wake.set()

    # -- packets the placement already marked delivered -------------------------------
    async def push_delivered(
        self, agent_id: uuid.UUID, outbox_id: int, packet: dict, waited_s: float
    ) -> bool:
        """Push a packet that the placement wrote as delivered to a socket of this process
        (fleet/executors/fleet/delivery/batch_placement.py), right after its commit: no relay round trip.

        When it cannot be pushed now (the socket is gone or not yet past its hello) the row
        goes back to pending, so this relay — or the one of the server the agent reconnects
        to — pushes it; a crash before this point is covered by redelivery of unconfirmed
        rows and by the agent's hello.
        """
        socket = local_sockets.get(agent_id)
        if socket is not None:
            await self._send(socket, packet)
            self.pushed += 1
            _observe_latency([(1, waited_s)])
            return True
        conn = await self._connection()
        await conn.execute(ledger.UNTAKE, [[outbox_id]])  # NOTIFY: a relay takes it from here
        return False

    async def _send(self, socket: local_sockets.LocalSocket, packet: dict) -> None:
        """Hand ``packet`` to the socket's consumer by a direct call (local_sockets.py)."""
        try:
            await socket.push(packet)
        except Exception:
            # A packet the socket cannot carry stays delivered and unconfirmed:
            # redelivery retries it and, past its pushes, fails it with a reason.
            log.exception("pushing packet %s to agent %s failed",
                          packet.get("outbox_id"), socket.agent_id)  # fmt: skip

    # -- lifecycle ------------------------------------------------------------------
    def start(self) -> None:
        local_sockets.on_register(self.on_socket)
        self._task = asyncio.create_task(self._run(), name="outbox-relay")

    async def stop(self) -> None:
        local_sockets.remove_listener(self.on_socket)
        if self._socket_wake is not None:
            self._socket_wake.cancel()
            self._socket_wake = None
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None
        await self._drop_connection()

    async def _drop_connection(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                await conn.close()

    async def _connection(self) -> psycopg.AsyncConnection:
        if self._conn is None or self._conn.closed or self._conn.broken:
            await self._drop_connection()
            self._conn = await connect_async("cloacina-relay", relaxed=True)
        return self._conn

    async def _run(self) -> None:
        delay = self.poll_s
        while True:
            self.wake.clear()
            try:
                await self.run_once()
                self.rounds += 1
                delay = self.poll_s
            except asyncio.CancelledError:
                raise
            except (psycopg.Error, OSError) as exc:
                log.warning("outbox relay: database error (%s); retrying in %.1fs", exc, delay)
                await self._drop_connection()
                await asyncio.sleep(delay)
                delay = min(delay * 2, RECONNECT_MAX_S)
                continue
            except Exception:
                log.exception("outbox relay round failed")
            await wait_event(self.wake, self.poll_s)

    # -- one round ------------------------------------------------------------------
    async def run_once(self) -> int:
        """Push every pending row of locally connected agents; reconcile sockets when due."""
        conn = await self._connection()
        pushed = 0
        while True:
            count = await self._push_batch(conn)
            pushed += count
            if count < self.batch:
                break
        if time.monotonic() - self._last_reconcile >= RECONCILE_EVERY_S:
            await self.reconcile(conn)
        return pushed

    async def _pending_here(self, conn: psycopg.AsyncConnection) -> list[uuid.UUID]:
        """The agents with pending rows whose sockets the roster puts on this server and
        this process holds past their hello.  Asked of the database by ``connected_to``:
        an idle round sends no id and reads no row (it sent every local socket's id, twice a
        second: 5,000 of them per round at 5,000 agents).  A socket the roster puts here but
        that is not registered yet (before its hello) is left out, so its rows are not taken
        (and their ``attempts`` counted) only to be handed back."""
        cursor = await conn.execute(ledger.PENDING_HERE, {"me": local_sockets.server_id()})
        return [row[0] for row in await cursor.fetchall() if local_sockets.get(row[0])]

    async def _push_batch(self, conn: psycopg.AsyncConnection) -> int:
        agents = await self._pending_here(conn)
        if not agents:
            return 0
        me = local_sockets.server_id()
        cursor = await conn.execute(
            ledger.TAKE_PENDING, {"agents": agents, "batch": self.batch, "me": me}
        )
        rows = await cursor.fetchall()
        if not rows:
            return 0
        failed: list[int] = []
        delivered: list[tuple] = []
        for outbox_id, agent_id, task_execution_id, assignment, attempts, payload in rows:
            socket = local_sockets.get(agent_id)
            if socket is None:
                failed.append(outbox_id)
                continue
            payload["outbox_id"] = outbox_id  # the row's own dict: no copy per packet
            await self._send(socket, payload)
            delivered.append((task_execution_id, assignment, attempts))
        if failed:
            await conn.execute(ledger.UNTAKE, [failed])
        if delivered:
            cursor = await conn.execute(
                _START_CLOCK,
                {
                    "grace": RESULT_GRACE_S,
                    "tasks": [d[0] for d in delivered],
                    "assignments": [d[1] for d in delivered],
                    "attempts": [d[2] for d in delivered],
                },
            )
            _observe_latency(await cursor.fetchall())
        self.pushed += len(delivered)
        return len(rows)

    async def _stale_sockets(
        self, conn: psycopg.AsyncConnection, sockets: dict, me: str
    ) -> dict[uuid.UUID, tuple]:
        """The sockets here the roster no longer backs, with what it says of them; none
        when the roster's digest is this process's (``ROSTER_DIGEST``)."""
        local = local_sockets.digest()
        cursor = await conn.execute(ROSTER_DIGEST, {"me": me})
        count, total = await cursor.fetchone()
        if (count, int(total)) == local:
            return {}
        ids = list(sockets)
        cursor = await conn.execute(
            _STALE_SOCKETS,
            {"ids": ids, "generations": [sockets[i].generation for i in ids], "me": me},
        )
        return {row[0]: row[1:] for row in await cursor.fetchall()}

    async def reconcile(self, conn: psycopg.AsyncConnection | None = None) -> int:
        """Close local sockets whose key was revoked or tenant deactivated (4401), whose
        agent is dead (4404) or connected elsewhere/anew (4408)."""
        self._last_reconcile = time.monotonic()
        sockets = local_sockets.snapshot()
        if not sockets:
            return 0
        conn = conn or await self._connection()
        me = local_sockets.server_id()
        keys = local_sockets.key_ids()
        cursor = await conn.execute(_ACTIVE_KEYS, [list(keys)])
        active_keys = {row[0] for row in await cursor.fetchall()}
        roster = await self._stale_sockets(conn, sockets, me)
        candidates = list(roster)
        if keys - active_keys:  # rare: only then is every socket's key looked at
            candidates += [
                a for a, s in sockets.items() if s.key_id in keys - active_keys and a not in roster
            ]
        closed = 0
        for agent_id in candidates:
            socket = sockets[agent_id]
            # A socket the roster still backs is not in ``roster`` (its key was revoked).
            state, connected_to, generation = roster.get(agent_id, ("", me, socket.generation))
            if socket.key_id is not None and socket.key_id not in active_keys:
                code, reason = CLOSE_BAD_KEY, "API key revoked or tenant deactivated"
            elif state in ("dead", "stopped"):
                code, reason = CLOSE_UNKNOWN_AGENT, f"agent is {state}; register again"
            elif connected_to != me or generation != socket.generation:
                code, reason = CLOSE_SUPERSEDED, "superseded by a newer connection"
            else:
                continue
            local_sockets.unregister(agent_id, socket.channel_name)
            await socket.close(code, reason)
            closed += 1
        return closed
