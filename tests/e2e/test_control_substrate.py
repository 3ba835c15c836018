"""Substrate guards: every misconfigured actuator is a loud boot error naming the problem.

Here: the end-to-end tests (real processes); the rest are in tests/unit/test_control_substrate.py, tests/integration/test_control_substrate.py.
"""

from __future__ import annotations

import pytest

from tests.support.substrate import SERVER_URL


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("actuator", "env", "words"),
    [
        (
            "docker",
            {**SERVER_URL, "KUBERNETES_SERVICE_HOST": "10.0.0.1"},
            "docker refused: this server runs inside Kubernetes",
        ),
        (
            "docker",
            {**SERVER_URL, "DOCKER_HOST": "tcp://127.0.0.1:1"},
            "docker refused: no Docker daemon reachable",
        ),
        (
            "kubernetes",
            SERVER_URL,
            "kubernetes refused: this server is not running in a Kubernetes cluster",
        ),
    ],
)
def test_serve_exits_2_with_one_clear_line(transactional_db, tmp_path, actuator, env, words):
    from tests.support.processes import Processes

    with Processes(tmp_path) as procs:
        result = procs.manage(
            "serve", "--port", "0", "--actuator", actuator, env=procs.env(**env), timeout=30
        )
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert words in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert result.stdout == ""
