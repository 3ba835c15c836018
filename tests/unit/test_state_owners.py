"""One owner per state machine (issue 14): only the owners name the tables in SQL.

* ``delivery_outbox`` — only the slots/outbox owner (fleet/executors/fleet/state/ledger.py);
* ``agents_agent`` — only the agent lifecycle (fleet/executors/fleet/lifecycle.py) and the slots owner
  (the slot counter lives on that table);
* ``in_flight`` is written (``in_flight =`` / ``+`` / ``-`` in SQL, or an ORM
  ``update(in_flight=…)``) only by the slots owner;
* an agent's circuit breaker (``breaker_*`` columns of ``agents_agent``) is written only by
  its owner (fleet/executors/fleet/state/breaker.py), which names ``agents_agent`` too;
  the reservation folds the owner's ``probe_taken`` fragment into its statement.

* a tenant's limits (``desired_count``, ``max_agents_override``, ``max_backlog``,
  ``is_active``, ``storage_quota_bytes``) — only the control plane's limits module
  (fleet/control/limits.py), plus the autoscaler's guarded step and ``createtenant``'s
  seed, which audit through it; ``FleetChange`` rows are written only by limits.py and
  ``createtenant`` (issue 15 item 7: every limit change is audited, whoever makes it).

Strings are read with ``ast`` (comments never count); docstrings are prose, not SQL, and
the models' ``db_table`` declarations and migrations are where the tables are defined.
Everyone else reads through the ORM, a function of an owner, or the fragments an owner
exports (``fleet.executors.fleet.state.ledger.AGENTS`` / ``OUTBOX`` and its predicates).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("fleet", "agents", "artifacts", "cloacina_site")
SLOTS_OWNER = "fleet/executors/fleet/state/ledger.py"
LIFECYCLE_OWNER = "fleet/executors/fleet/lifecycle.py"
BREAKER_OWNER = "fleet/executors/fleet/state/breaker.py"
OWNERS = {
    "agents_agent": {SLOTS_OWNER, LIFECYCLE_OWNER, BREAKER_OWNER},
    "delivery_outbox": {SLOTS_OWNER},
}
TABLE = re.compile(r"\b(agents_agent|delivery_outbox)\b")
SLOT_WRITE = re.compile(r"\bin_flight\s*[=+-](?!=)")
BREAKER_WRITE = re.compile(r"\bbreaker_\w+\s*=(?!=)")


def _sources() -> Iterator[tuple[str, ast.Module]]:
    for package in SCANNED:
        for path in sorted((ROOT / package).rglob("*.py")):
            relative = path.relative_to(ROOT).as_posix()
            if "/migrations/" in relative:
                continue
            yield relative, ast.parse(path.read_text(), filename=relative)


def _docstrings(tree: ast.Module) -> set[int]:
    """ids of the docstring nodes (module, class, function)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
    return found


def _db_tables(tree: ast.Module) -> set[int]:
    """ids of the strings a model's ``Meta.db_table = "..."`` declares."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            if any(isinstance(t, ast.Name) and t.id == "db_table" for t in node.targets):
                found.add(id(node.value))
    return found


def _strings(tree: ast.Module) -> Iterator[tuple[int, str]]:
    """(line, text) of every string literal that is not a docstring or a db_table."""
    skipped = _docstrings(tree) | _db_tables(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if id(node) not in skipped:
                yield node.lineno, node.value


def _at(line: int, text: str, start: int) -> int:
    return line + text.count("\n", 0, start)


def _sql_hits(path: str, tree: ast.Module, pattern: re.Pattern[str]) -> list[str]:
    """``path:line: 'match'`` for every match of ``pattern`` in the module's strings."""
    return [
        f"{path}:{_at(line, text, match.start())}: {match.group(0)!r}"
        for line, text in _strings(tree)
        for match in pattern.finditer(text)
    ]


def _slot_keywords(tree: ast.Module) -> Iterator[int]:
    """Lines of ORM writes of the slot counter: ``….update(in_flight=…)``."""
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in {"update", "update_or_create"}
        ):
            if any(k.arg == "in_flight" for k in node.keywords):
                yield node.lineno


