"""The tenant/key/console-user CLI: idempotency, stdout hygiene, one-line errors.

Here: the integration tests (database, in-process ASGI, fakes); the rest are in tests/e2e/test_cli.py.
"""

from __future__ import annotations

import io

import pytest
from django.contrib.auth import get_user_model
from django.core.management import CommandError, call_command

from fleet.models import ApiKey, FleetChange, Tenant, TenantMembership
from fleet.platform.config import reset_config


def run(*args: str, stdin: str | None = None, monkeypatch=None) -> str:
    out = io.StringIO()
    if stdin is not None:
        monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    call_command(*args, stdout=out)
    return out.getvalue()


@pytest.fixture
def fleet_env(monkeypatch):
    monkeypatch.setenv("CLOACINA_INITIAL_AGENTS", "3")
    monkeypatch.setenv("CLOACINA_DEFAULT_MAX_AGENTS", "2")
    reset_config()
    yield
    monkeypatch.undo()
    reset_config()


@pytest.mark.django_db
def test_createtenant_seeds_desired_count_within_the_limit(fleet_env):
    assert "created tenant acme" in run("createtenant", "acme")
    tenant = Tenant.objects.get(name="acme")
    assert tenant.desired_count == 2  # min(initial 3, default max 2)
    assert tenant.max_agents_override is None
    change = FleetChange.objects.get(tenant=tenant)
    assert (change.field, change.old_value, change.new_value, change.reason) == (
        "desired_count",
        None,
        2,
        "seed",
    )


@pytest.mark.django_db
def test_createtenant_max_agents_sets_the_override(fleet_env):
    run("createtenant", "big", "--max-agents", "10")
    tenant = Tenant.objects.get(name="big")
    assert tenant.max_agents_override == 10 and tenant.desired_count == 3
    assert set(FleetChange.objects.values_list("field", flat=True)) == {
        "desired_count",
        "max_agents_override",
    }


@pytest.mark.django_db
def test_createtenant_is_idempotent():
    run("createtenant", "acme")
    assert run("createtenant", "acme", "--max-agents", "9").strip() == "tenant acme already exists"
    assert Tenant.objects.filter(name="acme").count() == 1
    assert Tenant.objects.get().max_agents_override is None  # left unchanged
    assert FleetChange.objects.count() == 1


@pytest.mark.django_db
@pytest.mark.parametrize("name", ["Acme", "a.b", "a_b", "a" * 64, "", "acme!"])
def test_createtenant_rejects_bad_names(name):
    with pytest.raises(CommandError, match="invalid tenant name"):
        call_command("createtenant", name)
    assert Tenant.objects.count() == 0


@pytest.mark.django_db
def test_createtenant_rejects_a_negative_limit():
    with pytest.raises(CommandError, match="--max-agents must be >= 0"):
        call_command("createtenant", "acme", "--max-agents", "-1")
    assert Tenant.objects.count() == 0


@pytest.mark.django_db
@pytest.mark.parametrize("role", ["agent", "read", "write"])
def test_mintkey_prints_only_a_working_key(tenant, role):
    out = run("mintkey", "--tenant", "acme", "--role", role)
    token = out.strip()
    assert out == token + "\n" and "\n" not in token
    key = ApiKey.verify(token)
    assert key is not None and key.role == role and key.tenant == tenant


@pytest.mark.django_db
def test_mintkey_admin_is_platform_wide():
    key = ApiKey.verify(run("mintkey", "--role", "admin").strip())
    assert key.role == "admin" and key.tenant is None


@pytest.mark.django_db
@pytest.mark.parametrize(
    "args, message",
    [
        (["--tenant", "nope", "--role", "read"], "unknown tenant 'nope'"),
        (["--tenant", "acme", "--role", "admin"], "admin keys are platform-wide"),
        (["--role", "write"], "pass --tenant NAME"),
    ],
)
def test_mintkey_errors(tenant, args, message):
    with pytest.raises(CommandError, match=message):
        call_command("mintkey", *args)
    assert ApiKey.objects.count() == 0


@pytest.mark.django_db
def test_createconsoleuser_member_with_password_from_stdin(tenant, monkeypatch):
    out = run(
        "createconsoleuser", "ann", "--tenant", "acme", "--role", "write", "--password-stdin",
        stdin="correct horse battery\n", monkeypatch=monkeypatch,
    )  # fmt: skip
    assert "created console user ann (write member of acme)" in out
    assert "password" not in out
    user = get_user_model().objects.get(username="ann")
    assert user.check_password("correct horse battery") and not user.is_superuser
    assert TenantMembership.objects.get(user=user).role == "write"
    # Running it again changes the role instead of duplicating anything.
    run("createconsoleuser", "ann", "--tenant", "acme", "--role", "read")
    assert TenantMembership.objects.get(user=user).role == "read"
    assert user.check_password("correct horse battery")


@pytest.mark.django_db
def test_createconsoleuser_superuser_gets_a_generated_password():
    out = run("createconsoleuser", "root", "--superuser")
    password = out.split("password: ")[1].strip()
    user = get_user_model().objects.get(username="root")
    assert user.is_superuser and user.is_staff and user.check_password(password)
    assert not TenantMembership.objects.exists()


@pytest.mark.django_db
@pytest.mark.parametrize(
    "args, message",
    [
        (["bob", "--superuser", "--tenant", "acme"], "--superuser is platform-wide"),
        (["bob", "--tenant", "acme"], "pass --tenant NAME --role"),
        (["bob", "--tenant", "nope", "--role", "read"], "unknown tenant 'nope'"),
    ],
)
def test_createconsoleuser_errors(tenant, args, message):
    with pytest.raises(CommandError, match=message):
        call_command("createconsoleuser", *args)
    assert not get_user_model().objects.exists()
