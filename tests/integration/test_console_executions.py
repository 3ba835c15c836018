"""Executions: the filtered list, the task graph by dependency layer, and cancel."""

from __future__ import annotations

import json

from fleet.console.executions import dependency_layers
from fleet.models import TaskExecution, WorkflowExecution
from tests.support.console import HX, make_agent
from tests.support.factories import finish, publish_example, start, tasks_of


def _ids(body: str) -> list[str]:
    return [chunk.split("</code>")[0] for chunk in body.split("<code>")[1:]]


def test_it_lists_executions_with_task_counts(reader_client, tenant):
    publish_example(tenant)
    execution, tasks = start(tenant, "etl", {})
    finish(tasks["extract"])
    body = reader_client.get("/console/executions/").content.decode()
    assert str(execution.pk)[:8] in body
    assert "1/4 done" in body and "etl-demo 1.0.0" in body


def test_it_filters_by_status(admin_client, tenant):
    publish_example(tenant)
    running, _ = start(tenant, "etl", {})
    failed, _ = start(tenant, "etl", {})
    WorkflowExecution.objects.filter(pk=failed.pk).update(
        status="Failed", error="task(s) failed: x"
    )
    body = admin_client.get("/console/executions/?status=Failed").content.decode()
    assert _ids(body) == [str(failed.pk)[:8]]
    assert "with status Failed" in body and "level-bad" in body
    assert _ids(admin_client.get("/console/executions/?status=Pending").content.decode()) == [
        str(running.pk)[:8]
    ]
    response = admin_client.get("/console/executions/partials/table/?status=Exploded", **HX)
    assert response.status_code == 400
    assert json.loads(response.content)["detail"].startswith("status must be one of Pending,")


def test_it_paginates(admin_client, tenant):
    publish_example(tenant)
    for _ in range(27):
        start(tenant, "etl", {})
    assert len(_ids(admin_client.get("/console/executions/").content.decode())) == 25
    second = admin_client.get("/console/executions/?page=2").content.decode()
    assert len(_ids(second)) == 2 and "page 2 of 2" in second


def test_a_member_sees_only_its_tenants_executions(writer_client, tenant, other_tenant):
    publish_example(tenant)
    publish_example(other_tenant)
    mine, _ = start(tenant, "etl", {})
    theirs, _ = start(other_tenant, "etl", {})
    body = writer_client.get("/console/executions/partials/table/").content.decode()
    assert _ids(body) == [str(mine.pk)[:8]]
    assert writer_client.get(f"/console/executions/{theirs.pk}/").status_code == 404


def test_dependency_layers_of_the_diamond(tenant):
    publish_example(tenant)
    execution, _ = start(tenant, "etl", {})
    layers = dependency_layers(list(TaskExecution.objects.filter(workflow_execution=execution)))
    assert [[t.task_name for t in layer] for layer in layers] == [
        ["extract"],
        ["transform_a", "transform_b"],
        ["load"],
    ]


def test_the_detail_page_shows_each_tasks_state_attempts_agent_and_error(admin_client, tenant):
    publish_example(tenant)
    execution, tasks = start(tenant, "etl", {})
    finish(tasks["extract"], "failure", error_type="ValueError", error_message="marker missing")
    body = admin_client.get(f"/console/executions/{execution.pk}/").content.decode()
    extract = body[
        body.index('data-task="extract"') : body.index(
            "</article>", body.index('data-task="extract"')
        )
    ]
    assert "attempt</dt><dd>1 of 3" in extract
    assert "ValueError" in extract and "marker missing" in extract
    assert "Ready" in extract  # retried: back to Ready after the backoff
    load = body[body.index('data-task="load"') :]
    assert "transform_a, transform_b" in load
    assert (
        body.index('data-task="extract"')
        < body.index('data-task="transform_a"')
        < body.index('data-task="load"')
    )
    assert 'hx-trigger="every 2s"' in body  # still running: the graph polls


