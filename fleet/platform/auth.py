"""Bearer-key authentication for the REST API.

Every endpoint declares which roles may call it; the key's tenant is put on
the request (``request.tenant``) and every query must be scoped by it.  A verified key is
reused for a few seconds (fleet/platform/key_cache.py: revocation is immediate in this
process, within the TTL in others).
"""

from __future__ import annotations

from django.http import HttpRequest
from django.utils import timezone
from ninja.errors import HttpError
from ninja.security import HttpBearer

from fleet.platform import key_cache
from fleet.platform.tenancy import ApiKey, Role, hash_secret

# A write key may do everything a read key may.
ROLE_IMPLIES = {
    Role.WRITE: {Role.WRITE, Role.READ},
    Role.READ: {Role.READ},
    Role.AGENT: {Role.AGENT},
    Role.ADMIN: {Role.ADMIN},
}
LAST_USED_GRANULARITY_S = 30  # don't write last_used_at on every request


class KeyAuth(HttpBearer):
    """Accepts keys whose role grants one of ``roles``; 401 for a bad key, 403 for a wrong role."""

    def __init__(self, *roles: str) -> None:
        super().__init__()
        self.roles = set(roles)

    def __call__(self, request: HttpRequest):
        header = request.headers.get("Authorization", "")
        if not header:
            raise HttpError(401, "missing Authorization: Bearer <key> header")
        return super().__call__(request)

    def authenticate(self, request: HttpRequest, token: str) -> ApiKey:
        key_hash = hash_secret(token)
        key = key_cache.lookup(key_hash) or verify_and_remember(token, key_hash)
        if key is None:
            raise HttpError(401, "invalid or revoked API key")
        if not (ROLE_IMPLIES[key.role] & self.roles):
            raise HttpError(
                403,
                f"a {key.role} key may not call this endpoint (needs {' or '.join(sorted(self.roles))})",
            )
        if touch_last_used(key):
            key_cache.note_used(key_hash, key.last_used_at)
        request.api_key = key
        request.tenant = key.tenant
        return key


def verify_and_remember(token: str, key_hash: str) -> ApiKey | None:
    """:meth:`ApiKey.verify`, the key kept in the cache when it verified."""
    key = ApiKey.verify(token)
    if key is not None:
        key_cache.remember(key_hash, key)
    return key


def touch_last_used(key: ApiKey) -> bool:
    """Record that ``key`` was used, at most once per LAST_USED_GRANULARITY_S; True if written."""
    now = timezone.now()
    if (
        key.last_used_at is None
        or (now - key.last_used_at).total_seconds() > LAST_USED_GRANULARITY_S
    ):
        ApiKey.objects.filter(pk=key.pk).update(last_used_at=now)
        key.last_used_at = now
        return True
    return False


read_auth = KeyAuth(Role.READ)
write_auth = KeyAuth(Role.WRITE)
agent_auth = KeyAuth(Role.AGENT)
admin_auth = KeyAuth(Role.ADMIN)
