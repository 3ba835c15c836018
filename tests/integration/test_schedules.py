"""Cron schedules on the database: the firing tick (exactly once, catchup, overlap,
failed_to_start), the REST API (CRUD, run now, fires, bad input, tenancy) and
package-declared schedules replaced by a newer version."""

from __future__ import annotations

import json
import threading
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.db import close_old_connections, connection
from django.test import Client

from artifacts.store.testing import build_archive, package_files
from fleet.models import Schedule, ScheduleFire, WorkflowExecution, WorkflowStatus
from fleet.platform.config import apply_overrides, reset_config
from fleet.schedules.firing import fire_due
from fleet.schedules.service import ScheduleSpec, create_schedule
from tests.support.keys import bearer

pytestmark = pytest.mark.django_db

API = "/api/v1"
T0 = datetime(2030, 1, 1, 12, 0, 0, tzinfo=UTC)


@pytest.fixture
def client() -> Client:
    return Client()


def upload(client: Client, key: str, version: str = "1.0.0", schedules: str = ""):
    files = package_files(version=version)
    files["cloacina.toml"] += schedules
    return client.post(
        f"{API}/packages",
        {"file": SimpleUploadedFile("demo.tar.gz", build_archive(files))},
        **bearer(key),
    )


@pytest.fixture
def demo(client, write_key) -> str:
    response = upload(client, write_key)
    assert response.status_code == 201, response.content
    return "demo"


@pytest.fixture
def grace():
    apply_overrides(schedule_grace_s=5.0, schedule_catchup_max=3)
    yield
    reset_config()


def every_10s(tenant, first: datetime = T0, **policies) -> Schedule:
    """A schedule firing at :00, :10, ... whose next fire time is ``first``."""
    schedule = create_schedule(tenant, ScheduleSpec("demo", "*/10 * * * * *", **policies))
    Schedule.objects.filter(pk=schedule.pk).update(next_fire_at=first)
    schedule.refresh_from_db()
    return schedule


def fires(schedule: Schedule) -> list[tuple[datetime, str]]:
    rows = ScheduleFire.objects.filter(schedule=schedule).order_by("fire_time")
    return [(f.fire_time, f.outcome) for f in rows]


def at(seconds: int) -> datetime:
    return T0 + timedelta(seconds=seconds)


# --- the tick ---------------------------------------------------------------------------


def test_a_due_schedule_fires_once_and_advances(tenant, demo, grace):
    schedule = every_10s(tenant, context={"n": 1})
    report = fire_due(now=at(1))
    assert report.outcomes == {"started": 1}
    [fire] = ScheduleFire.objects.filter(schedule=schedule)
    assert (fire.fire_time, fire.outcome) == (T0, "started")
    execution = WorkflowExecution.objects.get(pk=fire.execution_id)
    assert (execution.workflow_name, execution.input_context) == ("demo", {"n": 1})
    schedule.refresh_from_db()
    assert (schedule.next_fire_at, schedule.last_fire_at) == (at(10), T0)
    # Again at the same instant: nothing is due, nothing fires twice.
    assert fire_due(now=at(1)).outcomes == {}
    assert ScheduleFire.objects.filter(schedule=schedule).count() == 1


def test_catchup_skip_records_the_misses(tenant, demo, grace):
    schedule = every_10s(tenant)
    fire_due(now=at(62))  # down from T0 to T0+62 s: 0..50 are late, 60 is on time
    assert fires(schedule) == [(at(s), "missed") for s in range(0, 60, 10)] + [(at(60), "started")]
    schedule.refresh_from_db()
    assert schedule.next_fire_at == at(70)


def test_catchup_latest_runs_one_for_the_misses(tenant, demo, grace):
    schedule = every_10s(tenant, catchup="latest")
    fire_due(now=at(57))
    assert fires(schedule) == [(at(s), "missed") for s in range(0, 50, 10)] + [(at(50), "started")]


def test_catchup_all_runs_every_miss_up_to_the_cap(tenant, demo, grace):
    schedule = every_10s(tenant, catchup="all")
    fire_due(now=at(57))  # cap 3: the newest three late ones run
    assert fires(schedule) == [(at(s), "missed") for s in (0, 10, 20)] + [
        (at(s), "started") for s in (30, 40, 50)
    ]
    assert WorkflowExecution.objects.filter(tenant=tenant).count() == 3


