"""Context flows down the DAG: a task sees the outputs of all its upstream tasks."""

from __future__ import annotations

from fleet.engine.context import upstream_order


def test_ancestors_come_once_each_after_their_own_ancestors():
    graph = {
        "extract": ([], None),
        "transform_a": (["extract"], None),
        "transform_b": (["extract"], None),
        "load": (["transform_a", "transform_b"], None),
    }
    assert upstream_order(["transform_a", "transform_b"], graph) == [
        "extract",
        "transform_a",
        "transform_b",
    ]
    assert upstream_order(["transform_b", "transform_a"], graph) == [
        "extract",
        "transform_b",
        "transform_a",
    ]


def test_a_long_chain_does_not_recurse():
    graph = {str(i): ([str(i - 1)] if i else [], None) for i in range(5000)}
    assert upstream_order(["4999"], graph) == [str(i) for i in range(5000)]
