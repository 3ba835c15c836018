"""The server's layers only point down: import-linter's server-* contracts hold
(pyproject.toml [tool.importlinter]; docs/architecture.md draws the layers), none of
them ignores an import, and the engine names no executor's table in its SQL.

Here: the integration tests (database, in-process ASGI, fakes); the rest are in tests/unit/test_server_layers.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SERVER_CONTRACTS = ("server-layers", "server-acyclic", "server-inprocess-no-fleet")


def test_import_linter_keeps_the_server_contracts():
    args = [arg for cid in SERVER_CONTRACTS for arg in ("--contract", cid)]
    run = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from importlinter.cli import lint_imports_command; "
            "sys.exit(lint_imports_command())",
            "--no-cache",
            "--no-logo",
            *args,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert f"Contracts: {len(SERVER_CONTRACTS)} kept, 0 broken." in run.stdout
