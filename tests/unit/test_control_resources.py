"""The agents' CPU/memory settings (Kubernetes quantities) as Docker's HostConfig values."""

from __future__ import annotations

import pytest

from fleet.control.actuators.settings import (
    ControlSettings,
    cpu_millis,
    load_control_settings,
    memory_bytes,
)
from fleet.platform.config import ConfigError


@pytest.mark.parametrize(
    ("value", "expected"),
    [("2Gi", 2 * 2**30), ("512Mi", 512 * 2**20), ("1G", 10**9), ("1048576", 2**20),
     ("1.5Gi", 3 * 2**29), ("64k", 64_000)],
)  # fmt: skip
def test_memory_quantities(value, expected):
    assert memory_bytes("X", value) == expected


@pytest.mark.parametrize(
    ("value", "expected"), [("2", 2000), ("250m", 250), ("0.5", 500), ("1.25", 1250)]
)
def test_cpu_quantities(value, expected):
    assert cpu_millis("X", value) == expected


@pytest.mark.parametrize("value", ["", "2GB", "lots", "-1Gi", "0", "100m"])
def test_a_malformed_memory_quantity_names_the_variable(value):
    with pytest.raises(ConfigError, match="CLOACINA_AGENT_MEMORY_LIMIT"):
        memory_bytes("CLOACINA_AGENT_MEMORY_LIMIT", value)


@pytest.mark.parametrize("value", ["", "2Gi", "two", "0", "0.1m"])
def test_a_malformed_cpu_quantity_names_the_variable(value):
    with pytest.raises(ConfigError, match="CLOACINA_AGENT_CPU_LIMIT"):
        cpu_millis("CLOACINA_AGENT_CPU_LIMIT", value)


def test_the_settings_become_limits_a_reservation_and_shares():
    settings = ControlSettings(
        agent_cpu_limit="1.5", agent_cpu_request="250m",
        agent_memory_limit="768Mi", agent_memory_request="256Mi",
    )  # fmt: skip
    assert settings.container_resources() == {
        "nano_cpus": 1_500_000_000,
        "cpu_shares": 256,  # 0.25 CPU of 1024 shares per CPU, as the kubelet maps a request
        "mem_limit": 768 * 2**20,
        "mem_reservation": 256 * 2**20,
    }


def test_a_tiny_cpu_request_keeps_the_minimum_shares():
    assert ControlSettings(agent_cpu_request="1m").container_resources()["cpu_shares"] == 2


def test_a_malformed_quantity_is_a_boot_error(tmp_path):
    env = {"CLOACINA_HOME": str(tmp_path), "CLOACINA_AGENT_MEMORY_LIMIT": "2 gigs"}
    with pytest.raises(ConfigError, match="CLOACINA_AGENT_MEMORY_LIMIT.*'2 gigs'"):
        load_control_settings(env)
