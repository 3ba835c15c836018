"""Fixtures every layer needs (tests/unit, tests/integration, tests/e2e).

The tests are layered like the code: tests/unit (no database, sockets or subprocesses),
tests/integration (the database, in-process ASGI, fakes at the HTTP boundary) and
tests/e2e (real `serve` and `runagent` processes, chaos, browsers); each layer's
conftest.py holds its own fixtures, and tests/support/ the helpers they share.

Tests that touch the database run on the embedded PostgreSQL (pgserver) under a private
CLOACINA_HOME unless DATABASE_URL is given (see cloacina_site/test_settings.py).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# The shared helpers assert too (e.g. tests/support/task_isolation.py): rewrite their asserts so
# a failure shows the compared values, as in a test module.
pytest.register_assert_rewrite("tests.support")


@pytest.fixture
def tmp_path(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """pytest's tmp_path, opened to the task user when running as root: task code then runs
    as the unprivileged task user (agents/sandbox/task_isolation.py), and tests hand it
    paths under tmp_path to write markers in, which pytest's own directories (0700, under
    /tmp/pytest-of-root) would refuse.  The folder stays where pytest keeps it, so the logs
    of a failed end-to-end run are still there to read."""
    if os.geteuid() == 0:
        root = tmp_path_factory.getbasetemp().parent
        if os.environ.get("PYTEST_XDIST_WORKER"):
            root = root.parent  # a worker's basetemp is <run's basetemp>/popen-gwN
        for folder in [*reversed(tmp_path.parents), tmp_path]:
            if folder == root or root in folder.parents:
                mode = 0o777 if folder == tmp_path else 0o711  # passable, not listable
                os.chmod(folder, folder.stat().st_mode | mode)
    return tmp_path
