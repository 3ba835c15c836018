"""Transport security: `serve` with TLS and mutual TLS, `runagent` verifying it.

A throw-away CA (tests/support/tls.py) signs the server's certificate (for
127.0.0.1 and localhost) and the agents' client certificates.  The end-to-end
tests run a real `serve --default-executor fleet` and real `runagent`
processes: a workflow runs over https:// and wss://, and every way of getting
the certificates wrong ends the agent with one clear line and exit code 2.

Here: the end-to-end tests (real processes); the rest are in tests/unit/test_tls.py.
"""

from __future__ import annotations

import re
import ssl
import subprocess

import httpx
import pytest

from artifacts.store.testing import example_archive
from cloacina_site.tls import PLAINTEXT_WARNING
from tests.support.keys import cli_agent_key, cli_tenant_key
from tests.support.processes import (
    FLEET_ENV,
    ManagedProcess,
    Processes,
    ServeHandle,
    start_agent,
)
from tests.support.tls import TestCA
from tests.support.waiting import wait_until

TLS_READY_LINE = re.compile(r"Cloacina server ready: console at (https://\S+?)/console/")

EXIT_CONFIG = 2

EXIT_AUTH = 3

ROWS = [4, 1, 7]

REPORT = "loaded 3 rows: sum=12 max=7"


@pytest.fixture
def ca(tmp_path):
    return TestCA(tmp_path)


@pytest.mark.e2e
def test_serve_exits_2_with_one_line_on_a_bad_certificate_path(tmp_path, ca):
    procs = Processes(tmp_path)
    env = {**procs.env(), "DATABASE_URL": "postgresql://nowhere.invalid/x"}  # never reached
    result = procs.manage(
        "serve", "--port", "0", "--tls-cert", str(tmp_path / "missing.crt"),
        "--tls-key", str(ca.server().key), env=env, timeout=60,
    )  # fmt: skip
    assert result.returncode == EXIT_CONFIG, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot read" in lines[0] and "missing.crt" in lines[0], lines
    assert result.stdout == ""


@pytest.fixture
def procs(transactional_db, tmp_path):
    with Processes(tmp_path) as procs:
        yield procs


def tls_serve(procs: Processes, *flags: str) -> ServeHandle:
    process = procs.start(
        ["serve", "--port", "0", *flags], name="serve-tls", env=procs.env(**FLEET_ENV)
    )
    url = process.wait_for_output(TLS_READY_LINE, 60).group(1)
    return ServeHandle(process, url)


