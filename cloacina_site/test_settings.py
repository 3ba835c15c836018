"""Settings for the test run: a private CLOACINA_HOME (own embedded PostgreSQL) unless given."""

import os
import shutil
import sys
import tempfile
from pathlib import Path

from agents.sandbox.task_isolation import ENV_TASK_PYTHON, task_user, unreachable_for

os.environ.setdefault("CLOACINA_HOME", str(Path(tempfile.gettempdir()) / "cloacina-test-home"))
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
