"""Settings for the test run: a private CLOACINA_HOME (own embedded PostgreSQL) unless given."""

import os
import shutil
import sys
import tempfile
from pathlib import Path

from agents.sandbox.task_isolation import ENV_TASK_PYTHON, task_user, unreachable_for

os.environ.setdefault("CLOACINA_HOME", str(Path(tempfile.gettempdir()) / "cloacina-test-home"))


# The URL of the embedded server this run's settings started (not one given by the caller).
EMBEDDED_URL_ENV = "CLOACINA_TEST_EMBEDDED_DATABASE_URL"


def _home_per_worker() -> None:
    """Under pytest-xdist (scripts/test runs the slow layers with -n), each worker gets a
    CLOACINA_HOME of its own below the given one, so its own embedded PostgreSQL, bench
    database, secret key and artifacts: parallel workers share no server, lock or file.

    The workers inherit the environment of pytest's controller, whose settings started the
    embedded server of the parent home and exported its URL: that URL is dropped, so the
    worker starts its own.  A DATABASE_URL given by the caller is kept (pytest-django then
    gives each worker its own test database on that server)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if not worker:
        return
    parent = Path(os.environ["CLOACINA_HOME"])
    os.environ["CLOACINA_HOME"] = str(parent / worker)
    if os.environ.get("DATABASE_URL") and os.environ.get(EMBEDDED_URL_ENV) == os.environ.get(
        "DATABASE_URL"
    ):
        del os.environ["DATABASE_URL"]
        if os.environ.get("XDG_RUNTIME_DIR") == str(parent / "run"):
            del os.environ["XDG_RUNTIME_DIR"]  # the embedded server sets the worker's own


_home_per_worker()
_DATABASE_GIVEN = bool(os.environ.get("DATABASE_URL"))
Path(os.environ["CLOACINA_HOME"]).mkdir(parents=True, exist_ok=True)
os.environ.setdefault("CLOACINA_SECRET_KEY", "test-secret-key-not-for-production")


def _task_python_for_root() -> None:
    """As root, task children run as the unprivileged task user, who must be able to run
    their interpreter.  A test environment's may live where it cannot (a pyenv under a 0700
    /root): then the children use the system's interpreter of the same version."""
    user = task_user()
    if user is None or ENV_TASK_PYTHON in os.environ:
        return
    if unreachable_for(user, Path(sys.executable).resolve().parent) is None:
        return
    name = f"python{sys.version_info.major}.{sys.version_info.minor}"
    system = shutil.which(name, path="/usr/local/bin:/usr/bin:/bin")
    if system and unreachable_for(user, Path(system).resolve().parent) is None:
        os.environ[ENV_TASK_PYTHON] = system


_task_python_for_root()

from cloacina_site.settings import *  # noqa: E402,F403

if not _DATABASE_GIVEN and "DATABASE_URL" in os.environ:
    os.environ[EMBEDDED_URL_ENV] = os.environ["DATABASE_URL"]
