"""The browser-facing layer: API docs served from this server, a Content-Security-Policy on
HTML pages, ALLOWED_HOSTS from the configuration, Secure cookies and HSTS over TLS,
console/admin login lockout (django-axes), and /metrics behind a bearer token.

Here: the unit tests (no database, socket or process); the rest are in tests/integration/test_web_security.py, tests/e2e/test_web_security.py.
"""

from __future__ import annotations

import pytest

from cloacina_site.web_security import allowed_hosts
from fleet.platform.config import ConfigError, load_config


def test_allowed_hosts_come_from_the_configuration_with_loopback_kept(tmp_path):
    home = {"CLOACINA_HOME": str(tmp_path)}
    assert allowed_hosts(load_config(home)) == ["*"]  # default: today's behaviour
    config = load_config({**home, "CLOACINA_ALLOWED_HOSTS": "cloacina.example.com, .corp"})
    assert allowed_hosts(config) == [
        "cloacina.example.com",
        ".corp",
        "localhost",
        "127.0.0.1",
        "[::1]",
    ]


@pytest.mark.parametrize(
    "value", ["https://cloacina.example.com", "cloacina.example.com:8000", " , ", "a b", "x/y"]
)
def test_a_malformed_allowed_hosts_names_the_variable(tmp_path, value):
    with pytest.raises(ConfigError, match="CLOACINA_ALLOWED_HOSTS"):
        load_config({"CLOACINA_HOME": str(tmp_path), "CLOACINA_ALLOWED_HOSTS": value})


@pytest.mark.parametrize(
    "env,message",
    [
        ({"CLOACINA_LOGIN_FAILURE_LIMIT": "0"}, "CLOACINA_LOGIN_FAILURE_LIMIT must be >= 1"),
        ({"CLOACINA_LOGIN_LOCKOUT_S": "soon"}, "CLOACINA_LOGIN_LOCKOUT_S must be an integer"),
        ({"CLOACINA_HSTS_SECONDS": "-1"}, "CLOACINA_HSTS_SECONDS must be >= 0"),
    ],
)
def test_the_other_new_settings_reject_bad_values_by_name(tmp_path, env, message):
    with pytest.raises(ConfigError, match=message):
        load_config({"CLOACINA_HOME": str(tmp_path), **env})
