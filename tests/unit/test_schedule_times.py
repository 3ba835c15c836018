"""Cron fire times (fleet/platform/cron.py) and the schedule policies (fleet/schedules/policy.py):
pure functions, no database."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest

from artifacts.store import manifest
from fleet.models import Catchup, Overlap
from fleet.platform.cron import CronError, parse_cron
from fleet.schedules.policy import OverlapAction, Planned, overlap_action, plan_catchup

NEW_YORK = ZoneInfo("America/New_York")


def utc(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)


def local(times: list[datetime], zone: ZoneInfo = NEW_YORK) -> list[str]:
    return [t.astimezone(zone).isoformat() for t in times]


# --- expressions ----------------------------------------------------------------------


def test_five_fields_fire_on_the_minute():
    cron = parse_cron("*/15 9 * * *")
    assert cron.fire_times(utc(2026, 1, 1), utc(2026, 1, 1, 10), 10) == [
        utc(2026, 1, 1, 9, 0),
        utc(2026, 1, 1, 9, 15),
        utc(2026, 1, 1, 9, 30),
        utc(2026, 1, 1, 9, 45),
    ]


def test_six_fields_put_seconds_first():
    cron = parse_cron("*/20 30 * * * *")
    assert cron.fire_times(utc(2026, 1, 1), utc(2026, 1, 1, 0, 31), 10) == [
        utc(2026, 1, 1, 0, 30, 0),
        utc(2026, 1, 1, 0, 30, 20),
        utc(2026, 1, 1, 0, 30, 40),
    ]


def test_day_of_week_numbers_are_crontab_ones():
    # 1-5 is Monday..Friday (APScheduler 3 alone would read Tuesday..Saturday); 0 and 7 Sunday.
    weekdays = parse_cron("0 9 * * 1-5").fire_times(utc(2026, 1, 4), utc(2026, 1, 11), 10)
    assert [t.strftime("%a") for t in weekdays] == ["Mon", "Tue", "Wed", "Thu", "Fri"]
    sundays = parse_cron("0 9 * * 0,7").fire_times(utc(2026, 1, 1), utc(2026, 1, 15), 10)
    assert [t.strftime("%a %d") for t in sundays] == ["Sun 04", "Sun 11"]
    named = parse_cron("0 9 * * sat").fire_times(utc(2026, 1, 1), utc(2026, 1, 8), 10)
    assert [t.strftime("%a") for t in named] == ["Sat"]


def test_next_after_is_strictly_after():
    cron = parse_cron("0 * * * *")
    assert cron.next_after(utc(2026, 1, 1, 5)) == utc(2026, 1, 1, 6)
    assert cron.next_after(utc(2026, 1, 1, 5, 0, 0) - timedelta(microseconds=1)) == utc(
        2026, 1, 1, 5
    )


@pytest.mark.parametrize(
    ("expression", "zone", "message"),
    [
        ("* * *", "UTC", "has 3 fields; it needs 5"),
        ("* * * * * * *", "UTC", "has 7 fields"),
        ("61 * * * *", "UTC", "bad cron expression '61 * * * *'"),
        ("0 0 30 2 *", "UTC", "never fires"),
        ("0 9 * * 8", "UTC", "day-of-week '8' must be within 0-7"),
        ("", "UTC", "non-empty string"),
        ("* * * * *", "Mars/Olympus", "unknown timezone 'Mars/Olympus'"),
        ("* * * * *", "../../etc/passwd", "unknown timezone"),
    ],
)
def test_bad_expressions_and_zones_name_the_problem(expression, zone, message):
    with pytest.raises(CronError, match=None) as caught:
        parse_cron(expression, zone)
    assert message in str(caught.value)


# --- DST and leap days ----------------------------------------------------------------


def test_spring_forward_gap_fires_once_at_the_next_valid_instant():
    # 2026-03-08: New York's clocks jump 02:00 EST -> 03:00 EDT; 02:30 does not exist.
    cron = parse_cron("30 2 * * *", "America/New_York")
    times = cron.fire_times(utc(2026, 3, 7), utc(2026, 3, 10), 10)
    assert local(times) == [
        "2026-03-07T02:30:00-05:00",
        "2026-03-08T03:00:00-04:00",  # once, the first instant after the gap
        "2026-03-09T02:30:00-04:00",
    ]


def test_spring_forward_gap_collapses_onto_an_existing_fire_time_once():
    cron = parse_cron("*/30 * * * *", "America/New_York")
    times = cron.fire_times(utc(2026, 3, 8, 6), utc(2026, 3, 8, 8), 10)
    assert local(times) == [
        "2026-03-08T01:30:00-05:00",
        "2026-03-08T03:00:00-04:00",  # 02:00, 02:30 and 03:00 all land here: once
        "2026-03-08T03:30:00-04:00",
        "2026-03-08T04:00:00-04:00",
    ]


def test_autumn_repeat_fires_once():
    # 2026-11-01: 02:00 EDT -> 01:00 EST; 01:30 happens twice and runs at the first.
    cron = parse_cron("30 1 * * *", "America/New_York")
    times = cron.fire_times(utc(2026, 10, 31), utc(2026, 11, 3), 10)
    assert local(times) == [
        "2026-10-31T01:30:00-04:00",
        "2026-11-01T01:30:00-04:00",
        "2026-11-02T01:30:00-05:00",
    ]
    every_half_hour = parse_cron("*/30 * * * *", "America/New_York")
    repeated = every_half_hour.fire_times(utc(2026, 11, 1, 4, 45), utc(2026, 11, 1, 7, 15), 10)
    assert local(repeated) == [
        "2026-11-01T01:00:00-04:00",
        "2026-11-01T01:30:00-04:00",
        "2026-11-01T02:00:00-05:00",  # the repeated 01:00 and 01:30 (EST) did not fire again
    ]


def test_leap_day_fires_only_in_leap_years():
    cron = parse_cron("0 12 29 2 *", "Europe/Paris")
    times = cron.fire_times(utc(2026, 1, 1), utc(2033, 1, 1), 10)
    assert times == [utc(2028, 2, 29, 11), utc(2032, 2, 29, 11)]


def test_month_end_on_a_leap_year():
    cron = parse_cron("0 0 28-29 2 *")
    assert cron.fire_times(utc(2028, 2, 27), utc(2028, 3, 2), 10) == [
        utc(2028, 2, 28),
        utc(2028, 2, 29),
    ]


# --- catchup --------------------------------------------------------------------------

NOW = utc(2026, 6, 1, 12, 0, 0)
LATE = [NOW - timedelta(seconds=s) for s in (80, 60, 40)]
ON_TIME = [NOW - timedelta(seconds=1)]


def runs(plans: list[Planned]) -> list[datetime]:
    return [p.fire_time for p in plans if p.run]


def test_on_time_fire_times_always_run():
    for policy in Catchup.values:
        assert runs(plan_catchup(ON_TIME, NOW, policy, 10, 100)) == ON_TIME


def test_skip_records_every_late_time_missed():
    plans = plan_catchup(LATE + ON_TIME, NOW, Catchup.SKIP, 10, 100)
    assert runs(plans) == ON_TIME
    assert [p.fire_time for p in plans if not p.run] == LATE


def test_latest_runs_the_newest_and_misses_the_rest():
    assert runs(plan_catchup(LATE, NOW, Catchup.LATEST, 10, 100)) == [LATE[-1]]
    # With an on-time fire time, that one is the newest: no late one runs.
    assert runs(plan_catchup(LATE + ON_TIME, NOW, Catchup.LATEST, 10, 100)) == ON_TIME


def test_all_runs_the_newest_up_to_the_cap():
    assert runs(plan_catchup(LATE, NOW, Catchup.ALL, 10, 100)) == LATE
    plans = plan_catchup(LATE + ON_TIME, NOW, Catchup.ALL, 10, 2)
    assert runs(plans) == LATE[1:] + ON_TIME
    assert [p.fire_time for p in plans if not p.run] == LATE[:1]


def test_a_truncated_backlog_is_missed_whatever_the_policy():
    for policy in Catchup.values:
        assert runs(plan_catchup(LATE, NOW, policy, 10, 100, truncated=True)) == []


def test_grace_decides_late():
    assert runs(plan_catchup(LATE, NOW, Catchup.SKIP, 90, 100)) == LATE


# --- overlap --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "busy", "action"),
    [
        (Overlap.ALLOW, True, OverlapAction.START),
        (Overlap.SKIP, True, OverlapAction.SKIP),
        (Overlap.CANCEL_PREVIOUS, True, OverlapAction.CANCEL_THEN_START),
        (Overlap.SKIP, False, OverlapAction.START),
        (Overlap.CANCEL_PREVIOUS, False, OverlapAction.START),
    ],
)
def test_overlap_actions(policy, busy, action):
    assert overlap_action(policy, busy) is action


def test_manifest_policy_names_are_the_models():
    assert manifest.CATCHUP_POLICIES == tuple(Catchup.values)
    assert manifest.OVERLAP_POLICIES == tuple(Overlap.values)


# --- [[schedules]] in cloacina.toml -----------------------------------------------------

TASKS = [{"id": "a", "function": "demo.steps:a"}]


def parse_with(block: str) -> dict:
    from artifacts.store.testing import manifest_toml

    return manifest.parse_manifest(manifest_toml(TASKS) + block)


def test_declared_schedules_are_normalised_and_absent_when_none():
    assert "schedules" not in parse_with("")
    parsed = parse_with('\n[[schedules]]\ncron = "0  6 * * *"\n')
    assert parsed["schedules"] == [
        {"cron": "0 6 * * *", "timezone": "UTC", "context": {}, "catchup": "skip",
         "overlap": "allow", "enabled": True},
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("block", "message"),
    [
        ('[[schedules]]\ncron = "0 6 * * *"\n[[schedules]]\ncron = "0 6 * * *"\n', "repeats"),
        ('[[schedules]]\ncron = "* * * * *"\ncontext = { k = "a\\u0000b" }\n', "NUL"),
        ('[[schedules]]\ncron = "* * * * *"\ncontext = { at = 1979-05-27 }\n', "JSON values"),
        ('[[schedules]]\ncron = "* * * * *"\nenabled = "yes"\n', "enabled must be true or false"),
        ("".join(f'[[schedules]]\ncron = "{m} * * * *"\n' for m in range(60))
         + "".join(f'[[schedules]]\ncron = "{m} 1 * * *"\n' for m in range(41)), "limit is 100"),
    ],
)  # fmt: skip
def test_declared_schedules_refused_with_the_reason(block, message):
    with pytest.raises(manifest.ManifestError) as caught:
        parse_with("\n" + block)
    assert message in str(caught.value)


def test_schedules_must_be_an_array_of_tables():
    from artifacts.store.testing import manifest_toml

    with pytest.raises(manifest.ManifestError, match="array of tables"):
        manifest.parse_manifest('schedules = "daily"\n' + manifest_toml(TASKS))
