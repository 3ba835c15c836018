"""Safe reading and extraction of package archives (.tar.gz or .zip).

Both the server (validating an upload) and the agent (unpacking a fetched
artifact) read archives written by tenants, so this module trusts nothing:
paths are checked before use, links become plain copies of in-tree files or
are refused, device files are refused, and every size is bounded *while*
decompressing so a zip or gzip bomb stops at the limit instead of filling
memory. DB-free: it imports no Django model.
"""

from __future__ import annotations

import gzip
import io
import os
import posixpath
import stat
import tarfile
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

MAX_UNCOMPRESSED_BYTES = 200 * 1024 * 1024  # all members together, once expanded
MAX_MEMBER_BYTES = 100 * 1024 * 1024  # any single member
MAX_MEMBERS = 10_000
MAX_PATH_CHARS = 1024
# Tar headers, padding and pax records on top of the members' own bytes.
TAR_OVERHEAD_BYTES_PER_MEMBER = 2048
READ_CHUNK_BYTES = 1024 * 1024

GZIP_MAGIC = b"\x1f\x8b"
ZIP_MAGICS = (b"PK\x03\x04", b"PK\x05\x06")


class ArchiveError(ValueError):
    """The archive is unreadable or unsafe; the message names the offending member."""


class ArchiveLimitError(ArchiveError):
    """The archive would expand beyond a size or member-count limit."""


@dataclass(frozen=True)
class Limits:
    max_uncompressed_bytes: int
    max_member_bytes: int
    max_members: int


def default_limits() -> Limits:
    """The module constants, read at call time so a test or an operator can change them."""
    return Limits(MAX_UNCOMPRESSED_BYTES, MAX_MEMBER_BYTES, MAX_MEMBERS)


def archive_format(data: bytes) -> str:
    """``"tar.gz"`` or ``"zip"``, sniffed from the magic bytes (file names are not trusted)."""
    if data.startswith(GZIP_MAGIC):
        return "tar.gz"
    if data.startswith(ZIP_MAGICS):
        return "zip"
    raise ArchiveError("not a .tar.gz or .zip archive")