LIMITS_OWNER = "fleet/control/limits.py"
LIMIT_WRITERS = {
    LIMITS_OWNER,
    "fleet/control/autoscaler.py",
    "fleet/management/commands/createtenant.py",
}
AUDIT_WRITERS = {LIMITS_OWNER, "fleet/management/commands/createtenant.py"}
LIMIT_COLUMNS = {
    "desired_count",
    "max_agents_override",
    "max_backlog",
    "is_active",
    "storage_quota_bytes",
}
TENANT_UPDATE = re.compile(r"\bUPDATE\s+fleet_tenant\b", re.IGNORECASE)


def _string_items(node: ast.AST) -> set[str]:
    """The string constants of a list/tuple/set literal (``update_fields=[...]``)."""
    if isinstance(node, ast.List | ast.Tuple | ast.Set):
        return {e.value for e in node.elts if isinstance(e, ast.Constant)}
    return set()


def _limit_writes(tree: ast.Module) -> Iterator[tuple[int, str]]:
    """ORM writes of a limit column: ``update(col=…)`` or ``save(update_fields=[col])``."""
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        if node.func.attr in {"update", "update_or_create"}:
            for k in node.keywords:
                if k.arg in LIMIT_COLUMNS:
                    yield node.lineno, f"update({k.arg}=…)"
        if node.func.attr == "save":
            for k in node.keywords:
                if k.arg == "update_fields" and _string_items(k.value) & LIMIT_COLUMNS:
                    yield node.lineno, "save(update_fields=[…limit…])"


def _audit_writes(tree: ast.Module) -> Iterator[int]:
    """Lines that make FleetChange rows: ``FleetChange(…)`` or ``FleetChange.objects.create``."""
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name) and func.id == "FleetChange":
            yield node.lineno
        if (
            isinstance(func, ast.Attribute)
            and func.attr in {"create", "bulk_create", "get_or_create", "update_or_create"}
            and isinstance(func.value, ast.Attribute)
            and isinstance(func.value.value, ast.Name)
            and func.value.value.id == "FleetChange"
        ):
            yield node.lineno


def limit_write_violations() -> list[str]:
    found = []
    for path, tree in _sources():
        if path in LIMIT_WRITERS:
            continue
        found += _sql_hits(path, tree, TENANT_UPDATE)
        found += [f"{path}:{line}: {what}" for line, what in _limit_writes(tree)]
    for path, tree in _sources():
        if path not in AUDIT_WRITERS:
            found += [f"{path}:{line}: a FleetChange row" for line in _audit_writes(tree)]
    return found


def table_violations() -> list[str]:
    found = []
    for path, tree in _sources():
        for line, text in _strings(tree):
            for match in TABLE.finditer(text):
                if path not in OWNERS[match.group(1)]:
                    found.append(f"{path}:{_at(line, text, match.start())}: {match.group(1)}")
    return found


def slot_write_violations() -> list[str]:
    found = []
    for path, tree in _sources():
        if path == SLOTS_OWNER:
            continue
        found += _sql_hits(path, tree, SLOT_WRITE)
        found += [f"{path}:{line}: update(in_flight=…)" for line in _slot_keywords(tree)]
    return found


def breaker_write_violations() -> list[str]:
    found = []
    for path, tree in _sources():
        if path == BREAKER_OWNER:
            continue
        for line, text in _strings(tree):
            for match in BREAKER_WRITE.finditer(text):
                found.append(f"{path}:{_at(line, text, match.start())}: {match.group(0)!r}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                if node.func.attr in {"update", "update_or_create"} and any(
                    (k.arg or "").startswith("breaker_") for k in node.keywords
                ):
                    found.append(f"{path}:{node.lineno}: update(breaker_…=…)")
    return found


def test_only_the_breaker_owner_writes_the_breaker_columns():
    violations = breaker_write_violations()
    assert not violations, (
        f"{len(violations)} write(s) of breaker_* outside {BREAKER_OWNER}:\n"
        + "\n".join(violations)
    )


