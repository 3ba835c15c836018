"""A throw-away PKI for TLS tests: a CA, a server certificate for 127.0.0.1/localhost, and
client certificates, written as PEM files (made at test time with ``cryptography``)."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())  # fast to make, unlike RSA


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(key, path: Path) -> Path:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return path


def _write_cert(cert: x509.Certificate, path: Path) -> Path:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path


@dataclass(frozen=True)
class Pair:
    cert: Path
    key: Path


class TestCA:
    """A CA that signs server and client certificates into ``directory``."""

    __test__ = False  # not a test class, whatever pytest thinks of the name

    def __init__(self, directory: Path, name: str = "ca") -> None:
        self.directory = directory
        self.name = name
        self.key = _key()
        now = datetime.datetime.now(datetime.UTC)
        self.certificate = (
            x509.CertificateBuilder()
            .subject_name(_name(f"Cloacina test CA {name}"))
            .issuer_name(_name(f"Cloacina test CA {name}"))
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),  # fmt: skip
                critical=True,
            )
            .add_extension(
                x509.SubjectKeyIdentifier.from_public_key(self.key.public_key()), critical=False
            )
            .sign(self.key, hashes.SHA256())
        )
        self.cert_path = _write_cert(self.certificate, directory / f"{name}.pem")

    def _issue(
        self,
        common_name: str,
        usage,
        sans: list[x509.GeneralName] | None = None,
        valid_days: float = 1,
        file_stem: str | None = None,
    ) -> Pair:
        key = _key()
        now = datetime.datetime.now(datetime.UTC)
        # An already expired certificate (valid_days < 0) still starts before it ends.
        start = now - datetime.timedelta(days=2 if valid_days < 0 else 0, minutes=5)
        builder = (
            x509.CertificateBuilder()
            .subject_name(_name(common_name))
            .issuer_name(self.certificate.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start)
            .not_valid_after(now + datetime.timedelta(days=valid_days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()),
                critical=False,
            )
        )
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = builder.sign(self.key, hashes.SHA256())
        stem = file_stem or common_name
        return Pair(
            _write_cert(cert, self.directory / f"{stem}.crt"),
            _write_key(key, self.directory / f"{stem}.key"),
        )

    def server(self, valid_days: float = 1, file_stem: str = "server") -> Pair:
        """A server certificate for 127.0.0.1 and localhost."""
        sans = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        return self._issue(
            "localhost", ExtendedKeyUsageOID.SERVER_AUTH, sans, valid_days, file_stem
        )

    def client(self, name: str) -> Pair:
        """A client certificate (for mutual TLS) whose common name is ``name``."""
        return self._issue(name, ExtendedKeyUsageOID.CLIENT_AUTH, file_stem=f"client-{name}")
