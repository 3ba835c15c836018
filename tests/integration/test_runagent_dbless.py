"""The agent is DB-less: its runtime imports no model (no Django at all), `runagent` refuses
any database connection, and a real agent with an unreachable DATABASE_URL still registers
and runs work against a live server.

Here: the integration tests (database, in-process ASGI, fakes); the rest are in tests/e2e/test_runagent_dbless.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.support.processes import (
    MANAGE,
    REPO,
)

NOWHERE_DB = "postgresql://nowhere.invalid/x"

# Anything that would mean a model, the ORM or a database driver came along.
FORBIDDEN_PREFIXES = ("django", "psycopg", "fleet", "artifacts", "cloacina_site", "agents.models")


def _clean_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("DJANGO_SETTINGS_MODULE",)}
    env.update(extra)
    return env


def test_the_runtime_imports_no_model_and_no_database_driver():
    script = (
        "import json, sys\n"
        "import agents.runtime.agent, agents.sandbox.task_runner, agents.sandbox.package_cache\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env=_clean_env(), capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    modules = json.loads(done.stdout)
    assert "agents.runtime.agent" in modules  # the import did happen
    leaked = [m for m in modules if m.startswith(FORBIDDEN_PREFIXES)]
    assert leaked == []


def test_the_runagent_guard_refuses_any_database_connection():
    # The command's settings (CLOACINA_DB_LESS=1) plus its guard: the ORM and a raw cursor fail.
    script = (
        "import django\n"
        "django.setup()\n"
        "from agents.management.commands.runagent import install_db_guard\n"
        "install_db_guard()\n"
        "from django.db import connection\n"
        "from fleet.models import Tenant\n"
        "for attempt in (lambda: Tenant.objects.count(), lambda: connection.cursor()):\n"
        "    try:\n"
        "        attempt()\n"
        "        print('CONNECTED')\n"
        "    except RuntimeError as exc:\n"
        "        print('refused:', exc)\n"
    )
    env = _clean_env(
        DJANGO_SETTINGS_MODULE="cloacina_site.settings",
        CLOACINA_DB_LESS="1",
        DATABASE_URL=NOWHERE_DB,
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines == ["refused: the agent is DB-less: it must never open a database connection"] * 2


def test_manage_py_runs_runagent_db_less():
    # manage.py itself flags the command: its settings then never start or reach a database.
    script = (
        "import os, sys\n"
        f"sys.argv = [{MANAGE!r}, 'runagent', '--help']\n"
        "import runpy\n"
        "try:\n"
        f"    runpy.run_path({MANAGE!r}, run_name='__main__')\n"
        "except SystemExit:\n"
        "    pass\n"
        "from django.conf import settings\n"
        "print('DB_LESS', os.environ.get('CLOACINA_DB_LESS'), settings.DATABASES['default']['HOST'])\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO,
        env=_clean_env(DATABASE_URL=NOWHERE_DB),
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert "--api-key" in done.stdout  # the help text: the command loaded
    assert done.stdout.strip().splitlines()[-1] == "DB_LESS 1 /nonexistent"
