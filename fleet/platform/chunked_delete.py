"""Retention pruning in bounded chunks: one ``DELETE … LIMIT`` statement per chunk, oldest
first, so a long-neglected table is worked down over several runs instead of by one huge
delete that holds its locks and bloats the WAL at once."""

from __future__ import annotations

from datetime import datetime

from django.db import connection


def delete_in_chunks(sql: str, cutoff: datetime, chunk: int, max_chunks: int) -> int:
    """Run ``sql`` (parameters: the cutoff, the chunk size) until a chunk comes back short
    or ``max_chunks`` ran; how many rows went."""
    deleted = 0
    with connection.cursor() as cursor:
        for _ in range(max_chunks):
            cursor.execute(sql, [cutoff, chunk])
            deleted += cursor.rowcount
            if cursor.rowcount < chunk:
                break
    return deleted