def test_the_detail_names_the_agent_and_the_wait_reason(admin_client, tenant):
    publish_example(tenant)
    execution, tasks = start(tenant, "etl", {})
    agent = make_agent(tenant, "agent-7")
    TaskExecution.objects.filter(pk=tasks["extract"].pk).update(
        status="Running", agent=agent, attempt=1
    )
    TaskExecution.objects.filter(pk=tasks["transform_a"].pk).update(
        wait_reason="no live agent of tenant acme can load this artifact"
    )
    body = admin_client.get(f"/console/executions/{execution.pk}/partials/graph/").content.decode()
    assert "agent-7" in body
    assert "waiting: no live agent of tenant acme can load this artifact" in body


def test_a_finished_execution_stops_polling_and_shows_its_final_context(admin_client, tenant):
    publish_example(tenant)
    execution, tasks = start(tenant, "etl", {"x": 1})
    finish(tasks["extract"], output={"rows": 3})
    for name in ("transform_a", "transform_b"):
        finish(tasks_of(execution)[name])
    finish(tasks_of(execution)["load"], output={"loaded": True})
    body = admin_client.get(f"/console/executions/{execution.pk}/partials/graph/").content.decode()
    assert 'id="execution-status">Completed<' in body
    assert "hx-trigger" not in body
    # Nor an hx-get on the graph: htmx would reload it on every click inside (a log link).
    assert '<section id="execution-graph" >' in body
    assert "&#x27;loaded&#x27;: True" in body and "Cancel execution" not in body


def test_a_writer_cancels_an_execution(writer_client, tenant):
    publish_example(tenant)
    execution, _ = start(tenant, "etl", {})
    response = writer_client.post(f"/console/executions/{execution.pk}/cancel/", **HX)
    assert response.status_code == 204
    execution.refresh_from_db()
    assert execution.status == "Cancelled"
    again = writer_client.post(f"/console/executions/{execution.pk}/cancel/", **HX)
    assert again.status_code == 409
    assert json.loads(again.content)["detail"] == "execution is already Cancelled"


def test_a_reader_sees_a_disabled_cancel_button(reader_client, tenant):
    publish_example(tenant)
    execution, _ = start(tenant, "etl", {})
    body = reader_client.get(f"/console/executions/{execution.pk}/").content.decode()
    assert 'disabled title="your role in acme is read-only"' in body


def test_an_unknown_execution_is_404(admin_client, db):
    response = admin_client.get("/console/executions/00000000-0000-0000-0000-000000000000/")
    assert response.status_code == 404


CHAIN = 2000


def test_the_detail_page_of_a_2000_task_chain_renders(admin_client, tenant):
    """Each task depends on the one before: the layering used to recurse once per link
    and turned the page into a 500 (RecursionError)."""
    from tests.support.factories import make_package

    # Listed end first, so the layering meets the deepest task before any of its chain.
    tasks = [
        {"id": f"t{i}", "function": "demo.steps:a", "dependencies": [f"t{i - 1}"]}
        for i in range(CHAIN - 1, 0, -1)
    ] + [{"id": "t0", "function": "demo.steps:a"}]
    make_package(tenant, tasks, "def a(context):\n    return None\n")
    execution, _ = start(tenant, "demo", {})
    for url in (
        f"/console/executions/{execution.pk}/",
        f"/console/executions/{execution.pk}/partials/graph/",
    ):
        response = admin_client.get(url)
        assert response.status_code == 200, url
    layers = dependency_layers(list(TaskExecution.objects.filter(workflow_execution=execution)))
    assert [[t.task_name for t in layer] for layer in layers] == [[f"t{i}"] for i in range(CHAIN)]


def test_dependency_layers_put_a_task_after_its_deepest_dependency(tenant):
    """Shared dependencies (reached twice) and a long and a short path to one task."""
    from types import SimpleNamespace

    graph = {"a": [], "b": ["a"], "c": ["b"], "d": ["a", "c"], "e": ["a", "b"], "f": ["e", "d"]}
    tasks = [
        SimpleNamespace(task_name=k, dependencies=v, position=i)
        for i, (k, v) in enumerate(graph.items())
    ]
    layers = dependency_layers(tasks)
    assert [[t.task_name for t in layer] for layer in layers] == [
        ["a"], ["b"], ["c", "e"], ["d"], ["f"]
    ]  # fmt: skip
