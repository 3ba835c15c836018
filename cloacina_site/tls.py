"""TLS for `serve`: certificate, key and (for mutual TLS) the client CA, checked at boot.

``serve --tls-cert PATH --tls-key PATH`` makes daphne listen with TLS; adding
``--tls-client-ca PATH`` makes every client (agents, API scripts, browsers)
present a certificate signed by that CA, on top of its API key.  Everything is
loaded and cross-checked before the server touches the database, so a wrong
path, a key that does not match the certificate or an expired certificate is one
clear :class:`ConfigError` line (exit 2), never a traceback from inside daphne.

The listener is built in code, not as the string ``ssl:port=P:interface=H:
privateKey=KEY:certKey=CERT``: the string form cannot require client
certificates, reads only the first certificate of a chain file, and needs
escaping for colons in paths and IPv6 interfaces.  Daphne only accepts endpoint
*descriptions*, so :func:`daphne_endpoint` registers the built endpoint under a
description that daphne's ``serverFromString`` then resolves (see
:func:`_route_daphne_endpoints`).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleet.platform.config import Config, ConfigError

PLAINTEXT_WARNING = (
    "WARNING: TLS is off: traffic to this server, API keys included, is unencrypted "
    "(set --tls-cert and --tls-key, see docs/security-transport.md)"
)
ENDPOINT_PREFIX = "cloacina-tls"

# Where each file came from, for messages that name what the operator has to fix.
CERT_SOURCE = "--tls-cert (CLOACINA_TLS_CERT, tls_cert)"
KEY_SOURCE = "--tls-key (CLOACINA_TLS_KEY, tls_key)"
CLIENT_CA_SOURCE = "--tls-client-ca (CLOACINA_TLS_CLIENT_CA, tls_client_ca)"


@dataclass(frozen=True)
class ServerTLS:
    """A checked TLS configuration; ``options`` is Twisted's context factory for it."""

    cert_path: Path
    key_path: Path
    client_ca_path: Path | None
    options: Any = field(repr=False, compare=False)

    @property
    def mutual(self) -> bool:
        return self.client_ca_path is not None


