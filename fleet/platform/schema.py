"""Bringing the database schema up to date, safely from several processes at once."""

from __future__ import annotations

from django.core.management import call_command
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

from fleet.platform.advisory_locks import MIGRATE_LOCK_ID


def pending_migrations() -> bool:
    executor = MigrationExecutor(connection)
    return bool(executor.migration_plan(executor.loader.graph.leaf_nodes()))


def migrate_with_lock() -> None:
    """Apply migrations; an advisory lock makes processes that start together take turns."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_advisory_lock(%s)", [MIGRATE_LOCK_ID])
    try:
        call_command("migrate", interactive=False, verbosity=0)
    finally:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_unlock(%s)", [MIGRATE_LOCK_ID])


def ensure_schema() -> None:
    """Migrate first when needed, so `createtenant` or `mintkey` work on a fresh database too."""
    if pending_migrations():
        migrate_with_lock()
