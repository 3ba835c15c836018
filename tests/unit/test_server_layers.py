"""The server's layers only point down: import-linter's server-* contracts hold
(pyproject.toml [tool.importlinter]; docs/architecture.md draws the layers), none of
them ignores an import, and the engine names no executor's table in its SQL.

Here: the unit tests (no database, socket or process); the rest are in tests/integration/test_server_layers.py.
"""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SERVER_CONTRACTS = ("server-layers", "server-acyclic", "server-inprocess-no-fleet")


def _contracts() -> dict[str, dict]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return {c["id"]: c for c in config["tool"]["importlinter"]["contracts"]}


def test_the_server_contracts_exist_and_ignore_nothing():
    contracts = _contracts()
    for contract_id in SERVER_CONTRACTS:
        assert contract_id in contracts, contract_id
    for contract in contracts.values():
        assert not contract.get("ignore_imports"), contract["id"]


def test_the_engine_names_no_executor_table():
    """Executors add their side effects through fleet/engine/hooks.py, never by the engine
    writing (or reading) their tables."""
    tables = re.compile(r"\b(delivery_outbox|agents_agent|fleet_deliveryoutbox)\b")
    offenders = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in sorted((ROOT / "fleet" / "engine").rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if tables.search(line)
    ]
    assert offenders == []


def test_the_fleet_settle_hook_is_registered_at_startup_and_folded_in():
    """One statement per outcome still acks the packet and frees the slot: the fleet's
    fragment is part of the result handler's statement, not a statement of its own."""
    from fleet.engine import hooks, results, success_sets
    from fleet.executors.fleet.delivery.outbox_ack import OUTBOX_SETTLE_HOOK

    assert hooks.settle_hook() is OUTBOX_SETTLE_HOOK
    statements = results._statements()
    for sql in (statements.complete_freeing, statements.close_freeing):
        assert "UPDATE delivery_outbox" in sql and "UPDATE agents_agent" in sql
    for sql in (statements.complete_holding, statements.close_holding):
        assert "UPDATE delivery_outbox" in sql and "agents_agent" not in sql
    # A batch's successes as a set: always the holding form (one slot per packet is freed
    # by the batch's release, never one per agent by the fragment).
    for sql in success_sets._statements():
        assert "UPDATE delivery_outbox" in sql and "agents_agent" not in sql


# -- names and imports: nothing private crosses a module, no local import hides a cycle ------

PROJECT_PACKAGES = ("fleet", "agents", "artifacts", "cloacina_site")
WHY_LOCAL = re.compile(r"\b(local|lazy|lazily)\b", re.IGNORECASE)


def _source_files(root: Path, packages: tuple[str, ...]) -> list[Path]:
    return sorted(
        path
        for package in packages
        for path in (root / package).rglob("*.py")
        if "migrations" not in path.parts
    )


def _is_project_import(node: ast.Import | ast.ImportFrom) -> bool:
    if isinstance(node, ast.ImportFrom):
        return bool(node.level) or (node.module or "").split(".")[0] in PROJECT_PACKAGES
    return any(alias.name.split(".")[0] in PROJECT_PACKAGES for alias in node.names)


def _says_why(lines: list[str], node: ast.stmt) -> bool:
    """A comment on the import's first line, or in the comment block right above it."""
    first = node.lineno - 1
    if "#" in lines[first] and WHY_LOCAL.search(lines[first].split("#", 1)[1]):
        return True
    above = first - 1
    while above >= 0 and lines[above].strip().startswith("#"):
        if WHY_LOCAL.search(lines[above]):
            return True
        above -= 1
    return False


def import_audit(root: Path) -> tuple[list[str], list[str]]:
    """(private names imported from project modules, unexplained function-local project
    imports) in the server's packages under ``root``; tests/ is checked for the first only."""
    private: list[str] = []
    unexplained: list[str] = []
    for path in _source_files(root, (*PROJECT_PACKAGES, "tests")):
        text = path.read_text()
        lines = text.splitlines()
        where = path.relative_to(root)
        tree = ast.parse(text)
        for node in ast.walk(tree):
            in_tests = where.parts[0] == "tests"
            if (
                isinstance(node, ast.ImportFrom)
                and _is_project_import(node)
                and not (in_tests and node.level)  # a test's own helpers may stay private
            ):
                private += [
                    f"{where}:{node.lineno} {node.module}.{alias.name}"
                    for alias in node.names
                    if alias.name.startswith("_")
                ]
            if in_tests or not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            unexplained += [
                f"{where}:{inner.lineno}"
                for inner in ast.walk(node)
                if isinstance(inner, ast.Import | ast.ImportFrom)
                and _is_project_import(inner)
                and not _says_why(lines, inner)
            ]
    return private, sorted(set(unexplained))


def test_no_private_name_is_imported_and_every_local_import_says_why():
    """(a) No ``from <project module> import _name``, in the server or in tests/: a name
    another module needs is public (tests may import their own private helpers).
    (b) A project import inside a function of fleet/, agents/, artifacts/ or
    cloacina_site/ (migrations aside) is a deliberate lazy import, never a way around an
    import cycle (those are removed; the acyclic contract above keeps them out), so it
    says why: its own line or the comment block right above it contains the word
    "local" or "lazy" (e.g. "A local import: settings.py imports this module, before any
    model can be loaded")."""
    private, unexplained = import_audit(ROOT)
    assert private == [], "private names imported across modules"
    assert unexplained == [], "function-local project imports with no comment saying why"
