"""A tenant's agents a page at a time: filtered by state, health, tag and pool, sorted.

One definition for ``GET /fleet`` and the console's agents table.  Filtering, sorting
and paging happen in the database, so a page costs a count and a page query whatever
the size of the fleet, and Python only touches the rows of the page.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime

from django.db.models import Case, Count, F, IntegerField, QuerySet, Value, When, Window
from django.db.models.expressions import RawSQL

from agents.models import AgentState
from fleet.control.pools import LABEL_PATTERN
from fleet.executors.fleet.routing.health import Health, health_q
from fleet.models import DEFAULT_POOL, AgentPool, Tenant
from fleet.models.pools import POOL_NAME_PATTERN, POOL_TAG_PREFIX, pool_tag
from fleet.platform.config import get_config
from fleet.platform.errors import DomainError, ErrorKind

STATES = tuple(AgentState.values)
# Ascending health reads best to worst; ``-health`` puts the worst first.
HEALTHS = (
    Health.HEALTHY, Health.DEGRADED, Health.UNHEALTHY, Health.DRAINING, Health.STOPPED,
    Health.DEAD,
)  # fmt: skip
STATE_ORDER = (AgentState.LIVE, AgentState.DRAINING, AgentState.STOPPED, AgentState.DEAD)
SORT_KEYS = ("name", "state", "health", "last_heartbeat", "in_flight", "registered_at")
SORTS = SORT_KEYS + tuple(f"-{key}" for key in SORT_KEYS)
TAG_MAX_CHARS = 200
DEFAULT_LIMIT = 100  # what GET /fleet lists without ?limit (the whole fleet of most tenants)
LIMIT_MAX = 500
OFFSET_MAX = 1_000_000_000  # PostgreSQL's OFFSET is a bigint; past this there is nothing anyway
# An agent is in the default pool when none of its tags names a pool (pool_of_tags).
IN_NAMED_POOL_SQL = (
    "EXISTS (SELECT 1 FROM jsonb_array_elements_text(tags) AS t(tag) WHERE t.tag LIKE %s)"
)


class BadListing(DomainError):
    """A filter value that names nothing: the caller is told which, nothing is listed."""


@dataclass(frozen=True)
class AgentFilter:
    state: str = ""
    health: str = ""
    tag: str = ""
    pool: str = ""
    sort: str = "name"

    def checked(self, tenant: Tenant) -> AgentFilter:
        """Itself, or BadListing (INVALID; NOT_FOUND for a pool the tenant does not have)."""
        for name, value, choices in (
            ("state", self.state, STATES),
            ("health", self.health, HEALTHS),
            ("sort", self.sort, SORTS),
        ):
            if value and value not in choices:
                raise BadListing(
                    ErrorKind.INVALID, f"{name} must be one of {', '.join(choices)}, got {value!r}"
                )
        if self.tag and (
            len(self.tag) > TAG_MAX_CHARS or not re.fullmatch(LABEL_PATTERN, self.tag)
        ):
            raise BadListing(
                ErrorKind.INVALID,
                f"tag must be an agent tag: at most {TAG_MAX_CHARS} characters, no comma or "
                "control character, no space at either end",
            )
        if self.pool and self.pool != DEFAULT_POOL:
            known = re.fullmatch(POOL_NAME_PATTERN, self.pool) and (
                AgentPool.objects.filter(tenant=tenant, name=self.pool).exists()
            )
            if not known:
                raise BadListing(ErrorKind.NOT_FOUND, f"unknown pool {self.pool!r}")
        return self

    @property
    def active(self) -> bool:
        """Whether anything narrows the list (the sort does not)."""
        return bool(self.state or self.health or self.tag or self.pool)


@dataclass
class AgentPage:
    rows: list
    total: int  # rows matching the filter, over all pages
    limit: int
    offset: int

    @property
    def next_offset(self) -> int | None:
        return self.offset + self.limit if self.offset + self.limit < self.total else None


def filter_agents(agents: QuerySet, wanted: AgentFilter, now: datetime) -> QuerySet:
    """``agents`` narrowed by ``wanted`` and in its order (name, then id, breaks ties)."""
    if wanted.state:
        agents = agents.filter(state=wanted.state)
    if wanted.health:
        agents = agents.filter(_health(wanted.health, now))
    if wanted.tag:
        agents = agents.filter(tags__contains=[wanted.tag])
    if wanted.pool == DEFAULT_POOL:
        named = RawSQL(IN_NAMED_POOL_SQL, [f"{POOL_TAG_PREFIX}_%"])
        agents = agents.alias(in_named_pool=named).filter(in_named_pool=False)
    elif wanted.pool:
        agents = agents.filter(tags__contains=[pool_tag(wanted.pool)])
    return _ordered(agents, wanted.sort or "name", now)


PAGE_TOTAL = "page_total"  # the window count each row of a page carries


def page_of(agents: QuerySet, limit: int, offset: int) -> AgentPage:
    """One page of an ordered queryset and the number of rows it was cut from, in ONE
    statement: each row carries ``count(*) OVER ()``, computed before the LIMIT (a second
    COUNT statement cost as much as the page).  Only a page past the end counts apart."""
    rows = list(agents.annotate(**{PAGE_TOTAL: Window(Count("pk"))})[offset : offset + limit])
    if not rows:
        return AgentPage([], agents.count() if offset else 0, limit, offset)
    for row in rows:  # values() rows are dicts, model rows instances
        total = row.pop(PAGE_TOTAL) if isinstance(row, dict) else getattr(row, PAGE_TOTAL)
    return AgentPage(rows, total, limit, offset)


def _health(health: str, now: datetime):
    config = get_config()
    return health_q(health, now, config.heartbeat_interval_s, config.liveness_window_s)


def _ordered(agents: QuerySet, sort: str, now: datetime) -> QuerySet:
    key = sort.removeprefix("-")
    if key == "state":
        rank = [When(state=s, then=Value(i)) for i, s in enumerate(STATE_ORDER)]
        agents = agents.alias(sort_key=Case(*rank, default=Value(9), output_field=IntegerField()))
    elif key == "health":
        rank = [When(_health(h, now), then=Value(i)) for i, h in enumerate(HEALTHS)]
        agents = agents.alias(sort_key=Case(*rank, default=Value(9), output_field=IntegerField()))
    else:
        agents = agents.alias(sort_key=F(key))
    first = F("sort_key").desc() if sort.startswith("-") else F("sort_key").asc()
    return agents.order_by(first, "name", "id")
