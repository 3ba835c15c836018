"""Task selectors (the manifest's per-task routing keys) compiled to SQL over ``agents_agent a``.

Every selector a task names is a filter; they are split in two, because the split is
what makes a wait transient or a failure permanent:

* **static** — what an agent *is*: its name (``agent``), ``tags`` (all of them),
  ``capability``, a GPU (``gpu = true``, or a model name matched in its reported GPUs),
  and the ``exclusive`` flag (an exclusive agent takes only work that targets it by
  name, tag or capability).  No live agent matching these → nothing could ever take
  the task → NoMatchingAgent.
* **dynamic** — what an agent *has free now*: ``min_free_memory_mb``,
  ``min_free_cpu_pct``, ``min_free_vram_pct`` (from its last heartbeat's metrics), a
  slot, a socket, a group/affinity binding.  Matching agents exist but none has it now
  → NoFreeAgent: the task waits.

Ranking among the candidates (:func:`tiebreak` and :attr:`Choice.order`, the one definition
every path uses), first key first:

1. the most free slots (``max_concurrency - in_flight``): greedy on free capacity, so load
   spreads (seed 000);
2. healthy before degraded (a late heartbeat, :mod:`~fleet.executors.fleet.routing.health`);
3. the host score, for work that is not ``tags``/``capability`` work (that work takes turns
   among its matches, the seed's round-robin): the fallback score
   ``(100 − CPU%) + free-memory% [+ 0.5 × free-VRAM% for GPU work]`` (a CPU or memory figure
   an agent does not report counts as 50; the CPU + memory part is the stored
   ``agents_agent.fallback_score``), highest first, where every score within ``SCORE_TIE``
   points of the best healthy candidate's counts as that best (they take turns);
4. the least recently selected (``last_selected_at``, never selected first);
5. the id (a total order).

A direct ``agent`` names one agent; floors pick among the agents meeting them by the same
ranking.

Agent metrics are agent-supplied JSON: every number is read through a type check, so a
malformed value makes that agent not match, never an SQL error for everyone.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from fleet.executors.fleet.routing.health import DEGRADED_SQL
from fleet.executors.fleet.state import ledger

SCORE_TIE = 10.0  # fallback scores this close to the best count as best: round-robin among them


class SelectorError(ValueError):
    """A task's routing keys cannot be used (permanent: the task fails, it never waits)."""


def _num(key: str) -> str:
    """A numeric metric of ``a.metrics``, NULL unless it is a JSON number (as numeric:
    any JSON number converts, where a float8 cast could overflow)."""
    return (
        f"(CASE WHEN jsonb_typeof(a.metrics -> '{key}') = 'number' "
        f"THEN (a.metrics ->> '{key}')::numeric END)"
    )


def _pct(key: str, missing: float) -> str:
    return f"LEAST(100.0, GREATEST(0.0, coalesce({_num(key)}, {missing})))::float8"


_GPU_NAMED = """EXISTS (
    SELECT 1 FROM jsonb_array_elements(
        CASE WHEN jsonb_typeof(a.metrics -> 'gpus') = 'array' THEN a.metrics -> 'gpus'
             ELSE '[]'::jsonb END) g
    WHERE jsonb_typeof(g) = 'object' AND jsonb_typeof(g -> 'name') = 'string'
      AND position(lower(%(s_gpu)s) IN lower(g ->> 'name')) > 0
)"""


def _optional_number(routing: dict, key: str) -> float | None:
    value = routing.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SelectorError(f"{key} must be a number, got {value!r}")
    return float(value) if value > 0 else None  # a floor of 0 constrains nothing


