"""The ranking of the candidates, on every path that reserves a slot (issue 15, seed 000):
most free slots, then healthy before degraded, then the host score, then the least
recently selected.

One fleet, five placements, each decided by one key of the ranking:

=====  ====  ========  =====  =================  =====================================
agent  free  health    score  last selected      taken at
=====  ====  ========  =====  =================  =====================================
A      3     degraded  170    never              4 — most free beats healthy B
B      2     healthy   170    never              5 — all at 2 free: best healthy score
C      3     healthy   20     a minute ago       3 — healthy beats degraded A
D      3     healthy   20     an hour ago        2 — least recently selected beats C
E      3     healthy   100    seconds ago        1 — score beats C and D
=====  ====  ========  =====  =================  =====================================

So E, D, C, A, B — and every other order of the four keys gives another sequence
(:func:`test_the_fleet_tells_every_other_order_apart` checks that on a model of the
ranking; the former order — health, score, least recently selected, then free slots —
placed B, B, E, E, E one by one and dealt B, E, D, C, B in a batch).
"""

from __future__ import annotations

import itertools
import uuid
from collections import Counter
from datetime import timedelta

import pytest
from django.db import transaction
from django.utils import timezone

from agents.models import Agent
from fleet.executors.fleet.delivery.batch_placement import place_tasks
from fleet.executors.fleet.delivery.placement import Placed, reserve_for_reclaim
from fleet.executors.fleet.routing.selectors import SCORE_TIE
from fleet.models import TaskExecution
from tests.support.factories import start
from tests.support.routing import agent, place_root, routed_package

EXPECTED = ["E", "D", "C", "A", "B"]

# name: (max_concurrency, in_flight, degraded, score, seconds since last selected)
FLEET: dict[str, tuple[int, int, bool, float, float | None]] = {
    "A": (3, 0, True, 170.0, None),
    "B": (3, 1, False, 170.0, None),
    "C": (3, 0, False, 20.0, 60.0),
    "D": (3, 0, False, 20.0, 3600.0),
    "E": (3, 0, False, 100.0, 10.0),
}


def make_fleet(tenant) -> None:
    now = timezone.now()
    for name, (slots, in_flight, degraded, score, selected_s) in FLEET.items():
        agent(
            tenant,
            name,
            max_concurrency=slots,
            in_flight=in_flight,
            # Degraded: no beat for 2.5 intervals (default 15 s; window 45 s), socket open.
            heartbeat_age_s=37.5 if degraded else 0.0,
            # The stored score is free CPU % + free memory %; every agent meets a 100 MB floor.
            metrics={
                "free_cpu_pct": score / 2,
                "memory_free_pct": score / 2,
                "free_memory_mb": 8000,
            },
            last_selected_at=None if selected_s is None else now - timedelta(seconds=selected_s),
        )


def names_of(placed: list[Placed]) -> list[str]:
    names = dict(Agent.objects.values_list("id", "name"))
    return [names[p.agent_id] for p in placed]


# -- the single reservation: a lone task, a task with selectors, a reclaimed packet -------


@pytest.mark.django_db
def test_lone_tasks_take_the_agents_in_rank_order(tenant):
    routed_package(tenant)
    make_fleet(tenant)
    placed = [place_root(tenant)[0] for _ in EXPECTED]
    assert all(isinstance(p, Placed) for p in placed), placed
    assert names_of(placed) == EXPECTED


@pytest.mark.django_db
def test_tasks_with_a_floor_take_the_agents_in_rank_order(tenant):
    routed_package(tenant, min_free_memory_mb=100)
    make_fleet(tenant)
    placed = [place_root(tenant)[0] for _ in EXPECTED]
    assert all(isinstance(p, Placed) for p in placed), placed
    assert names_of(placed) == EXPECTED


@pytest.mark.django_db
def test_reclaimed_packets_take_the_agents_in_rank_order(tenant):
    make_fleet(tenant)
    task = {"tenant_id": tenant.pk, "routing": {}}
    survivors = [reserve_for_reclaim(uuid.uuid4(), task, None) for _ in EXPECTED]
    assert [s.name for s in survivors] == EXPECTED


# -- the batch reservation: N slots in one statement ------------------------------------


@pytest.mark.django_db
def test_a_batch_deals_its_slots_in_rank_order(tenant):
    routed_package(tenant)
    make_fleet(tenant)
    # A batch of n takes the first n slots of the ranking; which task gets which slot is
    # the batch's business, so the n-th slot is what a batch of n adds to one of n - 1.
    taken: list[Counter] = [Counter()]
    for size in range(1, len(EXPECTED) + 1):
        savepoint = transaction.savepoint()
        ids = [start(tenant, "demo")[1]["a"].pk for _ in range(size)]
        placed = list(place_tasks(ids, "test-server").values())
        assert all(isinstance(p, Placed) for p in placed), placed
        assert TaskExecution.objects.filter(pk__in=ids, status="Running").count() == size
        taken.append(Counter(names_of(placed)))
        transaction.savepoint_rollback(savepoint)
    dealt = [next(iter(after - before)) for before, after in itertools.pairwise(taken)]
    assert dealt == EXPECTED


# -- the fleet above tells every order of the keys apart -------------------------------


def _model_sequence(keys: str, batch: bool) -> list[str]:
    """The placements a ranking by ``keys`` (F free, H health, S score, L least recently
    selected) makes on :data:`FLEET`, one by one or as one batch (the free-slot key
    applied per slot, the others as of the statement)."""
    agents = {
        n: {"free": s - f, "degraded": d, "score": sc, "ago": ago}
        for n, (s, f, d, sc, ago) in FLEET.items()
    }
    best = max(a["score"] for a in agents.values() if not a["degraded"])

    def key(name: str, free: int) -> tuple:
        a = agents[name]
        parts = {
            "F": -free,
            "H": a["degraded"],
            "S": -min(a["score"], best - SCORE_TIE),  # the near-best band
            "L": -(a["ago"] if a["ago"] is not None else float("inf")),
        }
        return (*(parts[k] for k in keys), name)  # the name stands in for the id

    if batch:
        slots = [(n, a["free"] - i) for n, a in agents.items() for i in range(a["free"])]
        return [n for n, free in sorted(slots, key=lambda s: key(*s))][: len(EXPECTED)]
    sequence: list[str] = []
    for _ in EXPECTED:
        free = [n for n, a in agents.items() if a["free"] > 0]
        name = min(free, key=lambda n: key(n, agents[n]["free"]))
        agents[name]["free"] -= 1
        agents[name]["ago"] = -len(sequence)  # selected now: after every earlier selection
        sequence.append(name)
    return sequence


@pytest.mark.parametrize("batch", [False, True], ids=["single", "batch"])
def test_the_fleet_tells_every_other_order_apart(batch):
    assert _model_sequence("FHSL", batch) == EXPECTED
    others = {"".join(p) for p in itertools.permutations("FHSL")} - {"FHSL"}
    assert all(_model_sequence(keys, batch) != EXPECTED for keys in others)
