"""Which agent pool could run a task: the static selectors judged on a pool's labels (pure)."""

from __future__ import annotations

import pytest

from fleet.executors.fleet.routing.pool_match import (
    PoolLabels,
    first_pool_for,
    labels_satisfy,
    pool_of_tags,
)
from fleet.executors.fleet.routing.selectors import Selectors

DEFAULT = PoolLabels("default", frozenset(), frozenset())
GPU = PoolLabels("gpu", frozenset({"gpu", "pool:gpu"}), frozenset({"cuda"}), gpu=1)
BIG = PoolLabels("big", frozenset({"big", "pool:big"}), frozenset())


@pytest.mark.parametrize(
    ("routing", "pool", "expected"),
    [
        ({}, DEFAULT, True),
        ({"tags": ["gpu"]}, DEFAULT, False),
        ({"tags": ["gpu"]}, GPU, True),
        ({"tags": ["gpu", "a100"]}, GPU, False),  # every tag, not any
        ({"tags": ["pool:gpu"]}, GPU, True),  # the membership tag targets the pool
        ({"capability": "cuda"}, GPU, True),
        ({"capability": "cuda"}, BIG, False),
        ({"gpu": True}, GPU, True),
        ({"gpu": True}, BIG, False),
        ({"min_free_vram_pct": 50}, GPU, True),
        ({"gpu": "A100"}, GPU, False),  # a GPU model is known only once an agent reports it
        ({"agent": "w1"}, DEFAULT, False),  # a pool never promises a name
        ({"min_free_memory_mb": 512}, DEFAULT, True),  # dynamic floors say nothing of "could"
    ],
)
def test_labels_satisfy_the_static_selectors(routing, pool, expected):
    assert labels_satisfy(Selectors.from_routing(routing), pool) is expected


def test_a_task_counts_toward_the_first_pool_that_could_run_it():
    pools = [DEFAULT, BIG, GPU]
    assert first_pool_for(Selectors.from_routing({}), pools) == "default"
    assert first_pool_for(Selectors.from_routing({"tags": ["gpu"]}), pools) == "gpu"
    assert first_pool_for(Selectors.from_routing({"tags": ["tpu"]}), pools) is None


def test_an_agent_belongs_to_the_pool_its_tag_names_else_the_default():
    assert pool_of_tags(["gpu", "pool:gpu"]) == "gpu"
    assert pool_of_tags(["gpu"]) == "default"
    assert pool_of_tags([]) == "default" and pool_of_tags(None) == "default"
    assert pool_of_tags(["pool:"]) == "default"
