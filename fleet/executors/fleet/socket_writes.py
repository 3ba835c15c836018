"""The delivery sockets' frequent writes — heartbeats and ``received`` confirmations —
batched onto one async connection per process.

Every agent beats every interval and confirms every packet; as one UPDATE per
frame on the shared thread pool these queued behind dispatch work, and a
heartbeat stuck in a queue for a liveness window gets a healthy agent evicted.
Here they never wait behind anything: frames from all sockets of the process
are gathered while the previous batch is written and written together, one
UPDATE per kind.

Confirmations are urgent (dispatch waits on them); beats are not: a beat alone waits
a short gather window (a twentieth of the heartbeat interval, at most a second) for
the beats of other agents, so thousands of agents cost a few statements per interval
instead of one each, and a liveness window (interval × misses) never notices.

One socket's bad write never costs another socket anything: when a batched
statement fails on its data (not on the connection), the round's writes are
retried agent by agent on the same connection, and only the agent whose write
fails again loses it — its socket is closed 4400 — while every other agent's
confirmations and beats land in that round.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from dataclasses import dataclass
from typing import NamedTuple

import psycopg

from agents.protocol import hop_trace
from fleet.executors.fleet import lifecycle
from fleet.executors.fleet.delivery import local_sockets
from fleet.executors.fleet.delivery.pg import connect_async
from fleet.executors.fleet.delivery.waiting import wait_event
from fleet.executors.fleet.state import ledger
from fleet.platform.config import get_config

log = logging.getLogger(__name__)

RECONNECT_MAX_S = 2.0  # at most, and at most a quarter of the liveness window (below)
CLOSE_MALFORMED = 4400  # the close code of a socket whose write the database refused

# Confirmations (the ledger's statements) never wait for a row lock; one whose row was
# not marked is tried again a few rounds (fleet/executors/fleet/state/ledger.py says why).
RECEIVED_TRIES = 20  # rounds a confirmation that was not marked is tried again
RECEIVED_RETRY_S = 0.01
# Under load, rounds of confirmations are at least this far apart, so each statement
# carries several (it costs the database far more than a row does).  Load is a round
# that carried more than one: after a round of one (an idle server, or one client
# starting one task at a time) the next confirmation is written at once, since the
# gap would only add to its pickup's latency and gather nothing.
MIN_ROUND_GAP_S = 0.01
BEAT_GATHER_SHARE = 0.05  # of the heartbeat interval: how long a lone beat waits for company
BEAT_GATHER_MAX_S = 1.0
BEAT_RETRY_S = 0.05  # a beat whose agent row was locked is tried again this much later


class BeatAnswer(NamedTuple):  # a tuple: one made per beat, thousands a minute
    state: str
    drain: bool


@dataclass
class _Beat:
    tenant_id: int
    running: list[uuid.UUID]
    metrics_json: str | None  # as the agent's checked frame gave it: written, not re-encoded
    draining: bool
    waiters: list[asyncio.Future]


class SocketWrites:
    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._beats: dict[uuid.UUID, _Beat] = {}
        self._received: list[tuple[uuid.UUID, int]] = []
        self._retry: dict[tuple[uuid.UUID, int], int] = {}  # skipped confirmations → tries
        # Packets whose outcome committed since the round began: their ack wrote
        # ``received_at`` (ledger.SETTLE_ACK), so their confirmations are not written.
        self._settled: set[tuple[uuid.UUID, int]] = set()
        # Packets whose outcomes are on their way to a result batch (outcome_coming): their
        # confirmations wait (parked) for it, and are written only if it was not applied.
        self._coming: set[tuple[uuid.UUID, int]] = set()
        self._parked: set[tuple[uuid.UUID, int]] = set()
        self._wake = asyncio.Event()
        self._writing = False  # a round's statements are on their way
        self._nudged = False  # results were applied since the last round (results_applied)
        self._beat_gather_s = beat_gather_s(get_config().heartbeat_interval_s)
        self._reconnect_max_s = reconnect_max_s(get_config().liveness_window_s)
        self._beats_since = 0.0  # when the oldest unwritten beat arrived
        self._conn: psycopg.AsyncConnection | None = None
        self._task = asyncio.create_task(self._run(), name="socket-writes")

    # -- producers (the consumers) ------------------------------------------------------
    def received(self, agent_id: uuid.UUID, outbox_ids: list[int]) -> None:
        """Confirm packets (only rows addressed to ``agent_id`` are touched)."""
        self._received.extend((agent_id, i) for i in outbox_ids)
        self._wake.set()

    def heartbeat(
        self,
        agent_id: uuid.UUID,
        tenant_id: int,
        running: list[uuid.UUID],
        metrics_json: str | None,
        draining: bool,
    ) -> asyncio.Future[BeatAnswer | None]:
        """Record a beat (its metrics as JSON text, None for none): a future of its answer,
        None when the agent is dead or unknown (its socket must close), or
        :class:`WriteRefused` when the database refused this beat's data.  A future, not a coroutine: the consumer acts on the answer in a done
        callback, with no task per beat (thousands of agents beat every 15 s)."""
        future = self._loop.create_future()
        if not self._beats:
            # The round's first beat wakes the writer, which then waits for the others until
            # this one is beat_gather_s old: a beat that joins it has nothing to wake (one
            # wake-up per beat was a task step and a timer each, thousands a minute).
            self._beats_since = self._loop.time()
            self._wake.set()
        beat = self._beats.get(agent_id)
        if beat is None:
            self._beats[agent_id] = _Beat(tenant_id, running, metrics_json, draining, [future])
        else:  # coalesce with a beat not yet written
            beat.running, beat.draining = running, draining or beat.draining
            if metrics_json is not None:
                beat.metrics_json = metrics_json
            beat.waiters.append(future)
        return future

    @property
    def running(self) -> bool:
        """Whether this writer still writes (false once closed, with its loop or by
        :func:`close_writer`): a consumer keeps its writer while it runs."""
        return not self._task.done()

    @property
    def retrying(self) -> int:
        """Confirmations skipped (their rows were locked) and waiting to be written again."""
        return len(self._retry)

    def outcome_coming(self, keys: list[tuple[uuid.UUID, int]]) -> None:
        """The outcomes of these packets (agent, outbox id) arrived and go to a result
        batch: a confirmation of theirs not yet written waits for it, since the ack writes
        ``received_at`` (ledger.SETTLE_ACK).  Every key must come back through
        :meth:`results_applied`, settled or not."""
        self._coming.update(keys)

    def results_applied(
        self,
        settled: list[tuple[uuid.UUID, int]] | None = None,
        unsettled: list[tuple[uuid.UUID, int]] | None = None,
    ) -> None:
        """A batch of results of this process committed: a confirmation skipped because
        its packet's row was being acked (locked) by it can be written now.  Without this
        nudge it waited for the next retry round, RECEIVED_RETRY_S later — with a no-op
        task, whose result comes a millisecond after its ``received``, one idle pickup in
        ten on a loaded machine.

        ``settled``: the (agent, outbox id) of the packets whose outcomes the batch applied.
        Their acks wrote ``received_at`` in the same commit, so a confirmation of theirs
        still waiting here is dropped: it would only look the row up and find it
        confirmed (or, skipped behind the ack's lock, come back to do so).  ``unsettled``:
        the packets announced by :meth:`outcome_coming` whose outcomes were not applied
        (stale, refused, the batch failed): a confirmation parked for them is written."""
        if settled:
            if self._received or self._retry or self._writing:
                self._settled.update(settled)
            self._coming.difference_update(settled)
            self._parked.difference_update(settled)
        if unsettled:
            self._coming.difference_update(unsettled)
            back = [key for key in unsettled if key in self._parked]
            if back:
                self._parked.difference_update(back)
                self._received.extend(back)
                self._wake.set()
        if self._retry:
            self._nudged = True
            self._wake.set()

    # -- the writer -------------------------------------------------------------------
    async def _run(self) -> None:
        try:
            await self._loop_forever()
        finally:  # cancelled with its event loop: do not leave the connection open
            await self._drop()

    async def _loop_forever(self) -> None:
        delay = 0.1
        last_confirming = 0.0  # when the last round that wrote confirmations began
        spaced = False  # that round carried several: the next one keeps the gap
        while True:
            if self._retry:
                await wait_event(self._wake, RECEIVED_RETRY_S)
            else:
                await self._wake.wait()
            await self._gather_beats()
            # Only confirmations space each other out: a round of beats just before must
            # not hold back the first confirmation after it (an idle pickup's latency).
            gap = last_confirming + MIN_ROUND_GAP_S - self._loop.time()
            if gap > 0 and spaced and not self._beats and not self._lone_retry_nudged():
                await asyncio.sleep(gap)  # a beat never waits (liveness)
            self._nudged = False
            self._wake.clear()
            beats, self._beats = self._beats, {}
            received, self._received = self._received, []
            received.extend(key for key in self._retry if key not in received)
            if self._settled or self._coming:
                wanted, received = bool(received), self._to_write(received)
                if wanted and not received and not beats:
                    continue  # every confirmation of the round is (or will be) its ack's
            if received:
                last_confirming = self._loop.time()
                spaced = len(received) > 1
            try:
                self._writing = True
                await self._write(beats, received)
                delay = 0.1
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("socket writes failed (%s); retrying in %.1fs", exc, delay)
                await self._drop()
                # Keep the beats for the next try (a beat late is better than lost);
                # confirmations are safety-netted by redelivery + the agent's dedupe.
                for agent_id, beat in beats.items():
                    self._put_back(agent_id, beat)
                self._beats_since = 0.0  # already waited: written with the next round
                self._wake.set()
                await asyncio.sleep(delay)
                delay = min(delay * 2, self._reconnect_max_s)
            finally:
                self._writing = False

    def _to_write(self, received: list) -> list:
        """``received`` without the confirmations whose packets' acks committed (and wrote
        them) and without those whose outcomes are coming (parked until they are applied);
        the retries lose both."""
        settled, self._settled = self._settled, set()
        coming = self._coming
        parked = [key for key in received if key in coming]
        self._parked.update(parked)
        self._retry = {
            key: n for key, n in self._retry.items() if key not in settled and key not in coming
        }
        return [key for key in received if key not in settled and key not in coming]

    def _lone_retry_nudged(self) -> bool:
        """The round would only retry one confirmation, its blocker just committed: an idle
        server's (under load there are new confirmations, and the spacing holds)."""
        return self._nudged and not self._received and len(self._retry) == 1

    async def _gather_beats(self) -> None:
        """Beats alone wait until the oldest is ``beat_gather_s`` old, for others to join
        them; a confirmation (urgent) ends the wait, and the beats go in its round."""
        while self._beats and not self._received and not self._retry:
            left = self._beats_since + self._beat_gather_s - self._loop.time()
            if left <= 0:
                return
            self._wake.clear()
            await wait_event(self._wake, left)

    async def _connection(self) -> psycopg.AsyncConnection:
        if self._conn is None or self._conn.closed or self._conn.broken:
            await self._drop()
            self._conn = await connect_async("cloacina-sockets", relaxed=True)
        return self._conn

    async def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                await conn.close()

    async def _write(self, beats: dict[uuid.UUID, _Beat], received: list) -> None:
        conn = await self._connection()
        if received:
            await self._write_received(conn, received)
        if beats:
            await self._write_beats(conn, beats)

    async def _write_received(self, conn: psycopg.AsyncConnection, received: list) -> None:
        if hop_trace.enabled():
            for _agent, outbox_id in received:
                hop_trace.mark("confirming", outbox=outbox_id)
        try:
            marked = await self._mark_received(conn, received)
        except _DATA_ERRORS:
            marked, refused = set(), set()
            for agent_id, keys in _by_agent(received).items():
                try:
                    marked |= await self._mark_received(conn, keys)
                except _DATA_ERRORS as exc:
                    refused.add(agent_id)
                    await _refuse(agent_id, "received", exc)
            received = [key for key in received if key[0] not in refused]
        tries, settled = self._retry, self._settled  # settled: acked while this round ran
        self._retry = {
            key: tries.get(key, 0) + 1
            for key in received
            if key[1] not in marked
            and key not in settled
            and tries.get(key, 0) + 1 < RECEIVED_TRIES
        }

    @staticmethod
    async def _mark_received(conn: psycopg.AsyncConnection, received: list) -> set[int]:
        cursor = await conn.execute(
            ledger.RECEIVED_MANY,
            {"agents": [r[0] for r in received], "ids": [r[1] for r in received]},
        )
        return {row[0] for row in await cursor.fetchall()}

    async def _write_beats(
        self, conn: psycopg.AsyncConnection, beats: dict[uuid.UUID, _Beat]
    ) -> None:
        refused: set[uuid.UUID] = set()
        try:
            answers, skipped = await self._beat(conn, beats)
        except _DATA_ERRORS:
            answers, skipped = {}, set()
            for agent_id, beat in beats.items():
                try:
                    one, one_skipped = await self._beat(conn, {agent_id: beat})
                    answers |= one
                    skipped |= one_skipped
                except _DATA_ERRORS as exc:
                    refused.add(agent_id)
                    await _refuse(agent_id, "heartbeat", exc)
        for agent_id in skipped:
            self._retry_beat(agent_id, beats.pop(agent_id))
        for agent_id, beat in beats.items():
            for waiter in beat.waiters:
                if waiter.done():
                    continue
                if agent_id in refused:
                    waiter.set_exception(WriteRefused("the database refused its heartbeat"))
                else:
                    waiter.set_result(answers.get(agent_id))

    def _retry_beat(self, agent_id: uuid.UUID, beat: _Beat) -> None:
        """A beat whose row was locked: written again in BEAT_RETRY_S (merged with a newer
        beat of the agent, whose data wins; every waiter gets the answer)."""
        self._put_back(agent_id, beat)
        due = self._loop.time() - self._beat_gather_s + BEAT_RETRY_S
        self._beats_since = min(self._beats_since, due) if len(self._beats) > 1 else due
        self._wake.set()

    def _put_back(self, agent_id: uuid.UUID, beat: _Beat) -> None:
        """An unwritten beat back into the next round.  A newer beat of the agent may have
        come meanwhile: it takes the older one's waiters (dropping them would leave that
        socket's beat unanswered for ever, and the agent evicted while it beats)."""
        newer = self._beats.get(agent_id)
        if newer is None:
            self._beats[agent_id] = beat
            return
        newer.waiters[:0] = beat.waiters
        newer.draining = newer.draining or beat.draining
        if newer.metrics_json is None:
            newer.metrics_json = beat.metrics_json

    @staticmethod
    async def _beat(
        conn: psycopg.AsyncConnection, beats: dict[uuid.UUID, _Beat]
    ) -> tuple[dict[uuid.UUID, BeatAnswer], set[uuid.UUID]]:
        """The answers of the beats written, and the agents whose rows were locked (their
        beats are to be tried again)."""
        ids = list(beats)
        rows = list(beats.values())
        cursor = await conn.execute(
            lifecycle.BEAT_MANY_BINARY,
            {
                "ids": ids,
                "tenants": [b.tenant_id for b in rows],
                "has": [b.metrics_json is not None for b in rows],
                "metrics": [b.metrics_json or "{}" for b in rows],
                "draining": [b.draining for b in rows],
            },
        )
        rows = await cursor.fetchall()
        lifecycle.count_beats(rows)  # an agent may have declared itself draining
        answers = {row[0]: BeatAnswer(row[1], row[2]) for row in rows}
        running = [(i, t) for i in ids if i in answers for t in beats[i].running]
        if running:
            await conn.execute(
                ledger.RUNNING_MANY,
                {"agents": [r[0] for r in running], "tasks": [r[1] for r in running]},
            )
        missing = [i for i in ids if i not in answers]
        skipped: set[uuid.UUID] = set()
        if missing:
            cursor = await conn.execute(
                lifecycle.BEAT_PENDING,
                {"ids": missing, "tenants": [beats[i].tenant_id for i in missing]},
            )
            skipped = {row[0] for row in await cursor.fetchall()}
        return answers, skipped

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._task
        await self._drop()
        for beat in self._beats.values():
            for waiter in beat.waiters:
                if not waiter.done():
                    waiter.cancel()