def clean_member_name(raw: str) -> str:
    """The member's normalised relative path; refuses absolute paths, ``..`` and odd characters."""
    if not raw or "\x00" in raw:
        raise ArchiveError(f"member {raw!r} has an empty or NUL-containing name")
    if "\\" in raw:
        raise ArchiveError(f"member {raw!r}: backslashes are not allowed in member names")
    if len(raw) > MAX_PATH_CHARS:
        raise ArchiveError(f"member {raw[:80]!r}...: path longer than {MAX_PATH_CHARS} characters")
    if raw.startswith("/") or (len(raw) > 1 and raw[1] == ":"):
        raise ArchiveError(f"member {raw!r} has an absolute path")
    parts = [p for p in raw.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise ArchiveError(f"member {raw!r} contains a '..' path component")
    return "/".join(parts)


@dataclass
class _Link:
    name: str
    target: str
    kind: str  # "symlink" or "hardlink"


class _Collector:
    """Accumulates members while enforcing the limits and the path rules."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.files: dict[str, bytes] = {}
        self.links: list[_Link] = []
        self.link_names: set[str] = set()
        self.total = 0
        self.count = 0

    def count_member(self) -> None:
        self.count += 1
        if self.count > self.limits.max_members:
            raise ArchiveLimitError(
                f"archive has more than {self.limits.max_members} members (limit)"
            )

    def check_size(self, name: str, size: int) -> None:
        if size > self.limits.max_member_bytes:
            raise ArchiveLimitError(
                f"member {name!r} expands to more than {self.limits.max_member_bytes} bytes (limit)"
            )
        if self.total + size > self.limits.max_uncompressed_bytes:
            raise ArchiveLimitError(
                f"archive expands to more than {self.limits.max_uncompressed_bytes} bytes "
                f"(limit reached at member {name!r})"
            )

    def add_file(self, name: str, data: bytes) -> None:
        self.check_size(name, len(data))
        if name in self.files or name in self.link_names:
            raise ArchiveError(f"member {name!r} appears more than once")
        self.total += len(data)
        self.files[name] = data

    def add_link(self, name: str, target: str, kind: str) -> None:
        if name in self.files or name in self.link_names:
            raise ArchiveError(f"member {name!r} appears more than once")
        self.link_names.add(name)
        self.links.append(_Link(name, target, kind))

    def finish(self) -> dict[str, bytes]:
        regular = dict(self.files)  # links resolve to regular files only, never to other links
        for link in self.links:
            resolved = _resolve_link(link)
            if resolved not in regular:
                raise ArchiveError(
                    f"{link.kind} {link.name!r} -> {link.target!r} does not point to a regular "
                    "file in the package (links to directories or other links are not supported)"
                )
            content = regular[resolved]
            self.check_size(link.name, len(content))
            self.total += len(content)
            self.files[link.name] = content
        _check_file_dir_clash(self.files)
        return dict(sorted(self.files.items()))


def _resolve_link(link: _Link) -> str:
    target = link.target
    if not target or target.startswith("/") or "\\" in target:
        raise ArchiveError(
            f"{link.kind} {link.name!r} -> {target!r} points outside the package (absolute target)"
        )
    base = posixpath.dirname(link.name) if link.kind == "symlink" else ""
    joined = posixpath.normpath(posixpath.join(base, target))
    if joined == ".." or joined.startswith("../"):
        raise ArchiveError(f"{link.kind} {link.name!r} -> {target!r} points outside the package")
    return joined


def _check_file_dir_clash(files: dict[str, bytes]) -> None:
    for name in files:
        parent = posixpath.dirname(name)
        while parent:
            if parent in files:
                raise ArchiveError(f"{parent!r} is both a file and a directory in the archive")
            parent = posixpath.dirname(parent)


class _BoundedReader(io.RawIOBase):
    """Wraps the gunzip stream and refuses to yield more than ``cap`` bytes (gzip bombs)."""

    def __init__(self, inner: io.BufferedIOBase, cap: int) -> None:
        self.inner = inner
        self.cap = cap
        self.seen = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:  # type: ignore[override]
        chunk = self.inner.read(len(buffer))
        self.seen += len(chunk)
        if self.seen > self.cap:
            raise ArchiveLimitError(
                f"archive expands to more than {self.cap} bytes of tar data (limit)"
            )
        buffer[: len(chunk)] = chunk
        return len(chunk)


def _read_tar(data: bytes, collector: _Collector) -> None:
    limits = collector.limits
    cap = limits.max_uncompressed_bytes + (limits.max_members + 2) * TAR_OVERHEAD_BYTES_PER_MEMBER
    stream = _BoundedReader(gzip.GzipFile(fileobj=io.BytesIO(data)), cap)
    with tarfile.open(fileobj=io.BufferedReader(stream), mode="r|") as tar:
        for member in tar:
            collector.count_member()
            name = clean_member_name(member.name)
            if member.isdir():
                continue
            if member.issym() or member.islnk():
                kind = "symlink" if member.issym() else "hardlink"
                collector.add_link(name, member.linkname, kind)
            elif member.isreg():
                collector.check_size(name, member.size)
                fh = tar.extractfile(member)
                collector.add_file(name, fh.read() if fh else b"")
            else:
                raise ArchiveError(
                    f"member {name!r} is a device, FIFO or other special file (not allowed)"
                )


def _read_zip(data: bytes, collector: _Collector) -> None:
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        infos = zf.infolist()
        if len(infos) > collector.limits.max_members:
            raise ArchiveLimitError(
                f"archive has more than {collector.limits.max_members} members (limit)"
            )
        # Declared sizes first: refuses an obvious bomb without inflating a byte.
        declared = sum(info.file_size for info in infos)
        if declared > collector.limits.max_uncompressed_bytes:
            raise ArchiveLimitError(
                f"archive expands to more than {collector.limits.max_uncompressed_bytes} bytes (limit)"
            )
        for info in infos:
            collector.count_member()
            name = clean_member_name(info.filename)
            # Unix file-type bits only mean something in zips made on Unix (create_system 3);
            # tools such as zipfile.writestr() leave them 0 for plain files.
            ftype = stat.S_IFMT(info.external_attr >> 16) if info.create_system == 3 else 0
            if info.is_dir() or ftype == stat.S_IFDIR:
                continue
            if info.flag_bits & 0x1:
                raise ArchiveError(f"member {name!r} is encrypted (not supported)")
            if ftype == stat.S_IFLNK:
                target = _read_bounded(zf, info, name, collector)
                collector.add_link(name, target.decode("utf-8", "replace"), "symlink")
            elif ftype in (0, stat.S_IFREG):
                collector.check_size(name, info.file_size)
                collector.add_file(name, _read_bounded(zf, info, name, collector))
            else:
                raise ArchiveError(
                    f"member {name!r} is a device, FIFO or other special file (not allowed)"
                )


def _read_bounded(zf: zipfile.ZipFile, info: zipfile.ZipInfo, name: str, c: _Collector) -> bytes:
    # Never trust the declared size: read at most one byte past the limit.
    limit = min(c.limits.max_member_bytes, c.limits.max_uncompressed_bytes - c.total)
    with zf.open(info) as fh:
        out = fh.read(limit + 1)
    c.check_size(name, len(out))
    return out


def read_members(data: bytes, limits: Limits | None = None) -> dict[str, bytes]:
    """Every regular file of the archive as ``{relative/path: bytes}``, sorted by path.

    In-tree links become copies of their target; anything unsafe raises
    :class:`ArchiveError` (or :class:`ArchiveLimitError` for size/count limits).
    """
    collector = _Collector(limits or default_limits())
    fmt = archive_format(data)
    try:
        if fmt == "zip":
            _read_zip(data, collector)
        else:
            _read_tar(data, collector)
    except ArchiveError:
        raise
    except (tarfile.TarError, zipfile.BadZipFile, EOFError, OSError, zlib.error) as exc:
        raise ArchiveError(f"corrupt {fmt} archive: {exc}") from None
    return collector.finish()


def safe_extract(data: bytes, dest: Path, limits: Limits | None = None) -> list[Path]:
    """Unpack the archive under ``dest`` (created if needed); returns the files written.

    Paths were already cleaned by :func:`read_members`; the resolved-path check
    here is a second fence in case ``dest`` already holds links of its own.
    """
    members = read_members(data, limits)
    root = Path(dest)
    root.mkdir(parents=True, exist_ok=True)
    root = root.resolve()
    written: list[Path] = []
    for name, content in members.items():
        target = (root / name).resolve()
        if root != target and root not in target.parents:
            raise ArchiveError(f"member {name!r} would be written outside {root}")
        target.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "wb") as fh:
            fh.write(content)
        written.append(target)
    return written
