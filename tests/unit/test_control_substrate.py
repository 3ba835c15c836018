"""Substrate guards: every misconfigured actuator is a loud boot error naming the problem.

Here: the unit tests (no database, socket or process); the rest are in tests/e2e/test_control_substrate.py, tests/integration/test_control_substrate.py.
"""

from __future__ import annotations

import pytest

from fleet.control.actuators.noop import NoopActuator
from fleet.control.actuators.process import ProcessActuator
from fleet.control.jobs import control_plane_jobs
from fleet.control.substrate import guard_process
from fleet.platform.config import ConfigError, load_config
from tests.support.substrate import SERVER_URL, build


def service_account(tmp_path, token=True, ca=True):
    sa = tmp_path / "sa"
    sa.mkdir(exist_ok=True)
    if token:
        (sa / "token").write_text("t")
    if ca:
        (sa / "ca.crt").write_text("not really a certificate")
    return sa


def never_called(env):
    raise AssertionError("the Docker daemon must not even be pinged")


def test_none_and_process_need_nothing(tmp_path):
    assert isinstance(build(tmp_path, "none"), NoopActuator)
    assert isinstance(build(tmp_path, "process"), ProcessActuator)


def test_an_unknown_actuator_lists_the_valid_ones(tmp_path):
    with pytest.raises(
        ConfigError, match="unknown actuator 'podman'; valid: none, process, docker, kubernetes"
    ):
        build(tmp_path, "podman")


def test_docker_refuses_when_kubernetes_service_host_is_set(tmp_path):
    env = {**SERVER_URL, "KUBERNETES_SERVICE_HOST": "10.0.0.1"}
    with pytest.raises(ConfigError) as err:
        build(tmp_path, "docker", env, ping=never_called)
    assert (
        "docker refused: this server runs inside Kubernetes (KUBERNETES_SERVICE_HOST is set)"
        in str(err.value)
    )
    assert "use CLOACINA_FLEET_ACTUATOR=kubernetes" in str(err.value)


def test_docker_refuses_when_a_service_account_token_is_mounted(tmp_path):
    sa = service_account(tmp_path)
    with pytest.raises(ConfigError, match="a service-account token is mounted at .*sa/token"):
        build(tmp_path, "docker", SERVER_URL, sa_dir=sa, ping=never_called)


def test_docker_refuses_without_a_server_url(tmp_path):
    with pytest.raises(ConfigError, match="docker needs CLOACINA_FLEET_SERVER_URL"):
        build(tmp_path, "docker", ping=never_called)


def test_docker_refuses_the_default_socket_when_absent(tmp_path):
    def missing_socket(env):
        raise FileNotFoundError(2, "No such file or directory")

    with pytest.raises(ConfigError, match="the default socket /var/run/docker.sock"):
        build(tmp_path, "docker", SERVER_URL, ping=missing_socket)


@pytest.mark.parametrize(
    ("env", "token", "ca", "words"),
    [
        ({}, True, True, "KUBERNETES_SERVICE_HOST is not set"),
        ({"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, True, True, "KUBERNETES_SERVICE_PORT is not set"),
        (
            {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "KUBERNETES_SERVICE_PORT": "443"},
            False,
            True,
            "token does not exist",
        ),
        (
            {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "KUBERNETES_SERVICE_PORT": "443"},
            True,
            False,
            "ca.crt does not exist",
        ),
    ],
)
def test_kubernetes_refuses_outside_a_cluster(tmp_path, env, token, ca, words):
    sa = service_account(tmp_path, token=token, ca=ca)
    with pytest.raises(ConfigError) as err:
        build(tmp_path, "kubernetes", {**SERVER_URL, **env}, sa_dir=sa)
    assert "kubernetes refused: this server is not running in a Kubernetes cluster" in str(
        err.value
    )
    assert words in str(err.value)


def test_kubernetes_refuses_without_a_server_url(tmp_path):
    sa = service_account(tmp_path)
    env = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    with pytest.raises(ConfigError, match="kubernetes needs CLOACINA_FLEET_SERVER_URL"):
        build(tmp_path, "kubernetes", env, sa_dir=sa)


@pytest.mark.parametrize(
    ("env", "words"),
    [
        ({"CLOACINA_FLEET_SERVER_URL": "cloacina:8000"}, "must be an http(s):// URL"),
        ({"CLOACINA_SERVER_POD_LABELS": "app"}, "must be k=v pairs"),
        ({"CLOACINA_AGENT_MAX_CONCURRENCY": "0"}, "CLOACINA_AGENT_MAX_CONCURRENCY must be >= 1"),
        ({"CLOACINA_FLEET_NETWORK_POLICY": "maybe"}, "must be true or false"),
    ],
)
def test_malformed_actuator_settings_are_boot_errors(tmp_path, env, words):
    with pytest.raises(ConfigError) as err:
        build(tmp_path, "none", env)
    assert words in str(err.value)


def test_the_process_guard_needs_the_source_tree(tmp_path):
    with pytest.raises(ConfigError, match="process refused: .*manage.py not found"):
        guard_process(tmp_path / "manage.py")


def test_the_control_job_is_leader_only_on_the_autoscale_interval(tmp_path):
    build(tmp_path, "none")
    config = load_config({"CLOACINA_HOME": str(tmp_path), "CLOACINA_AUTOSCALE_INTERVAL_S": "7"})
    [job] = control_plane_jobs(config)
    assert (job.name, job.interval_s, job.leader_only) == ("fleet_control", 7.0, True)