def _read(path: Path, source: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{source}: cannot read {path}: {exc.strerror or exc}") from None


def _certificates(path: Path, source: str) -> list:
    from cryptography import x509

    data = _read(path, source)
    try:
        return x509.load_pem_x509_certificates(data)
    except ValueError:  # no "BEGIN CERTIFICATE" block, or one that does not parse
        raise ConfigError(
            f"{source}: {path} holds no PEM certificate (-----BEGIN CERTIFICATE-----)"
        ) from None


def _private_key(path: Path, source: str):
    from cryptography.hazmat.primitives.serialization import load_pem_private_key

    data = _read(path, source)
    try:
        return load_pem_private_key(data, password=None)
    except TypeError:  # cryptography's way of saying "this one needs a password"
        raise ConfigError(
            f"{source}: {path} is encrypted; give serve an unencrypted key (readable by it alone)"
        ) from None
    except ValueError:  # cryptography's reasons are long and rarely more helpful
        raise ConfigError(
            f"{source}: {path} is not a PEM private key (-----BEGIN PRIVATE KEY-----)"
        ) from None


def _public_der(public_key) -> bytes:
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    return public_key.public_bytes(Encoding.DER, PublicFormat.SubjectPublicKeyInfo)


def _check_validity(certificate, path: Path, source: str) -> None:
    now = datetime.datetime.now(datetime.UTC)
    if certificate.not_valid_after_utc < now:
        raise ConfigError(
            f"{source}: the certificate in {path} expired on "
            f"{certificate.not_valid_after_utc:%Y-%m-%d %H:%M} UTC"
        )
    if certificate.not_valid_before_utc > now:
        raise ConfigError(
            f"{source}: the certificate in {path} is not valid before "
            f"{certificate.not_valid_before_utc:%Y-%m-%d %H:%M} UTC"
        )


def load_server_tls(
    cert: str | Path | None, key: str | Path | None, client_ca: str | Path | None = None
) -> ServerTLS | None:
    """None when neither certificate nor key is given; ConfigError on anything unusable."""
    from OpenSSL import crypto
    from twisted.internet import ssl

    if not cert and not key:
        if client_ca:
            raise ConfigError(f"{CLIENT_CA_SOURCE} needs {CERT_SOURCE} and {KEY_SOURCE}")
        return None
    if not cert or not key:
        missing, given = (CERT_SOURCE, KEY_SOURCE) if not cert else (KEY_SOURCE, CERT_SOURCE)
        raise ConfigError(f"{given} is set but {missing} is not; TLS needs both")
    cert_path, key_path = Path(cert).expanduser(), Path(key).expanduser()
    chain = _certificates(cert_path, CERT_SOURCE)
    leaf = chain[0]  # the server's own certificate first, then any intermediates
    private_key = _private_key(key_path, KEY_SOURCE)
    if _public_der(private_key.public_key()) != _public_der(leaf.public_key()):
        raise ConfigError(
            f"{KEY_SOURCE}: {key_path} is not the key of the certificate in {cert_path}"
        )
    _check_validity(leaf, cert_path, CERT_SOURCE)
    ca_path = Path(client_ca).expanduser() if client_ca else None
    trust_root = None
    if ca_path is not None:
        authorities = _certificates(ca_path, CLIENT_CA_SOURCE)
        trust_root = ssl.trustRootFromCertificates(
            [ssl.Certificate(crypto.X509.from_cryptography(ca)) for ca in authorities]
        )
    # pyOpenSSL takes cryptography's objects for the context (its own are deprecated there);
    # only the trust root's X509Store still wants pyOpenSSL certificates.
    options = ssl.CertificateOptions(
        privateKey=private_key,
        certificate=leaf,
        extraCertChain=chain[1:] or None,
        # A trust root makes Twisted ask for a client certificate and fail the handshake
        # unless one chaining to it is shown (it implies requireCertificate); without one,
        # no client certificate is asked for.
        trustRoot=trust_root,
    )
    try:
        options.getContext()  # OpenSSL's own objections (e.g. a too-weak key) now, not per client
    except crypto.Error as exc:
        raise ConfigError(f"{CERT_SOURCE}: OpenSSL refused the certificate or key: {exc}") from None
    return ServerTLS(cert_path, key_path, ca_path, options)


def server_tls(config: Config) -> ServerTLS | None:
    """The configuration's TLS settings, loaded and checked (None: plain HTTP)."""
    return load_server_tls(config.tls_cert, config.tls_key, config.tls_client_ca)


# -- daphne ---------------------------------------------------------------------------

_endpoints: dict[str, Any] = {}


def daphne_endpoint(tls: ServerTLS, host: str, port: int, backlog: int = 50) -> str:
    """A description to put in daphne's ``endpoints``: TLS on ``host:port`` with ``tls``,
    ``backlog`` connections queued before they are accepted (Twisted's default: 50).

    Call after importing ``daphne.server`` (which installs the asyncio reactor).
    """
    from twisted.internet import reactor
    from twisted.internet.endpoints import SSL4ServerEndpoint

    _route_daphne_endpoints()
    description = f"{ENDPOINT_PREFIX}:{len(_endpoints)}"
    _endpoints[description] = SSL4ServerEndpoint(
        reactor, port, tls.options, backlog=backlog, interface=host
    )
    return description


def _route_daphne_endpoints() -> None:
    """Let daphne's ``serverFromString`` resolve our descriptions (idempotent)."""
    import daphne.server

    original = daphne.server.serverFromString
    if getattr(original, "_cloacina_tls", False):
        return

    def server_from_string(reactor, description):
        endpoint = _endpoints.get(str(description))
        return endpoint if endpoint is not None else original(reactor, description)

    server_from_string._cloacina_tls = True
    daphne.server.serverFromString = server_from_string
