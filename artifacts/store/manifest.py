"""The ``cloacina.toml`` schema: parse, check every field, and normalise.

The server never imports tenant code, so this manifest is the only source of
the DAG; every error names the exact field (and task) so the author can fix
it without guessing.
"""

from __future__ import annotations

import json
import math
import re
import tomllib
from typing import Any

from packaging.version import InvalidVersion, Version

from fleet.platform.cron import CronError, parse_cron

MANIFEST_NAME = "cloacina.toml"
PACKAGE_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]*$")
IDENTIFIER_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
FUNCTION_RE = re.compile(
    r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$"
)
MAX_PACKAGE_NAME_CHARS = 100
MAX_VERSION_CHARS = 64
MAX_NAME_CHARS = 200
KINDS = ("python", "native")
TRIGGER_RULES = ("all_success", "all_done", "one_failed")
DEFAULT_TIMEOUT_S = 300.0
# Bounds that keep every number inside its column and its timedelta: a manifest is hostile
# input like any other.
PRIORITY_LIMIT = 1_000_000  # |priority|; an execution may add as much again
MAX_RETRIES = 100
MAX_TIMEOUT_S = 7 * 24 * 3600.0
MAX_RETRY_BACKOFF_S = 24 * 3600.0

TOP_LEVEL_KEYS = ("package", "workflow", "tasks", "schedules")
PACKAGE_KEYS = ("name", "version", "kind")
WORKFLOW_KEYS = ("name",)
# Routing keys are hints for agent selection; their defaults mean "no constraint".
ROUTING_DEFAULTS: dict[str, Any] = {
    "agent": None,
    "tags": [],
    "capability": None,
    "min_free_memory_mb": None,
    "min_free_cpu_pct": None,
    "gpu": None,
    "min_free_vram_pct": None,
    "group": None,
    "affinity": None,
    "priority": 0,
}
ROUTING_KEYS = tuple(ROUTING_DEFAULTS)
# [[schedules]]: cron schedules of the workflow, declared with it (docs/schedules.md).  The
# policy names are fleet.models' Catchup and Overlap values (a unit test keeps them equal);
# this module stays free of Django.
SCHEDULE_KEYS = ("cron", "timezone", "context", "catchup", "overlap", "enabled")
CATCHUP_POLICIES = ("skip", "latest", "all")
OVERLAP_POLICIES = ("allow", "skip", "cancel_previous")
MAX_SCHEDULES = 100
TASK_KEYS = (
    "id",
    "function",
    "retries",
    "retry_backoff_s",
    "timeout_s",
    "dependencies",
    "trigger_rule",
) + ROUTING_KEYS


class ManifestError(ValueError):
    """cloacina.toml is missing, unparsable or breaks the schema."""


class ManifestLimitError(ManifestError):
    """cloacina.toml declares more than the server accepts (a configured bound)."""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


def _unknown_keys(table: dict, allowed: tuple[str, ...], where: str) -> None:
    for key in table:
        if key not in allowed:
            raise ManifestError(f"unknown key {key!r} in {where} (allowed: {', '.join(allowed)})")


def _table(data: dict, key: str) -> dict:
    value = data.get(key)
    if value is None:
        raise ManifestError(f"missing [{key}] table in {MANIFEST_NAME}")
    if not isinstance(value, dict):
        raise ManifestError(f"[{key}] must be a table")
    return value


def _string(table: dict, key: str, where: str, pattern: re.Pattern | None, max_chars: int) -> str:
    value = table.get(key)
    if value is None:
        raise ManifestError(f"{where}.{key} is required")
    if not isinstance(value, str) or not value:
        raise ManifestError(f"{where}.{key} must be a non-empty string, got {value!r}")
    if len(value) > max_chars:
        raise ManifestError(f"{where}.{key} is longer than {max_chars} characters")
    if pattern is not None and not pattern.match(value):
        raise ManifestError(f"{where}.{key} {value!r} must match {pattern.pattern}")
    return value


def parse_version(value: str, where: str = "package.version") -> Version:
    """PEP 440 version, or a :class:`ManifestError` naming the field."""
    try:
        return Version(value)
    except InvalidVersion:
        raise ManifestError(f"{where} {value!r} is not a valid version (PEP 440)") from None


