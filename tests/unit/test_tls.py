"""Transport security: `serve` with TLS and mutual TLS, `runagent` verifying it.

A throw-away CA (tests/support/tls.py) signs the server's certificate (for
127.0.0.1 and localhost) and the agents' client certificates.  The end-to-end
tests run a real `serve --default-executor fleet` and real `runagent`
processes: a workflow runs over https:// and wss://, and every way of getting
the certificates wrong ends the agent with one clear line and exit code 2.

Here: the unit tests (no database, socket or process); the rest are in tests/e2e/test_tls.py.
"""

from __future__ import annotations

import ssl

import pytest
from cryptography.hazmat.primitives import serialization
from django.core.management import CommandError, call_command

from agents.management.commands import runagent
from agents.runtime.tls import AgentTLS, TLSConfigError, client_context
from cloacina_site.tls import load_server_tls
from fleet.platform.config import ConfigError
from tests.support.tls import TestCA

EXIT_CONFIG = 2


@pytest.fixture
def ca(tmp_path):
    return TestCA(tmp_path)


def test_a_certificate_and_its_key_give_a_tls_listener_and_a_client_ca_makes_it_mutual(ca):
    server = ca.server()
    plain = load_server_tls(server.cert, server.key)
    assert plain is not None and not plain.mutual
    mutual = load_server_tls(server.cert, server.key, ca.cert_path)
    assert mutual is not None and mutual.mutual
    assert load_server_tls("", "") is None  # nothing configured: plain HTTP


def test_a_certificate_chain_file_sends_the_intermediates_too(ca, tmp_path):
    server = ca.server()
    chain = tmp_path / "chain.pem"
    chain.write_bytes(server.cert.read_bytes() + ca.cert_path.read_bytes())
    tls = load_server_tls(chain, server.key)
    assert len(tls.options.extraCertChain) == 1


def _encrypted_copy(key_path, tmp_path):
    key = serialization.load_pem_private_key(key_path.read_bytes(), None)
    path = tmp_path / "encrypted.key"
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"secret"),
        )
    )
    return path


@pytest.mark.parametrize(
    "case, message",
    [
        ("missing cert", "--tls-cert (CLOACINA_TLS_CERT, tls_cert): cannot read"),
        ("cert only", "--tls-cert (CLOACINA_TLS_CERT, tls_cert) is set but --tls-key"),
        ("key only", "--tls-key (CLOACINA_TLS_KEY, tls_key) is set but --tls-cert"),
        ("client CA only", "--tls-client-ca (CLOACINA_TLS_CLIENT_CA, tls_client_ca) needs"),
        ("not a certificate", "holds no PEM certificate"),
        ("not a key", "is not a PEM private key"),
        ("encrypted key", "is encrypted"),
        ("someone else's key", "is not the key of the certificate in"),
        ("expired", "expired on"),
        ("client CA not a certificate", "--tls-client-ca (CLOACINA_TLS_CLIENT_CA, tls_client_ca)"),
    ],
)
def test_unusable_tls_files_are_one_clear_configuration_error(ca, tmp_path, case, message):
    server = ca.server()
    other = ca.client("someone")
    junk = tmp_path / "junk.pem"
    junk.write_text("this is not PEM\n")
    args = {
        "missing cert": (tmp_path / "nope.crt", server.key, None),
        "cert only": (server.cert, None, None),
        "key only": (None, server.key, None),
        "client CA only": (None, None, ca.cert_path),
        "not a certificate": (junk, server.key, None),
        "not a key": (server.cert, junk, None),
        "encrypted key": (server.cert, _encrypted_copy(server.key, tmp_path), None),
        "someone else's key": (server.cert, other.key, None),
        "expired": (*_pair(ca.server(valid_days=-1, file_stem="old")), None),
        "client CA not a certificate": (server.cert, server.key, junk),
    }[case]
    with pytest.raises(ConfigError) as info:
        load_server_tls(*args)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def _pair(pair):
    return pair.cert, pair.key


def test_the_agent_context_verifies_the_server_and_carries_the_client_certificate(ca):
    client = ca.client("w1")
    context = client_context(AgentTLS(ca.cert_path, client.cert, client.key))
    assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname
    assert [c["subject"] for c in context.get_ca_certs()] == [
        ((("commonName", "Cloacina test CA ca"),),)
    ]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--ca-cert", "{tmp}/missing.pem"], "--ca-cert: {tmp}/missing.pem: no such file"),
        (["--ca-cert", "{junk}"], "is not a PEM CA certificate"),
        (["--client-key", "{client_key}"], "--client-key needs --client-cert"),
        (["--client-cert", "{client_cert}", "--client-key", "{server_key}"], "cannot be used"),
    ],
)
def test_runagent_refuses_unusable_tls_files_with_exit_code_2(
    monkeypatch, tmp_path, ca, flags, message
):
    junk = tmp_path / "junk.pem"
    junk.write_text("not PEM\n")
    client, server = ca.client("w1"), ca.server()
    values = {
        "tmp": tmp_path, "junk": junk, "client_key": client.key,
        "client_cert": client.cert, "server_key": server.key,
    }  # fmt: skip
    monkeypatch.setattr(runagent, "install_db_guard", lambda: None)
    monkeypatch.setattr(runagent, "_configure_logging", lambda: None)
    monkeypatch.setattr(runagent, "_run", lambda *a: pytest.fail("got past the TLS checks"))
    with pytest.raises(CommandError) as info:
        call_command(
            "runagent", "--server", "https://127.0.0.1:9", "--api-key", "clk_x_secret",
            *[flag.format(**values) for flag in flags],
        )  # fmt: skip
    assert info.value.returncode == EXIT_CONFIG
    assert message.format(**values) in str(info.value)


def test_client_context_refuses_a_key_without_a_certificate(ca):
    with pytest.raises(TLSConfigError, match="--client-key needs --client-cert"):
        client_context(AgentTLS(client_key=ca.client("w1").key))
