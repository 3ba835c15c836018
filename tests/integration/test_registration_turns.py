"""Registrations of one tenant take turns on its roster lock, and each one's counts are
read under it (fleet/executors/fleet/lifecycle.py, ``register``: BEGIN, the lock and the
counts travel in one round trip, and PostgreSQL runs them in order): registrations
racing past the tenant's cap let in exactly the cap, never more."""

from __future__ import annotations

import pytest

from agents.models import Agent, AgentState
from fleet.executors.fleet import roster
from fleet.models import ApiKey
from fleet.platform.errors import ErrorKind
from tests.support.racing import race

pytestmark = pytest.mark.django_db(transaction=True)

CAP = 5  # above the default limit (4), which the cap never goes below
RACERS = 9
TRIPLE = "x86_64-unknown-linux-gnu"


def test_registrations_racing_past_the_cap_let_in_exactly_the_cap(agent_key, setting):
    setting(CLOACINA_MAX_REGISTERED_AGENTS=str(CAP), CLOACINA_AGENT_ADMISSIONS_PER_S="0")
    key = ApiKey.verify(agent_key)

    def register(index: int) -> str:
        try:
            roster.register(key, roster.Registration(name=f"racer-{index}", target_triple=TRIPLE))
            return "in"
        except roster.RosterError as exc:
            return "capped" if exc.kind is ErrorKind.LIMITED else repr(exc)

    outcomes = race(RACERS, register)
    assert sorted(outcomes) == ["capped"] * (RACERS - CAP) + ["in"] * CAP
    assert Agent.objects.filter(state=AgentState.LIVE).count() == CAP
