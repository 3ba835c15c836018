"""The embedded PostgreSQL (pgserver) used when DATABASE_URL is unset.

The data directory lives under ``$CLOACINA_HOME/pgdata``.  Several processes
may share it; pgserver keeps a list of handles and stops the server when the
last one exits.  The URL is exported as ``DATABASE_URL`` so every server
process this one starts talks to the same server (task children never see it:
:mod:`agents.sandbox.task_isolation`).

pgserver initialises a data directory with *trust* authentication: anything
that can reach the socket is the superuser.  Tenant code runs on this machine,
so the server is switched to password (SCRAM) authentication before first use,
with a generated password kept 0600 in ``$CLOACINA_HOME/pg_password``.  A data
directory created by an older Cloacina (still trusting) is migrated in place at
boot: the superuser gets the password, pg_hba.conf is rewritten, the server
reloads.  The socket directory is 0700, owned by the database's own user.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import parse_qs, parse_qsl, quote, unquote, urlencode, urlparse

_server = None

PASSWORD_FILE = "pg_password"
SUPERUSER = "postgres"
# The only access rules: every connection, socket or loopback, proves the password.
HBA = """\
# Written by Cloacina (fleet/platform/embedded_db.py): password (SCRAM) authentication only.
local   all   all                  scram-sha-256
host    all   all   127.0.0.1/32   scram-sha-256
host    all   all   ::1/128        scram-sha-256
"""
# How long the server may take to apply the new pg_hba.conf after pg_reload_conf().
RELOAD_TIMEOUT_S = 10.0


class EmbeddedDatabaseError(RuntimeError):
    """The embedded server cannot be used safely (the message says why and what to do)."""


def start_embedded(home: Path) -> str:
    """Start (or attach to) the embedded server under ``home`` and return its URL
    (password included)."""
    global _server
    home.mkdir(parents=True, exist_ok=True)
    # Before importing pgserver: platformdirs reads it at import time.
    os.environ.setdefault("XDG_RUNTIME_DIR", _private_runtime_dir(home))
    import pgserver

    password = _password(home)
    with _boot_lock(home):  # processes booting together migrate the data directory once
        _server = pgserver.get_server(home / "pgdata", cleanup_mode="stop")
        info = _server.get_postmaster_info()
        _private_socket_dir(Path(_server.pgdata), info.socket_dir)
        _require_password(Path(_server.pgdata), _server.get_uri(), password)
    return with_password(_server.get_uri(), password)


def with_password(url: str, password: str) -> str:
    """``url`` with ``password`` as its password (the user part is kept)."""
    parsed = urlparse(url)
    user = parsed.username or SUPERUSER
    host = parsed.netloc.rpartition("@")[2]
    return parsed._replace(netloc=f"{user}:{quote(password, safe='')}@{host}").geturl()


def _password(home: Path) -> str:
    """The superuser's password, generated once and kept readable by this user only."""
    path = home / PASSWORD_FILE
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        os.chmod(path, 0o600)
        password = path.read_text().strip()
        if not password:
            raise EmbeddedDatabaseError(f"{path} is empty: restore the database password") from None
        return password
    password = secrets.token_urlsafe(32)
    with os.fdopen(fd, "w") as fh:
        fh.write(password)
    return password


@contextlib.contextmanager
def _boot_lock(home: Path) -> Iterator[None]:
    fd = os.open(
        Path(_private_runtime_dir(home)) / "embedded-db.lock", os.O_RDWR | os.O_CREAT, 0o600
    )
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _private_runtime_dir(home: Path) -> str:
    path = home / "run"
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path, 0o700)
    return str(path)


def _private_socket_dir(pgdata: Path, socket_dir: Path | None) -> None:
    """Only the database's own user (and root) may enter the socket directory.

    pgserver uses the data directory when its path is short enough (already 0700), else a
    directory under the runtime path, which it makes 0777 when running as root."""
    if socket_dir is None:
        return
    owner = pgdata.stat()
    if os.geteuid() == 0 and socket_dir != pgdata:
        os.chown(socket_dir, owner.st_uid, owner.st_gid)  # the postmaster still unlinks there
    os.chmod(socket_dir, 0o700)


def hba_rules(hba_text: str) -> list[list[str]]:
    """The lines of a pg_hba.conf that say something: its comments may name an older path of
    this module (a data directory keeps the file it was first given)."""
    return [
        line.split()
        for line in hba_text.splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]