def test_overlap_skip_while_the_previous_run_is_unfinished(tenant, demo, grace):
    schedule = every_10s(tenant, overlap="skip")
    fire_due(now=at(1))
    fire_due(now=at(11))
    assert fires(schedule) == [(T0, "started"), (at(10), "skipped_overlap")]
    first = ScheduleFire.objects.get(schedule=schedule, fire_time=T0).execution
    WorkflowExecution.objects.filter(pk=first.pk).update(status=WorkflowStatus.COMPLETED)
    fire_due(now=at(21))
    assert fires(schedule)[-1] == (at(20), "started")


def test_overlap_cancel_previous_cancels_through_the_engine(tenant, demo, grace):
    schedule = every_10s(tenant, overlap="cancel_previous")
    fire_due(now=at(1))
    fire_due(now=at(11))
    assert fires(schedule) == [(T0, "started"), (at(10), "started")]
    first, second = (
        ScheduleFire.objects.get(schedule=schedule, fire_time=t).execution for t in (T0, at(10))
    )
    first.refresh_from_db()
    second.refresh_from_db()
    assert (first.status, first.error) == (WorkflowStatus.CANCELLED, "cancelled by request")
    assert second.status == WorkflowStatus.PENDING


def test_overlap_allow_starts_alongside(tenant, demo, grace):
    schedule = every_10s(tenant, overlap="allow", catchup="all")
    fire_due(now=at(21))
    assert [o for _, o in fires(schedule)] == ["started"] * 3


def test_overlap_skip_applies_within_one_catch_up(tenant, demo, grace):
    schedule = every_10s(tenant, overlap="skip", catchup="all")
    fire_due(now=at(21))
    assert [o for _, o in fires(schedule)] == ["started", "skipped_overlap", "skipped_overlap"]


def test_no_package_is_failed_to_start(tenant, grace):
    schedule = every_10s(tenant)
    fire_due(now=at(1))
    [fire] = ScheduleFire.objects.filter(schedule=schedule)
    assert (fire.outcome, fire.execution_id) == ("failed_to_start", None)
    assert "no active package provides workflow 'demo'" in fire.detail
    schedule.refresh_from_db()
    assert schedule.next_fire_at == at(10)


def test_a_paused_schedule_does_not_fire(tenant, demo, grace):
    schedule = every_10s(tenant)
    Schedule.objects.filter(pk=schedule.pk).update(enabled=False)
    assert fire_due(now=at(100)).claimed == 0
    assert fires(schedule) == []


