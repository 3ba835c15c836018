"""Reporting outcomes to the server until it has them: over the delivery socket when it
is open (``result`` → ``result_ack``), else over REST (``POST /agents/{id}/results``).

An outcome is the only copy of a finished task's result, so it is kept and
re-sent with backoff for as long as the server cannot answer: a server restart
between the push and the result loses nothing.  It is let go only when the server
answers — 2xx (recorded, whether applied or not), or 404/409 (it no longer wants
it from us) — over either path; unless the answer is "not applied" to an agent id that
a re-push has since replaced (the agent re-registered): then it goes again under the new
id.  An outcome the server rejects as malformed (e.g.
an output over the context size limit) is replaced by a failure naming the
rejection, so the task fails visibly instead of waiting for a timeout.

The socket saves the server an HTTP request per task (the bulk of its CPU per
task).  It is used only when the server announced it answers ``result`` frames,
for outcomes owed under the agent id the socket belongs to, and for frames
within the server's 1 MiB limit.  A socket that closes before the ``result_ack``
means "try again" (the next socket or REST); no ack within ``RESULT_ACK_TIMEOUT_S``
means "ask REST" — a duplicate is harmless: the server records it, applies once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from agents.protocol import wire
from agents.protocol.work import OUTCOME_FAILURE, TaskKey
from agents.runtime.backoff import Backoff, wait_event
from agents.runtime.client import AgentClient, AuthRejected, ServerUnavailable

log = logging.getLogger(__name__)

NOT_WANTED = (404, 409)  # the packet is not (or no longer) ours to report
# How long a result frame may wait for its result_ack before the outcome goes over REST.
RESULT_ACK_TIMEOUT_S = 10.0
MAX_RESULT_FRAME_BYTES = 1024 * 1024  # the server closes a socket over this (4413)

Answer = tuple[int, dict[str, Any]]
_NO_ACK = object()  # what a result frame's future holds when its result_ack never came


def _resolve(future: asyncio.Future, value: object) -> None:
    if not future.done():
        future.set_result(value)


@dataclass
class HeldTask:
    """A packet the agent holds, from receipt until the server has its outcome."""

    key: TaskKey
    agent_id: str  # the agent id the latest push came through: the one to report under
    label: str  # for logs
    result: dict[str, Any] | None = None  # the outcome body, once known
    result_bytes: int = 0  # its estimated size, kept with it after it is reported


class ResultSocket(Protocol):
    """What the reporter needs of a delivery session (agents.runtime.connection.Session)."""

    wire_format: str

    def send_soon(self, data: str | bytes) -> bool:
        """Queue an encoded frame (batched with the loop turn's others); False: closed."""
        ...


class _SocketAnswers:
    """Result frames sent and the futures waiting for their ``result_ack``, per socket."""

    def __init__(self) -> None:
        # outbox_id -> [(socket, future)], oldest first (an ack names only the outbox id).
        self._waiting: dict[int, list[tuple[ResultSocket, asyncio.Future]]] = {}

    def expect(
        self, outbox_id: int, socket: ResultSocket, loop: asyncio.AbstractEventLoop
    ) -> asyncio.Future:
        future = loop.create_future()
        self._waiting.setdefault(outbox_id, []).append((socket, future))
        return future

    def forget(self, outbox_id: int, future: asyncio.Future) -> None:
        entries = self._waiting.get(outbox_id, [])
        entries[:] = [e for e in entries if e[1] is not future]
        if not entries:
            self._waiting.pop(outbox_id, None)

    def answer(self, frame: dict[str, Any]) -> bool:
        """Resolve the oldest waiter of the frame's outbox id; False if nobody waits."""
        outbox_id = frame.get("outbox_id")
        status = frame.get("status")
        if not isinstance(outbox_id, int) or not isinstance(status, int):
            log.warning("ignoring a malformed result_ack: %r", frame)
            return False
        for _socket, future in self._waiting.get(outbox_id, []):
            if not future.done():
                body = {k: v for k, v in frame.items() if k not in ("type", "outbox_id", "status")}
                future.set_result((status, body))
                return True
        return False

    def socket_closed(self, socket: ResultSocket) -> None:
        """The socket is gone: its unanswered frames will never be answered."""
        for entries in self._waiting.values():
            for owner, future in entries:
                if owner is socket and not future.done():
                    future.set_result(None)


class OutcomeReporter:
    """``submit(held)`` reports ``held.result`` under ``held.agent_id`` (re-read on every try).

    ``result_socket(agent_id)`` gives the open delivery session through which an
    outcome owed under ``agent_id`` may be reported, or None (then REST).
    """

    def __init__(
        self,
        client: AgentClient,
        on_settled: Callable[[HeldTask], None],
        on_auth_rejected: Callable[[AuthRejected], None],
        result_socket: Callable[[str], ResultSocket | None] | None = None,
    ) -> None:
        self._client = client
        self._on_settled = on_settled
        self._on_auth_rejected = on_auth_rejected
        self._result_socket = result_socket or (lambda _agent_id: None)
        self._acks = _SocketAnswers()
        self._tasks: set[asyncio.Task] = set()
        self._server_back = asyncio.Event()
        self.answered = 0  # reports the server answered (2xx or 4xx), either path
        self.answered_by_socket = 0

    @property
    def pending(self) -> int:
        return len(self._tasks)

    def server_is_back(self) -> None:
        """Cut every retry's backoff short: the server answers again (the socket reopened)."""
        self._server_back.set()
        self._server_back = asyncio.Event()  # later retries wait for the next comeback

    def on_result_ack(self, frame: dict[str, Any]) -> None:
        """A ``result_ack`` frame from the server."""
        if not self._acks.answer(frame):
            log.debug("result_ack for outbox %s that nobody waits for", frame.get("outbox_id"))

    def socket_closed(self, socket: ResultSocket) -> None:
        """The delivery session ended: reports waiting on it are sent again."""
        self._acks.socket_closed(socket)

    def submit(self, held: HeldTask, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """``loop``: the running loop, when the caller has it (on Python 3.11 each look-up
        is a getpid system call; the intake looks it up once per task)."""
        loop = loop or asyncio.get_running_loop()
        task = loop.create_task(self._deliver(held, loop))
        task.set_name(f"report-{held.label}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def cancel_all(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _deliver(self, held: HeldTask, loop: asyncio.AbstractEventLoop) -> None:
        backoff = Backoff()
        try:
            while True:
                # A re-push through a new registration may change held.agent_id while
                # this report is out: the answer is judged against the id it went under.
                agent_id = held.agent_id
                answer = await self._over_socket(held, agent_id, loop)
                if answer is None:
                    try:
                        answer = await self._client.post_result(agent_id, held.result)
                    except ServerUnavailable as exc:
                        delay = backoff.next_delay()
                        log.warning(
                            "could not post the outcome of %s (%s); retrying in %.1fs",
                            held.label,
                            exc,
                            delay,
                        )
                        await wait_event(self._server_back, delay)
                        continue
                self.answered += 1
                if self._owed_under_new_id(held, agent_id, *answer):
                    continue
                if self._settles(held, *answer):
                    break
        except AuthRejected as exc:
            self._on_auth_rejected(exc)
        finally:
            # Settled also on cancellation (forced stop): nobody will post it after us.
            self._on_settled(held)

    async def _over_socket(
        self, held: HeldTask, agent_id: str, loop: asyncio.AbstractEventLoop
    ) -> Answer | None:
        """The server's answer to a ``result`` frame sent through ``agent_id``'s socket, or
        None: report over REST instead."""
        socket = self._result_socket(agent_id)
        if socket is None:
            return None
        frame = {"type": "result", **held.result}
        try:
            data = wire.encode(frame, socket.wire_format)
        except wire.WireFormatError:
            return None  # REST's JSON body says what is wrong with it (422 → ResultRejected)
        if len(data) > MAX_RESULT_FRAME_BYTES:
            return None
        outbox_id = held.result["outbox_id"]
        future = self._acks.expect(outbox_id, socket, loop)
        # A plain timer on the future, not asyncio.timeout(): one per task, and the
        # context manager (current task, cancellation bookkeeping) cost several times more.
        timer = loop.call_later(RESULT_ACK_TIMEOUT_S, _resolve, future, _NO_ACK)
        try:
            # Sent with the other outcomes and confirmations of this loop turn (one batch
            # frame when the server takes them).  A socket that drops before the frame is
            # written ends the session, which resolves the future to None (socket_closed).
            if not socket.send_soon(data):
                return None
            answer = await future
        finally:
            timer.cancel()
            self._acks.forget(outbox_id, future)
        if answer is _NO_ACK:
            log.info(
                "no result_ack for %s within %gs; posting it over REST",
                held.label,
                RESULT_ACK_TIMEOUT_S,
            )
            return None
        if answer is not None:
            self.answered_by_socket += 1
        return answer  # None: the socket closed first — REST, or the next socket

    def _owed_under_new_id(
        self, held: HeldTask, sent_as: str, status: int, answer: dict[str, Any]
    ) -> bool:
        """Whether the outcome must go again, under the id a push came through meanwhile.

        The agent re-registered and the server re-pushed the packet through the new id
        while the report under the old one was out.  That report may have been recorded
        and not applied ("no longer assigned to this agent") or not wanted at all; the
        agent has already answered the push with ``received`` (the packet was in hand), so
        nothing would ever report it again and the task would stay Running."""
        if held.agent_id == sent_as:
            return False
        applied = 200 <= status < 300 and bool(answer.get("applied"))
        if applied or not (200 <= status < 300 or status in NOT_WANTED):
            return False  # the server has it; or a rejection, handled by _settles
        log.info(
            "the outcome of %s was not applied under agent %s (%s); "
            "reporting its outcome again as agent %s",
            held.label,
            sent_as,
            answer.get("reason") or answer.get("detail") or status,
            held.agent_id,
        )
        return True

    def _settles(self, held: HeldTask, status: int, answer: dict[str, Any]) -> bool:
        """Whether this answer settles the outcome (else ``held.result`` was replaced)."""
        if 200 <= status < 300:
            # One line per task is enough at INFO ("finished"); say more when
            # the server did not apply it.
            log.log(
                logging.DEBUG if answer.get("applied") else logging.INFO,
                "reported %s outcome of %s (applied=%s%s)",
                held.result["outcome"],
                held.label,
                answer.get("applied"),
                f", {answer['reason']}" if answer.get("reason") else "",
            )
            return True
        if status in NOT_WANTED:
            log.warning(
                "the server no longer wants the outcome of %s (%s: %s)",
                held.label,
                status,
                answer.get("detail", ""),
            )
            return True
        if held.result.get("error_type") == "ResultRejected":
            log.error(
                "the server rejected the outcome of %s twice (%s: %s); dropping it",
                held.label,
                status,
                answer.get("detail", ""),
            )
            return True
        log.error(
            "the server rejected the outcome of %s (%s: %s); reporting a failure instead",
            held.label,
            status,
            answer.get("detail", ""),
        )
        held.result = {
            **held.result,
            "outcome": OUTCOME_FAILURE,
            "output": None,
            "error_type": "ResultRejected",
            "error_message": f"the server rejected the task's outcome: {answer.get('detail', status)}",
            "traceback": "",
        }
        return False
