"""The console complete from the browser, in real headless Chromium against a live server.

A writer uploads a package (and sees a broken one refused with the API's words), sees its
version, starts an execution with the JSON context editor (which refuses bad JSON before
anything is sent), watches it fail on the execution page, re-runs it with an edited
input, and retries the original from its failed task until it completes.  A reader sees
the same pages without a single write control.  The tasks' outcomes are applied by the
test through the engine's one result handler (the live server runs no dispatch loop).

Screenshots of the new pages go to CLOACINA_SCREENSHOT_DIR (docs/screenshots refreshes the
docs), taken from this real data.
"""

from __future__ import annotations

import re

import pytest
from playwright.sync_api import expect

from artifacts.store.testing import example_archive
from fleet.models import ExecutionLink, WorkflowExecution
from tests.support.browser import login
from tests.support.console import PASSWORD, with_password
from tests.support.factories import finish, publish_example, start, tasks_of

pytestmark = [pytest.mark.browser, pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

LIVE_UPDATE_S = 5  # partials poll every 0.5 s here (fast_polling); allow for a busy machine
EXECUTION_URL = re.compile(r".*/console/executions/([0-9a-f-]{36})/$")


def _no_script_errors(page) -> list[str]:
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    return errors


def _execution_id(page) -> str:
    match = EXECUTION_URL.match(page.url)
    assert match, page.url
    return match.group(1)


def _fail_transform_a(execution_id: str) -> None:
    """extract and transform_b complete, transform_a fails: the execution is Failed."""
    execution = WorkflowExecution.objects.get(pk=execution_id)
    finish(tasks_of(execution)["extract"], output={"rows": 1200})
    finish(tasks_of(execution)["transform_b"], output={"transform_b": "ok"})
    finish(
        tasks_of(execution)["transform_a"],
        "failure",
        error_type="ValueError",
        error_message="row 17: price is not a number",
        traceback='Traceback (most recent call last):\n  File "steps.py", line 12\nValueError',
    )


def test_upload_start_rerun_and_retry_from_the_browser(
    page, live_server, writer_user, tenant, screenshot_dir
):
    errors = _no_script_errors(page)
    page.on("dialog", lambda dialog: dialog.accept())  # hx-confirm of the retry button
    login(page, live_server, with_password(writer_user).username, PASSWORD)
    page.goto(f"{live_server.url}/console/tenants/acme/packages/")
    expect(page.locator("#start-card")).to_contain_text("Upload a package first")

    # A broken archive: refused with the API's words, nothing published.
    page.set_input_files(
        "#package-file", files=[{"name": "broken.tar.gz", "mimeType": "application/gzip",
                                  "buffer": b"this is not a tar.gz"}]
    )  # fmt: skip
    page.click("#upload-button")
    expect(page.locator("#flash")).to_contain_text("400: bad archive")
    # The real package: published, listed, and its workflow offered by the start form.
    page.set_input_files(
        "#package-file", files=[{"name": "etl-demo.tar.gz", "mimeType": "application/gzip",
                                  "buffer": example_archive()}]
    )  # fmt: skip
    page.click("#upload-button")
    expect(page.locator("#flash")).to_contain_text("etl-demo 1.0.0 published: workflow etl")
    row = page.locator('#packages-table tr[data-package="etl-demo"]')
    expect(row).to_contain_text("extract, transform_a, transform_b, load")
    expect(row).to_contain_text("active")
    expect(page.locator("#start-workflow")).to_have_value("etl")

    # The context editor refuses what is not a JSON object before anything is sent.
    editor = page.locator("#start-context")
    editor.fill('{"source": "s3://bucket/day=1",}')
    expect(page.locator('[data-json-error-for="start-context"]')).to_contain_text("not valid JSON")
    page.click("#start-button")
    editor.fill('["not", "an", "object"]')
    expect(page.locator('[data-json-error-for="start-context"]')).to_contain_text(
        "must be a JSON object"
    )
    page.click("#start-button")
    assert WorkflowExecution.objects.count() == 0
    editor.fill('{"source": "s3://bucket/day=1", "rows": 1200}')
    expect(page.locator('[data-json-error-for="start-context"]')).to_have_text("")
    page.screenshot(path=str(screenshot_dir / "packages.png"), full_page=True)
    page.click("#start-button")
    page.wait_for_url(EXECUTION_URL)
    original_id = _execution_id(page)
    assert WorkflowExecution.objects.get(pk=original_id).input_context == {
        "source": "s3://bucket/day=1",
        "rows": 1200,
    }
    expect(page.locator("#flash")).to_contain_text("started")

    # It fails on the page, live; Retry appears, the re-run editor holds the input.
    _fail_transform_a(original_id)
    expect(page.locator("#execution-status")).to_have_text("Failed", timeout=LIVE_UPDATE_S * 1000)
    expect(page.locator("#retry-button")).to_be_visible()
    page.locator("#rerun-panel summary").click()
    rerun_editor = page.locator("#rerun-context")
    expect(rerun_editor).to_have_value(re.compile(r'"rows": 1200'))
    page.screenshot(path=str(screenshot_dir / "execution-failed.png"), full_page=True)

    # Re-run with an edited input: a new execution of the same version, linked both ways.
    rerun_editor.fill('{"source": "s3://bucket/day=1", "rows": 1200, "skip_bad_rows": true}')
    page.click("#rerun-button")
    page.wait_for_url(lambda url: EXECUTION_URL.match(url) and original_id not in url)
    rerun_id = _execution_id(page)
    expect(page.locator('[data-link="rerun-of"]')).to_have_attribute(
        "href", f"/console/executions/{original_id}/"
    )
    assert WorkflowExecution.objects.get(pk=rerun_id).input_context["skip_bad_rows"] is True
    page.screenshot(path=str(screenshot_dir / "execution-rerun.png"), full_page=True)

    # Back to the original, which now names its re-run; retry it from its failed task.
    page.locator('[data-link="rerun-of"]').click()
    page.wait_for_url(f"{live_server.url}/console/executions/{original_id}/")
    expect(page.locator('[data-link="rerun"]')).to_have_attribute(
        "href", f"/console/executions/{rerun_id}/"
    )
    page.click("#retry-button")
    expect(page.locator("#flash")).to_contain_text("retried: transform_a, load")
    expect(page.locator("#execution-status")).to_have_text("Running")
    expect(page.locator('[data-link="retry"]')).to_contain_text("Retried by console:wendy")
    expect(page.locator('article[data-task="extract"]')).to_contain_text("Completed")
    expect(page.locator('article[data-task="transform_a"]')).to_contain_text("Ready")
    expect(page.locator("#retry-button")).to_have_count(0)

    # The retried task and the join run; the page follows live to Completed.
    execution = WorkflowExecution.objects.get(pk=original_id)
    finish(tasks_of(execution)["transform_a"], output={"transform_a": "ok"})
    finish(tasks_of(execution)["load"], output={"loaded": 1200})
    expect(page.locator("#execution-status")).to_have_text(
        "Completed", timeout=LIVE_UPDATE_S * 1000
    )
    expect(page.locator('article[data-task="transform_a"] dd').first).to_have_text("2 of 2")
    page.screenshot(path=str(screenshot_dir / "execution-retried.png"), full_page=True)
    kinds = sorted(ExecutionLink.objects.values_list("kind", "actor"))
    assert kinds == [("rerun", "console:wendy"), ("retry", "console:wendy")]
    assert errors == []


def test_a_reader_sees_no_write_control(page, live_server, reader_user, tenant):
    errors = _no_script_errors(page)
    publish_example(tenant)
    execution, _ = start(tenant, "etl", {"rows": 3})
    _fail_transform_a(str(execution.pk))
    login(page, live_server, with_password(reader_user).username, PASSWORD)
    page.goto(f"{live_server.url}/console/tenants/acme/packages/")
    expect(page.locator('#packages-table tr[data-package="etl-demo"]')).to_be_visible()
    for control in ("#upload-form", "#start-form", "#package-file"):
        expect(page.locator(control)).to_have_count(0)
    page.goto(f"{live_server.url}/console/executions/{execution.pk}/")
    expect(page.locator("#execution-status")).to_have_text("Failed")
    for control in ("#retry-button", "#rerun-form", "#rerun-context"):
        expect(page.locator(control)).to_have_count(0)
    assert errors == []
