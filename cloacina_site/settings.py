"""Django settings for the Cloacina server.

Every knob comes from :mod:`fleet.platform.config` (flag > env > config.toml >
default).  With DATABASE_URL unset the embedded PostgreSQL is started, except
in DB-less processes (``runagent``), which get a database entry that points
nowhere and a guard that refuses any connection.
"""

import os
import secrets
from datetime import timedelta
from pathlib import Path

from cloacina_site import web_security
from fleet.platform import db_pool, embedded_db, isolation
from fleet.platform.config import get_config

BASE_DIR = Path(__file__).resolve().parent.parent
CONFIG = get_config()
DB_LESS = os.environ.get("CLOACINA_DB_LESS") == "1"


def _secret_key() -> str:
    if CONFIG.secret_key:
        return CONFIG.secret_key
    # Persist a generated key under CLOACINA_HOME so sessions survive restarts
    # and every server process on this machine signs cookies the same way.
    path = CONFIG.home / "secret_key"
    if DB_LESS:
        return "db-less-agent-process"
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        CONFIG.home.mkdir(parents=True, exist_ok=True)
        key = secrets.token_urlsafe(50)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(key)
        return key
    except FileExistsError:  # pragma: no cover - lost a race with another process
        return path.read_text().strip()


SECRET_KEY = _secret_key()
DEBUG = CONFIG.debug
ALLOWED_HOSTS = web_security.allowed_hosts(CONFIG)

INSTALLED_APPS = [
    "daphne",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "channels",
    "ninja",  # its bundled Swagger UI (static/ninja/), not a CDN's
    "axes",  # console and admin login lockout
    "cloacina_site",  # for its management commands (serve)
    "fleet",
    "agents",
    "artifacts",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "cloacina_site.request_guards.RejectNulInUrl",  # before anything queries the database
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "cloacina_site.web_security.ContentSecurityPolicy",
    # Last, as django-axes asks: it turns a locked-out login into the lockout page.
    "axes.middleware.AxesMiddleware",
]

# -- login lockout (django-axes): per username and, separately, per address ----------
AUTHENTICATION_BACKENDS = [
    "axes.backends.AxesStandaloneBackend",  # first: refuses a locked-out login outright
    "django.contrib.auth.backends.ModelBackend",
]
AXES_FAILURE_LIMIT = CONFIG.login_failure_limit
AXES_COOLOFF_TIME = timedelta(seconds=CONFIG.login_lockout_s)
AXES_LOCKOUT_PARAMETERS = ["username", "ip_address"]
AXES_CLIENT_IP_CALLABLE = "cloacina_site.web_security.connection_address"
AXES_LOCKOUT_TEMPLATE = "console/locked_out.html"
AXES_RESET_ON_SUCCESS = True
AXES_VERBOSE = False

# -- cookies and HSTS: Secure / sent only when TLS is on (serve re-applies for --tls-cert)
_TLS = web_security.tls_settings(bool(CONFIG.tls_cert), CONFIG.hsts_seconds)
SESSION_COOKIE_SECURE = _TLS["SESSION_COOKIE_SECURE"]
CSRF_COOKIE_SECURE = _TLS["CSRF_COOKIE_SECURE"]
SECURE_HSTS_SECONDS = _TLS["SECURE_HSTS_SECONDS"]

ROOT_URLCONF = "cloacina_site.urls"
ASGI_APPLICATION = "cloacina_site.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

if DB_LESS:
    # An agent never opens a connection; this entry exists only so Django boots.
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": "db-less-agent",
            "HOST": "/nonexistent",
        }
    }
else:
    DATABASES = {
        "default": embedded_db.database_settings(
            embedded_db.ensure_database_url(),
            pool=db_pool.pool_options(
                db_pool.pool_size(CONFIG.db_pool_max, CONFIG.worker_processes)
            ),
        )
    }
    # After the embedded server's start: pgserver opens the path to its data directory.
    isolation.secure_home(CONFIG.home)

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True

STATIC_URL = "static/"
STATICFILES_DIRS = [BASE_DIR / "static"]
STATIC_ROOT = CONFIG.home / "static"

LOGIN_URL = "/console/login/"
LOGIN_REDIRECT_URL = "/console/"

# Uploads: the package validator enforces its own limit; keep Django's in step.
DATA_UPLOAD_MAX_MEMORY_SIZE = CONFIG.max_context_bytes + 1024 * 1024
FILE_UPLOAD_MAX_MEMORY_SIZE = 5 * 1024 * 1024

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": os.environ.get("CLOACINA_LOG_LEVEL", "INFO")},
    "loggers": {
        "django.db.backends": {"level": "WARNING"},
        "daphne": {"level": "WARNING"},
        "apscheduler": {"level": "WARNING"},
        "pgserver": {"level": "WARNING"},
    },
}
