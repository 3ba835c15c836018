"""The console complete from the browser: re-run and retry on the execution page, and the
packages page (upload, versions, builds, per-target artifacts, start with a context editor).

Writers get the forms and their posts work; readers see no form and their posts are
403; a bad request answers 4xx with the API's words and changes nothing.
"""

from __future__ import annotations

import json

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile

from artifacts.models import PackageArtifact, WorkflowPackage
from artifacts.store.testing import build_archive, example_archive, package_files
from fleet.models import ExecutionLink, TaskExecution, WorkflowExecution
from fleet.platform.config import apply_overrides, reset_config
from tests.support.console import HX
from tests.support.factories import finish, publish_example, start

pytestmark = pytest.mark.django_db(transaction=True)


def failed_execution(tenant):
    publish_example(tenant)
    execution, tasks = start(tenant, "etl", {"rows": 3})
    finish(tasks["extract"], output={"extracted": 3})
    finish(tasks["transform_a"], "failure", error_type="ValueError", error_message="bad row")
    finish(tasks["transform_b"], output={"b": 1})
    execution.refresh_from_db()
    assert execution.status == "Failed"
    return execution


def snapshot() -> tuple:
    return (
        sorted(WorkflowExecution.objects.values_list("id", "status", "input_context")),
        sorted(TaskExecution.objects.values_list("id", "status", "attempt")),
        ExecutionLink.objects.count(),
        WorkflowPackage.objects.count(),
    )


# --- the execution page -----------------------------------------------------------------


def test_a_writer_sees_retry_and_a_prefilled_rerun_editor_a_reader_sees_neither(
    writer_client, reader_client, tenant
):
    execution = failed_execution(tenant)
    page = writer_client.get(f"/console/executions/{execution.pk}/").content.decode()
    assert 'id="retry-button"' in page and 'id="rerun-form"' in page
    editor = page[page.index('id="rerun-context"') :]
    editor = editor[editor.index(">") + 1 : editor.index("</textarea>")]
    assert json.loads(editor.replace("&quot;", '"')) == {"rows": 3}
    graph = writer_client.get(f"/console/executions/{execution.pk}/partials/graph/", **HX)
    assert 'id="retry-button"' in graph.content.decode()

    read_only = reader_client.get(f"/console/executions/{execution.pk}/").content.decode()
    assert "retry-button" not in read_only and "rerun-form" not in read_only


def test_retry_from_the_console_reopens_it_and_records_the_user(writer_client, tenant):
    execution = failed_execution(tenant)
    response = writer_client.post(f"/console/executions/{execution.pk}/retry/", **HX)
    assert response.status_code == 204, response.content
    assert response["HX-Redirect"] == f"/console/executions/{execution.pk}/"
    execution.refresh_from_db()
    assert execution.status == "Running"
    statuses = dict(TaskExecution.objects.filter(workflow_execution=execution).values_list(
        "task_name", "status"))  # fmt: skip
    assert statuses == {"extract": "Completed", "transform_a": "Ready",
                        "transform_b": "Completed", "load": "NotStarted"}  # fmt: skip
    [link] = ExecutionLink.objects.all()
    assert link.actor == "console:wendy" and link.tasks == ["transform_a", "load"]
    page = writer_client.get(f"/console/executions/{execution.pk}/").content.decode()
    assert "Retried by console:wendy" in page and "retry-button" not in page  # not Failed now
    assert "retried: transform_a, load" in page  # the flash line, kept for the page


def test_rerun_from_the_console_with_an_edited_context_links_both_pages(writer_client, tenant):
    execution = failed_execution(tenant)
    response = writer_client.post(
        f"/console/executions/{execution.pk}/rerun/", {"context": '{"rows": 9}'}, **HX
    )
    assert response.status_code == 204, response.content
    new = WorkflowExecution.objects.exclude(pk=execution.pk).get()
    assert response["HX-Redirect"] == f"/console/executions/{new.pk}/"
    assert new.input_context == {"rows": 9} and new.package_id == execution.package_id
    derived = writer_client.get(f"/console/executions/{new.pk}/").content.decode()
    assert f'href="/console/executions/{execution.pk}/" data-link="rerun-of"' in derived
    assert "by console:wendy" in derived and "edited input" in derived
    original = writer_client.get(f"/console/executions/{execution.pk}/").content.decode()
    assert f'href="/console/executions/{new.pk}/" data-link="rerun"' in original
    assert "edited input" in original and "console:wendy" in original