def refused(process: ManagedProcess) -> tuple[int, str]:
    """The exit code and the last log line of an agent that must stop on its own."""
    try:
        code = process.popen.wait(60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{process.name} did not stop:\n{process.tail()}")
    # At its first attempt: a refusal is recognised as such, not retried as an outage.
    assert "cannot register (" not in process.output(), process.tail()
    return code, process.output().strip().splitlines()[-1]


def run_diamond(api: httpx.Client, key: str, tmp_path) -> dict:
    """Upload etl-demo, run it, return the finished execution (all over the given client)."""
    auth = {"Authorization": f"Bearer {key}"}
    files = {"file": ("etl.tar.gz", example_archive("etl-demo"))}
    assert api.post("/api/v1/packages", files=files, headers=auth).status_code == 201
    started = api.post(
        "/api/v1/workflows/etl/executions",
        json={"context": {"input_rows": ROWS, "marker_path": str(tmp_path / "marker")}},
        headers=auth,
    )
    assert started.status_code == 201, started.text
    url = f"/api/v1/executions/{started.json()['id']}"
    return wait_until(
        lambda: (
            (body := api.get(url, headers=auth).json())["status"] in ("Completed", "Failed")
            and body
        ),
        timeout=60,
        what="the execution to finish",
    )


@pytest.mark.e2e
def test_a_workflow_runs_on_an_agent_over_https_and_wss(procs, ca, tmp_path):
    cert = ca.server()
    key, akey = cli_tenant_key(procs), cli_agent_key(procs)
    server = tls_serve(procs, "--tls-cert", str(cert.cert), "--tls-key", str(cert.key))
    assert PLAINTEXT_WARNING not in server.process.output()

    stranger = start_agent(procs, server, akey, "no-ca", wait=False)
    agent = start_agent(procs, server, akey, "w1", "--ca-cert", str(ca.cert_path))
    assert "TLS trusting CA" in agent.output()

    # Without the CA the agent cannot trust the server: it stops, it does not retry forever.
    code, line = refused(stranger)
    assert code == EXIT_CONFIG
    assert "TLS: the server's certificate is not trusted" in line and "--ca-cert" in line, line
    assert akey not in stranger.output()
    with httpx.Client(
        base_url=server.url, verify=ssl.create_default_context(cafile=ca.cert_path), timeout=30
    ) as api:
        assert api.get("/healthz").status_code == 200
        body = run_diamond(api, key, tmp_path)
    assert body["status"] == "Completed", body
    assert body["context"]["report"] == REPORT
    assert {t["agent"] for t in body["tasks"]} == {"w1"}

    # The port speaks only TLS: a plain-HTTP request gets no answer at all.
    with pytest.raises(httpx.HTTPError):
        httpx.get(server.url.replace("https://", "http://") + "/healthz", timeout=5)


@pytest.mark.e2e
def test_with_a_client_ca_only_agents_with_a_certificate_from_it_get_in(procs, ca, tmp_path):
    cert = ca.server()
    key, akey = cli_tenant_key(procs), cli_agent_key(procs)
    server = tls_serve(
        procs, "--tls-cert", str(cert.cert), "--tls-key", str(cert.key),
        "--tls-client-ca", str(ca.cert_path),
    )  # fmt: skip
    trust = ("--ca-cert", str(ca.cert_path))
    w1, outsider = ca.client("w1"), TestCA(tmp_path, name="other-ca").client("intruder")
    mine = ("--client-cert", str(w1.cert), "--client-key", str(w1.key))
    theirs = ("--client-cert", str(outsider.cert), "--client-key", str(outsider.key))
    # Started together (each one boots Django and its task processes): three that must fail…
    no_cert = start_agent(procs, server, akey, "no-cert", *trust, wait=False)
    intruder = start_agent(procs, server, akey, "intruder", *trust, *theirs, wait=False)
    bad_key = start_agent(procs, server, "clk_bogus_key", "bad-key", *trust, *mine, wait=False)
    # …and one that must get in.
    start_agent(procs, server, akey, "w1", *trust, *mine)

    code, line = refused(no_cert)
    assert code == EXIT_CONFIG
    assert "TLS: the server refused the handshake" in line, line
    assert "showed no client certificate (pass --client-cert and --client-key)" in line, line
    code, line = refused(intruder)
    assert code == EXIT_CONFIG and "the server refused the handshake" in line, line
    assert str(outsider.cert) in line
    # The certificate is in addition to the key, not instead of it.
    code, line = refused(bad_key)
    assert code == EXIT_AUTH and "rejected the API key" in line, line

    with httpx.Client(
        base_url=server.url, verify=ssl.create_default_context(cafile=ca.cert_path), timeout=30
    ) as anonymous:
        with pytest.raises((httpx.HTTPError, ssl.SSLError)):
            anonymous.get("/healthz")
    client_ssl = ssl.create_default_context(cafile=str(ca.cert_path))
    ops = ca.client("ops")
    client_ssl.load_cert_chain(ops.cert, ops.key)
    with httpx.Client(base_url=server.url, verify=client_ssl, timeout=30) as api:
        assert api.get("/api/v1/fleet").status_code == 401  # a certificate alone is not a key
        body = run_diamond(api, key, tmp_path)
    assert body["status"] == "Completed" and body["context"]["report"] == REPORT, body
    assert {t["agent"] for t in body["tasks"]} == {"w1"}


@pytest.mark.e2e
def test_without_certificates_serve_warns_once_that_traffic_is_unencrypted(procs):
    server = procs.serve()
    lines = [line for line in server.process.output().splitlines() if "TLS is off" in line]
    assert lines == [PLAINTEXT_WARNING]
    assert lines[0].startswith("WARNING:") and "API keys included" in lines[0]
