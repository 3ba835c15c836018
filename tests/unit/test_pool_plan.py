"""The process and docker actuators' shared per-pool arithmetic (actuators/base.plan_pool)."""

from __future__ import annotations

from fleet.control.actuators.base import plan_pool


def age(agent: tuple[str, int]) -> int:
    return agent[1]


def test_crashed_agents_are_replaced_first_then_new_ones_started():
    plan = plan_pool(4, running=[("a", 1)], crashed=[("b", 2), ("c", 3)], age=age)
    assert plan.replace == [("b", 2), ("c", 3)]
    assert plan.start == 1
    assert plan.drain == []


def test_only_as_many_crashed_agents_are_replaced_as_are_missing():
    plan = plan_pool(2, running=[("a", 1)], crashed=[("b", 2), ("c", 3)], age=age)
    assert (plan.replace, plan.start, plan.drain) == ([("b", 2)], 0, [])


def test_a_surplus_drains_the_newest_and_replaces_nothing():
    running = [("old", 1), ("newest", 9), ("mid", 5)]
    plan = plan_pool(1, running=running, crashed=[("x", 4)], age=age)
    assert (plan.replace, plan.start) == ([], 0)
    assert plan.drain == [("newest", 9), ("mid", 5)]


def test_at_the_desired_count_nothing_changes():
    plan = plan_pool(2, running=[("a", 1), ("b", 2)], crashed=[], age=age)
    assert (plan.replace, plan.start, plan.drain) == ([], 0, [])
