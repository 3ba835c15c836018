"""What the server does so tenant code on this machine cannot reach its secrets, and what it
says when it cannot (docs/threat-model.md, "Tenant code and the host").

Task children run as an unprivileged user only when the server is root
(:mod:`agents.sandbox.task_isolation`).  Then ``$CLOACINA_HOME`` must be closed to that
user except for the package caches it imports from.  When the server is not root, tasks
run as the server's own user and can read everything it can: with more than one tenant,
``serve`` says so at boot and the console shows it to platform admins.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

# Directories in CLOACINA_HOME the task user must be able to enter: the package caches of
# the in-process executor and of agents started by the process actuator (each package in
# them is opened by digest, the roots are not listable: agents/sandbox/package_cache.py).
TASK_READABLE = frozenset({"packages", "agent-cache"})


def secure_home(home: Path, euid: int | None = None) -> None:
    """Close ``home`` to other users: 0700, or when root 0711 (the database's user and the
    task user must pass through it) with everything in it but the package caches and the
    data directory (which pgserver keeps 0700 itself) closed to "other"."""
    root = (os.geteuid() if euid is None else euid) == 0
    with contextlib.suppress(FileNotFoundError, PermissionError):
        os.chmod(home, 0o711 if root else 0o700)
        if not root:
            return
        for entry in home.iterdir():
            if entry.name in TASK_READABLE or entry.name == "pgdata" or entry.is_symlink():
                continue
            with contextlib.suppress(FileNotFoundError, PermissionError):
                os.chmod(entry, entry.stat().st_mode & ~0o007)


def isolation_warning(tenant_count: int, euid: int | None = None) -> str | None:
    """The one-line warning when tasks cannot be isolated from the server and from each
    other (not root) and more than one tenant shares this server; None otherwise."""
    euid = os.geteuid() if euid is None else euid
    if euid == 0 or tenant_count < 2:
        return None
    return (
        f"WARNING: tenant isolation is impossible: serve is not running as root, so task code "
        f"runs as its own user (uid {euid}) and can read $CLOACINA_HOME (the secret key, the "
        f"database password) and this process's environment; with {tenant_count} tenants, one "
        "tenant's tasks can read or forge another's data. Run serve as root (tasks then run as "
        "CLOACINA_TASK_USER, default nobody) or give each tenant its own server."
    )


def current_warning() -> str | None:
    """:func:`isolation_warning` for this process and the tenants in the database now."""
    if os.geteuid() == 0:  # no query: nothing to warn about
        return None
    # A local import: settings.py imports this module, before any model can be loaded.
    from fleet.platform.tenancy import Tenant

    return isolation_warning(Tenant.objects.count())
