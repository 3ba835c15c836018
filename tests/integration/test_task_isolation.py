"""Hostile tenants: a task tries every door to the server's secrets and gets nothing.

The doors (issue 13): the environment (DATABASE_URL, CLOACINA_HOME, keys), the secret key
and database password files under CLOACINA_HOME, postmaster.pid and a superuser login on
the embedded PostgreSQL's unix socket, and the parent's /proc/<pid>/environ.  Tried
through the in-process executor and through a real `runagent` started by the process
actuator.  The suite runs as root here, so the children run as the task user (nobody).

Here: the integration tests (database, in-process ASGI, fakes); the rest are in tests/e2e/test_task_isolation.py, tests/unit/test_task_isolation.py.
"""

from __future__ import annotations

import os

import pytest

from fleet.models import Tenant
from tests.support.factories import make_package, start, tasks_of
from tests.support.inprocess import drive, running_executor
from tests.support.loop import run_async
from tests.support.task_isolation import (
    AS_ROOT,
    PROBE,
    PROBE_TASKS,
    assert_nothing_found,
    doors,
    server_home,
)


@pytest.fixture
def secret_key_file():
    """The file serve keeps its generated key in (settings._secret_key: 0600), in the test
    server's home (the test settings give the key through the environment instead)."""
    path = server_home() / "secret_key"
    created = not path.exists()
    if created:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, b"not-for-tenants")
        os.close(fd)
    yield path
    if created:
        path.unlink()


@AS_ROOT
@pytest.mark.django_db(transaction=True)
def test_a_task_run_in_process_reaches_none_of_the_servers_secrets(tmp_path, secret_key_file):
    tenant = Tenant.objects.create(name="mallory")
    make_package(tenant, PROBE_TASKS, PROBE)
    home = secret_key_file.parent
    assert "DATABASE_URL" in os.environ  # the server itself has it: the child must not
    execution, _ = start(tenant, "demo", doors(home))
    with running_executor(tmp_path / "cache", workers=1) as (executor, sink):
        run_async(drive(executor, sink, execution.pk))
    task = tasks_of(execution)["probe"]
    assert task.status == "Completed", task.error_message
    assert_nothing_found(task.output_context)
