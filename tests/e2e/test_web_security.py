"""The browser-facing layer: API docs served from this server, a Content-Security-Policy on
HTML pages, ALLOWED_HOSTS from the configuration, Secure cookies and HSTS over TLS,
console/admin login lockout (django-axes), and /metrics behind a bearer token.

Here: the end-to-end tests (real processes); the rest are in tests/integration/test_web_security.py, tests/unit/test_web_security.py.
"""

from __future__ import annotations

import re
import ssl

import httpx
import pytest

from cloacina_site.web_security import CONTENT_SECURITY_POLICY
from tests.support.console import PASSWORD
from tests.support.processes import Processes, ServeHandle
from tests.support.tls import TestCA

TLS_READY_LINE = re.compile(r"Cloacina server ready: console at (https://\S+?)/console/")


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
