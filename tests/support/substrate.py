"""The substrate-guard suites (tests/*/test_control_substrate.py): the server URL every
actuator needs, and an actuator built from environment variables the way boot builds it."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

from fleet.control.actuators.base import Actuator
from fleet.control.jobs import build_actuator
from fleet.control.substrate import SubstrateProbe
from fleet.platform.config import load_config

SERVER_URL = {"CLOACINA_FLEET_SERVER_URL": "http://cloacina.example:8000"}


def build(
    tmp_path: Path,
    actuator: str,
    env: dict[str, str] | None = None,
    sa_dir: Path | None = None,
    ping: Callable[[Mapping[str, str]], str] | None = None,
) -> Actuator:
    """The ``actuator`` boot would build from ``env``, probing a service-account folder that
    does not exist unless ``sa_dir`` is given, and the real Docker ping unless ``ping`` is."""
    env = {"CLOACINA_HOME": str(tmp_path), **(env or {})}
    probe_kwargs = {"environ": env, "service_account_dir": sa_dir or tmp_path / "no-such-sa"}
    if ping is not None:
        probe_kwargs["docker_ping"] = ping
    config = load_config({**env, "CLOACINA_FLEET_ACTUATOR": actuator})
    return build_actuator(config, probe=SubstrateProbe(**probe_kwargs))
