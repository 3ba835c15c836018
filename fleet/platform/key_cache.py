"""A short-lived, per-process cache of verified API keys: the REST path's authentication.

Every REST request carries a bearer key, and verifying one is a query (the key and its
tenant).  Keys are 256-bit random tokens stored as their SHA-256, so this cache maps that
hash to what the verification found (the key's id, role and lookup; its tenant's id, name,
``is_active`` and ``max_backlog``) for ``CLOACINA_AUTH_CACHE_TTL_S`` seconds (default 5, at
most :data:`MAX_TTL_S`; 0 turns the cache off).  Only keys that verified are kept: a wrong
token costs its query every time and cannot grow the cache.

Only the users' keys (read and write: the start-and-poll path) are cached.  Agent keys are
verified on every request: the platform revokes them itself (actuators, evictions) and a
revoked agent must lose its artifacts and its results at once on every server process
(docs/threat-model.md); admin keys are rare and powerful.  Both are a small share of requests.

Revocation and tenant changes:

* in this process, at once: revoking a key (``fleet.executors.fleet.lifecycle``) forgets it;
  saving or deleting a tenant or a key through the ORM (the tenant limits in
  ``fleet.control.limits``, the Django admin, the console) forgets the tenant's or the key's
  entries, now and again when the transaction commits;
* in other server processes: when their entry expires, within the TTL.

Each hit builds fresh model instances: nothing is shared between requests, and a tenant field
that is not cached (``desired_count``, …) is loaded from the database when first read.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime

from django.db import transaction
from django.db.models.signals import post_delete, post_save

from fleet.platform.config import get_config
from fleet.platform.tenancy import ApiKey, Role, Tenant

MAX_TTL_S = 60.0  # a revocation must reach every server process within this, whatever is set
MAX_ENTRIES = 10_000  # verified keys only; past this the cache starts over
DB_ALIAS = "default"
# Loaded on a hit, in the models' field order (Model.from_db takes them in that order).
TENANT_FIELDS = ("id", "name", "is_active", "max_backlog")
CACHED_ROLES = frozenset({Role.READ, Role.WRITE})
KEY_FIELDS = ("id", "tenant_id", "role", "lookup", "last_used_at", "revoked_at")


@dataclass(frozen=True, slots=True)
class VerifiedKey:
    """What verifying a key found, and until when (``time.monotonic``) it may be reused."""

    key_id: int
    role: str
    lookup: str
    last_used_at: datetime | None
    tenant: tuple | None  # the TENANT_FIELDS values; None for a platform (admin) key
    expires_at: float

    def api_key(self) -> ApiKey:
        """A fresh ApiKey (with its tenant) as the verification loaded it."""
        tenant = Tenant.from_db(DB_ALIAS, TENANT_FIELDS, self.tenant) if self.tenant else None
        key = ApiKey.from_db(
            DB_ALIAS,
            KEY_FIELDS,
            (
                self.key_id,
                tenant.pk if tenant else None,
                self.role,
                self.lookup,
                self.last_used_at,
                None,
            ),
        )
        key.tenant = tenant
        return key


_entries: dict[str, VerifiedKey] = {}
_lock = threading.Lock()


def ttl_s() -> float:
    """How long a verification is reused: the configured TTL, bounded by :data:`MAX_TTL_S`."""
    return min(get_config().auth_cache_ttl_s, MAX_TTL_S)


def lookup(key_hash: str) -> ApiKey | None:
    """The cached verification of the key whose hash is ``key_hash``, if still fresh."""
    entry = _entries.get(key_hash)
    if entry is None:
        return None
    if entry.expires_at <= time.monotonic():
        with _lock:
            if _entries.get(key_hash) is entry:
                del _entries[key_hash]
        return None
    return entry.api_key()


def remember(key_hash: str, key: ApiKey) -> None:
    """Keep ``key`` (just verified, with its tenant loaded) for the TTL, if a user's key."""
    ttl = ttl_s()
    if ttl <= 0 or key.role not in CACHED_ROLES:
        return
    tenant = key.tenant if key.tenant_id else None
    entry = VerifiedKey(
        key_id=key.pk,
        role=key.role,
        lookup=key.lookup,
        last_used_at=key.last_used_at,
        tenant=tuple(getattr(tenant, name) for name in TENANT_FIELDS) if tenant else None,
        expires_at=time.monotonic() + ttl,
    )
    with _lock:
        if len(_entries) >= MAX_ENTRIES:
            _entries.clear()
        _entries[key_hash] = entry


def note_used(key_hash: str, when: datetime) -> None:
    """The key's ``last_used_at`` was just written: keep the entry in step, so it is not
    written again on every request until the entry expires."""
    with _lock:
        entry = _entries.get(key_hash)
        if entry is not None:
            _entries[key_hash] = replace(entry, last_used_at=when)


def forget_key(key_id: int) -> None:
    """Drop the entries of the key ``key_id`` (revoked, changed or deleted)."""
    _now_and_on_commit(lambda entry: entry.key_id == key_id)


def forget_tenant(tenant_id: int) -> None:
    """Drop the entries of every key of tenant ``tenant_id`` (deactivated, changed, deleted)."""
    _now_and_on_commit(lambda entry: entry.tenant is not None and entry.tenant[0] == tenant_id)


def clear() -> None:
    with _lock:
        _entries.clear()


def _now_and_on_commit(matches: Callable[[VerifiedKey], bool]) -> None:
    # Now, for this transaction's own later requests; inside a transaction, again after the
    # commit, because another thread may have cached the old row meanwhile.
    _forget(matches)
    if transaction.get_connection().in_atomic_block:
        transaction.on_commit(lambda: _forget(matches))


def _forget(matches: Callable[[VerifiedKey], bool]) -> None:
    with _lock:
        for key_hash in [h for h, entry in _entries.items() if matches(entry)]:
            del _entries[key_hash]


def _tenant_changed(sender, instance: Tenant, **kwargs) -> None:
    forget_tenant(instance.pk)


def _key_changed(sender, instance: ApiKey, **kwargs) -> None:
    forget_key(instance.pk)


post_save.connect(_tenant_changed, sender=Tenant, dispatch_uid="key_cache.tenant_saved")
post_delete.connect(_tenant_changed, sender=Tenant, dispatch_uid="key_cache.tenant_deleted")
post_save.connect(_key_changed, sender=ApiKey, dispatch_uid="key_cache.key_saved")
post_delete.connect(_key_changed, sender=ApiKey, dispatch_uid="key_cache.key_deleted")
