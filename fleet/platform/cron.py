"""Cron expressions and their fire times, computed with APScheduler's ``CronTrigger``.

Pure functions (no database): the package store validates ``[[schedules]]`` with
them at upload, the API validates request bodies, and the schedule firing tick
computes every fire time with them.

Expressions:

- 5 fields — ``minute hour day-of-month month day-of-week`` — crontab semantics
  (``from_crontab``), with crontab's day-of-week numbers: 0 and 7 are Sunday,
  1 is Monday (APScheduler 3 numbers Monday 0; numbers are translated to names).
- 6 fields — ``second minute hour day-of-month month day-of-week``: seconds FIRST,
  then the five crontab fields.

Fire times are wall-clock times in the schedule's IANA timezone.  Across DST:

- a wall time that does not exist (spring forward: 02:30 on the night clocks jump
  from 02:00 to 03:00) fires once, at the first valid instant after the gap (03:00);
- a wall time that happens twice (autumn: 01:30 comes round again) fires once, at
  its first occurrence.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from apscheduler.triggers.cron import CronTrigger

MAX_EXPRESSION_CHARS = 120
MAX_TIMEZONE_CHARS = 64
_TICK = timedelta(microseconds=1)
_CRON_DAY_NAMES = ("sun", "mon", "tue", "wed", "thu", "fri", "sat", "sun")
_DOW_PART = re.compile(r"^(\*|\d)(?:-(\d))?(?:/(\d+))?$")
# How far ahead a next fire time is searched (a "30 2 29 2 1" needs decades; past this the
# expression is treated as never firing again).
_HORIZON = timedelta(days=366 * 30)


class CronError(ValueError):
    """A cron expression or timezone the server refuses; the message names the problem."""


def check_timezone(name: object) -> ZoneInfo:
    """The IANA timezone ``name``, or :class:`CronError` naming it."""
    if not isinstance(name, str) or not name or len(name) > MAX_TIMEZONE_CHARS:
        raise CronError(f"unknown timezone {name!r} (an IANA name such as 'Europe/Paris')")
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError, OSError):
        raise CronError(
            f"unknown timezone {name!r} (an IANA name such as 'Europe/Paris')"
        ) from None


def _crontab_day_of_week(field: str) -> str:
    """Translate crontab's numeric days (0/7 Sunday .. 6 Saturday) to the names APScheduler
    reads the same way; names and ``*`` pass through."""
    parts = []
    for part in field.split(","):
        match = _DOW_PART.match(part)
        if match is None:
            parts.append(part)  # names (mon-fri) or something CronTrigger will judge
            continue
        start, end, step = match.groups()
        if start == "*" and step is None:
            parts.append("*")
            continue
        if start == "*":
            first, last = 0, 6
        else:
            first = int(start)
            last = int(end) if end is not None else (6 if step else first)
        if not (0 <= first <= 7 and 0 <= last <= 7 and first <= last):
            raise CronError(f"day-of-week {part!r} must be within 0-7 (0 and 7 are Sunday)")
        days = range(first, last + 1, int(step) if step else 1)
        if step is not None and int(step) == 0:
            raise CronError(f"day-of-week {part!r}: the step must be at least 1")
        parts.extend(_CRON_DAY_NAMES[day] for day in days)
    return ",".join(dict.fromkeys(parts))


def _fields(expression: str) -> dict[str, str]:
    values = expression.split()
    if len(values) == 5:
        names = ("minute", "hour", "day", "month", "day_of_week")
    elif len(values) == 6:
        names = ("second", "minute", "hour", "day", "month", "day_of_week")
    else:
        raise CronError(
            f"cron expression {expression!r} has {len(values)} fields; it needs 5 "
            "(minute hour day month weekday) or 6 (second first)"
        )
    fields = dict(zip(names, values, strict=True))
    fields["day_of_week"] = _crontab_day_of_week(fields["day_of_week"])
    if len(values) == 5:
        fields["second"] = "0"
    return fields


@dataclass(frozen=True)
class Cron:
    """A parsed expression in a timezone; :meth:`next_after` gives its fire times."""

    expression: str
    timezone: ZoneInfo
    trigger: CronTrigger

    def next_after(self, instant: datetime) -> datetime | None:
        """The first fire time strictly after ``instant`` (aware), in UTC; None if never."""
        start = instant.astimezone(UTC) + _TICK
        limit = start + _HORIZON
        while start < limit:
            candidate = self.trigger.get_next_fire_time(None, start)
            if candidate is None:
                return None
            fire = _resolve(candidate, self.timezone)
            if fire is not None and fire > instant:
                return fire
            start = candidate.astimezone(UTC) + _TICK
        return None

    def fire_times(self, after: datetime, until: datetime, limit: int) -> list[datetime]:
        """Fire times in ``(after, until]``, oldest first, at most ``limit`` of them."""
        times: list[datetime] = []
        current = after
        while len(times) < limit:
            fire = self.next_after(current)
            if fire is None or fire > until:
                break
            times.append(fire)
            current = fire
        return times


def parse_cron(expression: object, timezone: object = "UTC") -> Cron:
    """Parse ``expression`` in ``timezone``, or raise :class:`CronError` naming the problem."""
    zone = check_timezone(timezone)
    if not isinstance(expression, str) or not expression.strip():
        raise CronError(f"cron expression must be a non-empty string, got {expression!r}")
    if len(expression) > MAX_EXPRESSION_CHARS or not expression.isprintable():
        raise CronError(
            f"cron expression must be at most {MAX_EXPRESSION_CHARS} printable characters"
        )
    try:
        trigger = CronTrigger(timezone=zone, **_fields(expression))
    except CronError:
        raise
    except (ValueError, TypeError) as exc:
        raise CronError(f"bad cron expression {expression!r}: {exc}") from None
    cron = Cron(" ".join(expression.split()), zone, trigger)
    if cron.next_after(datetime(2000, 1, 1, tzinfo=UTC)) is None:
        raise CronError(f"cron expression {expression!r} never fires")
    return cron


def _resolve(candidate: datetime, zone: ZoneInfo) -> datetime | None:
    """The UTC instant a trigger's wall-clock ``candidate`` fires at: None for the second
    occurrence of a repeated wall time; the end of the gap for a wall time that is skipped."""
    wall = candidate.replace(tzinfo=None)
    first = wall.replace(tzinfo=zone, fold=0)
    second = wall.replace(tzinfo=zone, fold=1)
    if first.utcoffset() == second.utcoffset():
        return first.astimezone(UTC)  # an ordinary wall time
    round_trip = first.astimezone(UTC).astimezone(zone).replace(tzinfo=None)
    if round_trip == wall:
        # A repeated wall time: it runs at its first occurrence only.
        occurrence = candidate.astimezone(UTC).astimezone(zone)
        return None if occurrence.fold == 1 else first.astimezone(UTC)
    return _gap_end(second.astimezone(UTC), first.astimezone(UTC), zone)


def _gap_end(low: datetime, high: datetime, zone: ZoneInfo) -> datetime:
    """The first whole second in ``(low, high]`` with ``high``'s UTC offset: the moment
    the clocks jumped."""
    target = high.astimezone(zone).utcoffset()
    lo, hi = int(low.timestamp()), int(high.timestamp())
    while hi - lo > 1:
        middle = (lo + hi) // 2
        if datetime.fromtimestamp(middle, zone).utcoffset() == target:
            hi = middle
        else:
            lo = middle
    return datetime.fromtimestamp(hi, UTC)
