"""Overflow fairness: tenants take turns, then priority, then age; the backlog limit.

Here: the integration tests (database, in-process ASGI, fakes); the rest are in tests/unit/test_routing_fairness.py.
"""

from __future__ import annotations

import uuid

import pytest
from django.test import Client

from fleet.control import limits
from fleet.engine.claims import due_ready_task_events
from fleet.models import TaskExecution
from fleet.platform.config import reset_config
from tests.support.factories import start, two_task_package
from tests.support.keys import bearer


@pytest.mark.django_db
def test_the_tick_interleaves_tenants_so_a_backlog_cannot_hide_another_tenants_work(
    tenant, other_tenant
):
    two_task_package(tenant)
    two_task_package(other_tenant)
    for _ in range(30):
        start(tenant, "demo")
    _, late = start(other_tenant, "demo")
    _, urgent = start(tenant, "demo")
    TaskExecution.objects.filter(pk=urgent["a"].pk).update(priority=9)
    rows = due_ready_task_events(limit=4)
    assert [(r[4], r[5]) for r in rows] == [
        (tenant.pk, 9), (other_tenant.pk, 0), (tenant.pk, 0), (tenant.pk, 0),
    ]  # fmt: skip
    assert rows[1][0] == late["a"].pk
    assert all(isinstance(r[0], uuid.UUID) for r in rows)


@pytest.mark.django_db
def test_the_platform_backlog_limit_applies_when_the_tenant_sets_none(
    tenant, write_key, monkeypatch
):
    two_task_package(tenant)
    monkeypatch.setenv("CLOACINA_MAX_BACKLOG", "3")
    reset_config()
    try:
        client = Client()
        url = "/api/v1/workflows/demo/executions"
        ok = client.post(url, {}, content_type="application/json", **bearer(write_key))
        assert ok.status_code == 201
        refused = client.post(url, {}, content_type="application/json", **bearer(write_key))
        assert refused.status_code == 429
        assert refused.json()["detail"] == (
            "tenant 'acme' has 2 unfinished task(s); this execution adds 2, over the "
            "platform's CLOACINA_MAX_BACKLOG of 3: retry later"
        )
        assert TaskExecution.objects.count() == 2  # nothing was created by the refusal
        # A tenant's own limit wins over the platform's.  Set through the limits' owner, as
        # the admin does: this process's key cache forgets the tenant at once.
        limits.set_tenant_limits(tenant, "admin:root", "more room", max_backlog=10)
        again = client.post(url, {}, content_type="application/json", **bearer(write_key))
        assert again.status_code == 201
    finally:
        monkeypatch.delenv("CLOACINA_MAX_BACKLOG")
        reset_config()
