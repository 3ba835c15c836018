"""The delivery WebSocket: one consumer per connected agent (docs/agent-protocol.md).

Thin by design.  The handshake's ``Authorization: Bearer`` key is checked and
the agent must belong to the key's tenant; the connection then owns the agent
(``connected_to`` + a new ``connection_generation``).  Frames are size-
checked (1 MiB), rate-limited (token bucket) and parsed as they arrive, then
queued (bounded) for a worker task that batches their database work while any
wait: so a burst of ``received`` frames costs one UPDATE, and a slow database never
blocks the socket's reader.  Heartbeats skip that queue: each goes to the socket
writer at once, so a beat never waits behind a hello or results on the delivery pool.
Work packets come from this process's relay by a direct call (the consumer registers
``push_packet`` and its close in local_sockets; it holds no channel-layer channel); the
relay closes the socket the same way when the agent died or connected elsewhere, or when
the key the socket was opened with is revoked or its tenant deactivated (4401).
An agent may report outcomes over the socket too (``result`` frames, answered
by ``result_ack``): the same checks and handler as ``POST …/results``, without
an HTTP request per task.
Several ``received``/``result`` frames may come in one ``batch`` frame, each checked as
it would be alone; packets and acks to an agent whose hello asked for batches are queued
per loop turn and written as one ``batch`` frame (docs/agent-protocol.md, "Batched frames").

A socket opened on ``/ws/agents/`` (no agent id) registers first: its first frame is a
``register`` frame (the REST registration's body, always JSON), answered by a
``registered`` frame (the REST answer) or a ``refused`` frame and a close; then it goes on
as a socket of the new agent, hello first (docs/agent-protocol.md, "Registering on the
socket").  One connection instead of a REST request and a socket, no Django request stack.

Close codes: 4400 malformed frame, 4401 bad key, 4403 key not allowed,
4404 unknown/dead agent, 4408 superseded, 4409 registration conflict (protocol or wire
format), 4413 frame too large, 4422 invalid registration, 4429 flood,
4012 the server is shutting down (connect to another), 4013 the server admits no
more sockets or registrations for now (the reason says "retry after N s").
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
import uuid
from collections import deque
from collections.abc import Coroutine
from typing import Any

import msgpack
from channels.consumer import get_handler_name
from channels.exceptions import StopConsumer
from channels.generic.websocket import AsyncWebsocketConsumer
from pydantic import ValidationError

from agents.protocol import batching, hop_trace, wire
from agents.protocol import frames as agent_frames
from agents.surface.api import RegisterIn, as_registration
from fleet.engine import task_logs
from fleet.engine.context import unstorable
from fleet.executors.fleet import result_batches, roster, socket_writes
from fleet.executors.fleet.delivery import admission, local_sockets, redelivery
from fleet.executors.fleet.delivery import db as delivery_db
from fleet.executors.fleet.delivery.handover import CLOSE_GO_ELSEWHERE, GO_ELSEWHERE_REASON
from fleet.executors.fleet.result_intake import MAX_BIGINT, MAX_INT, ResultIn
from fleet.executors.fleet.routing.metrics import HEARTBEATS

log = logging.getLogger(__name__)
SOCKET_BEATS = HEARTBEATS.labels(via="socket")  # looked up once: every beat counts here

MAX_FRAME_BYTES = 1024 * 1024
INBOUND_QUEUE = 1024  # frames parsed but not yet handled
FRAME_RATE_PER_S = 4000.0  # sustained frames per second per socket (~2 per task + beats)
FRAME_BURST = 8000  # frames allowed at once above the sustained rate
RESULTS_IN_FLIGHT = 16  # results of one socket being applied at once
MAX_HOLDING = 10_000
INBOUND_BATCH = 512
MAX_REGISTER_FRAME_BYTES = 64 * 1024  # a registration body: metrics (16 KiB) and lists
# Socket registrations holding a delivery pool thread at once, as POOLED_AT_ONCE bounds the
# REST ones (cloacina_site/one_hop.py): one tenant's registrations take turns on its roster
# lock and must not hold every thread while hellos and results wait.
REGISTERING_AT_ONCE = 4

CLOSE_MALFORMED = 4400
CLOSE_BAD_KEY = 4401
CLOSE_UNKNOWN_AGENT = 4404
CLOSE_TOO_LARGE = 4413
CLOSE_FLOOD = 4429
CLOSE_SUPERSEDED = 4408
CLOSE_TRY_LATER = 4013  # 4000 + RFC 6455's 1013 "Try Again Later" (docs/agent-protocol.md)
CLOSE_INVALID_REGISTRATION = 4422

_registering: tuple[asyncio.AbstractEventLoop, asyncio.Semaphore] | None = None


def registering_slots() -> asyncio.Semaphore:
    """REGISTERING_AT_ONCE of the running loop (one under ``serve``; tests run several)."""
    global _registering
    loop = asyncio.get_running_loop()
    if _registering is None or _registering[0] is not loop:
        _registering = (loop, asyncio.Semaphore(REGISTERING_AT_ONCE))
    return _registering[1]


class FrameRejected(ValueError):
    """A frame that parses but does not fit the protocol (4400)."""


class TokenBucket:
    def __init__(self, rate: float, burst: int) -> None:
        self.rate, self.burst = rate, float(burst)
        self.tokens, self.stamp = float(burst), time.monotonic()

    def take(self) -> bool:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


def _bearer(scope: dict) -> str:
    for name, value in scope.get("headers", []):
        if name.lower() == b"authorization":
            text = value.decode("latin-1").strip()
            if text[:7].lower() == "bearer ":
                return text[7:].strip()
    return ""


def _bounded_int(value: Any, low: int, high: int) -> int | None:
    """``value`` if it is a JSON integer (not a boolean) within [low, high], else None."""
    if isinstance(value, int) and not isinstance(value, bool) and low <= value <= high:
        return value
    return None


def _holding(holding: Any) -> list[tuple[uuid.UUID, int]]:
    if not isinstance(holding, list) or len(holding) > MAX_HOLDING:
        raise FrameRejected(f"hello: holding must be a list of at most {MAX_HOLDING} pairs")
    pairs = []
    for item in holding:
        try:
            task_execution_id, assignment = item
            task_uuid = uuid.UUID(task_execution_id) if isinstance(task_execution_id, str) else None
        except (TypeError, ValueError):
            task_uuid = None
            assignment = None
        # Cast to int[] in SQL: an assignment past int4 would fail the statement.
        bounded = _bounded_int(assignment, 1, MAX_INT)
        if task_uuid is None or bounded is None:
            raise FrameRejected(
                "hello: each holding entry must be [task_execution_id, assignment] with "
                f"assignment an integer 1..{MAX_INT}"
            )
        pairs.append((task_uuid, bounded))
    return pairs


# How many characters of JSON (json.dumps) the content of a frame of N bytes can take at
# most, over N: spaces after separators, \u escapes of non-ASCII, ``9e15`` written out,
# and MessagePack's one-byte ``false``/``nil`` as ``false, ``/``null, ``: at most ~7.
METRICS_JSON_GROWTH = 8


def metrics_too_large(metrics: dict[str, Any], frame_bytes: int = MAX_FRAME_BYTES) -> bool:
    """Whether a beat's ``metrics`` take more than MAX_METRICS_BYTES as JSON.  A frame of
    ``frame_bytes`` too small to hold that much is not serialised to be measured: thousands
    of agents beat every few seconds, with metrics of a few hundred bytes."""
    if frame_bytes * METRICS_JSON_GROWTH <= roster.MAX_METRICS_BYTES:
        return False
    return len(json.dumps(metrics)) > roster.MAX_METRICS_BYTES


# The scope key under which `serve` (cloacina_site/daphne_server.py) offers a socket's
# application its frame shortcut: a function taking a synchronous frame handler.
FRAME_SHORTCUT = "cloacina.frame_shortcut"
# How a MessagePack heartbeat frame begins once its map header is passed (the agent's
# frames.heartbeat puts "type" first): the shortcut looks at nothing else.
_BEAT_MSGPACK_TYPE = msgpack.packb({"type": "heartbeat"})[1:]
_BEAT_KEYS = frozenset(("type", "in_flight", "running", "metrics", "draining"))
_SCALARS = (str, int, float, bool, type(None))
SHORTCUT_MAX_BYTES = 8 * 1024  # a beat larger than this goes the usual way
# json.dumps' own C encoder, made once: json.dumps builds it anew per call, a quarter of
# what encoding a beat's metrics cost.  The same text as json.dumps with its defaults
# (tests/unit/test_beat_shortcut.py); markers off, as a flat object cannot be circular.
# None on an interpreter without json's C speedups: json.dumps then.
_metrics_encoder = json.encoder.c_make_encoder and json.encoder.c_make_encoder(
    None, json.JSONEncoder().default, json.encoder.encode_basestring_ascii, None,
    ": ", ", ", False, False, True,
)  # fmt: skip


def plain_beat(payload: bytes) -> dict[str, Any] | None:
    """A MessagePack heartbeat frame as :func:`_check_frame` would make it (``running`` as
    UUIDs, ``metrics_json`` as the database stores it), when it is a plain one: the agent's
    fields only, metrics a flat object of JSON scalars that PostgreSQL can store, under
    MAX_METRICS_BYTES.  None for anything else, which then goes the usual way (the codec's
    walk, the frame check and their errors): this only skips, for the frame every agent sends
    every interval, the generic checks a flat object cannot fail."""
    if payload[1 : 1 + len(_BEAT_MSGPACK_TYPE)] != _BEAT_MSGPACK_TYPE:
        return None
    try:
        frame = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except Exception:  # noqa: BLE001 - any undecodable frame: the usual way names the error
        return None
    if type(frame) is not dict or not frame.keys() <= _BEAT_KEYS:
        return None
    in_flight, running, draining = (
        frame.get("in_flight", 0),
        frame.get("running"),
        frame.get("draining"),
    )
    if type(in_flight) is not int or type(draining) not in (bool, type(None)):
        return None
    metrics_json = _flat_metrics_json(frame.get("metrics"))
    if metrics_json is None and frame.get("metrics") is not None:
        return None
    if running is None:
        running = []
    if type(running) is not list or len(running) > 4096:
        return None
    try:
        # MessagePack strings are valid UTF-8: no lone surrogate can reach uuid.UUID.
        running = [uuid.UUID(t) for t in running]
    except (TypeError, ValueError, AttributeError):
        return None
    return {"type": "heartbeat", "running": running, "metrics_json": metrics_json,
            "draining": draining is True}  # fmt: skip


def _flat_metrics_json(metrics: Any) -> str | None:
    """``metrics`` as JSON text when it is a flat object of scalars the database stores as
    sent (finite numbers, strings without NUL; MessagePack strings hold no lone surrogate),
    at most MAX_METRICS_BYTES; None otherwise."""
    if type(metrics) is not dict:
        return None
    for key, value in metrics.items():
        kind = type(value)
        if type(key) is not str or "\x00" in key or kind not in _SCALARS:
            return None
        if (kind is str and "\x00" in value) or (kind is float and not math.isfinite(value)):
            return None
    text = "".join(_metrics_encoder(metrics, 0)) if _metrics_encoder else json.dumps(metrics)
    return text if len(text) <= roster.MAX_METRICS_BYTES else None


def _check_frame(frame: dict[str, Any], frame_bytes: int = MAX_FRAME_BYTES) -> dict[str, Any]:
    """``frame`` checked against the protocol (FrameRejected if it does not fit);
    ``frame_bytes``: its size on the wire."""
    kind = frame.get("type")
    if kind == "received":
        # The codec allows integers up to 2^64-1; delivery_outbox.id is a bigint, and one
        # id past it would fail the writer's batched UPDATE for every socket in the round.
        if _bounded_int(frame.get("outbox_id"), 1, MAX_BIGINT) is None:
            raise FrameRejected(f"received: outbox_id must be an integer 1..{MAX_BIGINT}")
    elif kind == "hello":
        frame = {
            "type": "hello",
            "holding": _holding(frame.get("holding", [])),
            "batch_frames": frame.get("batch_frames") is True,
        }
    elif kind == "heartbeat":
        metrics = frame.get("metrics")
        if metrics is not None and not isinstance(metrics, dict):
            raise FrameRejected("heartbeat: metrics must be an object")
        if metrics and metrics_too_large(metrics, frame_bytes):
            raise FrameRejected(f"heartbeat: metrics over {roster.MAX_METRICS_BYTES} bytes")
        if metrics and unstorable(metrics):  # PostgreSQL's jsonb would refuse the beat
            raise FrameRejected(f"heartbeat: metrics hold {unstorable(metrics)}")
        running = frame.get("running") or []
        try:
            running = [uuid.UUID(str(t)) for t in running][:4096]
        except (TypeError, ValueError):
            raise FrameRejected("heartbeat: running must be a list of task_execution_ids") from None
        frame = {
            "type": "heartbeat",
            "running": running,
            "metrics_json": None if metrics is None else json.dumps(metrics),  # as stored
            "draining": frame.get("draining") is True,
        }
    elif kind == "result":
        frame = _check_result(frame)
    elif kind == "log":
        frame = {"type": "log", "chunk": _check_log(frame)}
    else:
        raise FrameRejected(
            f"unknown frame type {kind!r} (expected hello, received, heartbeat, result, log)"
        )
    return frame


def _check_batch(frame: dict[str, Any]) -> list[dict[str, Any]]:
    """A ``batch`` frame's frames, each checked as it would be alone: at most
    MAX_BATCH_FRAMES of them, each a ``received`` or a ``result`` (anything else, or an
    empty batch, is a malformed frame)."""
    inner = frame.get(wire.BATCH_FIELD)
    if not isinstance(inner, list) or not 1 <= len(inner) <= agent_frames.MAX_BATCH_FRAMES:
        raise FrameRejected(
            f"batch: frames must be a list of 1..{agent_frames.MAX_BATCH_FRAMES} frames"
        )
    checked = []
    for index, item in enumerate(inner):
        if item.get("type") not in agent_frames.AGENT_BATCHABLE:
            raise FrameRejected(
                f"batch: frames[{index}] is {item.get('type')!r}; a batch carries only "
                f"{', '.join(sorted(agent_frames.AGENT_BATCHABLE))} frames"
            )
        checked.append(_check_frame(item))
    return checked


def _check_log(frame: dict[str, Any]) -> task_logs.LiveChunk:
    """A ``log`` frame: a running task's new output (its end offset; bytes skipped)."""
    try:
        task_execution_id = uuid.UUID(str(frame.get("task_execution_id")))
    except ValueError:
        raise FrameRejected("log: task_execution_id must be a UUID") from None
    assignment = _bounded_int(frame.get("assignment"), 1, MAX_INT)
    end = _bounded_int(frame.get("bytes"), 0, MAX_BIGINT)
    skipped = _bounded_int(frame.get("skipped", 0), 0, MAX_BIGINT)
    text = frame.get("text")
    if assignment is None or end is None or skipped is None or not isinstance(text, str):
        raise FrameRejected(
            f"log: needs assignment 1..{MAX_INT}, text (a string), bytes and skipped "
            f"(integers 0..{MAX_BIGINT})"
        )
    return task_logs.LiveChunk(task_execution_id, assignment, text, end, skipped)


