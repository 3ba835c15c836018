"""Helpers for the hostile-input suites (tests/*/test_hostile_*.py): a real `serve` with a
tenant and keys, the server's memory, and the "still serving" check every case ends with.
The ``served`` fixture that builds one lives in tests/e2e/conftest.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx
import psutil

from tests.support.processes import Processes, ServeHandle

TENANT = "acme"


@dataclass
class Served:
    procs: Processes
    server: ServeHandle
    keys: dict[str, str]  # role -> key of tenant acme

    def headers(self, role: str = "write") -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[role]}"}

    def post(self, path: str, role: str = "write", **kwargs) -> httpx.Response:
        kwargs["headers"] = {**self.headers(role), **kwargs.get("headers", {})}
        return httpx.post(self.server.api(path), timeout=60, **kwargs)

    def get(self, path: str, role: str = "read", **kwargs) -> httpx.Response:
        kwargs["headers"] = {**self.headers(role), **kwargs.get("headers", {})}
        return httpx.get(self.server.api(path), timeout=60, **kwargs)

    def rss_mb(self) -> float:
        """Resident memory of the server process (its task runner children included)."""
        root = psutil.Process(self.server.process.pid)
        processes = [root, *root.children(recursive=True)]
        total = 0
        for process in processes:
            try:
                total += process.memory_info().rss
            except psutil.NoSuchProcess:
                pass
        return total / 1024 / 1024

    def assert_still_serving(self) -> None:
        """Health, a read and a write all still answer."""
        assert httpx.get(f"{self.server.url}/healthz", timeout=10).status_code == 200
        assert self.get("/executions").status_code == 200
        assert self.post("/fleet/provision").status_code == 200
        assert self.post("/fleet/deprovision").status_code == 200
        assert self.server.process.poll() is None, self.server.process.tail()