@dataclass(frozen=True)
class Selectors:
    """The selectors of one task (``TaskExecution.routing``), validated."""

    agent: str | None = None
    tags: tuple[str, ...] = ()
    capability: str | None = None
    gpu: bool | str | None = None  # True: any GPU; a string: a GPU model name
    min_free_vram_pct: float | None = None
    min_free_memory_mb: float | None = None
    min_free_cpu_pct: float | None = None
    group: str | None = None
    affinity: str | None = None

    @classmethod
    def from_routing(cls, routing: dict | None) -> Selectors:
        routing = routing or {}
        tags = routing.get("tags") or []
        if not isinstance(tags, list) or not all(isinstance(t, str) and t for t in tags):
            raise SelectorError(f"tags must be a list of non-empty strings, got {tags!r}")
        gpu = routing.get("gpu")
        if gpu is False or gpu == "":
            gpu = None
        if gpu is not None and not isinstance(gpu, bool | str):
            raise SelectorError(f"gpu must be true/false or a GPU model name, got {gpu!r}")
        strings = {}
        for key in ("agent", "capability", "group", "affinity"):
            value = routing.get(key)
            if value is not None and not (isinstance(value, str) and value):
                raise SelectorError(f"{key} must be a non-empty string, got {value!r}")
            strings[key] = value
        return cls(
            tags=tuple(sorted(set(tags))),
            gpu=gpu,
            min_free_vram_pct=_optional_number(routing, "min_free_vram_pct"),
            min_free_memory_mb=_optional_number(routing, "min_free_memory_mb"),
            min_free_cpu_pct=_optional_number(routing, "min_free_cpu_pct"),
            **strings,
        )

    @property
    def targeted(self) -> bool:
        """Whether the task names its agent(s): only such work may go to an exclusive agent."""
        return bool(self.agent or self.tags or self.capability)

    @property
    def wants_gpu(self) -> bool:
        return self.gpu is not None or self.min_free_vram_pct is not None

    @property
    def filters(self) -> bool:
        """Whether any selector filters agents (else only the tenant/liveness/triple ones do)."""
        return self.targeted or self.wants_gpu or self.floors_text() != ""

    @property
    def step(self) -> str:
        """The seed's selection step that decides this task (a metrics label)."""
        if self.agent:
            return "direct"
        if self.tags:
            return "tag"
        if self.capability:
            return "capability"
        if self.wants_gpu:
            return "gpu"
        if self.min_free_memory_mb is not None or self.min_free_cpu_pct is not None:
            return "resources"
        return "fallback"

    def static_text(self) -> str:
        """The static selectors in words (for error messages)."""
        parts = []
        if self.agent:
            parts.append(f"agent {self.agent!r}")
        if self.tags:
            parts.append(f"tags [{', '.join(self.tags)}]")
        if self.capability:
            parts.append(f"capability {self.capability!r}")
        if self.gpu is True or (self.gpu is None and self.min_free_vram_pct is not None):
            parts.append("a GPU")
        elif isinstance(self.gpu, str):
            parts.append(f"a {self.gpu!r} GPU")
        return ", ".join(parts)

    def floors_text(self) -> str:
        parts = []
        if self.min_free_memory_mb is not None:
            parts.append(f"≥ {self.min_free_memory_mb:g} MB free memory")
        if self.min_free_cpu_pct is not None:
            parts.append(f"≥ {self.min_free_cpu_pct:g}% free CPU")
        if self.min_free_vram_pct is not None:
            parts.append(f"≥ {self.min_free_vram_pct:g}% free GPU memory")
        return ", ".join(parts)


# The first key of the ranking (module docstring).  The batch reservation applies it per
# slot it deals (each slot taken lowers its agent's count), the rest through ``tiebreak``.
MOST_FREE_FIRST = f"{ledger.free_slots('a')} DESC"


@dataclass(frozen=True)
class Choice:
    """A compiled selection: SQL conditions and ranking over ``agents_agent a``.

    ``static`` and ``dynamic`` are the two halves of the filter (module docstring);
    ``tiebreak`` ranks candidates with as many free slots (health, host score, least
    recently selected, id); ``params`` carries the filters' values (keys prefixed ``s_``).
    """

    static: str = "TRUE"
    dynamic: str = "TRUE"
    tiebreak: str = "a.id"
    params: dict[str, Any] = field(default_factory=dict)
    step: str = "fallback"

    @property
    def order(self) -> str:
        """The full ranking of one reservation: most free slots first, then ``tiebreak``."""
        return f"{MOST_FREE_FIRST}, {self.tiebreak}"


