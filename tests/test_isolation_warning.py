"""Where tasks cannot be isolated (serve not root) and tenants share the server, serve says
so at boot in one line and the console shows it to platform admins."""

from __future__ import annotations

import os
import stat

import pytest

from cloacina_site import isolation
from cloacina_site.management.commands.serve import warn_if_not_isolated
from fleet.models import Tenant
from tests.console_fixtures import *  # noqa: F403

NOT_ROOT = 1000


def test_the_warning_needs_both_not_root_and_two_tenants():
    assert isolation.isolation_warning(2, euid=0) is None
    assert isolation.isolation_warning(1, euid=NOT_ROOT) is None
    warning = isolation.isolation_warning(2, euid=NOT_ROOT)
    assert "\n" not in warning
    assert "not running as root" in warning and "uid 1000" in warning and "2 tenants" in warning


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


def test_secure_home_closes_home_but_the_package_caches(tmp_path):
    home = tmp_path / "home"
    for name in ("packages", "agent-cache", "agents", "run"):
        (home / name).mkdir(parents=True, mode=0o755)
    (home / "config.toml").write_text("secret_key = 'x'\n")
    os.chmod(home / "config.toml", 0o644)

    isolation.secure_home(home, euid=0)

    def mode(name: str = "") -> int:
        return stat.S_IMODE((home / name).stat().st_mode)

    assert mode() == 0o711  # passable (to the caches, the data directory), not listable
    assert (mode("packages"), mode("agent-cache")) == (0o755, 0o755)
    assert (mode("agents"), mode("run"), mode("config.toml")) == (0o750, 0o750, 0o640)
    isolation.secure_home(home, euid=NOT_ROOT)
    assert mode() == 0o700