def _check_result(frame: dict[str, Any]) -> dict[str, Any]:
    """A result frame carries the REST result body; a bad body is answered 422 (not closed)
    when its ``outbox_id`` lets the agent tell which result was refused."""
    try:
        body = ResultIn.model_validate({k: v for k, v in frame.items() if k != "type"})
    except ValidationError as exc:
        outbox_id = frame.get("outbox_id")
        if not isinstance(outbox_id, int) or isinstance(outbox_id, bool):
            raise FrameRejected("result: outbox_id must be an integer") from None
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()
        )
        return {"type": "result", "outbox_id": outbox_id, "invalid": problems}
    return {"type": "result", "outbox_id": body.outbox_id, "body": body}


def _settled(
    agent_id: uuid.UUID, frames: list[dict[str, Any]], answers: list[Any]
) -> list[tuple[uuid.UUID, int]]:
    """The (agent, outbox id) of the result frames whose outcomes were applied: their
    packets were acked, and confirmed by the ack, in the batch's commit."""
    return [
        (agent_id, frame["outbox_id"])
        for frame, answer in zip(frames, answers, strict=True)
        if isinstance(answer, tuple) and answer[0] == 200 and answer[1].get("applied")
    ]


def _keys(agent_id: uuid.UUID, frames: list[dict[str, Any]]) -> list[tuple[uuid.UUID, int]]:
    """The (agent, outbox id) of the valid result frames: the socket writer's keys."""
    return [(agent_id, frame["outbox_id"]) for frame in frames if "invalid" not in frame]


