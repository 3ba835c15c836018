"""The server's layers only point down: import-linter's server-* contracts hold
(pyproject.toml [tool.importlinter]; docs/architecture.md draws the layers), none of
them ignores an import, and the engine names no executor's table in its SQL.

Here: the unit tests (no database, socket or process); the rest are in tests/integration/test_server_layers.py.
"""

from __future__ import annotations

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
    from fleet.delivery.outbox_ack import OUTBOX_SETTLE_HOOK
    from fleet.engine import hooks, results

    assert hooks.settle_hook() is OUTBOX_SETTLE_HOOK
    statements = results._statements()
    for sql in (statements.complete_freeing, statements.close_freeing):
        assert "UPDATE delivery_outbox" in sql and "UPDATE agents_agent" in sql
    for sql in (statements.complete_holding, statements.close_holding):
        assert "UPDATE delivery_outbox" in sql and "agents_agent" not in sql