def _require_password(pgdata: Path, trust_url: str, password: str) -> None:
    """Make the server ask for ``password``: migrate a still-trusting data directory."""
    hba = pgdata / "pg_hba.conf"
    if hba_rules(hba.read_text()) == hba_rules(HBA):
        _check_password(with_password(trust_url, password), pgdata)
        return
    import psycopg
    from psycopg import sql

    # Still trusting: set the password over the socket first, then stop trusting.
    with psycopg.connect(trust_url, autocommit=True) as conn:
        conn.execute("SET password_encryption = 'scram-sha-256'")
        conn.execute(
            sql.SQL("ALTER ROLE {} PASSWORD {}").format(
                sql.Identifier(SUPERUSER), sql.Literal(password)
            )
        )
        _replace_keeping_owner(hba, HBA)
        conn.execute("SELECT pg_reload_conf()")
    _wait_until_password_required(trust_url)


def _check_password(url: str, pgdata: Path) -> None:
    """Fail with what to do, not a bare "authentication failed", when the password file
    does not match the server's (lost, or copied from another home)."""
    import psycopg

    try:
        psycopg.connect(url, passfile="/dev/null", connect_timeout=10).close()
    except psycopg.OperationalError as exc:
        if "password authentication failed" not in str(exc):
            raise
        raise EmbeddedDatabaseError(
            f"the embedded PostgreSQL in {pgdata} refuses the password in "
            f"{pgdata.parent / PASSWORD_FILE}: restore that file (it was generated with the "
            "data directory), or start over with an empty CLOACINA_HOME"
        ) from None


def _replace_keeping_owner(path: Path, text: str) -> None:
    """Write ``path`` atomically with its old owner and mode (the postmaster must read it)."""
    old = path.stat()
    tmp = path.with_name(f".{path.name}.cloacina-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    if os.geteuid() == 0:
        os.chown(tmp, old.st_uid, old.st_gid)
    os.chmod(tmp, old.st_mode & 0o777)
    os.replace(tmp, path)


def _wait_until_password_required(trust_url: str) -> None:
    """The reload is asynchronous: return once a password-less connection is refused."""
    import psycopg

    deadline = time.monotonic() + RELOAD_TIMEOUT_S
    while True:
        try:
            # passfile=/dev/null: a ~/.pgpass must not supply the password behind our back.
            psycopg.connect(trust_url, passfile="/dev/null", connect_timeout=5).close()
        except psycopg.OperationalError:
            return
        if time.monotonic() > deadline:
            raise EmbeddedDatabaseError(
                "the embedded PostgreSQL still accepts connections without a password after "
                f"pg_hba.conf was rewritten (waited {RELOAD_TIMEOUT_S:g}s)"
            )
        time.sleep(0.05)


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
    connection pool's options (:mod:`fleet.platform.db_pool`), None for none."""
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


# libpq also takes secrets as URI query parameters; they are hidden like the password.
SECRET_QUERY_KEYS = frozenset({"password", "sslpassword"})
REDACTED = "***"


def redacted_url(url: str) -> str:
    """``url`` fit to print or log: its password (userinfo or ``?password=``) replaced by
    ``***``; the user, host, port, database and other parameters are kept.  A string that is
    not a URL comes back whole only if it has no ``@`` (it could be a mistyped one)."""
    try:
        parsed = urlparse(url)
        parsed.port  # noqa: B018 -- a malformed port raises here, not later while printing
    except ValueError:
        return REDACTED
    if not parsed.scheme or not url.startswith(f"{parsed.scheme}://"):
        return url if "@" not in url else REDACTED
    netloc = parsed.netloc
    if parsed.password is not None:
        userinfo, _, hostport = netloc.rpartition("@")
        netloc = f"{userinfo.partition(':')[0]}:{REDACTED}@{hostport}"
    query = [
        (key, REDACTED if key.lower() in SECRET_QUERY_KEYS else value)
        for key, value in parse_qsl(parsed.query, keep_blank_values=True)
    ]
    shown = f"{parsed.scheme}://{netloc}{parsed.path}"  # geturl() would drop an empty host's //
    return f"{shown}?{urlencode(query, safe='/*')}" if query else shown


def url_for_database(url: str, name: str) -> str:
    """The same server's URL, pointing at database ``name``."""
    parsed = urlparse(url)
    return parsed._replace(path="/" + name).geturl()
