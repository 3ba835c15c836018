"""Who a task child runs as, and what it inherits: tenant code must not reach the server's
secrets (docs/threat-model.md, "Tenant code and the host").

* The environment is an allow-list: locale, time zone, PATH, TMPDIR.  Never
  ``CLOACINA_HOME``, ``DATABASE_URL``, an API key or anything else the server or agent
  was given: a variable added to the server tomorrow stays out without anyone
  remembering to scrub it.
* When this process is root, children run as an unprivileged user
  (``CLOACINA_TASK_USER``, default ``nobody``; ``name``, ``uid`` or ``uid:gid``) with no
  supplementary groups: it can read neither ``$CLOACINA_HOME`` (secret key, database
  password, 0600) nor this process's ``/proc/<pid>/environ`` (owner-only).
* When it is not root that drop is impossible: children share its uid.  ``serve`` says so
  at boot when more than one tenant exists (:mod:`fleet.platform.isolation`).

Imported by the task runner, shared by the server and the DB-less agent: stdlib only.
"""

from __future__ import annotations

import os
import pwd
import stat
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

ENV_TASK_USER = "CLOACINA_TASK_USER"
ENV_TASK_PYTHON = "CLOACINA_TASK_PYTHON"
DEFAULT_TASK_USER = "nobody"
# What a task child may inherit, by exact name or prefix; everything else stays behind.
TASK_ENV_NAMES = frozenset({"PATH", "LANG", "LANGUAGE", "TZ", "TMPDIR"})
TASK_ENV_PREFIXES = ("LC_",)


class TaskUserError(ValueError):
    """CLOACINA_TASK_USER names no usable unprivileged user."""


@dataclass(frozen=True)
class TaskUser:
    """The unprivileged identity task children run under when the parent is root."""

    name: str
    uid: int
    gid: int

    def popen_kwargs(self) -> dict:
        """subprocess.Popen arguments that start a child as this user, in a neutral directory
        (the parent's working directory may not be open to it)."""
        return {"user": self.uid, "group": self.gid, "extra_groups": [], "cwd": "/"}


def task_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The allow-listed environment of a task child, taken from ``environ`` (os.environ)."""
    env = os.environ if environ is None else environ
    kept = {
        name: value
        for name, value in env.items()
        if name in TASK_ENV_NAMES or name.startswith(TASK_ENV_PREFIXES)
    }
    kept.setdefault("PATH", os.defpath)
    return kept


def task_user(euid: int | None = None, environ: Mapping[str, str] | None = None) -> TaskUser | None:
    """Who task children run as: None when this process is not root (they keep its uid)."""
    if (os.geteuid() if euid is None else euid) != 0:
        return None
    env = os.environ if environ is None else environ
    return parse_task_user(env.get(ENV_TASK_USER, "").strip() or DEFAULT_TASK_USER)


def parse_task_user(spec: str) -> TaskUser:
    """``name``, ``uid`` or ``uid:gid`` → a TaskUser; root (uid or gid 0) is refused."""
    user, _, group = spec.partition(":")
    try:
        if user.isdigit():
            uid = int(user)
            try:
                entry = pwd.getpwuid(uid)
                name, gid = entry.pw_name, entry.pw_gid
            except KeyError:  # a bare uid (containers): its group must be given
                name, gid = user, -1
        else:
            entry = pwd.getpwnam(user)
            name, uid, gid = entry.pw_name, entry.pw_uid, entry.pw_gid
    except KeyError:
        raise TaskUserError(f"{ENV_TASK_USER}: no such user {user!r}") from None
    if group:
        if not group.isdigit():
            raise TaskUserError(f"{ENV_TASK_USER}: the group must be a number, got {group!r}")
        gid = int(group)
    if gid < 0:
        raise TaskUserError(f"{ENV_TASK_USER}: uid {uid} has no passwd entry: give uid:gid")
    if uid == 0 or gid == 0:
        raise TaskUserError(f"{ENV_TASK_USER} must be an unprivileged user, not {spec!r} (root)")
    return TaskUser(name, uid, gid)


def task_python(environ: Mapping[str, str] | None = None) -> str:
    """The interpreter task children run: ``CLOACINA_TASK_PYTHON``, else this one."""
    env = os.environ if environ is None else environ
    return env.get(ENV_TASK_PYTHON, "").strip() or sys.executable


def unreachable_for(user: TaskUser, path: Path) -> Path | None:
    """The first directory on the way to ``path`` (itself included) that ``user`` cannot
    enter, or None when it can reach it (a check by mode bits, as the kernel does)."""
    path = Path(path).resolve()
    for directory in [*reversed(path.parents), path]:
        try:
            st = directory.stat()
        except OSError:
            return directory
        if not _may_enter(user, st):
            return directory
    return None


def _may_enter(user: TaskUser, st: os.stat_result) -> bool:
    if st.st_uid == user.uid:
        return bool(st.st_mode & stat.S_IXUSR)
    if st.st_gid == user.gid:
        return bool(st.st_mode & stat.S_IXGRP)
    return bool(st.st_mode & stat.S_IXOTH)