def _parse_package(data: dict) -> dict:
    table = _table(data, "package")
    _unknown_keys(table, PACKAGE_KEYS, "[package]")
    name = _string(table, "name", "package", PACKAGE_NAME_RE, MAX_PACKAGE_NAME_CHARS)
    version = _string(table, "version", "package", None, MAX_VERSION_CHARS)
    parse_version(version)
    kind = table.get("kind")
    if kind not in KINDS:
        raise ManifestError(f"package.kind must be one of {', '.join(KINDS)}, got {kind!r}")
    return {"name": name, "version": version, "kind": kind}


def _parse_workflow(data: dict) -> dict:
    table = _table(data, "workflow")
    _unknown_keys(table, WORKFLOW_KEYS, "[workflow]")
    return {"name": _string(table, "name", "workflow", IDENTIFIER_RE, MAX_NAME_CHARS)}


def _number(task: dict, key: str, where: str, default: Any, *, minimum: float, strict: bool):
    value = task.get(key, default)
    if value is None:
        return None
    ok = _is_number(value) and (value > minimum if strict else value >= minimum)
    if not ok:
        bound = f"> {minimum:g}" if strict else f">= {minimum:g}"
        raise ManifestError(f"{where}: {key} must be a number {bound}, got {value!r}")
    return float(value)


def _at_most(value: float | None, limit: float, key: str, where: str) -> float | None:
    if value is not None and value > limit:
        raise ManifestError(f"{where}: {key} must be at most {limit:g} seconds, got {value:g}")
    return value


def _percent(task: dict, key: str, where: str) -> float | None:
    value = _number(task, key, where, None, minimum=0, strict=False)
    if value is not None and value > 100:
        raise ManifestError(f"{where}: {key} must be between 0 and 100, got {task[key]!r}")
    return value


def _storable(value: str, key: str, where: str) -> str:
    """A routing string as PostgreSQL can store it (jsonb and text refuse NUL), bounded
    like the names it is matched against."""
    if "\x00" in value:
        raise ManifestError(f"{where}: {key} holds a NUL character (\\u0000)")
    if len(value) > MAX_NAME_CHARS:
        raise ManifestError(f"{where}: {key} is longer than {MAX_NAME_CHARS} characters")
    return value


def _optional_str(task: dict, key: str, where: str) -> str | None:
    value = task.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ManifestError(f"{where}: {key} must be a non-empty string, got {value!r}")
    return _storable(value, key, where)


def _affinity(task: dict, where: str) -> str | None:
    """``"definition"`` or ``"payload:<context key>"`` (docs/routing.md)."""
    value = _optional_str(task, "affinity", where)
    if value is None or value == "definition":
        return value
    if value.startswith("payload:") and len(value) > len("payload:"):
        return value
    raise ManifestError(
        f'{where}: affinity must be "definition" or "payload:<context key>", got {value!r}'
    )


def _str_list(task: dict, key: str, where: str) -> list[str]:
    value = task.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ManifestError(f"{where}: {key} must be a list of non-empty strings, got {value!r}")
    for item in value:
        _storable(item, key, where)
    if len(set(value)) != len(value):
        dup = next(v for v in value if value.count(v) > 1)
        raise ManifestError(f"{where}: {key} lists {dup!r} more than once")
    return list(value)


def _parse_routing(task: dict, where: str) -> dict:
    gpu = task.get("gpu")
    if gpu is not None and not (isinstance(gpu, bool) or (isinstance(gpu, str) and gpu)):
        raise ManifestError(
            f"{where}: gpu must be true/false or a GPU model name (string), got {gpu!r}"
        )
    if isinstance(gpu, str):
        _storable(gpu, "gpu", where)
    priority = task.get("priority", 0)
    if not _is_int(priority) or abs(priority) > PRIORITY_LIMIT:
        raise ManifestError(
            f"{where}: priority must be an integer between -{PRIORITY_LIMIT} and "
            f"{PRIORITY_LIMIT}, got {priority!r}"
        )
    return {
        "agent": _optional_str(task, "agent", where),
        "tags": _str_list(task, "tags", where),
        "capability": _optional_str(task, "capability", where),
        "min_free_memory_mb": _number(
            task, "min_free_memory_mb", where, None, minimum=0, strict=False
        ),
        "min_free_cpu_pct": _percent(task, "min_free_cpu_pct", where),
        "gpu": gpu,
        "min_free_vram_pct": _percent(task, "min_free_vram_pct", where),
        "group": _optional_str(task, "group", where),
        "affinity": _affinity(task, where),
        "priority": priority,
    }


