"""The browser-facing layer: API docs served from this server, a Content-Security-Policy on
HTML pages, ALLOWED_HOSTS from the configuration, Secure cookies and HSTS over TLS,
console/admin login lockout (django-axes), and /metrics behind a bearer token.
"""

from __future__ import annotations

import re
import ssl
from dataclasses import replace

import httpx
import pytest
from django.test import Client

from cloacina_site.config import ConfigError, get_config, load_config
from cloacina_site.web_security import CONTENT_SECURITY_POLICY, allowed_hosts
from tests.console_fixtures import *  # noqa: F403
from tests.console_fixtures import PASSWORD, with_password
from tests.e2e_support import Processes, ServeHandle
from tests.tls_support import TestCA

TLS_READY_LINE = re.compile(r"Cloacina server ready: console at (https://\S+?)/console/")


# -- API docs: Swagger UI from this server, not a CDN ------------------------------------


@pytest.mark.django_db
def test_the_api_docs_load_swagger_ui_from_this_server():
    client = Client()
    page = client.get("/api/v1/docs")
    assert page.status_code == 200
    html = page.content.decode()
    scripts = re.findall(r'<(?:script|link)[^>]+(?:src|href)="([^"]+)"', html)
    assert "/static/ninja/swagger-ui-bundle.js" in scripts
    assert "/static/ninja/swagger-ui.css" in scripts
    assert not [url for url in scripts if "//" in url], scripts  # nothing off this server
    for url in scripts:
        assert client.get(url).status_code == 200, url


# -- Content-Security-Policy -------------------------------------------------------------


@pytest.mark.django_db
@pytest.mark.parametrize("path", ["/console/login/", "/admin/login/", "/api/v1/docs"])
def test_html_pages_carry_the_content_security_policy(path):
    response = Client().get(path)
    assert response.status_code == 200
    assert response["Content-Security-Policy"] == CONTENT_SECURITY_POLICY
    assert "script-src 'self'" in CONTENT_SECURITY_POLICY
    assert "unsafe-inline" not in CONTENT_SECURITY_POLICY


@pytest.mark.django_db
def test_the_console_pages_need_no_inline_script_or_style(admin_client):
    html = admin_client.get("/console/").content.decode()
    assert not re.search(r"<script(?![^>]*\bsrc=)[^>]*>", html), "inline <script>"
    assert "<style" not in html and " style=" not in html
    assert '"includeIndicatorStyles": false' in html  # htmx would inject a <style>


# -- ALLOWED_HOSTS -----------------------------------------------------------------------


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


@pytest.mark.django_db
def test_a_host_not_allowed_is_a_400_json_naming_the_setting(settings):
    settings.ALLOWED_HOSTS = ["cloacina.example.com", "localhost"]
    response = Client().get("/healthz", HTTP_HOST="evil.example.net")
    assert response.status_code == 400
    assert response.json() == {
        "detail": "this server does not answer to host 'evil.example.net' "
        "(see CLOACINA_ALLOWED_HOSTS)"
    }
    assert Client().get("/healthz", HTTP_HOST="cloacina.example.com").status_code == 200


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


# -- login lockout (django-axes) ---------------------------------------------------------


def _login(path: str, username: str, password: str, address: str):
    return Client(REMOTE_ADDR=address).post(path, {"username": username, "password": password})


def _locked(response) -> bool:
    return response.status_code == 429 and "Too many failed logins" in response.content.decode()


@pytest.mark.django_db
def test_console_logins_lock_out_per_username_and_per_address(reader_user, writer_user):
    limit = get_config().login_failure_limit
    reader, writer = with_password(reader_user).username, with_password(writer_user).username
    for attempt in range(1, limit + 1):
        response = _login("/console/login/", reader, "wrong", "10.0.0.1")
        assert _locked(response) == (attempt == limit), (attempt, response.status_code)
    # The lock names the user, the time, and how to lift it.
    page = response.content.decode()
    assert reader in page and "0:15:00" in page and "axes_reset_username" in page
    assert response["Content-Security-Policy"] == CONTENT_SECURITY_POLICY
    # Per username: the right password, even from another address, is refused meanwhile.
    assert _locked(_login("/console/login/", reader, PASSWORD, "10.0.0.2"))
    # Per address: another user from the locked address is refused too…
    assert _locked(_login("/console/login/", writer, PASSWORD, "10.0.0.1"))
    # …and the admin login shares the count.
    assert _locked(_login("/admin/login/", writer, PASSWORD, "10.0.0.1"))
    # Elsewhere, everyone else logs in as usual.
    ok = _login("/console/login/", writer, PASSWORD, "10.0.0.3")
    assert ok.status_code == 302 and ok["Location"] == "/console/"


@pytest.mark.django_db
def test_a_forwarded_for_header_does_not_escape_an_address_lock(reader_user, writer_user):
    limit = get_config().login_failure_limit
    reader, writer = with_password(reader_user).username, with_password(writer_user).username
    for n in range(limit):
        client = Client(REMOTE_ADDR="10.0.0.9", HTTP_X_FORWARDED_FOR=f"192.0.2.{n}")
        client.post("/console/login/", {"username": reader, "password": "wrong"})
    spoofing = Client(REMOTE_ADDR="10.0.0.9", HTTP_X_FORWARDED_FOR="192.0.2.200")
    response = spoofing.post("/console/login/", {"username": writer, "password": PASSWORD})
    assert _locked(response)


