"""Bindings: work that should keep going to the agent that took it first.

Two sources, one store (``AffinityBinding``, unique per tenant and key):

* a task **group** (``group = "name"``): the first task of the group placed in an
  execution binds its agent; the group's other tasks of that execution go to it
  (:mod:`fleet.executors.fleet.routing.groups` makes the key);
* **affinity** across executions: ``affinity = "definition"`` binds every execution of
  the workflow, ``affinity = "payload:<key>"`` every execution whose task context has
  the same value at ``<key>`` (a task whose context lacks the key is not bound).

A binding is a preference that must still satisfy the task's own selectors: a task
whose selectors the bound agent does not match ignores it.  While the bound agent is
live the work waits for it (full, degraded, briefly without a socket); once it is dead
or draining the binding is cleared — by the liveness sweep (:func:`clear_agent`), or by
the next lookup — and the next task binds afresh.

Placements of one key take turns (a transaction-scoped advisory lock per key), so two
tasks of a group dispatched at once cannot bind two agents.
"""

from __future__ import annotations

import hashlib
import uuid
from dataclasses import dataclass

from django.db import connection

from fleet.engine.context import encode_context
from fleet.executors.fleet.routing.selectors import SelectorError
from fleet.executors.fleet.state import ledger
from fleet.models import AffinityBinding, BindingKind

BINDING_LOCK_CLASS = 0x42494E44  # pg_advisory_xact_lock(class, hashtext(tenant:key))
MAX_KEY_CHARS = 400
PAYLOAD_PREFIX = "payload:"


@dataclass(frozen=True)
class BindingKey:
    kind: str  # a BindingKind value
    key: str
    workflow_execution_id: uuid.UUID | None = None  # groups: the execution they belong to


def _bounded(kind: str, text: str) -> str:
    key = f"{kind}:{text}"
    if len(key) <= MAX_KEY_CHARS:
        return key
    return f"{kind}:sha256:{hashlib.sha256(text.encode()).hexdigest()}"


def affinity_key(spec: str | None, workflow_name: str, context: dict) -> BindingKey | None:
    """The binding key of an ``affinity`` selector for this task, or None (no affinity,
    or a payload key its context lacks); SelectorError for a spec that is neither form."""
    if not spec:
        return None
    if spec == "definition":
        return BindingKey(BindingKind.DEFINITION, _bounded("definition", workflow_name))
    if spec.startswith(PAYLOAD_PREFIX) and len(spec) > len(PAYLOAD_PREFIX):
        name = spec[len(PAYLOAD_PREFIX) :]
        if name not in context:
            return None
        # The value's canonical JSON, hashed: any JSON value, a key of bounded length.
        value = hashlib.sha256(encode_context({"v": context[name]}).encode()).hexdigest()[:40]
        return BindingKey(
            BindingKind.PAYLOAD, _bounded("payload", f"{workflow_name}:{name}={value}")
        )
    raise SelectorError(f"affinity must be 'definition' or 'payload:<context key>', got {spec!r}")


def lock(tenant_id: int, keys: list[BindingKey]) -> None:
    """Serialise placements of these keys until the transaction ends (sorted: no deadlock)."""
    lock_many([(tenant_id, keys)])


def lock_many(keys_by_tenant: list[tuple[int, list[BindingKey]]]) -> None:
    """:func:`lock` for the keys of several tenants at once, all in the one order every
    placement takes them in (``tenant:key`` sorted), in one statement: a placement batch
    takes its keys up front, before any agent row (docs/fleet.md, "Lock order")."""
    wanted = sorted({f"{tenant_id}:{k.key}" for tenant_id, keys in keys_by_tenant for k in keys})
    if not wanted:
        return
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pg_advisory_xact_lock(%s, hashtext(k)) FROM unnest(%s::text[]) AS k ORDER BY k",
            [BINDING_LOCK_CLASS, wanted],
        )


def bound_agent(tenant_id: int, keys: list[BindingKey]) -> tuple[uuid.UUID, BindingKey] | None:
    """The agent the first bound key names (keys in precedence order), if it still lives.

    Bindings to dead or draining agents are deleted on the way: their work rebinds.
    """
    if not keys:
        return None
    with connection.cursor() as cursor:
        cursor.execute(
            f"""
            SELECT b.id, b.key, b.agent_id, a.state FROM fleet_affinitybinding b
            JOIN {ledger.AGENTS} a ON a.id = b.agent_id
            WHERE b.tenant_id = %s AND b.key = ANY(%s)
            """,
            [tenant_id, [k.key for k in keys]],
        )
        rows = {key: (binding_id, agent_id, state) for binding_id, key, agent_id, state in cursor}
    gone = [binding_id for binding_id, _, state in rows.values() if state != "live"]
    if gone:
        AffinityBinding.objects.filter(pk__in=gone).delete()
    for key in keys:
        row = rows.get(key.key)
        if row is not None and row[2] == "live":
            return row[1], key
    return None


def bind(tenant_id: int, keys: list[BindingKey], agent_id: uuid.UUID) -> int:
    """Bind the keys not bound yet to ``agent_id`` (in the placement's transaction)."""
    if not keys:
        return 0
    with connection.cursor() as cursor:
        cursor.execute(
            """
            INSERT INTO fleet_affinitybinding (tenant_id, kind, key, agent_id,
                                               workflow_execution_id, created_at)
            SELECT %s, k.kind, k.key, %s, k.execution, now()
            FROM unnest(%s::text[], %s::text[], %s::uuid[]) AS k(kind, key, execution)
            ON CONFLICT (tenant_id, key) DO NOTHING
            """,
            [
                tenant_id,
                agent_id,
                [k.kind for k in keys],
                [k.key for k in keys],
                [k.workflow_execution_id for k in keys],
            ],
        )
        return cursor.rowcount


def clear_agent(agent_id: uuid.UUID) -> int:
    """Forget every binding to this agent (it died or is draining); return how many."""
    deleted, _ = AffinityBinding.objects.filter(agent_id=agent_id).delete()
    return deleted