def test_a_plain_form_rerun_without_a_context_reruns_the_same_input(writer_client, tenant):
    execution = failed_execution(tenant)
    response = writer_client.post(f"/console/executions/{execution.pk}/rerun/", {"context": ""})
    new = WorkflowExecution.objects.exclude(pk=execution.pk).get()
    assert response.status_code == 302 and response["Location"] == f"/console/executions/{new.pk}/"
    assert new.input_context == {"rows": 3}


@pytest.mark.parametrize(
    ("text", "status", "wording"),
    [
        ("{not json", 422, "not valid JSON"),
        ("[1, 2]", 422, "must be a JSON object"),
        ('"text"', 422, "must be a JSON object"),
    ],
)
def test_a_bad_context_is_refused_and_changes_nothing(writer_client, tenant, text, status, wording):
    execution = failed_execution(tenant)
    before = snapshot()
    response = writer_client.post(
        f"/console/executions/{execution.pk}/rerun/", {"context": text}, **HX
    )
    assert response.status_code == status
    assert wording in response.json()["detail"]
    assert snapshot() == before


def test_refusals_keep_the_apis_words_and_change_nothing(writer_client, reader_client, tenant):
    execution = failed_execution(tenant)
    running, _ = start(tenant, "etl", {})
    before = snapshot()
    rerun = writer_client.post(f"/console/executions/{running.pk}/rerun/", **HX)
    assert rerun.status_code == 409 and "only a finished execution" in rerun.json()["detail"]
    retry = writer_client.post(f"/console/executions/{running.pk}/retry/", **HX)
    assert retry.status_code == 409 and "only a Failed execution" in retry.json()["detail"]
    for action in ("rerun", "retry"):
        refused = reader_client.post(f"/console/executions/{execution.pk}/{action}/", **HX)
        assert refused.status_code == 403 and "read-only" in refused.json()["detail"]
    assert snapshot() == before


# --- the packages page ------------------------------------------------------------------


def test_the_packages_page_lists_versions_artifacts_and_builds(writer_client, tenant):
    from artifacts.store.services import publish_target_artifact

    publish_example(tenant)
    files = package_files(name="native-demo", kind="native", workflow="native")
    from artifacts.store.services import publish_package

    native, _ = publish_package(tenant, build_archive(files))
    publish_target_artifact(
        tenant, native.name, native.version, "aarch64-unknown-linux-gnu", build_archive(files)
    )
    page = writer_client.get(f"/console/tenants/{tenant.name}/packages/").content.decode()
    assert 'data-package="etl-demo"' in page and 'data-package="native-demo"' in page
    assert 'data-target="aarch64-unknown-linux-gnu"' in page
    artifact = PackageArtifact.objects.get()
    assert artifact.content_hash[:12] in page
    assert 'id="upload-form"' in page and 'id="start-form"' in page
    assert '<option value="etl">etl</option>' in page and 'id="tenant-builds"' in page


def test_a_reader_sees_the_lists_without_forms_and_its_posts_are_403(reader_client, tenant):
    publish_example(tenant)
    page = reader_client.get(f"/console/tenants/{tenant.name}/packages/").content.decode()
    assert 'data-package="etl-demo"' in page
    assert "upload-form" not in page and "start-form" not in page
    before = snapshot()
    upload = reader_client.post(
        f"/console/tenants/{tenant.name}/packages/upload/",
        {"file": SimpleUploadedFile("p.tar.gz", example_archive())},
        **HX,
    )
    started = reader_client.post(
        f"/console/tenants/{tenant.name}/executions/start/", {"workflow": "etl"}, **HX
    )
    assert upload.status_code == started.status_code == 403
    assert snapshot() == before