def test_only_the_owners_name_the_agent_and_outbox_tables_in_sql():
    violations = table_violations()
    assert not violations, (
        f"{len(violations)} string(s) name a state owner's table outside its owner "
        f"(agents_agent: {LIFECYCLE_OWNER}, {SLOTS_OWNER}; delivery_outbox: {SLOTS_OWNER}) — "
        "use the ORM, an owner's function or the fragments it exports:\n" + "\n".join(violations)
    )


def test_only_the_slots_owner_writes_the_slot_counter():
    violations = slot_write_violations()
    assert not violations, (
        f"{len(violations)} write(s) of in_flight outside {SLOTS_OWNER}:\n" + "\n".join(violations)
    )


def test_the_scan_sees_the_owners_own_sql():
    # Guards the scanner itself: if it stopped reading strings it would pass vacuously.
    owned = {
        path: [match.group(1) for _, text in _strings(tree) for match in TABLE.finditer(text)]
        for path, tree in _sources()
        if path in {SLOTS_OWNER, LIFECYCLE_OWNER, BREAKER_OWNER}
    }
    assert "delivery_outbox" in owned[SLOTS_OWNER]
    assert "agents_agent" in owned[LIFECYCLE_OWNER]
    assert "agents_agent" in owned[BREAKER_OWNER]
    breaker_sql = [text for _, text in _strings(dict(_sources())[BREAKER_OWNER])]
    assert any(BREAKER_WRITE.search(text) for text in breaker_sql)


def test_only_the_limits_owner_writes_a_tenants_limits_and_their_audit():
    violations = limit_write_violations()
    assert not violations, (
        f"{len(violations)} write(s) of a tenant's limits or of the audit outside "
        f"{LIMITS_OWNER} — call limits.provision/deprovision/set_fleet_overrides/"
        "set_tenant_limits, which audit every change:\n" + "\n".join(violations)
    )


def test_the_limit_scan_sees_the_owners_own_writes():
    # Guards the scanner: the owners' own writes are what it would flag elsewhere.
    trees = dict(_sources())
    limits_tree = trees[LIMITS_OWNER]
    assert any(TENANT_UPDATE.search(text) for _, text in _strings(limits_tree))
    assert [what for _, what in _limit_writes(limits_tree)]
    assert list(_audit_writes(limits_tree))
    assert list(_audit_writes(trees["fleet/management/commands/createtenant.py"]))
    assert [what for _, what in _limit_writes(ast.parse("Tenant.objects.update(max_backlog=1)"))]


RERUNS_OWNER = "fleet/engine/reruns.py"
LINK_INSERT = re.compile(r"\b(INSERT\s+INTO|UPDATE|DELETE\s+FROM)\s+fleet_executionlink\b", re.I)


def _link_writes(tree: ast.Module) -> Iterator[int]:
    """Lines that make or change ExecutionLink rows through the ORM."""
    writes = {"create", "bulk_create", "get_or_create", "update_or_create", "update", "delete"}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name) and func.id == "ExecutionLink":
            yield node.lineno
        if (
            isinstance(func, ast.Attribute)
            and func.attr in writes
            and isinstance(func.value, ast.Attribute)
            and isinstance(func.value.value, ast.Name)
            and func.value.value.id == "ExecutionLink"
        ):
            yield node.lineno


def test_only_the_reruns_owner_writes_the_rerun_and_retry_history():
    """Re-runs and retries are recorded (who, when) in the transaction that makes them, by
    fleet/engine/reruns.py alone: nobody else can forge or drop a link."""
    found = []
    for path, tree in _sources():
        if path == RERUNS_OWNER:
            continue
        found += _sql_hits(path, tree, LINK_INSERT)
        found += [f"{path}:{line}: an ExecutionLink write" for line in _link_writes(tree)]
    assert not found, "writes of ExecutionLink outside " + RERUNS_OWNER + ":\n" + "\n".join(found)
    # Guards the scanner: the owner's own writes are what it would flag elsewhere.
    assert list(_link_writes(dict(_sources())[RERUNS_OWNER]))
