"""Observability of the hot paths on GET /metrics (issue 15, item 8): selection time on the
batch placement path and the agents' load by bounded utilisation buckets."""

from __future__ import annotations

import re

import pytest
from django.test import Client

from fleet.executors.fleet.delivery.batch_placement import place_tasks
from fleet.executors.fleet.delivery.placement import NoAgent, Placed
from tests.integration.test_fleet_batch_placement import ready_tasks, wide_package
from tests.support.agents import make_agent


def scrape() -> dict[str, float]:
    response = Client().get("/metrics")
    assert response.status_code == 200
    return {
        m.group(1): float(m.group(2))
        for m in re.finditer(
            r"^([a-z_]+(?:\{[^}]*\})?) ([0-9.e+-]+)$", response.content.decode(), re.MULTILINE
        )
    }


@pytest.mark.django_db
def test_the_batch_path_observes_the_selection_time_once_per_task(tenant):
    wide_package(tenant, 4)
    make_agent(tenant, "a", max_concurrency=1, connected="server-2")
    make_agent(tenant, "b", max_concurrency=1, connected="server-2")
    before = scrape()
    placed = place_tasks(ready_tasks(tenant), "server-1")
    assert sum(isinstance(p, Placed) for p in placed.values()) == 2
    assert sum(isinstance(p, NoAgent) for p in placed.values()) == 2
    after = scrape()
    count = "cloacina_selector_duration_seconds_count"
    total = "cloacina_selector_duration_seconds_sum"
    # One observation per task of the plain group, placed or not (as selection.select does).
    assert after[count] == before.get(count, 0) + 4
    assert after[total] > before.get(total, 0)
    assert after['cloacina_selector_duration_seconds_bucket{le="+Inf"}'] == after[count]


@pytest.mark.django_db
def test_agent_load_is_counted_per_tenant_in_six_buckets_never_per_agent(tenant, other_tenant):
    make_agent(tenant, "idle", max_concurrency=4, in_flight=0)
    make_agent(tenant, "eighth", max_concurrency=8, in_flight=1)  # 12.5 %
    make_agent(tenant, "quarter", max_concurrency=4, in_flight=1)  # 25 %: under_50
    make_agent(tenant, "half", max_concurrency=4, in_flight=2)  # 50 %: under_75
    make_agent(tenant, "three-quarters", max_concurrency=4, in_flight=3)  # under_100
    make_agent(tenant, "full", max_concurrency=2, in_flight=2)
    make_agent(tenant, "dead", max_concurrency=2, in_flight=2, state="dead", connected=False)
    make_agent(tenant, "draining", max_concurrency=2, in_flight=1, state="draining")
    make_agent(other_tenant, "other", max_concurrency=3, in_flight=3)
    metrics = scrape()

    def load(tenant_name: str) -> dict[str, float]:
        return {
            bucket: metrics[f'cloacina_fleet_agents_load{{load="{bucket}",tenant="{tenant_name}"}}']
            for bucket in ("idle", "under_25", "under_50", "under_75", "under_100", "full")
        }

    # Live agents only (as cloacina_fleet_agents_live), each in exactly one bucket.
    assert load("acme") == {
        "idle": 1, "under_25": 1, "under_50": 1, "under_75": 1, "under_100": 1, "full": 1,
    }  # fmt: skip
    assert load("globex") == {
        "idle": 0, "under_25": 0, "under_50": 0, "under_75": 0, "under_100": 0, "full": 1,
    }  # fmt: skip
    assert sum(load("acme").values()) == metrics['cloacina_fleet_agents_live{tenant="acme"}']
    assert metrics['cloacina_fleet_slots_busy{tenant="acme"}'] == 0 + 1 + 1 + 2 + 3 + 2
    assert metrics['cloacina_fleet_slots{tenant="acme"}'] == 4 + 8 + 4 + 4 + 4 + 2
    assert metrics['cloacina_fleet_slots_busy{tenant="globex"}'] == 3
    # Bounded: six series per tenant, none named after an agent.
    series = [name for name in metrics if name.startswith("cloacina_fleet_agents_load{")]
    assert len(series) == 6 * 2
    assert not any("agent" in name.split("{", 1)[1] for name in series)
