"""Substrate guards: every misconfigured actuator is a loud boot error naming the problem.

Here: the integration tests (database, in-process ASGI, fakes); the rest are in tests/e2e/test_control_substrate.py, tests/unit/test_control_substrate.py.
"""

from __future__ import annotations

import pytest

from fleet.control.actuators.docker import DockerActuator
from fleet.platform.config import ConfigError
from tests.support.fakes.docker_engine import FakeDockerEngine
from tests.support.processes import free_port
from tests.support.substrate import SERVER_URL, build


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
