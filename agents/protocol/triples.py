"""Target triples (``arch-vendor-os[-env]``), the key that says which build an agent can load.

DB-free: the agent calls :func:`host_triple` to announce itself, and the server
calls :func:`parse_triple` to validate what it is told.
"""

from __future__ import annotations

import glob
import platform
import re
import sys
from dataclasses import dataclass

# Architectures we know how to name; anything else is a typo more often than a real target.
KNOWN_ARCHES = frozenset(
    {
        "x86_64",
        "i686",
        "aarch64",
        "arm",
        "armv7",
        "powerpc64le",
        "powerpc64",
        "s390x",
        "riscv64gc",
        "loongarch64",
        "wasm32",
    }
)
MAX_TRIPLE_CHARS = 100  # the width of the target_triple columns

# platform.machine() spellings -> the triple's arch component.
_MACHINE_TO_ARCH = {
    "x86_64": "x86_64",
    "amd64": "x86_64",
    "i386": "i686",
    "i486": "i686",
    "i586": "i686",
    "i686": "i686",
    "x86": "i686",
    "aarch64": "aarch64",
    "arm64": "aarch64",
    "armv7l": "armv7",
    "armv7": "armv7",
    "armv6l": "arm",
    "ppc64le": "powerpc64le",
    "ppc64": "powerpc64",
    "s390x": "s390x",
    "riscv64": "riscv64gc",
    "loongarch64": "loongarch64",
}
_COMPONENT = re.compile(r"^[a-z0-9_.]+\Z")  # \Z: "$" would let a trailing newline in
# What parse_triple accepts, as one regular expression (published in the API's schema).
TRIPLE_PATTERN = (
    r"^(" + "|".join(sorted(re.escape(a) for a in KNOWN_ARCHES)) + r")(-[a-z0-9_.]+){2,3}$"
)


class TripleError(ValueError):
    """A target triple is malformed or names an unknown architecture."""


@dataclass(frozen=True)
class Triple:
    arch: str
    vendor: str
    os: str
    env: str | None = None

    def __str__(self) -> str:
        parts = [self.arch, self.vendor, self.os] + ([self.env] if self.env else [])
        return "-".join(parts)


def parse_triple(value: str) -> Triple:
    """Validate ``arch-vendor-os[-env]`` (lower case, known arch) and split it."""
    if not isinstance(value, str) or not value:
        raise TripleError("target triple must be a non-empty string like x86_64-unknown-linux-gnu")
    if len(value) > MAX_TRIPLE_CHARS:
        raise TripleError(f"target triple is longer than {MAX_TRIPLE_CHARS} characters")
    parts = value.split("-")
    if len(parts) not in (3, 4) or not all(_COMPONENT.match(p) for p in parts):
        raise TripleError(
            f"malformed target triple {value!r}: expected arch-vendor-os[-env] in lower case, "
            "e.g. x86_64-unknown-linux-gnu"
        )
    if parts[0] not in KNOWN_ARCHES:
        raise TripleError(
            f"unknown architecture {parts[0]!r} in target triple {value!r} "
            f"(known: {', '.join(sorted(KNOWN_ARCHES))})"
        )
    return Triple(*parts)


def _linux_env(arch: str) -> str:
    libc, _ = platform.libc_ver()
    # libc_ver() reports glibc reliably but says nothing on musl systems (Alpine).
    base = "musl" if libc != "glibc" and glob.glob("/lib/ld-musl-*") else "gnu"
    if arch == "armv7" or arch == "arm":
        return base + "eabihf"
    return base


def host_triple() -> str:
    """This machine's triple, e.g. ``x86_64-unknown-linux-gnu`` or ``aarch64-apple-darwin``."""
    machine = platform.machine().lower()
    arch = _MACHINE_TO_ARCH.get(machine, machine or "unknown")
    if sys.platform.startswith("linux"):
        return f"{arch}-unknown-linux-{_linux_env(arch)}"
    if sys.platform == "darwin":
        return f"{arch}-apple-darwin"
    if sys.platform in ("win32", "cygwin"):
        return f"{arch}-pc-windows-msvc"
    if sys.platform.startswith("freebsd"):
        return f"{arch}-unknown-freebsd"
    return f"{arch}-unknown-{sys.platform}"
