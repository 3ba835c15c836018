"""Posting outcomes to the server until it has them.

An outcome is the only copy of a finished task's result, so it is kept and
re-posted with backoff for as long as the server cannot answer: a server restart
between the push and the result loses nothing.  It is let go only when the server
answers — 2xx (recorded, whether applied or not), or 404/409 (it no longer wants
it from us).  An outcome the server rejects as malformed (e.g. an output over the
context size limit) is replaced by a failure naming the rejection, so the task
fails visibly instead of waiting for a timeout.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from agents.runtime.backoff import Backoff, wait_event
from agents.runtime.client import AgentClient, AuthRejected, ServerUnavailable
from agents.runtime.work import OUTCOME_FAILURE, HeldTask

log = logging.getLogger(__name__)

NOT_WANTED = (404, 409)  # the packet is not (or no longer) ours to report


class OutcomeReporter:
    """``submit(held)`` posts ``held.result`` under ``held.agent_id`` (re-read on every try)."""

    def __init__(
        self,
        client: AgentClient,
        on_settled: Callable[[HeldTask], None],
        on_auth_rejected: Callable[[AuthRejected], None],
    ) -> None:
        self._client = client
        self._on_settled = on_settled
        self._on_auth_rejected = on_auth_rejected
        self._tasks: set[asyncio.Task] = set()
        self._server_back = asyncio.Event()
        self.answered = 0  # result POSTs the server answered (2xx or 4xx)

    @property
    def pending(self) -> int:
        return len(self._tasks)

    def server_is_back(self) -> None:
        """Cut every retry's backoff short: the server answers again (the socket reopened)."""
        self._server_back.set()
        self._server_back = asyncio.Event()  # later retries wait for the next comeback

    def submit(self, held: HeldTask) -> None:
        task = asyncio.create_task(self._deliver(held), name=f"report-{held.label}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def cancel_all(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _deliver(self, held: HeldTask) -> None:
        backoff = Backoff()
        try:
            while True:
                try:
                    status, answer = await self._client.post_result(held.agent_id, held.result)
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
                if 200 <= status < 300:
                    # One line per task is enough at INFO ("finished"); say more when
                    # the server did not apply it.
                    log.log(
                        logging.DEBUG if answer.get("applied") else logging.INFO,
                        "posted %s outcome of %s (applied=%s%s)",
                        held.result["outcome"],
                        held.label,
                        answer.get("applied"),
                        f", {answer['reason']}" if answer.get("reason") else "",
                    )
                    break
                if status in NOT_WANTED:
                    log.warning(
                        "the server no longer wants the outcome of %s (%s: %s)",
                        held.label,
                        status,
                        answer.get("detail", ""),
                    )
                    break
                if held.result.get("error_type") == "ResultRejected":
                    log.error(
                        "the server rejected the outcome of %s twice (%s: %s); dropping it",
                        held.label,
                        status,
                        answer.get("detail", ""),
                    )
                    break
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
        except AuthRejected as exc:
            self._on_auth_rejected(exc)
        finally:
            # Settled also on cancellation (forced stop): nobody will post it after us.
            self._on_settled(held)
