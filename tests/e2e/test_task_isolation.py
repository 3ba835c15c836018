"""Hostile tenants: a task tries every door to the server's secrets and gets nothing.

The doors (issue 13): the environment (DATABASE_URL, CLOACINA_HOME, keys), the secret key
and database password files under CLOACINA_HOME, postmaster.pid and a superuser login on
the embedded PostgreSQL's unix socket, and the parent's /proc/<pid>/environ.  Tried
through the in-process executor and through a real `runagent` started by the process
actuator.  The suite runs as root here, so the children run as the task user (nobody).

Here: the end-to-end tests (real processes); the rest are in tests/integration/test_task_isolation.py, tests/unit/test_task_isolation.py.
"""

from __future__ import annotations

import pytest

from fleet.models import ApiKey, Tenant, WorkflowExecution
from tests.support.agents import live_agents
from tests.support.factories import make_package, tasks_of
from tests.support.processes import Processes, control_env, diagnostics
from tests.support.server_api import Api
from tests.support.task_isolation import (
    AS_ROOT,
    PROBE,
    PROBE_TASKS,
    assert_nothing_found,
    doors,
)
from tests.support.waiting import wait_until


@AS_ROOT
@pytest.mark.e2e
@pytest.mark.django_db(transaction=True)
def test_a_task_run_by_a_process_actuator_agent_reaches_none_of_the_servers_secrets(tmp_path):
    tenant = Tenant.objects.create(name="mallory")
    key = ApiKey.mint("write", tenant)[1]
    with Processes(tmp_path) as procs:
        env = control_env(procs)
        env.pop("CLOACINA_SECRET_KEY", None)  # serve generates and keeps its own key file
        serve = procs.serve(env=env)
        api, logs = Api(serve, key), diagnostics(procs, serve)
        assert (procs.home / "secret_key").exists()
        assert api.post("/fleet/provision").status_code == 200
        wait_until(lambda: live_agents(tenant), what="a live agent", logs=logs, timeout=60)
        make_package(tenant, PROBE_TASKS, PROBE)
        execution_id = api.start("demo", doors(procs.home))
        done = wait_until(
            lambda: WorkflowExecution.objects.filter(
                pk=execution_id, status__in=("Completed", "Failed")
            ).first(),
            what="the probe to finish on the agent",
            logs=logs,
            timeout=60,
        )
        task = tasks_of(done)["probe"]
        assert task.status == "Completed", task.error_message
        assert task.agent is not None  # it ran on the agent, not in process
        assert_nothing_found(task.output_context)
