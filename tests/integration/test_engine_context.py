"""The shared context builder, and proof that the in-process child gets exactly its bytes.

Here: the integration tests (database, in-process ASGI, fakes); the rest are in tests/unit/test_engine_context.py.
"""

from __future__ import annotations

import json

import pytest

from fleet.engine.context import (
    build_task_context,
    encode_context,
)
from fleet.engine.db_threads import DbThreadPool
from tests.support.factories import finish, make_package, start, tasks_of
from tests.support.inprocess import drive, running_executor
from tests.support.loop import run_async

SOURCE = "def f(ctx):\n    return {}\n"


def t(task_name: str, deps: list[str] | None = None, rule: str | None = None) -> dict:
    spec = {"id": task_name, "function": "demo.steps:f"}
    if deps:
        spec["dependencies"] = deps
    if rule:
        spec["trigger_rule"] = rule
    return spec


@pytest.mark.django_db
def test_dependency_outputs_merge_over_the_input_in_the_order_the_dependencies_are_listed(tenant):
    # "d" lists c before b, the reverse of the manifest order: listed order decides.
    make_package(tenant, [t("b"), t("c"), t("d", ["c", "b"])], SOURCE)
    execution, tasks = start(tenant, "demo", {"k": "input", "only_input": 1})
    finish(tasks["b"], output={"k": "b", "from_b": 1})
    finish(tasks["c"], output={"k": "c", "from_c": 1})
    context = build_task_context(tasks["d"].pk)
    assert context == {"k": "b", "only_input": 1, "from_c": 1, "from_b": 1}
    assert list(context) == ["k", "only_input", "from_c", "from_b"]  # insertion order is kept


@pytest.mark.django_db
def test_upstream_outputs_flow_through_and_a_nearer_task_wins(tenant):
    make_package(tenant, [t("a"), t("b", ["a"]), t("c", ["b"])], SOURCE)
    _, tasks = start(tenant, "demo", {"k": "input"})
    finish(tasks["a"], output={"k": "a", "from_a": 1})
    finish(tasks["b"], output={"k": "b"})
    assert build_task_context(tasks["c"].pk) == {"k": "b", "from_a": 1}


@pytest.mark.django_db
def test_a_failed_dependency_contributes_nothing(tenant):
    make_package(tenant, [t("a"), t("b"), t("after", ["a", "b"], "all_done")], SOURCE)
    _, tasks = start(tenant, "demo", {"in": 1})
    finish(tasks["a"], output={"a": 1})
    finish(tasks["b"], "failure", error_type="E", error_message="x")
    assert build_task_context(tasks["after"].pk) == {"in": 1, "a": 1}


@pytest.mark.django_db
def test_a_root_task_gets_the_input_context(tenant):
    make_package(tenant, [t("a")], SOURCE)
    _, tasks = start(tenant, "demo", {"x": [1, 2], "y": {"z": None}})
    assert build_task_context(tasks["a"].pk) == {"x": [1, 2], "y": {"z": None}}


ECHO = """
import sys

def a(ctx):
    return {"a": "α", "n": 1.5}

def b(ctx):
    return {"b": [1, None, True]}

def d(ctx):
    return {"received": ctx}
"""


@pytest.mark.django_db(transaction=True)
def test_the_in_process_child_gets_exactly_the_shared_builders_bytes(tenant, tmp_path):
    spec = [
        {"id": "a", "function": "demo.steps:a"},
        {"id": "b", "function": "demo.steps:b"},
        {"id": "d", "function": "demo.steps:d", "dependencies": ["b", "a"]},
    ]
    make_package(tenant, spec, ECHO)
    execution, _ = start(tenant, "demo", {"input": "ünïcode", "nested": {"k": [1, 2]}})
    handed: dict[str, str] = {}
    expected: dict[str, str] = {}

    def builder_says(function: str) -> tuple[str, str]:
        task = next(x for x in tasks_of(execution).values() if x.function == function)
        return task.task_name, encode_context(build_task_context(task.pk))

    db = DbThreadPool(1, "test-context")
    with running_executor(tmp_path / "cache") as (executor, sink):
        real_run = executor.runner.run

        async def recording_run(package_dir, function, context_json, timeout_s, log=None):
            # What the shared builder says, computed independently at the moment of the run.
            task_name, expected[task_name] = await db.call(builder_says, function)
            handed[task_name] = context_json
            return await real_run(package_dir, function, context_json, timeout_s, log)

        executor.runner.run = recording_run
        try:
            run_async(drive(executor, sink, execution.pk))
        finally:
            db.close()
    assert handed == expected
    assert handed["d"] == (
        '{"input":"ünïcode","nested":{"k":[1,2]},"b":[1,null,true],"a":"α","n":1.5}'
    )
    # And the child decoded those bytes into the dict it was called with (stored as jsonb,
    # which does not keep key order, hence compared as values).
    assert tasks_of(execution)["d"].output_context["received"] == json.loads(handed["d"])
