"""The task context builder shared by every executor.

A task's input is the execution's input context, then the output of every
upstream task (dependencies, transitively), each after its own ancestors and
the dependencies in the order they are listed.  Both the in-process and the
fleet path call :func:`build_task_context` + :func:`encode_context`, so a task
sees byte-for-byte the same input wherever it runs.
"""

from __future__ import annotations

import json
import math
import uuid
from typing import Any

from django.db import connection

from fleet.models import TaskExecution


class ContextError(ValueError):
    """A context is not a JSON object, holds NaN/Infinity, or is too large."""


# One round trip: the execution's input, the task's dependencies and, only when it
# has any, (task_name, dependencies, output) of every task of the execution.
_CONTEXT_SQL = """
SELECT e.input_context, t.dependencies,
       CASE WHEN jsonb_array_length(t.dependencies) > 0 THEN (
           SELECT jsonb_agg(jsonb_build_array(o.task_name, o.dependencies, o.output_context))
           FROM fleet_taskexecution o WHERE o.workflow_execution_id = t.workflow_execution_id
       ) END
FROM fleet_taskexecution t JOIN fleet_workflowexecution e ON e.id = t.workflow_execution_id
WHERE t.id = %s
"""


def _json(value: Any) -> Any:
    # Raw cursors hand jsonb back as text (Django decodes JSONField itself).
    return json.loads(value) if isinstance(value, str) else value


# The same for several tasks at once (the fleet places tasks in batches).
_CONTEXTS_SQL = _CONTEXT_SQL.replace("SELECT e.input_context,", "SELECT t.id, e.input_context,", 1)
_CONTEXTS_SQL = _CONTEXTS_SQL.replace("WHERE t.id = %s", "WHERE t.id = ANY(%s::uuid[])", 1)


def build_task_context(task_execution_id: uuid.UUID) -> dict:
    with connection.cursor() as cursor:
        cursor.execute(_CONTEXT_SQL, [task_execution_id])
        row = cursor.fetchone()
    if row is None:
        raise TaskExecution.DoesNotExist(f"task execution {task_execution_id} does not exist")
    return merge_context(*row)


def build_task_contexts(task_execution_ids: list[uuid.UUID]) -> dict[uuid.UUID, dict]:
    """:func:`build_task_context` of several tasks in one query (missing ids are left out);
    each context is exactly the one :func:`build_task_context` builds."""
    with connection.cursor() as cursor:
        cursor.execute(_CONTEXTS_SQL, [list(task_execution_ids)])
        return {row[0]: merge_context(*row[1:]) for row in cursor.fetchall()}


def merge_context(input_context: Any, dependencies: Any, tasks: Any) -> dict:
    """A task's context from the parts :data:`_CONTEXT_SQL` reads (the claim statement of
    :func:`fleet.engine.claims.claim_work` reads the same parts)."""
    context = dict(_json(input_context) or {})
    dependencies = _json(dependencies) or []
    if dependencies:
        graph = {name: (deps or [], output) for name, deps, output in _json(tasks) or []}
        for ancestor in upstream_order(dependencies, graph):
            context.update(graph[ancestor][1] or {})
    return context


def upstream_order(dependencies: list[str], graph: dict[str, tuple[list[str], Any]]) -> list[str]:
    """Every ancestor once, each after its own ancestors, dependencies in their listed order.

    Context flows down the DAG: ``load`` after ``transform_a`` (after ``extract``)
    sees extract's keys too, and a later dependency's output wins a conflict.
    """
    order: list[str] = []
    seen: set[str] = set()
    # Iterative post-order DFS (a long chain must not hit the recursion limit).
    for root in dependencies:
        stack = [(root, iter(graph[root][0]))] if root in graph and root not in seen else []
        if stack:
            seen.add(root)
        while stack:
            name, parents = stack[-1]
            parent = next(parents, None)
            if parent is None:
                stack.pop()
                order.append(name)
            elif parent in graph and parent not in seen:
                seen.add(parent)
                stack.append((parent, iter(graph[parent][0])))
    return order


def encode_context(context: dict) -> str:
    """Canonical JSON text of a context (the exact bytes a task receives)."""
    return json.dumps(context, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def validate_context(value: Any, max_bytes: int, what: str = "context") -> dict:
    """Return ``value`` if it is a JSON object without NaN/Infinity within ``max_bytes``."""
    if not isinstance(value, dict):
        raise ContextError(f"{what} must be a JSON object, got {type(value).__name__}")
    try:
        encoded = encode_context(value)
    except ValueError as exc:  # NaN / Infinity
        raise ContextError(f"{what} is not valid JSON: {exc}") from None
    except TypeError as exc:
        raise ContextError(f"{what} is not JSON-serialisable: {exc}") from None
    problem = unstorable(value)
    if problem:
        raise ContextError(f"{what} holds {problem}, which cannot be stored")
    size = len(encoded.encode())
    if size > max_bytes:
        raise ContextError(f"{what} is {size} bytes, over the {max_bytes}-byte limit")
    return value


def unstorable(value: Any) -> str:
    """What in a JSON value PostgreSQL cannot store (a NUL, a lone surrogate), or ''."""
    stack = [value]
    while stack:  # iterative: a deeply nested value must not hit the recursion limit
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str):
            if "\x00" in item:
                return "a NUL character (\\u0000)"
            try:
                item.encode()
            except UnicodeEncodeError:
                return "a lone surrogate (\\ud800-\\udfff)"
    return ""


def storable_text(text: str) -> str:
    """``text`` as PostgreSQL can store it: no NUL, no lone surrogate (error messages)."""
    return text.encode("utf-8", "replace").decode("utf-8").replace("\x00", "\ufffd")


def contains_non_finite(value: Any) -> bool:
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, dict):
        return any(contains_non_finite(v) for v in value.values())
    if isinstance(value, list):
        return any(contains_non_finite(v) for v in value)
    return False
