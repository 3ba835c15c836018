"""Console test fixtures: users with each role, logged-in clients, fleet rows.

The fixtures are registered by the conftest.py of each layer that has console tests
(``from tests.support.console import *``); the helpers are imported by name.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone

__all__ = [
    "admin_client",
    "admin_user",
    "anon_client",
    "client_for",
    "make_agent",
    "make_eviction",
    "make_outbox_row",
    "outsider_client",
    "outsider_user",
    "reader_client",
    "reader_user",
    "writer_client",
    "writer_user",
    "HX",
    "PASSWORD",
    "with_password",
    "tenant_admin_form",
    "NO_MEMBERSHIPS",
]

HX = {"HTTP_HX_REQUEST": "true"}  # what htmx sends with every request


PASSWORD = "pw-123456"


def _user(username: str, superuser: bool = False):
    # No password: hashing one costs ~0.2 s and force_login does not need it.
    # Tests that log in through the form call ``with_password``.
    from django.contrib.auth import get_user_model

    User = get_user_model()
    create = User.objects.create_superuser if superuser else User.objects.create_user
    return create(username, f"{username}@example.com", None)


def with_password(user, password: str = PASSWORD):
    user.set_password(password)
    user.save(update_fields=["password"])
    return user


def _member(username: str, tenant, role: str):
    from fleet.models import TenantMembership

    user = _user(username)
    TenantMembership.objects.create(user=user, tenant=tenant, role=role)
    return user


def client_for(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def admin_user(db):
    return _user("root", superuser=True)


@pytest.fixture
def writer_user(tenant):
    return _member("wendy", tenant, "write")


@pytest.fixture
def reader_user(tenant):
    return _member("rita", tenant, "read")


@pytest.fixture
def outsider_user(other_tenant):
    return _member("otto", other_tenant, "write")


@pytest.fixture
def admin_client(admin_user) -> Client:
    return client_for(admin_user)


@pytest.fixture
def writer_client(writer_user) -> Client:
    return client_for(writer_user)


@pytest.fixture
def reader_client(reader_user) -> Client:
    return client_for(reader_user)


@pytest.fixture
def outsider_client(outsider_user) -> Client:
    return client_for(outsider_user)


@pytest.fixture
def anon_client(db) -> Client:
    return Client()


def make_agent(tenant, name: str, **fields):
    """An agent row as the console tests show it: 4 slots, x86_64, on server "test-server"."""
    from tests.support.agents import make_agent as agent_row

    preset = {"triple": "x86_64-unknown-linux-gnu", "max_concurrency": 4}
    return agent_row(tenant, name, connected="test-server", **{**preset, **fields})


def make_eviction(agent, minutes_ago: float = 1, **fields):
    from fleet.models import Eviction

    at = timezone.now() - timedelta(minutes=minutes_ago)
    fields.setdefault("reason", "no heartbeat for 45s")
    fields.setdefault("last_heartbeat", at - timedelta(seconds=45))
    return Eviction.objects.create(
        agent=agent, tenant=agent.tenant, agent_name=agent.name, evicted_at=at, **fields
    )


def make_outbox_row(task, agent, state: str = "pending", age_s: float = 0, assignment: int = 1):
    from fleet.models import DeliveryOutbox

    created = timezone.now() - timedelta(seconds=age_s)
    return DeliveryOutbox.objects.create(
        tenant=task.tenant,
        agent=agent,
        task_execution=task,
        assignment=assignment,
        state=state,
        payload={"task": str(task.pk)},
        created_at=created,
        updated_at=created,
        delivered_at=created if state != "pending" else None,
    )


# The management form of the Tenant admin's (empty) membership inline.
NO_MEMBERSHIPS = {
    "memberships-TOTAL_FORMS": "0",
    "memberships-INITIAL_FORMS": "0",
    "memberships-MIN_NUM_FORMS": "0",
    "memberships-MAX_NUM_FORMS": "1000",
}


def tenant_admin_form(tenant, **changes) -> dict:
    """The Django admin's Tenant change form as posted with ``tenant``'s values, then ``changes``."""
    data = {
        "is_active": "on" if tenant.is_active else "",
        "max_agents_override": ""
        if tenant.max_agents_override is None
        else tenant.max_agents_override,
        "desired_count": tenant.desired_count,
        "max_backlog": tenant.max_backlog,
        "storage_quota_bytes": ""
        if tenant.storage_quota_bytes is None
        else tenant.storage_quota_bytes,
        "reason": "",
        **NO_MEMBERSHIPS,
    }
    data.update(changes)
    return data