def _parse_task(task: Any, index: int) -> dict:
    where = f"tasks[{index}]"
    if not isinstance(task, dict):
        raise ManifestError(f"{where} must be a table ([[tasks]])")
    task_name = _string(task, "id", where, IDENTIFIER_RE, MAX_NAME_CHARS)
    where = f"tasks[{index}] (id {task_name!r})"
    _unknown_keys(task, TASK_KEYS, where)
    function = task.get("function")
    if not isinstance(function, str) or not FUNCTION_RE.match(function):
        raise ManifestError(
            f"{where}: function must be 'module.path:function_name', got {function!r}"
        )
    retries = task.get("retries", 0)
    if not _is_int(retries) or retries < 0:
        raise ManifestError(f"{where}: retries must be an integer >= 0, got {retries!r}")
    if retries > MAX_RETRIES:
        raise ManifestError(f"{where}: retries must be at most {MAX_RETRIES}, got {retries!r}")
    trigger_rule = task.get("trigger_rule", "all_success")
    if trigger_rule not in TRIGGER_RULES:
        raise ManifestError(
            f"{where}: trigger_rule must be one of {', '.join(TRIGGER_RULES)}, got {trigger_rule!r}"
        )
    return {
        "id": task_name,
        "function": function,
        "retries": retries,
        "retry_backoff_s": _at_most(
            _number(task, "retry_backoff_s", where, 0.0, minimum=0, strict=False),
            MAX_RETRY_BACKOFF_S,
            "retry_backoff_s",
            where,
        ),
        "timeout_s": _at_most(
            _number(task, "timeout_s", where, DEFAULT_TIMEOUT_S, minimum=0, strict=True),
            MAX_TIMEOUT_S,
            "timeout_s",
            where,
        ),
        "dependencies": _str_list(task, "dependencies", where),
        "trigger_rule": trigger_rule,
        **_parse_routing(task, where),
    }


def _check_graph(tasks: list[dict]) -> None:
    seen: dict[str, int] = {}
    for index, task in enumerate(tasks):
        if task["id"] in seen:
            raise ManifestError(
                f"tasks[{index}]: duplicate task id {task['id']!r} (also tasks[{seen[task['id']]}])"
            )
        seen[task["id"]] = index
    for index, task in enumerate(tasks):
        for dep in task["dependencies"]:
            if dep not in seen:
                raise ManifestError(
                    f"tasks[{index}] (id {task['id']!r}): dependency {dep!r} is not a task "
                    "of this workflow"
                )
    cycle = find_cycle({t["id"]: t["dependencies"] for t in tasks})
    if cycle:
        raise ManifestError(
            f"dependency cycle: {' -> '.join(cycle)} (each task depends on the next)"
        )


def find_cycle(graph: dict[str, list[str]]) -> list[str] | None:
    """One cycle of ``{task: dependencies}`` as ``[a, b, ..., a]`` (a depends on b ...), or None."""
    white, grey, black = 0, 1, 2
    colour = dict.fromkeys(graph, white)
    for start in graph:
        if colour[start] != white:
            continue
        path: list[str] = [start]
        stack = [iter(graph[start])]
        colour[start] = grey
        while stack:  # iterative DFS: a deep chain must not hit the recursion limit
            nxt = next(stack[-1], None)
            if nxt is None:
                colour[path.pop()] = black
                stack.pop()
            elif colour[nxt] == grey:
                return path[path.index(nxt) :] + [nxt]
            elif colour[nxt] == white:
                colour[nxt] = grey
                path.append(nxt)
                stack.append(iter(graph[nxt]))
    return None


