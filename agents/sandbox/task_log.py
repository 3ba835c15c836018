"""What a task printed: a bounded ring of the last bytes of one attempt's output.

A task child's stdout and stderr (the ``logging`` module's records included: the child
routes them to stderr) go into one pipe that the parent reads while the task runs
(:mod:`agents.sandbox.task_runner`).  Tenant code may print without end, so nothing
here ever holds more than ``capacity`` bytes: the oldest bytes are dropped and the
rendered text starts with a line saying how many.

Shared by the server's in-process executor and the DB-less agent: stdlib only.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

ENV_TASK_LOG_BYTES = "CLOACINA_TASK_LOG_BYTES"
DEFAULT_TASK_LOG_BYTES = 256 * 1024
# A ring smaller than this could not hold one traceback; 0 would mean "no log" silently.
MIN_TASK_LOG_BYTES = 1024


def truncation_marker(dropped: int) -> str:
    """The first line of a log whose oldest ``dropped`` bytes are gone."""
    return f"[… {dropped} bytes truncated …]\n"


def task_log_bytes(environ: dict[str, str] | None = None) -> int:
    """``CLOACINA_TASK_LOG_BYTES`` (default 256 KiB); raises ValueError naming a bad value."""
    raw = (os.environ if environ is None else environ).get(ENV_TASK_LOG_BYTES, "").strip()
    if not raw:
        return DEFAULT_TASK_LOG_BYTES
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{ENV_TASK_LOG_BYTES} must be an integer, got {raw!r}") from None
    if value < MIN_TASK_LOG_BYTES:
        raise ValueError(f"{ENV_TASK_LOG_BYTES} must be at least {MIN_TASK_LOG_BYTES}, got {value}")
    return value


@dataclass(frozen=True)
class TaskLog:
    """One attempt's output as shipped and stored: the kept tail and how much was written.

    ``text`` is the kept tail decoded as UTF-8 (undecodable bytes replaced);
    ``bytes`` counts everything the task wrote, kept or not.
    """

    text: str
    bytes: int
    truncated_bytes: int = 0

    @property
    def truncated(self) -> bool:
        return self.truncated_bytes > 0

    def render(self) -> str:
        """The text a reader sees: the kept tail, after the truncation line when cut."""
        if not self.truncated:
            return self.text
        return truncation_marker(self.truncated_bytes) + self.text

    def as_body(self) -> dict[str, object]:
        """The ``log`` object of an outcome body (docs/agent-protocol.md)."""
        return {"text": self.text, "bytes": self.bytes, "truncated_bytes": self.truncated_bytes}


@dataclass(frozen=True)
class LogChunk:
    """Output written since a reader's last look (live tailing): ``text`` ends at byte
    ``end`` of the attempt's stream; ``skipped`` bytes before it were already dropped."""

    text: str
    end: int
    skipped: int = 0


def _decode(data: bytes, cut: bool) -> str:
    """UTF-8 text of ``data``; when the front was cut, a partial character there is dropped.
    Undecodable bytes and NUL become U+FFFD: the server refuses a body holding a NUL, and
    PostgreSQL cannot store one, so a task printing one must not lose its outcome."""
    if cut:
        start = 0
        while start < min(len(data), 3) and 0x80 <= data[start] <= 0xBF:
            start += 1
        data = data[start:]
    return data.decode("utf-8", errors="replace").replace("\x00", "\ufffd")


def _complete_prefix(data: bytes) -> int:
    """Length of ``data`` without a trailing, not yet complete UTF-8 character (its rest
    is still to come: a live chunk holds it back for the next one)."""
    for back in range(1, min(len(data), 4) + 1):
        byte = data[-back]
        if byte < 0x80:
            return len(data)
        if byte >= 0xC0:  # the lead byte: 110xxxxx needs 2, 1110xxxx 3, 11110xxx 4
            needed = 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
            return len(data) if back >= needed else len(data) - back
    return len(data)


