"""Substrate guards: every misconfigured actuator is a loud boot error naming the problem.

Here: the integration tests (database, in-process ASGI, fakes); the rest are in tests/e2e/test_control_substrate.py, tests/unit/test_control_substrate.py.
"""

from __future__ import annotations

import pytest

from fleet.control.actuators.docker import DockerActuator
from fleet.control.jobs import build_actuator
from fleet.control.substrate import SubstrateProbe
from fleet.platform.config import ConfigError, load_config
from tests.support.fakes.docker_engine import FakeDockerEngine
from tests.support.processes import free_port

SERVER_URL = {"CLOACINA_FLEET_SERVER_URL": "http://cloacina.example:8000"}


def build(tmp_path, actuator, env=None, sa_dir=None, ping=None):
    env = {"CLOACINA_HOME": str(tmp_path), **(env or {})}
    probe_kwargs = {"environ": env, "service_account_dir": sa_dir or tmp_path / "no-such-sa"}
    if ping is not None:
        probe_kwargs["docker_ping"] = ping
    config = load_config({**env, "CLOACINA_FLEET_ACTUATOR": actuator})
    return build_actuator(config, probe=SubstrateProbe(**probe_kwargs))


def test_docker_refuses_when_no_daemon_answers(tmp_path):
    port = free_port()  # nothing listens there
    env = {**SERVER_URL, "DOCKER_HOST": f"tcp://127.0.0.1:{port}"}
    with pytest.raises(ConfigError) as err:
        build(tmp_path, "docker", env)  # the real ping through the docker SDK
    message = str(err.value)
    assert f"no Docker daemon reachable at tcp://127.0.0.1:{port}" in message
    assert "Start Docker or set DOCKER_HOST" in message


def test_docker_starts_when_a_daemon_answers(tmp_path):
    with FakeDockerEngine() as engine:
        env = {**SERVER_URL, "DOCKER_HOST": engine.base_url}
        actuator = build(tmp_path, "docker", env)
        assert isinstance(actuator, DockerActuator)
        assert engine.calls("GET", "/_ping")  # it really asked the daemon
        assert actuator.actual("some-label") == []