def compile_choice(selectors: Selectors, bound_agent_id=None) -> Choice:
    """The SQL for ``selectors`` (and, when given, the one agent a binding names).

    The ranking also needs ``degraded_s``, which the reservation supplies from the
    configuration at the time it runs.
    """
    static, dynamic = [], []
    params: dict[str, Any] = {"s_targeted": selectors.targeted}
    if selectors.agent:
        static.append("a.name = %(s_agent)s")
        params["s_agent"] = selectors.agent
    if selectors.tags:
        static.append("a.tags @> %(s_tags)s::jsonb")
        params["s_tags"] = json.dumps(list(selectors.tags))
    if selectors.capability:
        static.append("a.capabilities @> jsonb_build_array(%(s_capability)s::text)")
        params["s_capability"] = selectors.capability
    if isinstance(selectors.gpu, str):
        static.append(_GPU_NAMED)
        params["s_gpu"] = selectors.gpu
    elif selectors.wants_gpu:
        static.append(f"coalesce({_num('gpu_count')}, 0) > 0")
    static.append("(NOT a.exclusive OR %(s_targeted)s)")
    floors = (
        ("min_free_memory_mb", "free_memory_mb", "s_mem"),
        ("min_free_cpu_pct", "free_cpu_pct", "s_cpu"),
        ("min_free_vram_pct", "free_vram_pct", "s_vram"),
    )
    for attr, metric, param in floors:
        value = getattr(selectors, attr)
        if value is not None:
            dynamic.append(f"{_num(metric)} >= %({param})s")
            params[param] = value
    if bound_agent_id is not None:
        dynamic.append("a.id = %(s_bound)s")
        params["s_bound"] = bound_agent_id
    return Choice(
        static=" AND ".join(static),
        dynamic=" AND ".join(dynamic) or "TRUE",
        tiebreak=tiebreak(selectors),
        params=params,
        step=selectors.step,
    )


CANDIDATES = "{candidates}"  # replaced by the reservation's full candidate filter


def _score(selectors: Selectors) -> str:
    # Kept by the database whenever the metrics change (agents migration 0004): the sum
    # of the free CPU and free memory percentages, each 50 when not reported.
    score = "a.fallback_score"
    if selectors.wants_gpu:
        score += f" + 0.5 * {_pct('free_vram_pct', 0.0)}"
    return score


def best_score_per_tenant(selectors: Selectors) -> str:
    """SQL window expression over candidate rows ``a``: the best healthy score among the
    candidates of the row's tenant — what :func:`tiebreak` computes for one tenant, for
    a statement that ranks the candidates of several tenants at once."""
    return (
        f"coalesce(max({_score(selectors)}) FILTER (WHERE NOT ({DEGRADED_SQL}))"
        " OVER (PARTITION BY a.tenant_id), -1)"
    )


def tiebreak(selectors: Selectors, best: str | None = None) -> str:
    """The ranking after the free slots (module docstring, keys 2 to 5): SQL ORDER BY keys.
    ``best``: a column holding the best healthy candidate score (from
    :func:`best_score_per_tenant`) instead of the subquery over ``{candidates}``."""
    rank = [f"({DEGRADED_SQL})"]  # false (healthy) sorts first
    if not (selectors.tags or selectors.capability):
        score = _score(selectors)
        # The best healthy score among the candidates (an InitPlan: computed once).
        best = best or (
            f"coalesce((SELECT max({score}) FROM {ledger.AGENTS} a "
            f"WHERE {CANDIDATES} AND NOT ({DEGRADED_SQL})), -1)"
        )
        # The agents within SCORE_TIE of the best all rank as best - SCORE_TIE, so they take
        # turns (next key); the others follow, best score first.  (One expression, with
        # the best computed once: this statement is planned for every dispatch.)
        rank.append(f"LEAST({score}, {best} - {SCORE_TIE}) DESC")
    rank += ["a.last_selected_at ASC NULLS FIRST", "a.id"]
    return ", ".join(rank)


UNCONSTRAINED = compile_choice(Selectors())