class LogRing:
    """The last ``capacity`` bytes written, and how many were written in all."""

    def __init__(self, capacity: int = DEFAULT_TASK_LOG_BYTES) -> None:
        if capacity < 1:
            raise ValueError(f"a log ring needs a positive capacity, got {capacity}")
        self.capacity = capacity
        self._buf = bytearray()
        self.written = 0  # every byte ever appended

    @property
    def dropped(self) -> int:
        return self.written - len(self._buf)

    def append(self, data: bytes) -> None:
        """Keep ``data``, dropping the oldest bytes beyond the capacity."""
        if not data:
            return
        self.written += len(data)
        if len(data) >= self.capacity:
            self._buf[:] = data[-self.capacity :]
            return
        self._buf += data
        excess = len(self._buf) - self.capacity
        if excess > 0:
            del self._buf[:excess]  # bytearray drops from the front without copying it all

    def clear(self) -> None:
        self._buf.clear()
        self.written = 0

    def snapshot(self) -> TaskLog:
        """Everything kept, for the outcome."""
        dropped = self.dropped
        return TaskLog(_decode(bytes(self._buf), dropped > 0), self.written, dropped)

    def since(self, offset: int, max_bytes: int | None = None) -> LogChunk | None:
        """What was written after byte ``offset`` of the stream (None: nothing new), at most
        its last ``max_bytes``; bytes dropped (from the ring, or by that cap) are counted in
        ``skipped``."""
        if offset >= self.written:
            return None
        first_kept = self.dropped
        start = max(offset, first_kept)
        if max_bytes is not None:
            start = max(start, self.written - max_bytes)
        data = bytes(self._buf[start - first_kept :])
        data = data[: _complete_prefix(data)]
        if not data:
            return None
        return LogChunk(_decode(data, start > offset), start + len(data), start - offset)


# How often a running task's new output is shipped for live tailing, at most, and the
# most one chunk holds (its tail): even escaped as JSON (6 bytes a character at worst) a
# chunk stays well inside a delivery socket's 1 MiB frame, whatever the ring's size.
LIVE_LOG_INTERVAL_S = 1.0
LIVE_CHUNK_MAX_BYTES = 128 * 1024


async def follow(
    ring: LogRing,
    ship: Callable[[LogChunk], Awaitable[object]],
    interval_s: float = LIVE_LOG_INTERVAL_S,
    first_after_s: float | None = None,
) -> None:
    """Ship what ``ring`` gained since the last look, every ``interval_s`` at most, until
    cancelled (the run ended: its outcome carries the whole log).  Each chunk is bounded
    by the ring; one that fails to ship is not retried (the next covers what it can).
    ``first_after_s``: the first look's delay (default ``interval_s``)."""
    offset = 0
    delay = interval_s if first_after_s is None else first_after_s
    while True:
        await asyncio.sleep(delay)
        delay = interval_s
        chunk = ring.since(offset, LIVE_CHUNK_MAX_BYTES)
        if chunk is None:
            continue
        offset = chunk.end
        try:
            await ship(chunk)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.warning("could not ship a live log chunk", exc_info=True)


class LiveTail:
    """:func:`follow` for one run, started only once the run has lasted ``interval_s``.

    Most tasks finish well within a second: for them this is one timer, set and cancelled,
    not a task that is created, sleeps and is cancelled again (each run of the agent and
    of the in-process executor paid for that).  Chunks go out at the same moments as with
    :func:`follow` started with the run.  ``stop()`` when the run ends.
    """

    def __init__(
        self,
        ring: LogRing,
        ship: Callable[[LogChunk], Awaitable[object]],
        interval_s: float = LIVE_LOG_INTERVAL_S,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        """``loop``: the running loop, when the caller has it (each look-up is a getpid)."""
        self._task: asyncio.Future | None = None
        self._timer = (loop or asyncio.get_running_loop()).call_later(
            interval_s, self._start, ring, ship, interval_s
        )

    def _start(
        self, ring: LogRing, ship: Callable[[LogChunk], Awaitable[object]], interval_s: float
    ) -> None:
        self._task = asyncio.ensure_future(follow(ring, ship, interval_s, first_after_s=0.0))

    def stop(self) -> None:
        self._timer.cancel()
        if self._task is not None:
            self._task.cancel()
