import pytest

from fleet.executors.fleet.lifecycle import revoke_key
from fleet.models import ApiKey


@pytest.mark.django_db
def test_it_stores_only_a_hash(tenant):
    key, token = ApiKey.mint("write", tenant=tenant)
    key.refresh_from_db()
    assert token not in (key.key_hash, key.lookup)
    assert ApiKey.verify(token) == key


@pytest.mark.django_db
def test_it_rejects_revoked_and_forged_keys(tenant):
    key, token = ApiKey.mint("read", tenant=tenant)
    assert ApiKey.verify(token[:-1] + ("A" if token[-1] != "A" else "B")) is None
    assert revoke_key(key)
    assert ApiKey.verify(token) is None
    assert not revoke_key(key)


@pytest.mark.django_db
def test_admin_keys_are_platform_wide(tenant):
    with pytest.raises(ValueError):
        ApiKey.mint("admin", tenant=tenant)
    with pytest.raises(ValueError):
        ApiKey.mint("write")