def _check_register(data: str | bytes) -> roster.Registration:
    """The first frame of a registering socket as the roster's registration: a JSON
    ``register`` frame carrying the REST body, checked by the same schema (FrameRejected
    names the problem)."""
    try:
        frame = wire.decode(data, "json")
    except wire.WireFormatError as exc:
        raise FrameRejected(f"the first frame must be a JSON register frame: {exc}") from None
    if frame.get("type") != "register":
        raise FrameRejected(f"the first frame must be a register frame, got {frame.get('type')!r}")
    try:
        body = RegisterIn.model_validate({k: v for k, v in frame.items() if k != "type"})
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()
        )
        raise FrameRejected(f"register: {problems}") from None
    return as_registration(body)


class AgentDeliveryConsumer(AsyncWebsocketConsumer):
    grant: roster.SocketGrant | None = None

    async def __call__(self, scope: dict, receive, send) -> None:
        """Channels' loop without the channel layer: this process's relay pushes packets and
        closes sockets by direct calls (local_sockets.LocalSocket's ``push`` and ``close``),
        so a channel per socket would only cost a receive task and a queue per connection,
        and ``await_many_dispatch`` a new task and an ``asyncio.wait`` per frame — at
        thousands of idle sockets beating, memory and CPU for nothing (docs/scaling.md).
        ``channel_name`` is kept as the socket's identity in local_sockets."""
        self.scope = scope
        self.channel_layer = None
        self.channel_name = f"agent-socket.{uuid.uuid4().hex}"
        self.base_send = send
        with contextlib.suppress(StopConsumer):
            while True:
                await self.dispatch(await receive())

    async def dispatch(self, message):
        # Channels' default dispatch closes old DB connections (a thread hop) before
        # every message, including each work packet; this consumer's DB work manages
        # its own connections, so skip that.
        handler = getattr(self, get_handler_name(message), None)
        if handler is None:
            raise ValueError(f"no handler for message type {message['type']}")
        await handler(message)

    # -- connect / disconnect ------------------------------------------------------------
    async def connect(self) -> None:
        self.grant = None
        self._closing = False
        self._registered = False
        self._drain_sent = False
        # Frames parsed and not yet handled, and the task handling them: started when a
        # frame arrives and ended when none is left, so an idle socket (thousands per
        # server) holds no task and no queue of its own (docs/scaling.md, memory).
        self._worker: asyncio.Task | None = None
        self._inbound: deque[dict[str, Any]] = deque()
        self._results: set[asyncio.Future] = set()
        # Closes and frames started from callbacks: held here until done, since the loop
        # keeps only a weak reference to a task (one nothing holds can vanish mid-flight).
        self._background: set[asyncio.Future] = set()
        self._results_pending = 0  # results of this socket taken and not yet answered
        self._results_room = asyncio.Event()
        self._beat: asyncio.Future | None = None  # the beat being written, if any
        self._next_beat: dict | None = None
        self._writes: socket_writes.SocketWrites | None = None  # kept: see _socket_writes
        self._bucket = TokenBucket(FRAME_RATE_PER_S, FRAME_BURST)
        # Frames to the agent (packets, result acks) queued in this loop turn, written at
        # the start of the next one: in batch frames when the agent's hello asked for them.
        self._outgoing: list[batching.Encoded] = []
        self._flushing: asyncio.Future | None = None
        self._batch_out = False
        self._register_with: str | None = None  # the key, while a register frame is awaited
        self._new_agent = False  # this socket registered its agent (nothing delivered to it)
        shortcut = self.scope.get(FRAME_SHORTCUT)  # under `serve`: beats skip the queue
        if shortcut is not None:
            shortcut(self._beat_shortcut)
        # Accept first: a close code (and its reason) can only be sent on an open socket.
        await self.accept()
        token = _bearer(self.scope)
        if not token:
            await self._close(CLOSE_BAD_KEY, "missing Authorization: Bearer <agent key> header")
            return
        if "agent_id" not in self.scope["url_route"]["kwargs"]:
            # Registering on the socket: the key is verified with the register frame, and
            # the admission is the registration's (one per agent, not one each).
            if not local_sockets.accepting():
                await self._close(CLOSE_GO_ELSEWHERE, GO_ELSEWHERE_REASON)
            else:
                self._register_with = token
            return
        try:
            agent_id = uuid.UUID(str(self.scope["url_route"]["kwargs"]["agent_id"]))
        except ValueError:
            await self._close(CLOSE_UNKNOWN_AGENT, "unknown agent")
            return
        if not await self._admitted():
            return
        # On the delivery pool, whose threads keep their connections: not on the one thread
        # every sync view shares, and not a new PostgreSQL connection per socket (a
        # reconnect storm opens thousands at once).
        result = await delivery_db.call(
            roster.open_socket, token, agent_id, local_sockets.server_id()
        )
        if isinstance(result, roster.SocketRefusal):
            await self._close(result.code, result.reason)
            return
        self.grant = result

    async def _admitted(self) -> bool:
        """Whether this process takes the socket now: not while it shuts down (4012: go to
        another server), not past its admissions per second (4013 with when to retry)."""
        if not local_sockets.accepting():
            await self._close(CLOSE_GO_ELSEWHERE, GO_ELSEWHERE_REASON)
            return False
        wait_s = admission.agents().admit()
        if wait_s > 0:
            seconds = admission.retry_after_s(wait_s)
            await self._close(CLOSE_TRY_LATER, f"server busy: retry after {seconds} s")
            return False
        return True

    async def _register_on_socket(self, data: str | bytes) -> None:
        """Handle a registering socket's first frame: register, answer, and hold the
        socket as the new agent's (its hello comes next), or refuse and close."""
        token, self._register_with = self._register_with, None
        size = len(data.encode()) if isinstance(data, str) else len(data)
        if size > MAX_REGISTER_FRAME_BYTES:
            await self._close(
                CLOSE_TOO_LARGE,
                f"register frame of {size} bytes is over {MAX_REGISTER_FRAME_BYTES}",
            )
            return
        try:
            registration = _check_register(data)
        except FrameRejected as exc:
            await self._refuse(roster.SocketRefusal(CLOSE_INVALID_REGISTRATION, str(exc)))
            return
        async with registering_slots():
            result = await delivery_db.call(
                roster.register_socket, token, registration, local_sockets.server_id()
            )
        if isinstance(result, roster.SocketRefusal):
            await self._refuse(result)
            return
        self.grant, agent = result
        self._new_agent = True
        # JSON like the register frame: the agent learns the wire format from this answer.
        answer = {"type": "registered", **roster.registration_answer(agent)}
        answer["agent_id"] = str(agent.id)
        await self._send_data(wire.encode(answer, "json"))

    async def _refuse(self, refusal: roster.SocketRefusal) -> None:
        """A refused registration: the whole reason in a ``refused`` frame (a close reason
        holds 123 bytes), then the close code."""
        status = 429 if refusal.code == CLOSE_TRY_LATER else refusal.code - 4000  # REST's
        frame = {"type": "refused", "status": status, "detail": refusal.reason}
        if refusal.retry_after_s is not None:
            frame["retry_after_s"] = refusal.retry_after_s
        await self._send_data(wire.encode(frame, "json"))
        await self._close(refusal.code, refusal.reason)

    async def disconnect(self, code) -> None:
        self._closing = True
        for task in list(self._results):
            task.cancel()  # the outcome is applied or not; only its ack is lost (REST re-post)
        if self._beat is not None:
            self._beat.cancel()  # the next socket's beats, or REST, keep the agent alive
        if self._flushing is not None:
            self._flushing.cancel()  # unsent packets are pushed again, acks reported again
        if self._worker is not None:
            self._worker.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._worker
        grant = self.grant
        if grant is None:
            return
        local_sockets.unregister(grant.agent_id, self.channel_name)
        with contextlib.suppress(Exception):
            await delivery_db.call(
                roster.close_socket, grant.agent_id, local_sockets.server_id(), grant.generation
            )

    async def _close(self, code: int, reason: str) -> None:
        if self._closing:
            return
        self._closing = True
        if self.grant is not None:
            local_sockets.unregister(self.grant.agent_id, self.channel_name)
        log.info("closing agent socket %s: %s %s", self.channel_name, code, reason)
        await self.close(code=code, reason=reason[:120])

    # -- frames from the agent -----------------------------------------------------------
    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        data: str | bytes = text_data if text_data is not None else (bytes_data or b"")
        if self._register_with is not None and not self._closing:
            await self._register_on_socket(data)
            return
        if self._closing or self.grant is None:
            return
        size = len(data.encode()) if isinstance(data, str) else len(data)
        if size > MAX_FRAME_BYTES:
            await self._close(CLOSE_TOO_LARGE, f"frame of {size} bytes is over the 1 MiB limit")
            return
        if not self._bucket.take():
            await self._close(CLOSE_FLOOD, f"more than {FRAME_RATE_PER_S:g} frames per second")
            return
        try:
            decoded = wire.decode(data, self.grant.wire_format)
            if decoded.get("type") == wire.BATCH:
                frames = _check_batch(decoded)
            else:
                frames = [_check_frame(decoded, size)]
        except (wire.WireFormatError, FrameRejected) as exc:
            await self._close(CLOSE_MALFORMED, f"malformed frame: {exc}")
            return
        if frames[0]["type"] == "heartbeat":  # never batched
            # Written at once, beside the other frames: they may wait on the delivery pool
            # (a hello, results) when the server is busy, and a beat held behind them for a
            # liveness window gets a healthy agent evicted.
            self._take_beat(frames[0])
            return
        received = [f["outbox_id"] for f in frames if f["type"] == "received"]
        if hop_trace.enabled():
            for outbox_id in received:
                hop_trace.mark("server_read", outbox=outbox_id)
        if len(received) == len(frames) and self._registered and self._idle():
            # Nothing of this socket waits ahead of them or is being handled (its hello is
            # applied): handed to the writer now, without a hop through the queue and the
            # worker task, which would only do the same (one per task: the commonest frame).
            self._socket_writes().received(self.grant.agent_id, received)
            return
        if len(self._inbound) + len(frames) > INBOUND_QUEUE:
            await self._close(CLOSE_FLOOD, f"more than {INBOUND_QUEUE} frames waiting")
            return
        self._inbound.extend(frames)
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._handle_inbound())

    def _idle(self) -> bool:
        """No frame of this socket waits or is being handled."""
        return not self._inbound and (self._worker is None or self._worker.done())

    async def _handle_inbound(self) -> None:
        """Handle the waiting frames in order, in batches, until none is left.  Between the
        last check and the return there is no await: a frame that arrives later finds this
        task done and starts the next one."""
        inbound = self._inbound
        while inbound:
            batch = [inbound.popleft() for _ in range(min(len(inbound), INBOUND_BATCH))]
            try:
                await self._handle_batch(batch)
            except asyncio.CancelledError:
                raise
            except Exception:
                # The database may be away: the frames' effects are safety-netted
                # (redelivery, heartbeats over REST); keep the socket.
                log.exception("handling frames of agent %s failed", self.grant.agent_id)

    async def _handle_batch(self, batch: list[dict]) -> None:
        grant = self.grant
        hellos = [f for f in batch if f["type"] == "hello"]
        if not self._registered:
            holding = hellos[-1]["holding"] if hellos else []
            if not hellos:
                log.warning("agent %s sent %s before hello", grant.agent_id, batch[0]["type"])
            if not self._new_agent:
                await delivery_db.call(redelivery.apply_hello, grant.agent_id, holding)
            # else: an agent registered on this very socket holds nothing, and no packet
            # was delivered to it: placement marks a row delivered to it only for this
            # process's relay to push at once, which puts it back to pending while the
            # socket is not past this hello (relay.push_delivered).  The hello's two
            # statements would change nothing; a crash in between is a new socket with a
            # full hello, and a push that failed is the redelivery sweep's.
            self._batch_out = bool(hellos) and hellos[-1]["batch_frames"]
            self._register()
        writes = socket_writes.writer()
        received = [f["outbox_id"] for f in batch if f["type"] == "received"]
        if received:
            writes.received(grant.agent_id, received)
        chunks = [frame["chunk"] for frame in batch if frame["type"] == "log"]
        if chunks:  # live output of running tasks: fenced on this agent holding them
            await delivery_db.call(
                task_logs.append_live_many, chunks, grant.tenant_id, grant.agent_id
            )
        results = [frame for frame in batch if frame["type"] == "result"]
        if results:
            # Applied on the DB pool with the results of every socket of this process,
            # at most RESULTS_IN_FLIGHT of this socket at once.  Room is taken before the
            # work exists: with no room the reader waits, the inbound queue fills and a
            # flood is closed (4429), instead of pending results (up to 1 MiB each)
            # piling up in memory.
            for start in range(0, len(results), RESULTS_IN_FLIGHT):
                chunk = results[start : start + RESULTS_IN_FLIGHT]
                while self._results_pending + len(chunk) > RESULTS_IN_FLIGHT:
                    self._results_room.clear()
                    await self._results_room.wait()
                self._results_pending += len(chunk)
                # Their confirmations, if not written yet, wait for these outcomes' acks.
                writes.outcome_coming(_keys(grant.agent_id, chunk))
                task = asyncio.ensure_future(self._apply_results(chunk))
                self._results.add(task)
                task.add_done_callback(self._results.discard)

    def _beat_shortcut(self, payload: bytes, is_binary: bool) -> bool:
        """Take a plain heartbeat straight from daphne's reader (the frame shortcut), as
        :meth:`receive` would, without the frame's trip through the application's queue,
        this consumer's task and Channels' dispatch: thousands of agents beat every
        interval.  False (the frame goes the usual way) for any other frame, a socket not
        past its grant or closing, or a flood (the usual way closes it)."""
        grant = self.grant
        if (
            grant is None
            or self._closing
            or not is_binary
            or grant.wire_format != "msgpack"
            or len(payload) > SHORTCUT_MAX_BYTES
        ):
            return False
        beat = plain_beat(payload)
        if beat is None or not self._bucket.take():
            return False
        self._take_beat(beat)
        return True

    def _take_beat(self, beat: dict) -> None:
        """Hand ``beat`` to the socket writer (its own connection, not the delivery pool).
        Answered in the background: the writer holds a beat back a moment to write it with
        others (socket_writes), and this socket's other frames must not wait."""
        SOCKET_BEATS.inc()
        if self._beat is None or self._beat.done():
            self._write_beat(beat)
        else:
            self._next_beat = beat  # one beat in flight: the newest is written next

    def _write_beat(self, beat: dict) -> None:
        """Hand ``beat`` to the writer; :meth:`_beat_written` acts on its answer."""
        grant = self.grant
        self._next_beat = None
        self._beat = self._socket_writes().heartbeat(
            grant.agent_id, grant.tenant_id, beat["running"], beat["metrics_json"], beat["draining"]
        )
        self._beat.add_done_callback(self._beat_written)

    def _socket_writes(self) -> socket_writes.SocketWrites:
        """This loop's socket writer, kept while it runs: looking it up per beat asked
        asyncio for the running loop, a ``getpid`` system call each time, a twentieth of an
        idle server's busy samples (docs/scaling.md, "Round i16-beat2")."""
        writes = self._writes
        if writes is None or not writes.running:
            writes = self._writes = socket_writes.writer()
        return writes

    def _in_background(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _beat_written(self, written: asyncio.Future) -> None:
        """Act on a beat's answer (a done callback: no task per beat): a dead agent's socket
        closes 4404, a drain the server wants is sent once; then any newer beat is written."""
        if written.cancelled() or self._closing:
            return
        refused = written.exception()
        if refused is not None:  # socket_writes.WriteRefused: the only error it sets
            self._in_background(self._close(CLOSE_MALFORMED, f"malformed frame: {refused}"))
            return
        result = written.result()
        if result is None:
            self._in_background(self._close(CLOSE_UNKNOWN_AGENT, "agent is dead; register again"))
            return
        if result.drain and not self._drain_sent:
            self._drain_sent = True
            self._in_background(self._send_frame({"type": "drain"}))
        if self._next_beat is not None:
            self._write_beat(self._next_beat)

    async def _apply_results(self, frames: list[dict]) -> None:
        valid = [f for f in frames if "invalid" not in f]
        grant = self.grant
        applied: list = []
        try:
            # One wait for the lot: one transaction, one synchronous commit with the results
            # of every socket of this process that arrive meanwhile (fleet/executors/fleet/result_batches.py).
            applied = (
                await result_batches.apply_many(
                    [(grant.tenant_id, grant.agent_id, f["body"]) for f in valid]
                )
                if valid
                else []
            )
        finally:
            self._results_pending -= len(frames)
            self._results_room.set()
            # A confirmation of this process skipped behind one of these acks goes now;
            # those of the packets these outcomes acked are not written at all (their acks
            # were), those of outcomes not applied (or not written: an error) are.
            settled = _settled(grant.agent_id, valid, applied) if applied else []
            done = set(settled)
            writes = socket_writes.current_writer()
            if writes is not None:
                writes.results_applied(
                    settled, [key for key in _keys(grant.agent_id, valid) if key not in done]
                )
        answers = iter(applied)
        for frame in frames:
            if "invalid" in frame:
                answer: tuple | BaseException = (
                    422,
                    {"detail": f"invalid result: {frame['invalid']}"},
                )
            else:
                answer = next(answers)
            if isinstance(answer, BaseException):
                # The database is away: no ack, the agent reports it again.
                log.warning("result for packet %s not applied: %s", frame["outbox_id"], answer)
                continue
            if self._closing:
                return
            status, body = answer
            # The acks of the lot go in one batch frame to an agent that takes them.
            self._queue_frame(
                {"type": "result_ack", "outbox_id": frame["outbox_id"], "status": status, **body}
            )

    def _register(self) -> None:
        grant = self.grant
        previous = local_sockets.register(
            local_sockets.LocalSocket(
                grant.agent_id, grant.tenant_id, self.channel_name, grant.generation,
                grant.wire_format, grant.key_id, self.push_packet, self._close,
            )
        )  # fmt: skip
        self._registered = True
        if previous is not None:
            # The same agent reconnected to this process: the older socket is stale.
            self._in_background(
                previous.close(CLOSE_SUPERSEDED, "superseded by a newer connection")
            )

    # -- messages from the relay ---------------------------------------------------------
    async def push_packet(self, packet: dict) -> None:
        """Queue one work packet for this socket (the relay calls this directly:
        local_sockets.py); the packets of a placement batch or a relay round for this agent
        are written together at the start of the next loop turn (in one batch frame to an
        agent that takes them).  A packet the socket loses is pushed again (redelivery, or
        the next hello)."""
        if not self._closing:
            self._queue_frame({"type": "work", "packet": packet})
            hop_trace.mark("frame_sent", packet.get("task_execution_id"), packet.get("outbox_id"))

    def _queue_frame(self, frame: dict) -> None:
        """Encode ``frame`` now (a refusal raises here, to the caller) and write it with the
        other frames of this loop turn."""
        self._outgoing.append(wire.encode(frame, self.grant.wire_format))
        if self._flushing is None:
            self._flushing = asyncio.ensure_future(self._flush_outgoing())

    async def _flush_outgoing(self) -> None:
        try:
            while self._outgoing and not self._closing:
                queued, self._outgoing = self._outgoing, []
                fmt = self.grant.wire_format
                for data in batching.pack(queued, fmt, self._batch_out):
                    await self._send_data(data)
        finally:
            self._flushing = None

    async def _send_frame(self, frame: dict) -> None:
        await self._send_data(wire.encode(frame, self.grant.wire_format if self.grant else "json"))

    async def _send_data(self, data: str | bytes) -> None:
        if isinstance(data, bytes):
            await self.send(bytes_data=data)
        else:
            await self.send(text_data=data)
