"""The fast layer: pure logic, no database, no sockets, no subprocesses.

pytest-django already refuses database access to a test that did not ask for it; the
fixture below refuses the other two, so a test that needs them fails here with the
reason instead of slowing the layer down.  It belongs in tests/integration then.
"""

from __future__ import annotations

import socket
import subprocess

import pytest


def _refuse(what: str):
    def refused(*args, **kwargs):
        raise AssertionError(f"a unit test may not use {what}: move it to tests/integration")

    return refused


@pytest.fixture(autouse=True)
def no_sockets_or_subprocesses(monkeypatch):
    """Fail a unit test that opens a network socket or starts a process."""
    monkeypatch.setattr(subprocess.Popen, "__init__", _refuse("a subprocess"))
    monkeypatch.setattr(socket.socket, "connect", _refuse("a socket"))
    monkeypatch.setattr(socket.socket, "bind", _refuse("a socket"))
