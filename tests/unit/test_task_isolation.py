"""Hostile tenants: a task tries every door to the server's secrets and gets nothing.

The doors (issue 13): the environment (DATABASE_URL, CLOACINA_HOME, keys), the secret key
and database password files under CLOACINA_HOME, postmaster.pid and a superuser login on
the embedded PostgreSQL's unix socket, and the parent's /proc/<pid>/environ.  Tried
through the in-process executor and through a real `runagent` started by the process
actuator.  The suite runs as root here, so the children run as the task user (nobody).

Here: the unit tests (no database, socket or process); the rest are in tests/integration/test_task_isolation.py, tests/e2e/test_task_isolation.py.
"""

from __future__ import annotations

import os
import pwd
import stat

import pytest

from agents.sandbox.task_isolation import (
    TaskUserError,
    parse_task_user,
    task_environment,
    task_user,
)
from fleet.control.actuators.process import agent_environment
from fleet.platform import embedded_db
from tests.support.task_isolation import server_home


def test_a_task_child_inherits_only_the_allow_listed_environment():
    server_env = {
        "PATH": "/usr/bin",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "TZ": "UTC",
        "DATABASE_URL": "postgresql://postgres:pw@/postgres?host=/x",
        "CLOACINA_HOME": "/root/.cloacina",
        "CLOACINA_SECRET_KEY": "s",
        "PGPASSWORD": "pw",
        "AWS_SECRET_ACCESS_KEY": "added-to-the-server-tomorrow",
    }
    assert task_environment(server_env) == {
        "PATH": "/usr/bin",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "TZ": "UTC",
    }


def test_a_runagent_child_inherits_an_allow_list_without_database_or_secret_key():
    server_env = {
        "PATH": "/usr/bin",
        "CLOACINA_HOME": "/srv/cloacina",
        "CLOACINA_LOG_LEVEL": "INFO",
        "DATABASE_URL": "postgresql://postgres:pw@/postgres?host=/x",
        "CLOACINA_SECRET_KEY": "s",
        "PGPASSWORD": "pw",
        "CLOACINA_DB_POOL_MAX": "20",
        "SOMETHING_NEW": "x",
    }
    assert agent_environment(server_env) == {
        "PATH": "/usr/bin",
        "CLOACINA_HOME": "/srv/cloacina",
        "CLOACINA_LOG_LEVEL": "INFO",
    }
    assert agent_environment(server_env, frozenset({"SOMETHING_NEW"}))["SOMETHING_NEW"] == "x"


def test_the_task_user_is_nobody_by_default_as_root_and_none_otherwise():
    nobody = pwd.getpwnam("nobody")
    assert task_user(euid=0, environ={}) == parse_task_user("nobody")
    assert (task_user(euid=0, environ={}).uid, task_user(euid=0, environ={}).gid) == (
        nobody.pw_uid,
        nobody.pw_gid,
    )
    assert task_user(euid=1000, environ={"CLOACINA_TASK_USER": "nobody"}) is None
    assert parse_task_user("4242:4343").uid == 4242 and parse_task_user("4242:4343").gid == 4343
    for bad, words in (
        ("root", "unprivileged"),
        ("0:5", "unprivileged"),
        ("no-such-user-here", "no such user"),
        ("4242", "uid:gid"),
    ):
        with pytest.raises(TaskUserError, match=words):
            parse_task_user(bad)


def test_the_test_servers_home_is_closed_to_the_task_user():
    home = server_home()
    assert stat.S_IMODE(home.stat().st_mode) == (0o711 if os.geteuid() == 0 else 0o700)
    password = home / embedded_db.PASSWORD_FILE
    assert stat.S_IMODE(password.stat().st_mode) == 0o600
