"""Every work packet from its push until the server has its outcome.

:class:`WorkIntake` decides what to do with a packet (ignore a repeat, refuse it,
run it), runs it — artifact from the package cache, function in a task-runner
child under the packet's timeout — and hands the outcome to the
:class:`~agents.runtime.outcome_reporter.OutcomeReporter`.  A packet is *held*
from receipt until its outcome is settled; ``held`` is what the agent's hello
and heartbeats report, and ``idle`` is what a drain waits for.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from agents.protocol import frames, hop_trace
from agents.protocol.work import (
    PacketError,
    TaskKey,
    WorkPacket,
    parse_packet,
    refusal,
    refusal_for_ids,
    result_body,
    run_result,
    triple_mismatch,
)
from agents.runtime.backoff import Backoff
from agents.runtime.client import (
    AgentClient,
    AuthRejected,
    RequestRejected,
    ServerUnavailable,
)
from agents.runtime.context_fetch import ContextUnavailable, fetch_context
from agents.runtime.outcome_reporter import HeldTask, OutcomeReporter, ResultSocket
from agents.runtime.recent_outcomes import RecentOutcomes, outcome_size
from agents.sandbox.archive import ArchiveError
from agents.sandbox.package_cache import PackageCache, PackageCacheError
from agents.sandbox.task_log import LiveTail, LogChunk
from agents.sandbox.task_runner import RunOutcome, TaskRunner

log = logging.getLogger("cloacina.agent")

# How long a fetch keeps retrying a server that does not answer before refusing the task.
FETCH_RETRY_WINDOW_S = 60.0


class ArtifactUnavailable(Exception):
    """The task's artifact cannot be had; the agent refuses the task (it never ran)."""


