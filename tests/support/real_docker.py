"""A real Docker engine for the `docker`-marked end-to-end tests.

:func:`agent_image` builds the project image with scripts/build-agent-image (a local
debootstrap base; cached, so a second run takes about a second) or skips the test with a
reason naming what is missing — no docker CLI, no reachable daemon, no BuildKit, no
debootstrap — never silently.  The fake Engine API (tests/support/fakes/docker_engine.py)
keeps covering the actuator's logic where no engine can run.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import docker
import pytest

REPO = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO / "scripts" / "build-agent-image"
IMAGE_TAG = "cloacina:e2e-docker"  # .ci/run builds the same tag ahead, in the background
MISSING = 3  # build-agent-image's exit status when something it needs is absent
BUILD_TIMEOUT_S = 900  # the first build bootstraps Debian and installs requirements.txt
PING_TIMEOUT_S = 5


def engine_missing() -> str | None:
    """Why no Docker engine can be used here, or None when one answers."""
    if shutil.which("docker") is None and not os.access("/usr/bin/docker", os.X_OK):
        return "no docker CLI installed (Debian: apt-get install docker.io; .ci/run installs it)"
    where = os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"
    try:
        client = docker.from_env(timeout=PING_TIMEOUT_S)
        try:
            client.ping()
        finally:
            client.close()
    except Exception as exc:  # the SDK raises DockerException, requests errors, OSError …
        return (
            f"no Docker engine reachable at {where} ({type(exc).__name__}); "
            "start dockerd (.ci/run starts it)"
        )
    return None


def agent_image() -> str:
    """The project image's tag, built (or found in the build cache) now; skips when it
    cannot be built here for a missing tool, fails on a real build error."""
    reason = engine_missing()
    if reason:
        pytest.skip(f"docker tests need a Docker engine: {reason}")
    result = subprocess.run(
        [str(BUILD_SCRIPT), IMAGE_TAG],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
    )
    if result.returncode == MISSING:
        pytest.skip(f"docker tests need the agent image: {result.stderr.strip()}")
    assert result.returncode == 0, f"scripts/build-agent-image failed:\n{result.stderr}"
    return result.stdout.strip().splitlines()[-1]


def remove_containers(client: docker.DockerClient, tenant_label: str) -> None:
    """Force-remove every managed container of one tenant label (a test's own cleanup)."""
    filters = {"label": ["cloacina.managed=true", f"cloacina.tenant={tenant_label}"]}
    for container in client.containers.list(all=True, filters=filters):
        container.remove(force=True)
