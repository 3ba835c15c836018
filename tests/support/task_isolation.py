"""The hostile-tenant probe (tests/*/test_task_isolation.py): a task that tries every door
to the server's secrets, the context that tells it where they are, and the check that it
found none.  Shared by the in-process (integration) and the process-actuator (e2e) runs.
"""

from __future__ import annotations

import os
import pwd
from pathlib import Path

import pytest
from django.conf import settings

from agents.sandbox.task_isolation import TASK_ENV_NAMES

AS_ROOT = pytest.mark.skipif(
    os.geteuid() != 0, reason="the uid drop needs root: not root, tasks share the server's uid"
)

# Every door, tried with the exact paths (the worst case: the attacker knows the layout).
PROBE = r'''
import os
import socket
import struct


def _try(action):
    try:
        return {"got": action()}
    except Exception as exc:
        return {"refused": type(exc).__name__}


def _read(path):
    with open(path, "rb") as fh:
        return fh.read(64).decode(errors="replace").replace("\0", " ")


def _superuser_login(socket_path):
    """A StartupMessage as user postgres: 'trusted' if the server lets us straight in."""
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(5)
        sock.connect(socket_path)
        body = struct.pack("!i", 196608) + b"user\0postgres\0database\0postgres\0\0"
        sock.sendall(struct.pack("!i", len(body) + 4) + body)
        kind, _size, code = struct.unpack("!cii", sock.recv(9))
        return "trusted" if (kind, code) == (b"R", 0) else f"asked {kind!r} {code}"


def _socket_from_postmaster_pid(pgdata):
    lines = _read(os.path.join(pgdata, "postmaster.pid")).splitlines()
    return os.path.join(lines[4], ".s.PGSQL." + lines[3])


def probe(ctx):
    parent = os.getppid()
    return {
        "uid": os.getuid(),
        "env": sorted(os.environ),
        "secret_key": _try(lambda: _read(ctx["secret_key"])),
        "pg_password": _try(lambda: _read(ctx["pg_password"])),
        "postmaster_pid": _try(lambda: _socket_from_postmaster_pid(ctx["pgdata"])),
        "superuser": _try(lambda: _superuser_login(ctx["socket"])),
        "parent_environ": _try(lambda: _read(f"/proc/{parent}/environ")),
        "home_listing": _try(lambda: os.listdir(ctx["home"])),
    }
'''

PROBE_TASKS = [{"id": "probe", "function": "demo.steps:probe", "timeout_s": 30}]

SECRET_NAMES = {"DATABASE_URL", "CLOACINA_HOME", "CLOACINA_SECRET_KEY", "CLOACINA_AGENT_API_KEY"}


def doors(home: Path) -> dict:
    """The probe's context: where the server's secrets are (``home``: its CLOACINA_HOME; the
    database is the test run's embedded one, which every server process here shares)."""
    socket_dir = Path(settings.DATABASES["default"]["HOST"])
    db_home = server_home()
    return {
        "home": str(home),
        "secret_key": str(home / "secret_key"),
        "pg_password": str(db_home / "pg_password"),
        "pgdata": str(db_home / "pgdata"),
        "socket": str(next(socket_dir.glob(".s.PGSQL.*"))),
    }


def assert_nothing_found(found: dict) -> None:
    print("the probe found:", found)  # shown when it fails: what a tenant could read
    nobody = pwd.getpwnam("nobody").pw_uid
    assert found["uid"] == nobody
    assert set(found["env"]) <= TASK_ENV_NAMES | {n for n in found["env"] if n.startswith("LC_")}
    assert not SECRET_NAMES & set(found["env"])
    assert not [n for n in found["env"] if n.startswith("PG")]
    for door in (
        "secret_key",
        "pg_password",
        "postmaster_pid",
        "superuser",
        "parent_environ",
        "home_listing",
    ):
        assert found[door] == {"refused": "PermissionError"}, (door, found[door])


def server_home() -> Path:
    """The test server's CLOACINA_HOME (the embedded database's password and data live there)."""
    return Path(os.environ["CLOACINA_HOME"])
