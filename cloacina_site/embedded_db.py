"""The embedded PostgreSQL (pgserver) used when DATABASE_URL is unset.

The data directory lives under ``$CLOACINA_HOME/pgdata``.  Several processes
may share it; pgserver keeps a list of handles and stops the server when the
last one exits.  The URL is exported as ``DATABASE_URL`` so every child
process (the worker pool, agents spawned by the process actuator) talks to the
same server.
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlparse

_server = None


def start_embedded(home: Path) -> str:
    """Start (or attach to) the embedded server under ``home`` and return its URL."""
    global _server
    home.mkdir(parents=True, exist_ok=True)
    # Before importing pgserver: platformdirs reads it at import time.
    os.environ.setdefault("XDG_RUNTIME_DIR", _private_runtime_dir(home))
    import pgserver

    _server = pgserver.get_server(home / "pgdata", cleanup_mode="stop")
    return _server.get_uri()


def _private_runtime_dir(home: Path) -> str:
    path = home / "run"
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path, 0o700)
    return str(path)


def ensure_database_url() -> str:
    """Return DATABASE_URL, starting the embedded server first when it is unset."""
    url = os.environ.get("DATABASE_URL")
    if url:
        return url
    home = Path(os.environ.get("CLOACINA_HOME") or "~/.cloacina").expanduser()
    url = start_embedded(home)
    os.environ["DATABASE_URL"] = url
    return url


def database_settings(url: str, pool: dict | None = None) -> dict:
    """Translate a ``postgresql://`` URL into Django's DATABASES entry; ``pool``: the
    connection pool's options (:mod:`cloacina_site.db_pool`), None for none."""
    parsed = urlparse(url)
    if parsed.scheme not in ("postgres", "postgresql"):
        raise ValueError(f"DATABASE_URL must be a postgresql:// URL, got scheme {parsed.scheme!r}")
    query = {k: v[-1] for k, v in parse_qs(parsed.query).items()}
    host = query.pop("host", None) or parsed.hostname or ""
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": unquote(parsed.path.lstrip("/")) or "postgres",
        "USER": unquote(parsed.username or ""),
        "PASSWORD": unquote(parsed.password or ""),
        "HOST": host,
        "PORT": str(parsed.port or ""),
        "OPTIONS": {**query, "pool": pool} if pool else query,
        "CONN_MAX_AGE": 0,  # a pool requires 0; "closing" gives the connection back
        "CONN_HEALTH_CHECKS": bool(pool),  # a pooled connection is checked before each use
        "TEST": {"NAME": "test_cloacina"},
    }


def url_for_database(url: str, name: str) -> str:
    """The same server's URL, pointing at database ``name``."""
    parsed = urlparse(url)
    return parsed._replace(path="/" + name).geturl()