# A statement refused for what it carries (a value out of range, bad text): the
# connection is fine and the other agents' writes are retried without it.  Anything
# else (the server gone, the connection broken) drops the connection and retries all.
_DATA_ERRORS = (
    psycopg.DataError, psycopg.IntegrityError, psycopg.ProgrammingError, psycopg.NotSupportedError
)  # fmt: skip


class WriteRefused(Exception):
    """The database refused this agent's write (its socket is being closed 4400)."""


def _by_agent(received: list[tuple[uuid.UUID, int]]) -> dict[uuid.UUID, list]:
    groups: dict[uuid.UUID, list] = {}
    for key in received:
        groups.setdefault(key[0], []).append(key)
    return groups


async def _refuse(agent_id: uuid.UUID, what: str, exc: Exception) -> None:
    """Drop an agent's write the database refused, and close its socket here (4400): it
    sent what its frames' checks should have stopped, so it is not an honest agent."""
    log.warning("agent %s: %s write refused by the database (%s); closing its socket",
                agent_id, what, str(exc).splitlines()[0] if str(exc) else type(exc).__name__)  # fmt: skip
    socket = local_sockets.get(agent_id)
    if socket is None:
        return
    local_sockets.unregister(agent_id, socket.channel_name)
    await socket.close(CLOSE_MALFORMED, f"malformed frame: the database refused its {what}")


