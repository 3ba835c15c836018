"""Results reported over the delivery sockets of this process, applied in batches.

Every outcome commits synchronously (it is the only durable copy of a task's
result), and a synchronous commit waits for a WAL flush.  One transaction per
outcome made the flush, the commit and a round trip per statement the bulk of the
database's work per task.  Here the results of all sockets of the process that
arrive while one batch is being written are written together as the next batch
(:class:`fleet.engine.batcher.Batcher`): one transaction, one flush, each result
still checked and applied by the same code as a REST report
(:func:`fleet.executors.fleet.result_intake.apply_results`, a savepoint per result).

A socket that closes while its result is in a batch loses only the answer: the
outcome is applied (or not) all the same, and the agent, with no ``result_ack``,
reports it again — recorded, not applied twice.
"""

from __future__ import annotations

import asyncio
import uuid

from fleet.engine.batcher import Batcher
from fleet.executors.fleet.delivery import db as delivery_db
from fleet.executors.fleet.result_intake import ResultIn, apply_results

MAX_BATCH = 256  # results per transaction
# Two batches may be written at once: results are applied workflow by workflow, task by
# task, and the agents' slots (and breakers) written last, their rows locked in one
# statement in id order — the lock order every writer of those rows keeps (docs/fleet.md,
# "Lock order") — so two batches, or a batch and a placement, cannot deadlock; while one
# waits for its commit's WAL flush the other gets on with the next results.
CONCURRENT_BATCHES = 2

ResultItem = tuple[int, uuid.UUID, ResultIn]  # tenant id, agent id, the result

_batchers: dict[asyncio.AbstractEventLoop, Batcher[ResultItem, tuple[int, dict]]] = {}


def _batcher() -> Batcher[ResultItem, tuple[int, dict]]:
    loop = asyncio.get_running_loop()
    current = _batchers.get(loop)
    if current is None:
        for old in [lp for lp in _batchers if lp.is_closed()]:
            del _batchers[old]
        current = _batchers[loop] = Batcher(
            apply_results, MAX_BATCH, "result-batches", delivery_db.call, CONCURRENT_BATCHES
        )
    return current


async def apply(tenant_id: int, agent_id: uuid.UUID, body: ResultIn) -> tuple[int, dict]:
    """The REST answer (status, body) for this result, once its batch is committed."""
    return await _batcher().submit((tenant_id, agent_id, body))


async def apply_many(items: list[ResultItem]) -> list[tuple[int, dict] | BaseException]:
    """:func:`apply` for results that arrived together (one socket's inbound batch)."""
    return await _batcher().submit_many(items)


async def close_batches() -> None:
    """Stop this event loop's batcher (server shutdown)."""
    current = _batchers.pop(asyncio.get_running_loop(), None)
    if current is not None:
        await current.close()
