"""Tenant name → the names the actuators use on their substrate.

A Kubernetes namespace (and, for consistency, a Docker label value) must be a
lowercase DNS-1123 label of at most 63 characters.  Sanitising alone would map
different tenants onto one name ("Acme" and "acme", "a" and "a_"), and one
tenant's actuator would then scale the other's workloads.  So every slug ends
with a short hash of the *exact* tenant name: distinct names never share a
slug, and the mapping is stable across processes and restarts.
"""

from __future__ import annotations

import hashlib
import re

NAMESPACE_PREFIX = "cloacina-tenant-"
DNS_LABEL_MAX = 63
HASH_CHARS = 10  # 40 bits: collisions between two real tenant names are not a practical concern
# What is left of a namespace name for the readable part: prefix + part + "-" + hash <= 63.
_READABLE_MAX = DNS_LABEL_MAX - len(NAMESPACE_PREFIX) - 1 - HASH_CHARS

_UNSAFE = re.compile(r"[^a-z0-9]+")


def name_hash(name: str) -> str:
    """The first HASH_CHARS hex digits of SHA-256 over the exact (case-sensitive) name."""
    return hashlib.sha256(name.encode("utf-8")).hexdigest()[:HASH_CHARS]


def tenant_slug(name: str) -> str:
    """A DNS-1123 label, unique per distinct tenant name: ``<readable part>-<hash>``."""
    readable = _UNSAFE.sub("-", name.lower()).strip("-")[:_READABLE_MAX].strip("-")
    return f"{readable or 'tenant'}-{name_hash(name)}"


def tenant_label(name: str) -> str:
    """The value of the ``cloacina.tenant`` label on containers, namespaces and pods."""
    return tenant_slug(name)


def tenant_namespace(name: str) -> str:
    """The Kubernetes namespace holding the tenant's agents: ``cloacina-tenant-<slug>``."""
    return NAMESPACE_PREFIX + tenant_slug(name)


def is_dns_label(value: str) -> bool:
    return (
        len(value) <= DNS_LABEL_MAX
        and re.fullmatch(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?", value) is not None
    )
