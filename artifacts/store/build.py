"""The build step: turn validated package files into one canonical, deterministic .tar.gz.

Determinism is what makes content addressing work: the same files give the
same bytes, hence the same digest, whether they were uploaded as a zip or a
tarball, on any day, by any user — so re-uploads are recognised as identical
and blobs are shared.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import tarfile

CANONICAL_MTIME = 0
CANONICAL_FILE_MODE = 0o644
GZIP_LEVEL = 9


def canonical_archive(members: dict[str, bytes]) -> bytes:
    """A gzip'd PAX tar of ``members`` sorted by path, with fixed mtime/owner/mode and no
    directory or link entries (extraction creates parents)."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in sorted(members):
            data = members[name]
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mtime = CANONICAL_MTIME
            info.mode = CANONICAL_FILE_MODE
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.type = tarfile.REGTYPE
            tar.addfile(info, io.BytesIO(data))
    out = io.BytesIO()
    # filename="" and mtime=0 keep the gzip header free of anything that varies.
    with gzip.GzipFile(
        filename="", mode="wb", fileobj=out, mtime=0, compresslevel=GZIP_LEVEL
    ) as gz:
        gz.write(raw.getvalue())
    return out.getvalue()


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
