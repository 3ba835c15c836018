"""The agent's side of TLS: whom it trusts, which certificate it shows, what a failure means.

One :class:`ssl.SSLContext` serves both the REST client (httpx) and the delivery
WebSocket (``wss://``), so they can never disagree about the server.  Without
``--ca-cert`` the agent trusts the public CAs httpx ships with (certifi); with it,
only that CA (a private CA is the usual case, and trusting the public ones as
well would let any public certificate for the host pass).  ``--client-cert`` /
``--client-key`` are shown to a server that asks for them (mutual TLS).

Imports nothing of Django: the runtime is DB-less.
"""

from __future__ import annotations

import asyncio
import ssl
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

ENV_CA_CERT = "CLOACINA_AGENT_CA_CERT"
ENV_CLIENT_CERT = "CLOACINA_AGENT_CLIENT_CERT"
ENV_CLIENT_KEY = "CLOACINA_AGENT_CLIENT_KEY"
PROBE_TIMEOUT_S = 3.0  # to connect and finish our side of the handshake
PROBE_VERDICT_S = 1.0  # to wait for a refusal once it is finished: silence means accepted

# The TLS alerts a server sends when it does not accept (or did not get) our certificate.
CLIENT_CERT_ALERTS = (
    "CERTIFICATE_REQUIRED",
    "BAD_CERTIFICATE",
    "UNKNOWN_CA",
    "CERTIFICATE_UNKNOWN",
    "CERTIFICATE_EXPIRED",
    "ACCESS_DENIED",
    "HANDSHAKE_FAILURE",
)


class TLSConfigError(ValueError):
    """A CA or client certificate/key file that cannot be used."""


@dataclass(frozen=True)
class AgentTLS:
    """The files behind the agent's TLS context (all optional)."""

    ca_cert: Path | None = None
    client_cert: Path | None = None
    client_key: Path | None = None

    def describe(self) -> str:
        trust = f"CA {self.ca_cert}" if self.ca_cert else "public CAs"
        mine = f", client certificate {self.client_cert}" if self.client_cert else ""
        return f"TLS trusting {trust}{mine}"


def _default_cafile() -> str | None:
    try:
        import certifi  # httpx's own default trust store

        return certifi.where()
    except ImportError:  # pragma: no cover - certifi comes with httpx
        return None


def client_context(tls: AgentTLS) -> ssl.SSLContext:
    """An SSL context verifying the server (hostname included); TLSConfigError if unusable."""
    if tls.client_key and not tls.client_cert:
        raise TLSConfigError("--client-key needs --client-cert")
    cafile = str(tls.ca_cert) if tls.ca_cert else _default_cafile()
    try:
        context = ssl.create_default_context(cafile=cafile)
    except FileNotFoundError:
        raise TLSConfigError(f"--ca-cert: {tls.ca_cert}: no such file") from None
    except (ssl.SSLError, OSError) as exc:
        raise TLSConfigError(
            f"--ca-cert: {tls.ca_cert} is not a PEM CA certificate ({exc})"
        ) from None
    if tls.client_cert:
        try:
            context.load_cert_chain(
                str(tls.client_cert), str(tls.client_key) if tls.client_key else None
            )
        except FileNotFoundError as exc:
            raise TLSConfigError(
                f"--client-cert/--client-key: {exc.filename}: no such file"
            ) from None
        except (ssl.SSLError, OSError) as exc:
            raise TLSConfigError(
                f"--client-cert {tls.client_cert} / --client-key {tls.client_key or '(in the cert file)'}"
                f" cannot be used: {exc} (is the key the certificate's, unencrypted, PEM?)"
            ) from None
    return context


def ssl_error_in(exc: BaseException) -> ssl.SSLError | None:
    """The :class:`ssl.SSLError` behind ``exc`` (httpx and httpcore wrap it twice)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, ssl.SSLError):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


async def handshake_refusal(server_url: str, context: ssl.SSLContext) -> ssl.SSLError | None:
    """The server's refusal of our TLS handshake, asked on a connection that sends nothing.

    Under TLS 1.3 the server judges our client certificate only after the client
    has finished its side of the handshake and already sent its request.  The
    server then closes on unread request bytes, its kernel answers with a reset,
    and the reset can discard the alert that said why: about half the time here
    a refused agent sees only a bare read error.  A connection that sends nothing
    and only listens always receives the alert.  None: accepted, or no answer.
    """
    parts = urlsplit(server_url)
    host, port = parts.hostname, parts.port or 443
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(host, port, ssl=context), PROBE_TIMEOUT_S
        )
    except ssl.SSLError as exc:  # refused (or untrusted) within the handshake itself
        return exc
    except (OSError, TimeoutError):
        return None
    try:
        await asyncio.wait_for(reader.read(1), PROBE_VERDICT_S)
    except ssl.SSLError as exc:
        return exc
    except (OSError, TimeoutError):
        pass
    finally:
        writer.close()
    return None


def explain(error: ssl.SSLError, tls: AgentTLS) -> str:
    """One line saying what went wrong in the handshake and which flag fixes it."""
    if isinstance(error, ssl.SSLCertVerificationError):
        reason = error.verify_message or str(error)
        if "hostname" in reason.lower() or "ip address mismatch" in reason.lower():
            return (
                f"TLS: the server's certificate does not name this host ({reason}); "
                "connect by a name or address in its subjectAltName"
            )
        hint = (
            f"is {tls.ca_cert} the CA that signed it?"
            if tls.ca_cert
            else "pass --ca-cert (or $" + ENV_CA_CERT + ") with the CA that signed it"
        )
        return f"TLS: the server's certificate is not trusted ({reason}); {hint}"
    reason = error.reason or ""
    text = f"{reason} {error}".upper()
    if any(alert in text for alert in CLIENT_CERT_ALERTS) and "ALERT" in text:
        mine = (
            f"the client certificate {tls.client_cert}"
            if tls.client_cert
            else "no client certificate (pass --client-cert and --client-key)"
        )
        return (
            f"TLS: the server refused the handshake ({reason or error}); this agent showed {mine}"
        )
    if "WRONG_VERSION_NUMBER" in text or "RECORD_LAYER_FAILURE" in text:
        return (
            f"TLS: the server did not answer in TLS ({reason or error}); is it an http:// server?"
        )
    return f"TLS handshake failed: {reason or error}"