def beat_gather_s(heartbeat_interval_s: float) -> float:
    """How long a lone beat waits for others: a small share of the interval, so the
    liveness window (misses × interval) is unaffected, and never more than a second."""
    return min(BEAT_GATHER_MAX_S, BEAT_GATHER_SHARE * heartbeat_interval_s)


def reconnect_max_s(liveness_window_s: float) -> float:
    """The longest pause between two tries of a failing writer.  Once the database is back,
    the liveness sweep gives agents one window for their beats to land again
    (fleet/executors/fleet/executor.py, ``_liveness_sweep``); a writer still pausing for
    longer than that got every live agent evicted after a database restart (the chaos
    test, with beats of 0.5 s: a 1.5 s window against pauses of up to 2 s)."""
    return min(RECONNECT_MAX_S, liveness_window_s / 4)


_writers: dict[asyncio.AbstractEventLoop, SocketWrites] = {}


def writer() -> SocketWrites:
    """This event loop's writer (created on first use)."""
    loop = asyncio.get_running_loop()
    current = _writers.get(loop)
    if current is None:
        for old in [lp for lp in _writers if lp.is_closed()]:
            del _writers[old]
        current = _writers[loop] = SocketWrites()
    return current


def current_writer() -> SocketWrites | None:
    """This event loop's writer if it has one (never creates one: a result batch finishing
    while the server shuts down must not start a writer)."""
    return _writers.get(asyncio.get_running_loop())


async def close_writer() -> None:
    current = _writers.pop(asyncio.get_running_loop(), None)
    if current is not None:
        await current.close()
