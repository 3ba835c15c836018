"""A `serve` subprocess for the benchmark, and the few API calls the benchmark makes."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent.parent
READY_LINE = re.compile(r"Cloacina server ready: console at (http://\S+?)/console/")
START_TIMEOUT_S = 60.0


class BenchServer:
    """`manage.py serve --port 0` against the bench database, with a private CLOACINA_HOME."""

    def __init__(self, database_url: str, executor: str = "default", **env: str) -> None:
        self.home = Path(tempfile.mkdtemp(prefix="cloacina-bench-"))
        self.log_path = self.home / "serve.log"
        self.env = {
            **os.environ,
            "DATABASE_URL": database_url,
            "CLOACINA_HOME": str(self.home),
            "CLOACINA_SECRET_KEY": os.environ.get("CLOACINA_SECRET_KEY") or "bench",
            "CLOACINA_LOG_LEVEL": "WARNING",
            "PYTHONUNBUFFERED": "1",
            **env,
        }
        self.executor = executor
        self.process: subprocess.Popen | None = None
        self.url = ""

    def start(self) -> str:
        args = [sys.executable, str(REPO / "manage.py"), "serve", "--port", "0"]
        args += ["--default-executor", self.executor]
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                args, cwd=REPO, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            match = READY_LINE.search(self.log_path.read_text(errors="replace"))
            if match:
                self.url = match.group(1)
                return self.url
            if self.process.poll() is not None:
                raise RuntimeError(f"serve exited with {self.process.returncode}:\n{self.log()}")
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"serve not ready after {START_TIMEOUT_S}s:\n{self.log()}")

    def log(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)  # stray task children, if any
        except (ProcessLookupError, PermissionError):
            pass
        self.process.wait(5)

    def __enter__(self) -> BenchServer:
        self.start()
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.stop()
        if exc_type is None:  # kept after a failure: serve.log says what went wrong
            shutil.rmtree(self.home, ignore_errors=True)


class Api:
    """The server's REST API with one tenant's write key."""

    def __init__(self, url: str, key: str) -> None:
        self.client = httpx.Client(
            base_url=f"{url}/api/v1", headers={"Authorization": f"Bearer {key}"}, timeout=30
        )

    def upload(self, archive: bytes) -> dict:
        response = self.client.post("/packages", files={"file": ("bench.tar.gz", archive)})
        if response.status_code not in (200, 201):
            raise RuntimeError(f"package upload failed: {response.status_code} {response.text}")
        return response.json()

    def start(self, workflow: str, context: dict | None = None) -> str:
        response = self.client.post(
            f"/workflows/{workflow}/executions", json={"context": context or {}}
        )
        if response.status_code != 201:
            raise RuntimeError(f"start failed: {response.status_code} {response.text}")
        return response.json()["id"]

    def close(self) -> None:
        self.client.close()
