"""The content-addressed blob store (table of ArtifactBlob rows keyed by sha256).

Blobs live in PostgreSQL so every server replica sees them; identical bytes
are stored once, whoever uploads them.  Authorisation is not checked here:
callers go through :mod:`artifacts.store.queries`, which scopes digests by tenant.
"""

from __future__ import annotations

import re

from artifacts.models import ArtifactBlob
from artifacts.store.build import sha256_hex

DIGEST_RE = re.compile(r"^[0-9a-f]{64}$")


class BlobNotFound(LookupError):
    """No blob with that digest."""


def store_blob(data: bytes) -> str:
    """Store ``data`` (once) and return its sha256 hex digest.

    ``ON CONFLICT DO NOTHING`` makes concurrent uploads of the same bytes safe;
    call inside the transaction that records the referencing row, so a failed
    upload leaves no orphan blob behind.
    """
    digest = sha256_hex(data)
    ArtifactBlob.objects.bulk_create(
        [ArtifactBlob(digest=digest, size=len(data), data=data)], ignore_conflicts=True
    )
    return digest


def load_blob(digest: str) -> bytes:
    """The bytes stored under ``digest``; raises :class:`BlobNotFound`."""
    if not DIGEST_RE.match(digest or ""):
        raise BlobNotFound(digest)
    data = ArtifactBlob.objects.filter(digest=digest).values_list("data", flat=True).first()
    if data is None:
        raise BlobNotFound(digest)
    return bytes(data)
