"""The tenant/key/console-user CLI: idempotency, stdout hygiene, one-line errors.

Here: the end-to-end tests (real processes); the rest are in tests/integration/test_cli.py.
"""

from __future__ import annotations

import pytest

from fleet.models import ApiKey, Tenant
from tests.support.processes import Processes


@pytest.fixture
def procs(transactional_db, tmp_path):
    with Processes(tmp_path) as procs:
        yield procs


def test_the_real_cli_keeps_stdout_clean_and_errors_on_one_line(procs):
    first = procs.manage("createtenant", "acme")
    assert first.returncode == 0 and first.stdout.startswith("created tenant acme")
    again = procs.manage("createtenant", "acme")
    assert (again.returncode, again.stdout) == (0, "tenant acme already exists\n")
    assert Tenant.objects.filter(name="acme").count() == 1

    minted = procs.manage("mintkey", "--tenant", "acme", "--role", "write")
    assert minted.returncode == 0
    assert ApiKey.verify(minted.stdout.strip()).role == "write"
    assert minted.stdout.count("\n") == 1

    bad = procs.manage("mintkey", "--tenant", "nope", "--role", "read")
    assert bad.returncode != 0 and bad.stdout == ""
    assert bad.stderr.strip().count("\n") == 0 and "unknown tenant 'nope'" in bad.stderr