def _parse_schedule(entry: Any, index: int) -> dict:
    where = f"schedules[{index}]"
    if not isinstance(entry, dict):
        raise ManifestError(f"{where} must be a table ([[schedules]])")
    _unknown_keys(entry, SCHEDULE_KEYS, where)
    if "cron" not in entry:
        raise ManifestError(f"{where}.cron is required (5 fields, or 6 with seconds first)")
    zone = entry.get("timezone", "UTC")
    try:
        cron = parse_cron(entry["cron"], zone)
    except CronError as exc:
        raise ManifestError(f"{where}: {exc}") from None
    context = entry.get("context", {})
    if not isinstance(context, dict):
        raise ManifestError(f"{where}: context must be a table, got {context!r}")
    # TOML dates and times are not JSON; PostgreSQL's jsonb refuses NUL.
    try:
        encoded = json.dumps(context)
    except TypeError as exc:
        raise ManifestError(f"{where}: context must hold JSON values only ({exc})") from None
    if "\\u0000" in encoded:
        raise ManifestError(f"{where}: context holds a NUL character (\\u0000)")
    catchup = entry.get("catchup", "skip")
    if catchup not in CATCHUP_POLICIES:
        raise ManifestError(
            f"{where}: unknown catchup policy {catchup!r} (one of {', '.join(CATCHUP_POLICIES)})"
        )
    overlap = entry.get("overlap", "allow")
    if overlap not in OVERLAP_POLICIES:
        raise ManifestError(
            f"{where}: unknown overlap policy {overlap!r} (one of {', '.join(OVERLAP_POLICIES)})"
        )
    enabled = entry.get("enabled", True)
    if not isinstance(enabled, bool):
        raise ManifestError(f"{where}: enabled must be true or false, got {enabled!r}")
    return {
        "cron": cron.expression,
        "timezone": zone,
        "context": context,
        "catchup": catchup,
        "overlap": overlap,
        "enabled": enabled,
    }


def _parse_schedules(data: dict) -> list[dict]:
    raw = data.get("schedules", [])
    if not isinstance(raw, list):
        raise ManifestError("schedules must be an array of tables ([[schedules]])")
    if len(raw) > MAX_SCHEDULES:
        raise ManifestError(f"{len(raw)} [[schedules]] declared; the limit is {MAX_SCHEDULES}")
    schedules = [_parse_schedule(entry, i) for i, entry in enumerate(raw)]
    seen: dict[tuple, int] = {}
    for index, schedule in enumerate(schedules):
        key = (
            schedule["cron"],
            schedule["timezone"],
            json.dumps(schedule["context"], sort_keys=True),
        )
        if key in seen:
            raise ManifestError(
                f"schedules[{index}] repeats schedules[{seen[key]}] (same cron, timezone "
                "and context)"
            )
        seen[key] = index
    return schedules


def parse_manifest(text: bytes | str, max_tasks: int | None = None) -> dict:
    """Validate cloacina.toml and return it normalised, every task field filled with its default.

    Shape: ``{"package": {name, version, kind}, "workflow": {name}, "tasks": [...]}``, plus
    ``"schedules": [...]`` (each with every key filled) when the manifest declares any.
    More than ``max_tasks`` tasks (if given) raises :class:`ManifestLimitError`.
    """
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError:
            raise ManifestError(f"{MANIFEST_NAME} is not valid UTF-8") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ManifestError(f"{MANIFEST_NAME} is not valid TOML: {exc}") from None
    _unknown_keys(data, TOP_LEVEL_KEYS, MANIFEST_NAME)
    package = _parse_package(data)
    workflow = _parse_workflow(data)
    raw_tasks = data.get("tasks")
    if not isinstance(raw_tasks, list) or not raw_tasks:
        raise ManifestError("the workflow needs at least one [[tasks]] entry")
    if max_tasks is not None and len(raw_tasks) > max_tasks:
        raise ManifestLimitError(
            f"the workflow has {len(raw_tasks)} tasks; the limit is {max_tasks}"
        )
    tasks = [_parse_task(task, i) for i, task in enumerate(raw_tasks)]
    _check_graph(tasks)
    manifest = {"package": package, "workflow": workflow, "tasks": tasks}
    schedules = _parse_schedules(data)
    if schedules:
        manifest["schedules"] = schedules
    return manifest


def task_routing(task: dict) -> dict:
    """The routing keys of a normalised task that actually constrain selection (non-default)."""
    return {
        k: task[k] for k in ROUTING_KEYS if task.get(k, ROUTING_DEFAULTS[k]) != ROUTING_DEFAULTS[k]
    }
