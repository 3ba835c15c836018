"""The per-process cache of verified API keys (fleet/platform/key_cache.py): what a hit
gives back, expiry, the TTL's bound, and forgetting a key or a tenant.  No database: the
models are built in memory; the REST behaviour is in tests/integration/test_rest_path.py."""

from __future__ import annotations

import pytest

from fleet.platform import key_cache
from fleet.platform.config import apply_overrides, reset_config
from fleet.platform.tenancy import ApiKey, Tenant


@pytest.fixture(autouse=True)
def fresh_cache():
    key_cache.clear()
    yield
    key_cache.clear()
    reset_config()


@pytest.fixture
def clock(monkeypatch):
    """key_cache's monotonic clock, moved by hand."""
    now = [1000.0]
    monkeypatch.setattr(key_cache.time, "monotonic", lambda: now[0])
    return now


def a_key(key_id: int = 7, tenant_id: int = 3, role: str = "write") -> ApiKey:
    tenant = Tenant(pk=tenant_id, name="acme", is_active=True, max_backlog=5, desired_count=2)
    key = ApiKey(pk=key_id, tenant=tenant, role=role, lookup=f"look{key_id}", key_hash="h")
    return key


def test_it_gives_back_a_fresh_key_with_its_tenant(clock):
    key_cache.remember("hash-a", a_key())
    first, second = key_cache.lookup("hash-a"), key_cache.lookup("hash-a")
    assert first is not second and first.tenant is not second.tenant  # nothing shared
    assert (first.pk, first.role, first.lookup, first.tenant_id) == (7, "write", "look7", 3)
    assert (first.tenant.pk, first.tenant.name, first.tenant.max_backlog) == (3, "acme", 5)
    assert first.is_active
    # What is not cached is left to load from the database when read, never guessed.
    assert first.tenant.get_deferred_fields() >= {"desired_count", "max_agents_override"}
    assert {"key_hash", "label"} <= first.get_deferred_fields()


def test_only_the_users_keys_are_cached(clock):
    """Agent keys must be refused at once on every server when revoked; admin keys are rare."""
    key_cache.remember("hash-read", a_key(1, role="read"))
    key_cache.remember("hash-agent", a_key(2, role="agent"))
    key_cache.remember(
        "hash-admin", ApiKey(pk=9, tenant=None, role="admin", lookup="a", key_hash="h")
    )
    assert key_cache.lookup("hash-read").role == "read"
    assert key_cache.lookup("hash-agent") is None and key_cache.lookup("hash-admin") is None


def test_an_entry_expires_after_the_ttl(clock):
    apply_overrides(auth_cache_ttl_s=2.0)
    key_cache.remember("hash-a", a_key())
    clock[0] += 1.9
    assert key_cache.lookup("hash-a") is not None
    clock[0] += 0.2
    assert key_cache.lookup("hash-a") is None


def test_the_ttl_is_bounded_and_zero_turns_the_cache_off(clock):
    apply_overrides(auth_cache_ttl_s=3600.0)
    assert key_cache.ttl_s() == key_cache.MAX_TTL_S == 60.0
    key_cache.remember("hash-a", a_key())
    clock[0] += 60.0
    assert key_cache.lookup("hash-a") is None  # a revocation elsewhere lands within 60 s
    apply_overrides(auth_cache_ttl_s=0.0)
    key_cache.remember("hash-a", a_key())
    assert key_cache.lookup("hash-a") is None


def test_forgetting_a_key_or_a_tenant_drops_only_theirs(clock):
    key_cache.remember("one", a_key(1, tenant_id=3))
    key_cache.remember("two", a_key(2, tenant_id=3))
    key_cache.remember("other", a_key(3, tenant_id=4))
    key_cache.forget_key(1)
    assert key_cache.lookup("one") is None and key_cache.lookup("two") is not None
    key_cache.forget_tenant(3)
    assert key_cache.lookup("two") is None
    assert key_cache.lookup("other").tenant_id == 4


def test_last_use_is_kept_in_step(clock):
    from django.utils import timezone

    key_cache.remember("hash-a", a_key())
    when = timezone.now()
    key_cache.note_used("hash-a", when)
    assert key_cache.lookup("hash-a").last_used_at == when


def test_the_cache_is_bounded(clock, monkeypatch):
    monkeypatch.setattr(key_cache, "MAX_ENTRIES", 2)
    key_cache.remember("one", a_key(1))
    key_cache.remember("two", a_key(2))
    key_cache.remember("three", a_key(3))  # full: starts over
    assert [key_cache.lookup(h) is not None for h in ("one", "two", "three")] == [
        False,
        False,
        True,
    ]
