"""Where tasks cannot be isolated (serve not root) and tenants share the server, serve says
so at boot in one line and the console shows it to platform admins.

Here: the integration tests (database, in-process ASGI, fakes); the rest are in tests/unit/test_isolation_warning.py.
"""

from __future__ import annotations

import os

import pytest

from cloacina_site.management.commands.serve import warn_if_not_isolated
from fleet.models import Tenant

NOT_ROOT = 1000


@pytest.mark.django_db
def test_serve_warns_in_one_line_at_boot_when_not_root_with_two_tenants(capsys, monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: NOT_ROOT)
    Tenant.objects.create(name="acme")
    warn_if_not_isolated()
    assert capsys.readouterr().err == ""  # one tenant: nobody else's data to reach

    Tenant.objects.create(name="globex")
    warn_if_not_isolated()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("serve: WARNING: tenant isolation is impossible")


@pytest.mark.django_db
def test_serve_as_root_does_not_warn(capsys, monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    Tenant.objects.create(name="acme")
    Tenant.objects.create(name="globex")
    warn_if_not_isolated()
    assert capsys.readouterr().err == ""


@pytest.mark.django_db
def test_the_console_shows_the_banner_to_platform_admins_only(
    monkeypatch, admin_client, reader_client, other_tenant
):
    monkeypatch.setattr(os, "geteuid", lambda: NOT_ROOT)
    page = admin_client.get("/console/").content.decode()
    assert 'id="isolation-banner"' in page and "tenant isolation is impossible" in page
    assert 'id="isolation-banner"' not in reader_client.get("/console/").content.decode()
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert 'id="isolation-banner"' not in admin_client.get("/console/").content.decode()