class WorkIntake:
    def __init__(
        self,
        client: AgentClient,
        cache: PackageCache,
        runner: TaskRunner,
        target_triple: str,
        max_concurrency: int,
        send: Callable[[dict[str, Any]], None],
        on_auth_rejected: Callable[[AuthRejected], None],
        result_socket: Callable[[str], ResultSocket | None] | None = None,
        send_log: Callable[[str, dict[str, Any]], Awaitable[None]] | None = None,
    ) -> None:
        """``send(frame)``: queue a ``received`` confirmation (never blocks);
        ``send_log(agent_id, frame)``: ship a running task's ``log`` frame (live tail)."""
        self.client = client
        self.cache = cache
        self.runner = runner
        self.target_triple = target_triple
        self.held: dict[TaskKey, HeldTask] = {}
        # Outcomes the server has: a re-push of one is answered with it, never re-run.
        self.recent = RecentOutcomes()
        self.draining = False  # set by the agent: refuse every new packet
        self.idle = asyncio.Event()  # nothing held
        self.idle.set()
        self.reporter = OutcomeReporter(client, self._settled, on_auth_rejected, result_socket)
        self._send = send
        self._send_log = send_log
        self._slots = asyncio.Semaphore(max_concurrency)
        self._tasks: set[asyncio.Task] = set()

    def holding(self) -> list[TaskKey]:
        return list(self.held)

    async def cancel_all(self) -> None:
        """A forced stop: abandon runs and pending reports."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.reporter.cancel_all()

    def on_work(self, raw: object, via_agent_id: str) -> None:
        """A ``work`` frame's packet, pushed through the socket of agent id ``via_agent_id``.

        Synchronous: it runs as the socket parses the frame (agents/runtime/connection.py,
        ``FrameConnection``); the run itself is a task of its own."""
        if hop_trace.enabled() and isinstance(raw, dict):
            hop_trace.mark("agent_read", outbox=raw.get("outbox_id"))
        try:
            packet = parse_packet(raw)
        except PacketError as exc:
            log.error("%s", exc)
            if exc.ids is not None and (exc.ids[1], exc.ids[2]) not in self.held:
                held = self._hold((exc.ids[1], exc.ids[2]), via_agent_id, f"task {exc.ids[1]}")
                self._send(frames.received(exc.ids[0]))
                self._report(held, refusal_for_ids(exc.ids, str(exc)))
            return
        existing = self.held.get(packet.key)
        if existing is not None:
            # A re-push (e.g. after a reconnect) is not run twice; but it says through
            # which agent id the server now expects the outcome.
            existing.agent_id = via_agent_id
            self._send(frames.received(packet.outbox_id))
            log.info("ignoring a repeated push of %s (already in hand)", packet.describe())
            return
        known, kept, size = self.recent.take(packet.key)
        if known:
            self._answer_repeat(packet, via_agent_id, kept, size)
            return
        held = self._hold(packet.key, via_agent_id, packet.describe())
        self._send(frames.received(packet.outbox_id))
        hop_trace.mark("agent_sent", outbox=packet.outbox_id)
        if self.draining:
            self._report(held, refusal(packet, "agent draining"))
            return
        mismatch = triple_mismatch(packet, self.target_triple)
        if mismatch is not None:
            log.warning("refusing %s: %s", packet.describe(), mismatch)
            self._report(held, refusal(packet, mismatch))
            return
        # The label _hold made (packet.describe()): arguments of a log call are built even
        # when its level is off, and this path runs once per task.
        log.debug(
            "received %s (attempt %d, timeout %gs)", held.label, packet.attempt, packet.timeout_s
        )
        # The loop, looked up once per packet and handed down the run and its report: on
        # Python 3.11 each look-up is a getpid system call (six per task before).
        loop = asyncio.get_running_loop()
        task = loop.create_task(self._execute(packet, held, loop))
        task.set_name(f"task-{packet.task_execution_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _hold(self, key: TaskKey, agent_id: str, label: str) -> HeldTask:
        held = HeldTask(key, agent_id, label)
        self.held[key] = held
        self.idle.clear()
        return held

    def _answer_repeat(
        self, packet: WorkPacket, via_agent_id: str, kept: dict[str, Any] | None, size: int
    ) -> None:
        """A push of a packet this agent already ran and reported.  It is not run again,
        and not ignored either (the server would push it again and again, its task Running
        all the while): the kept outcome is reported once more, under the agent id the push
        came through — the registration the server now expects it from.  The server applies
        it once, or records it as a duplicate.  Without a kept outcome the packet is
        refused, and the server runs the task again."""
        held = self._hold(packet.key, via_agent_id, packet.describe())
        self._send(frames.received(packet.outbox_id))
        if kept is None:
            log.warning(
                "refusing a repeated push of %s: its outcome is no longer kept", packet.describe()
            )
            self._report(
                held, refusal(packet, "already ran this packet; its outcome is no longer kept")
            )
            return
        log.info(
            "a repeated push of %s: reporting its outcome again as agent %s",
            packet.describe(),
            via_agent_id,
        )
        self._report(held, {**kept, "outbox_id": packet.outbox_id}, size)

    def _report(
        self,
        held: HeldTask,
        body: dict[str, Any],
        size: int | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        """Hand ``body`` to the reporter; ``size`` estimates what keeping it costs
        (default: a body without an output); ``loop``: the running one, when known."""
        held.result = body
        held.result_bytes = outcome_size(body) if size is None else size
        self.reporter.submit(held, loop)

    def _settled(self, held: HeldTask) -> None:
        self.held.pop(held.key, None)
        self.recent.remember(held.key, held.result, held.result_bytes)
        if not self.held:
            self.idle.set()

    async def _execute(
        self, packet: WorkPacket, held: HeldTask, loop: asyncio.AbstractEventLoop
    ) -> None:
        async with self._slots:
            digest = packet.artifact_digest
            self.cache.pin(digest)  # not evicted from under a running task
            try:
                try:
                    package_dir = await self.cache.aget(
                        digest, functools.partial(self._fetch_artifact, digest)
                    )
                except (ArtifactUnavailable, PackageCacheError, ArchiveError) as exc:
                    log.warning("refusing %s: %s", packet.describe(), exc)
                    self._report(held, refusal(packet, str(exc)))
                    return
                context_json = packet.context_json
                if packet.context_ref is not None:  # too large for a frame: fetch it
                    try:
                        context_json = await fetch_context(self.client, held.agent_id, packet)
                    except ContextUnavailable as exc:
                        log.warning("%s: %s", packet.describe(), exc)
                        self._report(held, exc.outcome(packet))
                        return
                run = await self._run_tailed(packet, held, package_dir, context_json, loop)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the runner itself broke: still tell the server
                log.exception("could not run %s", packet.describe())
                self._report(
                    held,
                    result_body(
                        packet,
                        "failure",
                        error_type="AgentError",
                        error_message=f"{type(exc).__name__}: {exc}",
                    ),
                )
                return
            finally:
                self.cache.unpin(digest)
        log.info(
            "%s finished: %s in %.3fs%s",
            held.label,
            run.status,
            run.duration_s,
            f" ({run.error_type}: {run.error_message})" if run.status != "success" else "",
        )
        body = run_result(packet, run)
        self._report(held, body, outcome_size(body, run.output_bytes), loop)

    async def _run_tailed(
        self,
        packet: WorkPacket,
        held: HeldTask,
        package_dir: Path,
        context_json: str,
        loop: asyncio.AbstractEventLoop,
    ) -> RunOutcome:
        """Run the task, shipping its new output every second or so while it runs."""
        ring = self.runner.new_log()
        tail = None
        if self._send_log is not None:
            tail = LiveTail(ring, functools.partial(self._ship, packet, held), loop=loop)
        try:
            return await self.runner.run(
                package_dir, packet.function, context_json, packet.timeout_s, ring, loop=loop
            )
        finally:
            if tail is not None:
                tail.stop()

    async def _ship(self, packet: WorkPacket, held: HeldTask, chunk: LogChunk) -> None:
        frame = frames.log_chunk(
            packet.task_execution_id, packet.assignment, chunk.text, chunk.end, chunk.skipped
        )
        await self._send_log(held.agent_id, frame)

    async def _fetch_artifact(self, digest: str) -> bytes:
        """The artifact's bytes, retrying an unreachable server for a while."""
        backoff = Backoff()
        deadline = asyncio.get_running_loop().time() + FETCH_RETRY_WINDOW_S
        while True:
            try:
                data = await self.client.fetch_artifact(digest)
                log.info("fetched artifact %s (%d bytes)", digest[:12], len(data))
                return data
            except RequestRejected as exc:
                raise ArtifactUnavailable(
                    f"artifact {digest} is not available from the server: {exc}"
                ) from None
            except AuthRejected as exc:
                raise ArtifactUnavailable(
                    f"artifact {digest} could not be fetched: {exc}"
                ) from None
            except ServerUnavailable as exc:
                if asyncio.get_running_loop().time() >= deadline:
                    raise ArtifactUnavailable(
                        f"artifact {digest} could not be fetched within {FETCH_RETRY_WINDOW_S:g}s: {exc}"
                    ) from None
                await asyncio.sleep(backoff.next_delay())
