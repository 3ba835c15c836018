"""Where tasks cannot be isolated (serve not root) and tenants share the server, serve says
so at boot in one line and the console shows it to platform admins.

Here: the unit tests (no database, socket or process); the rest are in tests/integration/test_isolation_warning.py.
"""

from __future__ import annotations

import os
import stat

from fleet.platform import isolation

NOT_ROOT = 1000


def test_the_warning_needs_both_not_root_and_two_tenants():
    assert isolation.isolation_warning(2, euid=0) is None
    assert isolation.isolation_warning(1, euid=NOT_ROOT) is None
    warning = isolation.isolation_warning(2, euid=NOT_ROOT)
    assert "\n" not in warning
    assert "not running as root" in warning and "uid 1000" in warning and "2 tenants" in warning


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
