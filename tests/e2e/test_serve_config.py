"""`serve` boot configuration: the executor registry and loud failures on bad configuration.

Here: the end-to-end tests (real processes); the rest are in tests/unit/test_serve_config.py.
"""

from __future__ import annotations

import pytest

from fleet.models import ServerInstance
from tests.support.processes import Processes


@pytest.fixture
def procs(transactional_db, tmp_path):
    with Processes(tmp_path) as procs:
        yield procs


@pytest.mark.e2e
@pytest.mark.parametrize(
    "flags, env, message",
    [
        (
            ["--default-executor", "bogus"],
            {},
            "unknown default executor 'bogus'; valid keys: default",
        ),
        ([], {"CLOACINA_DEFAULT_EXECUTOR": "bogus"}, "valid keys: default"),
        (["--actuator", "podman"], {}, "unknown actuator 'podman'"),
        (
            ["--agent-heartbeat-interval-s", "soon"],
            {},
            "--agent-heartbeat-interval-s must be a number, got 'soon'",
        ),
        (["--agent-liveness-misses", "0"], {}, "--agent-liveness-misses must be >= 1, got 0"),
        ([], {"CLOACINA_SCHEDULER_POLL_S": "fast"}, "CLOACINA_SCHEDULER_POLL_S must be a number"),
        ([], {"CLOACINA_DB_POOL_MAX": "10"}, "CLOACINA_DB_POOL_MAX must be at least 24"),
        ([], {"CLOACINA_ALLOWED_HOSTS": "https://x.example"}, "CLOACINA_ALLOWED_HOSTS: 'https:"),
        ([], {"CLOACINA_LOGIN_LOCKOUT_S": "soon"}, "CLOACINA_LOGIN_LOCKOUT_S must be an integer"),
        (
            [],
            {"CLOACINA_EVENT_LOOP": "tokio"},
            "CLOACINA_EVENT_LOOP must be one of uvloop, asyncio, got 'tokio'",
        ),
        (
            [],
            {"CLOACINA_EXECUTORS": '{"gpu": {"class": "no_such_pkg.executors:Gpu"}}'},
            "executor 'gpu' (CLOACINA_EXECUTORS[gpu]): cannot import module 'no_such_pkg.executors'",
        ),
        (
            [],
            {"CLOACINA_EXECUTORS": '{"default": {"class": "a.b:C"}}'},
            "executor 'default' (CLOACINA_EXECUTORS[default]): the key is built in",
        ),
        (
            ["--default-executor", "bogus"],
            {
                "CLOACINA_EXECUTORS": '{"limited": {"class": '
                '"examples.executors.subprocess_limits:SubprocessLimitsExecutor"}}'
            },
            "unknown default executor 'bogus'; valid keys: default, limited",
        ),
        (
            [],
            {"CLOACINA_MAX_REGISTERED_AGENTS": "0"},
            "CLOACINA_MAX_REGISTERED_AGENTS (max_registered_agents) must be auto or a positive",
        ),
    ],
)
def test_serve_refuses_bad_configuration(procs, flags, env, message):
    result = procs.manage("serve", "--port", "0", *flags, env=procs.env(**env), timeout=90)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1  # one clear line, no traceback
    if "valid keys" in message:
        assert "fleet" not in result.stderr  # not opted in: the key does not exist
    assert result.stdout == ""  # never got as far as the ready line
    assert not ServerInstance.objects.exists()


@pytest.mark.e2e
def test_serve_exits_non_zero_when_its_port_is_taken(procs):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = procs.manage("serve", "--port", str(port), timeout=60)
    assert result.returncode == 1, result.stderr
    assert f"could not listen on 127.0.0.1:{port}" in result.stderr
    assert result.stdout == ""
    instance = ServerInstance.objects.get()  # registered, then marked stopped: no live row left
    assert instance.stopped_at is not None


@pytest.mark.e2e
def test_serve_clamps_desired_count_to_a_lowered_default_at_boot(procs):
    from fleet.models import ChangeReason, FleetChange, Tenant

    tenant = Tenant.objects.create(name="acme", desired_count=4)  # at the old default limit
    # No control tick for an hour: whatever clamps before the ready line is the boot.
    serve = procs.serve(
        env=procs.env(CLOACINA_DEFAULT_MAX_AGENTS="2", CLOACINA_AUTOSCALE_INTERVAL_S="3600")
    )
    tenant.refresh_from_db()
    assert tenant.desired_count == 2
    [clamp] = FleetChange.objects.filter(tenant=tenant)
    assert (clamp.old_value, clamp.new_value, clamp.reason, clamp.actor) == (
        4,
        2,
        ChangeReason.CLAMP,
        "system",
    )
    assert clamp.note == "platform default max agents (CLOACINA_DEFAULT_MAX_AGENTS) lowered to 2"
    # Before this server registered itself: the clamp is the boot's, not a tick's.
    assert clamp.at <= ServerInstance.objects.get().started_at
    assert "desired_count 4 clamped to 2" in serve.process.output()
