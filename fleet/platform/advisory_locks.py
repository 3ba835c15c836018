"""PostgreSQL advisory lock ids: one namespace for every lock the server takes.

Ids are 64-bit; ours all start with "CL" in the high bytes so they stay apart from anything
else sharing the database.  The schema migration lock and the leader-only jobs' locks
(fleet/engine/leader.py) are drawn from it.
"""

from __future__ import annotations

import zlib

LOCK_NAMESPACE = 0x434C << 32
MIGRATE_LOCK_ID = LOCK_NAMESPACE | 1


def lock_id_for(job_name: str) -> int:
    """A stable lock id per periodic job, so unrelated leader-only jobs never wait on each other."""
    return LOCK_NAMESPACE | (zlib.crc32(job_name.encode()) & 0x7FFF_FFFF)
