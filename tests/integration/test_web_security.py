"""The browser-facing layer: API docs served from this server, a Content-Security-Policy on
HTML pages, ALLOWED_HOSTS from the configuration, Secure cookies and HSTS over TLS,
console/admin login lockout (django-axes), and /metrics behind a bearer token.

Here: the integration tests (database, in-process ASGI, fakes); the rest are in tests/e2e/test_web_security.py, tests/unit/test_web_security.py.
"""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
from django.test import Client

from cloacina_site.web_security import CONTENT_SECURITY_POLICY
from fleet.platform.config import get_config
from tests.support.console import PASSWORD, with_password


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


@pytest.mark.django_db
def test_metrics_require_the_bearer_token_once_one_is_configured(monkeypatch):
    from fleet.api import metrics

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
