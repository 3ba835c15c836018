"""The console's schedules page (next fire times, last outcomes, pause/resume, run now) and
the Django admin's pause action over every tenant's schedules."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from fleet.models import Schedule, ScheduleFire
from fleet.schedules.firing import fire_due
from fleet.schedules.service import ScheduleSpec, create_schedule
from tests.support.factories import make_package

pytestmark = pytest.mark.django_db

T0 = datetime(2030, 1, 1, 12, 0, 0, tzinfo=UTC)


@pytest.fixture
def schedule(tenant) -> Schedule:
    make_package(
        tenant, [{"id": "a", "function": "demo.steps:a"}], "def a(context):\n    return None\n"
    )
    schedule = create_schedule(tenant, ScheduleSpec("demo", "0 6 * * *", timezone="Europe/Paris"))
    return schedule


def page(client, tenant) -> str:
    response = client.get(f"/console/tenants/{tenant.name}/schedules/")
    assert response.status_code == 200
    return response.content.decode()


def test_the_page_shows_next_fire_time_in_the_zone_and_last_outcomes(
    writer_client, tenant, schedule
):
    Schedule.objects.filter(pk=schedule.pk).update(next_fire_at=T0)
    fire_due(now=T0)
    html = page(writer_client, tenant)
    assert "0 6 * * *" in html and "Europe/Paris" in html
    assert "2030-01-02 06:00:00 CET" in html  # the next fire after T0, in Paris time
    assert "outcome-started" in html
    partial = writer_client.get(f"/console/tenants/{tenant.name}/schedules/partials/table/")
    assert partial.status_code == 200 and "outcome-started" in partial.content.decode()


def test_pause_resume_and_run_now(writer_client, tenant, schedule):
    base = f"/console/tenants/{tenant.name}/schedules/{schedule.pk}"
    response = writer_client.post(f"{base}/pause/", HTTP_HX_REQUEST="true")
    assert response.status_code == 204 and "paused" in response["HX-Trigger"]
    assert Schedule.objects.get(pk=schedule.pk).enabled is False
    assert "paused" in page(writer_client, tenant)
    response = writer_client.post(f"{base}/resume/", HTTP_HX_REQUEST="true")
    assert response.status_code == 204
    resumed = Schedule.objects.get(pk=schedule.pk)
    assert resumed.enabled is True and resumed.next_fire_at is not None
    response = writer_client.post(f"{base}/run/", HTTP_HX_REQUEST="true")
    assert response.status_code == 204 and "manual run" in response["HX-Trigger"]
    [fire] = ScheduleFire.objects.filter(schedule=schedule)
    assert fire.outcome == "manual" and fire.execution_id is not None
    # Without htmx: a redirect back to the page.
    response = writer_client.post(f"{base}/pause/")
    assert response.status_code == 302 and response["Location"].endswith("/schedules/")


def test_a_reader_sees_but_may_not_change(reader_client, tenant, schedule):
    assert "Pause" in page(reader_client, tenant)
    response = reader_client.post(
        f"/console/tenants/{tenant.name}/schedules/{schedule.pk}/pause/", HTTP_HX_REQUEST="true"
    )
    assert response.status_code == 403 and "read-only" in response.json()["detail"]
    assert Schedule.objects.get(pk=schedule.pk).enabled is True


def test_an_outsider_gets_404(outsider_client, tenant, schedule):
    assert outsider_client.get(f"/console/tenants/{tenant.name}/schedules/").status_code == 404
    response = outsider_client.post(
        f"/console/tenants/{tenant.name}/schedules/{schedule.pk}/run/", HTTP_HX_REQUEST="true"
    )
    assert response.status_code == 404
    assert not ScheduleFire.objects.exists()


def test_the_admin_lists_every_tenants_schedules_and_pauses_them(
    admin_client, tenant, other_tenant, schedule
):
    other = create_schedule(other_tenant, ScheduleSpec("etl", "*/5 * * * *"))
    listing = admin_client.get("/admin/fleet/schedule/")
    assert listing.status_code == 200
    text = listing.content.decode()
    assert tenant.name in text and other_tenant.name in text
    response = admin_client.post(
        "/admin/fleet/schedule/",
        {"action": "pause", "_selected_action": [str(schedule.pk), str(other.pk)]},
    )
    assert response.status_code == 302
    assert set(Schedule.objects.values_list("enabled", flat=True)) == {False}
    admin_client.post(
        "/admin/fleet/schedule/", {"action": "resume", "_selected_action": [str(other.pk)]}
    )
    assert Schedule.objects.get(pk=other.pk).enabled is True
    assert Schedule.objects.get(pk=schedule.pk).enabled is False


def test_the_page_shows_each_schedules_last_five_outcomes_in_two_queries(
    writer_client, tenant, schedule, django_assert_max_num_queries
):
    from fleet.console.schedules import schedule_rows

    Schedule.objects.filter(pk=schedule.pk).update(next_fire_at=T0)
    others = [create_schedule(tenant, ScheduleSpec("demo", "0 7 * * *")) for _ in range(3)]
    for hour in range(8):
        ScheduleFire.objects.create(
            schedule=schedule, fire_time=T0.replace(hour=hour), outcome="missed"
        )
    ScheduleFire.objects.create(schedule=others[0], fire_time=T0, outcome="skipped_overlap")
    with django_assert_max_num_queries(2):
        rows = {row.schedule.pk: row for row in schedule_rows(tenant)}
    assert [f.fire_time.hour for f in rows[schedule.pk].fires] == [7, 6, 5, 4, 3]
    assert [f.outcome for f in rows[others[0].pk].fires] == ["skipped_overlap"]
    assert rows[others[1].pk].fires == []