@pytest.mark.django_db(transaction=True)
def test_two_concurrent_tickers_fire_each_time_exactly_once(tenant, grace):
    from tests.support.factories import make_package

    make_package(
        tenant, [{"id": "a", "function": "demo.steps:a"}], "def a(context):\n    return None\n"
    )
    schedules = [every_10s(tenant, catchup="all") for _ in range(40)]
    barrier = threading.Barrier(2)
    errors: list[BaseException] = []

    def ticker() -> None:
        try:
            for second in (1, 11, 21, 31):
                barrier.wait(10)
                fire_due(now=at(second), batch=7)
        except BaseException as exc:  # noqa: BLE001 (reported by the assertion below)
            errors.append(exc)
        finally:
            close_old_connections()
            connection.close()

    threads = [threading.Thread(target=ticker) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []
    for schedule in schedules:
        assert fires(schedule) == [(at(s), "started") for s in (0, 10, 20, 30)]
    started = ScheduleFire.objects.filter(schedule__tenant=tenant).values_list(
        "execution_id", flat=True
    )
    assert len(set(started)) == 160
    assert WorkflowExecution.objects.filter(tenant=tenant).count() == 160


# --- the REST API -----------------------------------------------------------------------


def post(client, key, path, body):
    return client.post(
        f"{API}{path}", json.dumps(body), content_type="application/json", **bearer(key)
    )


def patch(client, key, path, body):
    return client.patch(
        f"{API}{path}", json.dumps(body), content_type="application/json", **bearer(key)
    )


def test_api_create_list_get_patch_delete(client, write_key, read_key, demo):
    response = post(
        client,
        write_key,
        "/schedules",
        {"workflow": "demo", "cron": "0 9 * * 1-5", "timezone": "Europe/Paris",
         "context": {"k": 1}, "catchup": "latest", "overlap": "skip"},
    )  # fmt: skip
    assert response.status_code == 201, response.content
    body = response.json()
    assert body["source"] == "api" and body["package"] is None
    assert body["next_fire_at"] is not None and body["last_fire_at"] is None
    schedule_id = body["id"]
    listed = client.get(f"{API}/schedules", **bearer(read_key)).json()
    assert [s["id"] for s in listed] == [schedule_id]
    one = client.get(f"{API}/schedules/{schedule_id}", **bearer(read_key)).json()
    assert (one["cron"], one["timezone"], one["context"]) == (
        "0 9 * * 1-5",
        "Europe/Paris",
        {"k": 1},
    )
    paused = patch(client, write_key, f"/schedules/{schedule_id}", {"enabled": False})
    assert paused.status_code == 200 and paused.json()["enabled"] is False
    assert paused.json()["next_fire_at"] is None
    resumed = patch(
        client, write_key, f"/schedules/{schedule_id}", {"enabled": True, "cron": "*/5 * * * *"}
    )
    assert resumed.status_code == 200 and resumed.json()["cron"] == "*/5 * * * *"
    assert resumed.json()["next_fire_at"] is not None
    assert client.delete(f"{API}/schedules/{schedule_id}", **bearer(write_key)).status_code == 204
    assert client.get(f"{API}/schedules/{schedule_id}", **bearer(read_key)).status_code == 404


@pytest.mark.parametrize(
    ("body", "detail"),
    [
        ({"workflow": "demo", "cron": "* * *"}, "has 3 fields"),
        ({"workflow": "demo", "cron": "99 * * * *"}, "bad cron expression"),
        (
            {"workflow": "demo", "cron": "* * * * *", "timezone": "Nowhere/Land"},
            "unknown timezone 'Nowhere/Land'",
        ),
        ({"workflow": "demo", "cron": "* * * * *", "catchup": "sometimes"}, "catchup"),
        ({"workflow": "demo", "cron": "* * * * *", "overlap": "queue"}, "overlap"),
        ({"workflow": "demo", "cron": "* * * * *", "enabled": "yes"}, "enabled"),
        ({"cron": "* * * * *"}, "workflow"),
        ({"workflow": "demo", "cron": "* * * * *", "context": [1]}, "context"),
    ],
)
def test_api_bad_input_is_422_naming_it_and_changes_nothing(client, write_key, body, detail):
    response = post(client, write_key, "/schedules", body)
    assert response.status_code == 422, response.content
    assert detail in response.json()["detail"]
    assert Schedule.objects.count() == 0


def test_api_bad_patch_changes_nothing(client, write_key, tenant):
    schedule = every_10s(tenant)
    response = patch(
        client, write_key, f"/schedules/{schedule.pk}", {"cron": "nope", "enabled": False}
    )
    assert response.status_code == 422 and "cron" in response.json()["detail"]
    response = patch(client, write_key, f"/schedules/{schedule.pk}", {"enabled": None})
    assert response.status_code == 422 and "enabled may not be null" in response.json()["detail"]
    again = Schedule.objects.get(pk=schedule.pk)
    assert (again.cron, again.enabled, again.next_fire_at) == (schedule.cron, True, T0)


def test_api_run_now_is_manual_and_listed_in_fires(
    client, write_key, read_key, tenant, demo, grace
):
    schedule = every_10s(tenant, overlap="skip")
    response = post(client, write_key, f"/schedules/{schedule.pk}/run", {})
    assert response.status_code == 201, response.content
    execution_id = response.json()["id"]
    fire_due(now=at(1))
    listed = client.get(f"{API}/schedules/{schedule.pk}/fires", **bearer(read_key)).json()
    by_outcome = {f["outcome"]: f for f in listed}
    assert by_outcome["manual"]["execution_id"] == execution_id
    # The manual run is unfinished, so the skip-overlap schedule skipped its fire time.
    assert by_outcome["skipped_overlap"]["fire_time"].startswith("2030-01-01T12:00:00")
    assert [f["fire_time"] for f in listed] == sorted(
        (f["fire_time"] for f in listed), reverse=True
    )


def test_api_run_now_without_a_package_is_404_and_records_nothing(client, write_key, tenant):
    schedule = every_10s(tenant)
    response = post(client, write_key, f"/schedules/{schedule.pk}/run", {})
    assert response.status_code == 404 and "no active package" in response.json()["detail"]
    assert ScheduleFire.objects.count() == 0


def test_api_another_tenants_schedule_is_404_like_a_missing_one(
    client, other_write_key, write_key, tenant
):
    schedule = every_10s(tenant)
    for missing in (schedule.pk, uuid.uuid4()):
        for method, path in (
            ("get", ""), ("patch", ""), ("delete", ""), ("post", "/run"), ("get", "/fires"),
        ):  # fmt: skip
            response = client.generic(
                method.upper(), f"{API}/schedules/{missing}{path}", "{}",
                content_type="application/json", **bearer(other_write_key),
            )  # fmt: skip
            assert response.status_code == 404, (method, path, response.content)
            assert response.json()["detail"] == f"schedule {missing} not found"
    assert Schedule.objects.get(pk=schedule.pk).enabled is True


def test_api_roles(client, read_key, tenant):
    schedule = every_10s(tenant)
    assert (
        post(client, read_key, "/schedules", {"workflow": "demo", "cron": "* * * * *"}).status_code
        == 403
    )
    assert (
        patch(client, read_key, f"/schedules/{schedule.pk}", {"enabled": False}).status_code == 403
    )
    assert client.get(f"{API}/schedules").status_code == 401


# --- declared with the package ------------------------------------------------------------

DECLARED_V1 = """
[[schedules]]
cron = "0 6 * * *"
timezone = "Europe/Paris"
catchup = "latest"

[[schedules]]
cron = "*/5 * * * *"
context = { source = "v1" }
"""
DECLARED_V2 = """
[[schedules]]
cron = "0 6 * * *"
timezone = "Europe/Paris"
catchup = "all"
overlap = "skip"

[[schedules]]
cron = "30 * * * * *"
enabled = false
"""


def declared(tenant) -> list[tuple]:
    rows = Schedule.objects.filter(tenant=tenant, source="package").order_by("cron")
    return [(s.cron, s.timezone, s.catchup, s.overlap, s.enabled, s.package_version) for s in rows]


def test_declared_schedules_follow_the_newest_version(client, write_key, tenant):
    api_made = every_10s(tenant)
    assert upload(client, write_key, "1.0.0", DECLARED_V1).status_code == 201
    assert declared(tenant) == [
        ("*/5 * * * *", "UTC", "skip", "allow", True, "1.0.0"),
        ("0 6 * * *", "Europe/Paris", "latest", "allow", True, "1.0.0"),
    ]
    kept = Schedule.objects.get(tenant=tenant, cron="0 6 * * *")
    assert upload(client, write_key, "2.0.0", DECLARED_V2).status_code == 201
    assert declared(tenant) == [
        ("0 6 * * *", "Europe/Paris", "all", "skip", True, "2.0.0"),
        ("30 * * * * *", "UTC", "skip", "allow", False, "2.0.0"),
    ]
    assert Schedule.objects.get(tenant=tenant, cron="0 6 * * *").pk == kept.pk  # history kept
    # An older version arriving late changes nothing; the API's schedule is never touched.
    assert upload(client, write_key, "1.5.0", DECLARED_V1).status_code == 201
    assert declared(tenant)[0][-1] == "2.0.0"
    assert Schedule.objects.get(pk=api_made.pk).source == "api"
    listed = client.get(f"{API}/schedules", **bearer(write_key)).json()
    assert {s["package"] for s in listed} == {None, "demo==2.0.0"}


def test_declared_schedules_pause_but_do_not_edit_through_the_api(client, write_key, tenant):
    upload(client, write_key, "1.0.0", DECLARED_V1)
    schedule = Schedule.objects.get(tenant=tenant, cron="*/5 * * * *")
    response = patch(client, write_key, f"/schedules/{schedule.pk}", {"cron": "* * * * *"})
    assert response.status_code == 409 and "cloacina.toml" in response.json()["detail"]
    assert client.delete(f"{API}/schedules/{schedule.pk}", **bearer(write_key)).status_code == 409
    response = patch(client, write_key, f"/schedules/{schedule.pk}", {"enabled": False})
    assert response.status_code == 200 and response.json()["enabled"] is False


@pytest.mark.parametrize(
    ("block", "detail"),
    [
        ('[[schedules]]\ncron = "0 25 * * *"\n', "schedules[0]: bad cron expression '0 25 * * *'"),
        (
            '[[schedules]]\ncron = "* * * * *"\ntimezone = "Moon/Base"\n',
            "unknown timezone 'Moon/Base'",
        ),
        ('[[schedules]]\ncron = "* * * * *"\ncatchup = "some"\n', "unknown catchup policy 'some'"),
        (
            '[[schedules]]\ncron = "* * * * *"\noverlap = "queue"\n',
            "unknown overlap policy 'queue'",
        ),
        ('[[schedules]]\ncron = "* * * * *"\nevery = 5\n', "unknown key 'every' in schedules[0]"),
        ('[[schedules]]\ntimezone = "UTC"\n', "schedules[0].cron is required"),
    ],
)
def test_declared_schedules_are_validated_at_upload(client, write_key, tenant, block, detail):
    response = upload(client, write_key, "1.0.0", "\n" + block)
    assert 400 <= response.status_code < 500, response.content
    assert detail in response.json()["detail"]
    assert Schedule.objects.count() == 0


def test_metrics_show_lag_and_fires_by_outcome(client, tenant, demo, grace):
    every_10s(tenant)
    fire_due(now=at(1))
    text = client.get("/metrics").content.decode()
    assert 'cloacina_schedule_fires_total{outcome="started"}' in text
    assert "cloacina_schedule_fire_lag_seconds_bucket" in text


def test_cancel_previous_within_one_catch_up_cancels_each_earlier_run(tenant, demo, grace):
    schedule = every_10s(tenant, overlap="cancel_previous", catchup="all")
    fire_due(now=at(21))
    rows = ScheduleFire.objects.filter(schedule=schedule).order_by("fire_time")
    assert [f.outcome for f in rows] == ["started"] * 3
    statuses = [WorkflowExecution.objects.get(pk=f.execution_id).status for f in rows]
    assert statuses == [WorkflowStatus.CANCELLED, WorkflowStatus.CANCELLED, WorkflowStatus.PENDING]


def test_one_schedule_failing_to_start_does_not_hold_back_the_others(tenant, demo, grace):
    good = every_10s(tenant)
    orphan = create_schedule(tenant, ScheduleSpec("no-such-workflow", "*/10 * * * * *"))
    Schedule.objects.filter(pk=orphan.pk).update(next_fire_at=T0)
    report = fire_due(now=at(1))
    assert report.outcomes == {"started": 1, "failed_to_start": 1}
    assert fires(good) == [(T0, "started")]
    assert fires(orphan) == [(T0, "failed_to_start")]


def test_the_backlog_limit_bounds_scheduled_and_manual_runs(client, write_key, tenant, demo, grace):
    tenant.max_backlog = 3  # the demo workflow has 2 tasks: one execution fits, two do not
    tenant.save()
    first, second = every_10s(tenant), every_10s(tenant)
    report = fire_due(now=at(1))
    assert report.outcomes == {"started": 1, "failed_to_start": 1}
    [refused] = ScheduleFire.objects.filter(outcome="failed_to_start")
    assert "over its max_backlog of 3" in refused.detail
    assert {refused.schedule_id} < {first.pk, second.pk}
    response = post(client, write_key, f"/schedules/{first.pk}/run", {})
    assert response.status_code == 429 and "max_backlog of 3" in response.json()["detail"]
    assert not ScheduleFire.objects.filter(outcome="manual").exists()


def test_old_fire_rows_are_pruned_after_the_retention(tenant):
    from fleet.schedules.firing import prune_fires

    schedule = every_10s(tenant)
    for days in (40, 31, 29, 1):
        ScheduleFire.objects.create(
            schedule=schedule, fire_time=T0 - timedelta(days=days), outcome="missed"
        )
    assert prune_fires(now=T0) == 2  # the default retention is 30 days
    kept = sorted((T0 - f.fire_time).days for f in ScheduleFire.objects.all())
    assert kept == [1, 29]
    apply_overrides(schedule_fire_retention_s=0)  # 0 keeps them for ever
    try:
        assert prune_fires(now=T0 + timedelta(days=365)) == 0
    finally:
        reset_config()