# -- /metrics bearer token ---------------------------------------------------------------


@pytest.mark.django_db
def test_metrics_require_the_bearer_token_once_one_is_configured(monkeypatch):
    from fleet import metrics

    client = Client()
    assert client.get("/metrics").status_code == 200  # no token configured: open, as before
    configured = replace(get_config(), metrics_token="scrape-s3cret")
    monkeypatch.setattr(metrics, "get_config", lambda: configured)
    for headers in ({}, {"HTTP_AUTHORIZATION": "Bearer wrong"}, {"HTTP_AUTHORIZATION": "s3"}):
        refused = client.get("/metrics", **headers)
        assert refused.status_code == 401
        assert "CLOACINA_METRICS_TOKEN" in refused.json()["detail"]
        assert refused["WWW-Authenticate"].startswith("Bearer")
    scraped = client.get("/metrics", HTTP_AUTHORIZATION="Bearer scrape-s3cret")
    assert scraped.status_code == 200
    assert b"cloacina_fleet_dispatch_latency_seconds" in scraped.content


# -- against a real `serve`: hosts, metrics token, and what TLS turns on -----------------


@pytest.fixture
def procs(transactional_db, tmp_path):
    with Processes(tmp_path) as procs:
        yield procs


@pytest.mark.e2e
def test_plain_serve_checks_hosts_and_the_metrics_token_and_sends_no_hsts(procs):
    server = procs.serve(
        env=procs.env(
            CLOACINA_ALLOWED_HOSTS="cloacina.example.com", CLOACINA_METRICS_TOKEN="tok-123"
        )
    )
    port = server.url.rsplit(":", 1)[1]
    assert httpx.get(f"{server.url}/healthz", timeout=10).status_code == 200  # 127.0.0.1
    named = {"Host": f"cloacina.example.com:{port}"}
    assert httpx.get(f"{server.url}/healthz", headers=named, timeout=10).status_code == 200
    evil = {"Host": f"evil.example.net:{port}"}
    refused = httpx.get(f"{server.url}/api/v1/executions", headers=evil, timeout=10)
    assert refused.status_code == 400
    assert "evil.example.net" in refused.json()["detail"]
    assert "CLOACINA_ALLOWED_HOSTS" in refused.json()["detail"]
    assert httpx.get(f"{server.url}/metrics", timeout=10).status_code == 401
    token = {"Authorization": "Bearer tok-123"}
    assert httpx.get(f"{server.url}/metrics", headers=token, timeout=10).status_code == 200
    login = httpx.get(f"{server.url}/console/login/", timeout=10)
    assert "Strict-Transport-Security" not in login.headers
    assert "secure" not in login.headers["set-cookie"].lower()
    # The lockout through daphne and Django's async path (axes' middleware differs there).
    with httpx.Client(base_url=server.url, timeout=10) as browser:
        browser.get("/console/login/")
        form = {
            "username": "ops",
            "password": "wrong",
            "csrfmiddlewaretoken": csrf_value(browser.cookies.jar),
        }
        statuses = [browser.post("/console/login/", data=form).status_code for _ in range(5)]
        assert statuses == [200, 200, 200, 200, 429], statuses
        locked = browser.post("/console/login/", data=form)
        assert locked.status_code == 429 and "Too many failed logins" in locked.text
        assert "ops" in locked.text


@pytest.mark.e2e
def test_serve_with_tls_marks_cookies_secure_and_sends_hsts(procs, tmp_path):
    ca = TestCA(tmp_path)
    cert = ca.server()
    process = procs.start(
        ["serve", "--port", "0", "--tls-cert", str(cert.cert), "--tls-key", str(cert.key)],
        name="serve-tls",
    )
    server = ServeHandle(process, process.wait_for_output(TLS_READY_LINE, 60).group(1))
    verify = ssl.create_default_context(cafile=ca.cert_path)
    with httpx.Client(base_url=server.url, verify=verify, timeout=30) as browser:
        page = browser.get("/console/login/")
        assert page.status_code == 200
        assert page.headers["Strict-Transport-Security"] == "max-age=31536000"
        assert page.headers["Content-Security-Policy"] == CONTENT_SECURITY_POLICY
        csrf = browser.cookies.jar
        assert [c.secure for c in csrf if c.name == "csrftoken"] == [True]
        # A successful login's session cookie is Secure too.
        from django.contrib.auth import get_user_model

        get_user_model().objects.create_user("ops", None, PASSWORD)
        logged_in = browser.post(
            "/console/login/",
            data={"username": "ops", "password": PASSWORD},
            headers={"Referer": f"{server.url}/console/login/", "X-CSRFToken": csrf_value(csrf)},
        )
        assert logged_in.status_code == 302, logged_in.text[:300]
        assert [c.secure for c in browser.cookies.jar if c.name == "sessionid"] == [True]


def csrf_value(jar) -> str:
    return next(c.value for c in jar if c.name == "csrftoken")
