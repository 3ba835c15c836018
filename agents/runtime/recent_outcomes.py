"""Outcomes the server already has, kept (bounded) so that a re-push of one is answered.

The server may push a packet the agent has already run and reported: after it
reclaimed the packet of the agent's earlier registration onto its current one (a
server restart or a partition outlived the liveness window), or after a lost
``received``.  The agent never runs it again and never stays silent: it reports
the kept outcome once more, under the agent id the push came through (which the
server now expects), or — when the outcome was too large to keep — refuses the
packet, so that the server runs the task again elsewhere.

Bounds: at most ``MAX_ENTRIES`` outcomes and ``MAX_BYTES`` of them, oldest
dropped first.  A busy agent settles a few hundred outcomes a second at most, so
the count bound keeps several minutes of them: well past a liveness window
(45 s by default).  An outcome past a bound is forgotten altogether; a re-push of
it is then taken as new work and runs again (at-least-once, never silence).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from agents.protocol.work import TaskKey

MAX_ENTRIES = 50_000
MAX_BYTES = 32 * 1024 * 1024
# An outcome larger than this is not kept (one huge output must not flush the rest):
# its key is, so that a re-push is refused rather than run again.
MAX_KEPT_OUTCOME_BYTES = 1024 * 1024
ENTRY_OVERHEAD_BYTES = 512  # the dict, its keys and ids, roughly


def outcome_size(body: dict[str, Any], output_bytes: int = 0) -> int:
    """A cheap upper estimate of a kept outcome's memory (no serialisation on the hot path)."""
    texts = sum(len(body.get(k) or "") for k in ("error_type", "error_message", "traceback"))
    texts += len((body.get("log") or {}).get("text") or "")
    return ENTRY_OVERHEAD_BYTES + output_bytes + texts


class RecentOutcomes:
    def __init__(self, max_entries: int = MAX_ENTRIES, max_bytes: int = MAX_BYTES) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.bytes = 0
        # key -> (body or None when not kept, the bytes it counts for)
        self._entries: OrderedDict[TaskKey, tuple[dict[str, Any] | None, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: TaskKey) -> bool:
        return key in self._entries

    def remember(self, key: TaskKey, body: dict[str, Any] | None, size: int) -> None:
        """Keep ``body`` (the outcome the server answered) for a possible re-push."""
        if body is None or size > min(MAX_KEPT_OUTCOME_BYTES, self.max_bytes):
            body, size = None, ENTRY_OVERHEAD_BYTES
        self.forget(key)
        self._entries[key] = (body, size)
        self.bytes += size
        while self._entries and (
            len(self._entries) > self.max_entries or self.bytes > self.max_bytes
        ):
            _key, (_body, dropped) = self._entries.popitem(last=False)
            self.bytes -= dropped

    def take(self, key: TaskKey) -> tuple[bool, dict[str, Any] | None, int]:
        """(known, the kept body or None, its size) — and forget it: it is being reported
        again, and comes back through :meth:`remember` once the server has it."""
        entry = self._entries.pop(key, None)
        if entry is None:
            return False, None, 0
        self.bytes -= entry[1]
        return True, *entry

    def forget(self, key: TaskKey) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.bytes -= entry[1]
