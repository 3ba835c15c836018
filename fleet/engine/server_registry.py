"""Server processes register themselves and heartbeat into ``fleet_serverinstance``.

Work an in-process executor claimed dies with its process; the recovery sweep
(:mod:`fleet.engine.recovery`) finds instances whose beats stopped and releases
their claims.  The interval is short (a few seconds) because it bounds how long
such work waits; ``CLOACINA_SERVER_HEARTBEAT_S`` overrides it (tests use less).
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
from datetime import timedelta

from django.utils import timezone

from fleet.models import ServerInstance
from fleet.platform.config import ConfigError

log = logging.getLogger(__name__)

SERVER_HEARTBEAT_S = 3.0
SERVER_DEAD_AFTER_MISSES = 3


def heartbeat_interval_s() -> float:
    raw = os.environ.get("CLOACINA_SERVER_HEARTBEAT_S", "")
    if not raw:
        return SERVER_HEARTBEAT_S
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"CLOACINA_SERVER_HEARTBEAT_S must be a number, got {raw!r}") from None
    if value < 0.1:
        raise ConfigError(f"CLOACINA_SERVER_HEARTBEAT_S must be >= 0.1, got {value}")
    return value


def dead_after_s() -> float:
    """Seconds without a beat after which a server process is presumed dead."""
    return heartbeat_interval_s() * SERVER_DEAD_AFTER_MISSES


def new_instance_id() -> str:
    """host:pid:random, unique per process start (fits ServerInstance.id and claimed_by)."""
    host = socket.gethostname()[:60]
    return f"{host}:{os.getpid()}:{secrets.token_hex(4)}"


def register_instance(
    instance_id: str, default_executor: str, port: int | None = None
) -> ServerInstance:
    host, pid, _ = instance_id.rsplit(":", 2)
    return ServerInstance.objects.create(
        id=instance_id, host=host, pid=int(pid), port=port, default_executor=default_executor
    )


def set_port(instance_id: str, port: int) -> None:
    ServerInstance.objects.filter(pk=instance_id).update(port=port)


def beat(instance_id: str) -> None:
    """Record that this process is alive.

    If a peer presumed us dead (we stalled past the window) it has already
    released our in-process claims; those runs' outcomes will be fenced off.
    We simply come back to life for new work.
    """
    now = timezone.now()
    updated = ServerInstance.objects.filter(pk=instance_id, stopped_at__isnull=True).update(
        last_seen=now
    )
    if updated == 0:
        revived = ServerInstance.objects.filter(pk=instance_id).update(
            last_seen=now, stopped_at=None
        )
        if revived:
            log.warning("server %s was presumed dead by a peer; resuming heartbeats", instance_id)


def mark_stopped(instance_id: str) -> bool:
    return (
        ServerInstance.objects.filter(pk=instance_id, stopped_at__isnull=True).update(
            stopped_at=timezone.now()
        )
        == 1
    )


def claim_dead_instance(instance_id: str, cutoff) -> bool:
    """Compare-and-set: mark ``instance_id`` stopped only if it is still silent since ``cutoff``."""
    return (
        ServerInstance.objects.filter(
            pk=instance_id, stopped_at__isnull=True, last_seen__lt=cutoff
        ).update(stopped_at=timezone.now())
        == 1
    )


def silent_instances(now=None) -> list[str]:
    """Ids of running instances whose last beat is older than the liveness window."""
    cutoff = (now or timezone.now()) - timedelta(seconds=dead_after_s())
    return list(
        ServerInstance.objects.filter(stopped_at__isnull=True, last_seen__lt=cutoff).values_list(
            "id", flat=True
        )
    )