def test_upload_from_the_console_publishes_like_the_api(writer_client, tenant):
    response = writer_client.post(
        f"/console/tenants/{tenant.name}/packages/upload/",
        {"file": SimpleUploadedFile("etl.tar.gz", example_archive())},
        **HX,
    )
    assert response.status_code == 204, response.content
    page = f"/console/tenants/{tenant.name}/packages/"
    assert response["HX-Redirect"] == page
    assert WorkflowPackage.objects.get(tenant=tenant).name == "etl-demo"
    body = writer_client.get(page).content.decode()
    assert "etl-demo 1.0.0 published: workflow etl, tasks extract, transform_a" in body
    assert '<option value="etl">etl</option>' in body  # the start form offers it now
    again = writer_client.post(
        f"/console/tenants/{tenant.name}/packages/upload/",
        {"file": SimpleUploadedFile("etl.tar.gz", example_archive())},
    )
    assert again.status_code == 302 and again["Location"] == page
    assert "already stored" in writer_client.get(page).content.decode()


def test_a_bad_upload_is_refused_with_the_apis_words(writer_client, tenant):
    bad_manifest = {**package_files(), "cloacina.toml": "[package]\nname = 'x'\n"}
    cases = [
        (b"not an archive at all", 400, "bad archive"),
        (build_archive(bad_manifest), 422, "invalid package"),
    ]
    for data, status, wording in cases:
        response = writer_client.post(
            f"/console/tenants/{tenant.name}/packages/upload/",
            {"file": SimpleUploadedFile("p.tar.gz", data)},
            **HX,
        )
        assert response.status_code == status, response.content
        assert wording in response.json()["detail"]
    missing = writer_client.post(f"/console/tenants/{tenant.name}/packages/upload/", {}, **HX)
    assert missing.status_code == 400 and "choose a package file" in missing.json()["detail"]
    assert WorkflowPackage.objects.count() == 0


def test_an_oversized_upload_is_413_before_it_is_read(writer_client, tenant):
    apply_overrides(max_package_bytes=1024)
    try:
        response = writer_client.post(
            f"/console/tenants/{tenant.name}/packages/upload/",
            {"file": SimpleUploadedFile("big.tar.gz", b"x" * 4096)},
            **HX,
        )
    finally:
        reset_config()
    assert response.status_code == 413
    assert "the limit is 1024 (CLOACINA_MAX_PACKAGE_BYTES)" in response.json()["detail"]
    assert WorkflowPackage.objects.count() == 0


def test_start_from_the_console_with_a_context_opens_the_execution(writer_client, tenant):
    publish_example(tenant)
    response = writer_client.post(
        f"/console/tenants/{tenant.name}/executions/start/",
        {"workflow": "etl", "context": '{"rows": 5}'},
        **HX,
    )
    assert response.status_code == 204, response.content
    execution = WorkflowExecution.objects.get()
    assert response["HX-Redirect"] == f"/console/executions/{execution.pk}/"
    assert execution.input_context == {"rows": 5}


@pytest.mark.parametrize(
    ("form", "status", "wording"),
    [
        ({"workflow": "etl", "context": "{oops"}, 422, "not valid JSON"),
        ({"workflow": "etl", "context": "[]"}, 422, "must be a JSON object"),
        ({"workflow": "nope", "context": "{}"}, 404, "'nope'"),
        ({"context": "{}"}, 400, "choose a workflow"),
    ],
)
def test_a_bad_start_is_refused_and_starts_nothing(writer_client, tenant, form, status, wording):
    publish_example(tenant)
    response = writer_client.post(f"/console/tenants/{tenant.name}/executions/start/", form, **HX)
    assert response.status_code == status, response.content
    assert wording in response.json()["detail"]
    assert WorkflowExecution.objects.count() == 0


def test_start_over_the_backlog_is_429(writer_client, tenant):
    publish_example(tenant)
    tenant.max_backlog = 2
    tenant.save()
    response = writer_client.post(
        f"/console/tenants/{tenant.name}/executions/start/", {"workflow": "etl"}, **HX
    )
    assert response.status_code == 429 and "max_backlog" in response.json()["detail"]
    assert WorkflowExecution.objects.count() == 0
