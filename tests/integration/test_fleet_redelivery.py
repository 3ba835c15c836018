"""Redelivery rules, the agent's hello, received confirmations, and pruning of acked rows."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from fleet.executors.fleet.delivery.placement import place_task
from fleet.executors.fleet.delivery.pruning import prune_acked
from fleet.executors.fleet.delivery.redelivery import (
    apply_hello,
    mark_received,
    mark_running_received,
    redeliver_unreceived,
)
from fleet.models import DeliveryOutbox
from tests.support.agents import make_agent
from tests.support.factories import ready_root, two_task_package


def _packet(tenant, agent, delivered_ago_s=None, received=False):
    _, task = ready_root(tenant)
    place_task(task.pk, "s")
    row = DeliveryOutbox.objects.get(task_execution=task)
    assert row.agent_id == agent.id
    if delivered_ago_s is not None:
        at = timezone.now() - timedelta(seconds=delivered_ago_s)
        DeliveryOutbox.objects.filter(pk=row.pk).update(
            state="delivered", delivered_at=at, received_at=at if received else None, attempts=1
        )
    row.refresh_from_db()
    return row


def _state(row):
    row.refresh_from_db()
    return row.state


@pytest.mark.django_db
def test_an_unconfirmed_push_is_redelivered_after_the_window(tenant):
    two_task_package(tenant)
    agent = make_agent(tenant, max_concurrency=5)
    old = _packet(tenant, agent, delivered_ago_s=60)
    fresh = _packet(tenant, agent, delivered_ago_s=1)
    assert redeliver_unreceived(10.0) == 1
    assert (_state(old), _state(fresh)) == ("pending", "delivered")
    assert old.delivered_at is None and old.attempts == 1


@pytest.mark.django_db
def test_a_received_row_of_a_live_agent_is_never_pushed_again(tenant):
    two_task_package(tenant)
    agent = make_agent(tenant)
    long_running = _packet(tenant, agent, delivered_ago_s=86400, received=True)
    assert redeliver_unreceived(0.1) == 0
    assert _state(long_running) == "delivered"


@pytest.mark.django_db
def test_rows_of_dead_agents_are_left_to_the_reclaim(tenant):
    two_task_package(tenant)
    agent = make_agent(tenant)
    row = _packet(tenant, agent, delivered_ago_s=60)
    agent.state = "dead"
    agent.save()
    assert redeliver_unreceived(10.0) == 0
    assert _state(row) == "delivered"


@pytest.mark.django_db
def test_hello_confirms_what_the_agent_holds_and_requeues_the_rest(tenant, other_tenant):
    two_task_package(tenant)
    agent = make_agent(tenant, max_concurrency=5)
    held = _packet(tenant, agent, delivered_ago_s=5)
    lost = _packet(tenant, agent, delivered_ago_s=5)
    pending = _packet(tenant, agent)
    assert apply_hello(agent.id, [(held.task_execution_id, held.assignment)]) == (1, 1)
    held.refresh_from_db()
    assert held.state == "delivered" and held.received_at is not None
    assert (_state(lost), _state(pending)) == ("pending", "pending")
    # Holding another assignment of the task is not holding this packet.
    assert apply_hello(agent.id, [(held.task_execution_id, held.assignment + 1)]) == (0, 1)
    assert _state(held) == "pending"


@pytest.mark.django_db
def test_received_frames_only_touch_the_agents_own_rows(tenant):
    two_task_package(tenant)
    mine = make_agent(tenant, "mine", max_concurrency=1)
    row = _packet(tenant, mine, delivered_ago_s=1)
    theirs = make_agent(tenant, "theirs", max_concurrency=1)
    other = _packet(tenant, theirs, delivered_ago_s=1)
    assert mark_received(mine.id, [row.id, other.id]) == 1
    other.refresh_from_db()
    assert other.received_at is None
    assert mark_running_received(theirs.id, [other.task_execution_id, row.task_execution_id]) == 1
    other.refresh_from_db()
    assert other.received_at is not None


@pytest.mark.django_db
def test_acked_rows_are_pruned_after_the_retention_window(tenant):
    two_task_package(tenant)
    agent = make_agent(tenant, max_concurrency=5)
    old = _packet(tenant, agent)
    recent = _packet(tenant, agent)
    open_row = _packet(tenant, agent, delivered_ago_s=86400)
    DeliveryOutbox.objects.filter(pk=old.pk).update(
        state="acked", acked_at=timezone.now() - timedelta(hours=2)
    )
    DeliveryOutbox.objects.filter(pk=recent.pk).update(state="acked", acked_at=timezone.now())
    assert prune_acked(3600.0, batch=1) == 1
    assert set(DeliveryOutbox.objects.values_list("pk", flat=True)) == {recent.pk, open_row.pk}


@pytest.mark.django_db
def test_a_hello_assignment_past_int_matches_nothing_instead_of_failing_the_cast(tenant):
    two_task_package(tenant)
    agent = make_agent(tenant, max_concurrency=5)
    held = _packet(tenant, agent, delivered_ago_s=5)
    lost = _packet(tenant, agent, delivered_ago_s=5)
    holding = [
        (held.task_execution_id, held.assignment),
        (lost.task_execution_id, 2**31),
        (lost.task_execution_id, 2**64 - 1),
    ]
    assert apply_hello(agent.id, holding) == (1, 1)
    assert (_state(held), _state(lost)) == ("delivered", "pending")
