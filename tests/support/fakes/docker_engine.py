"""A fake Docker Engine API (the paths and shapes the `docker` SDK 7.x calls), over TCP.

Point the SDK at it with ``DOCKER_HOST=tcp://127.0.0.1:<port>``.  Containers
never run anything: a test moves them through their states (``exit``), and
``kill`` with SIGTERM only records the signal unless ``exit_on_sigterm``.
"""

from __future__ import annotations

import json
import re
import secrets
import time
from dataclasses import dataclass, field

from tests.support.fakes.http_fake import FakeHttpServer, HttpError, Response

API_VERSION = "1.45"
_VERSIONED = re.compile(r"^/v\d+\.\d+(/.*)$")


@dataclass
class Container:
    id: str
    name: str
    config: dict
    created: int
    state: str = "created"
    exit_code: int = 0
    signals: list[str] = field(default_factory=list)

    @property
    def labels(self) -> dict:
        return self.config.get("Labels") or {}

    def summary(self) -> dict:  # an item of GET /containers/json
        return {
            "Id": self.id,
            "Names": [f"/{self.name}"],
            "Image": self.config.get("Image"),
            "Command": " ".join(self.config.get("Cmd") or []),
            "Created": self.created,
            "Labels": self.labels,
            "State": self.state,
            "Status": "Up" if self.state == "running" else f"Exited ({self.exit_code})",
        }

    def inspect(self) -> dict:  # GET /containers/{id}/json
        return {
            "Id": self.id,
            "Name": f"/{self.name}",
            "Created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.created)),
            "Config": self.config,
            "HostConfig": self.config.get("HostConfig") or {},
            "State": {
                "Status": self.state,
                "Running": self.state == "running",
                "ExitCode": self.exit_code,
            },
        }


def _not_found(what: str) -> HttpError:
    return HttpError(404, {"message": f"No such container: {what}"})


class FakeDockerEngine(FakeHttpServer):
    def __init__(self, exit_on_sigterm: bool = False) -> None:
        super().__init__()
        self.containers: dict[str, Container] = {}
        self.exit_on_sigterm = exit_on_sigterm
        self._clock = int(time.time())

    @property
    def base_url(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    # -- test controls -----------------------------------------------------------------
    def exit(self, container_id: str, code: int = 0) -> None:
        with self.lock:
            c = self.containers[container_id]
            c.state, c.exit_code = "exited", code

    def by_label(self, **labels: str) -> list[Container]:
        with self.lock:
            return [
                c
                for c in self.containers.values()
                if all(c.labels.get(k.replace("_", ".")) == v for k, v in labels.items())
            ]

    def add_foreign(self, name: str, labels: dict) -> Container:
        """A container somebody else started (must never be touched by the actuator)."""
        with self.lock:
            c = Container(
                secrets.token_hex(32), name, {"Image": "x", "Labels": labels}, self._tick()
            )
            c.state = "running"
            self.containers[c.id] = c
            return c

    def _tick(self) -> int:
        self._clock += 1  # strictly increasing creation times, so "newest" is well defined
        return self._clock

    # -- the API -----------------------------------------------------------------------
    def route(self, method: str, path: str, query: dict, body: object) -> Response:
        if path == "/version":
            return Response(body={"ApiVersion": API_VERSION, "Version": "26.1.0", "Os": "linux"})
        match = _VERSIONED.match(path)
        path = match.group(1) if match else path
        if path == "/_ping":
            return Response(body="OK", content_type="text/plain")
        if path == "/containers/json" and method == "GET":
            return Response(body=self._list(query))
        if path == "/containers/create" and method == "POST":
            return Response(201, self._create(query.get("name", [""])[0], body or {}))
        m = re.fullmatch(r"/containers/([^/]+)(/json|/start|/stop|/kill)?", path)
        if not m:
            raise HttpError(404, {"message": f"page not found: {method} {path}"})
        c = self._find(m.group(1))
        action = m.group(2)
        if action == "/json" and method == "GET":
            return Response(body=c.inspect())
        if action == "/start" and method == "POST":
            c.state = "running"
            return Response(204)
        if action == "/stop" and method == "POST":
            c.signals.append("SIGTERM")
            c.state = "exited"
            return Response(204)
        if action == "/kill" and method == "POST":
            sig = query.get("signal", ["SIGKILL"])[0]
            c.signals.append(sig)
            if sig == "SIGKILL" or self.exit_on_sigterm:
                c.state, c.exit_code = "exited", 137 if sig == "SIGKILL" else 0
            return Response(204)
        if action is None and method == "DELETE":
            if c.state == "running" and query.get("force", ["0"])[0] not in ("1", "True", "true"):
                raise HttpError(409, {"message": "cannot remove a running container"})
            del self.containers[c.id]
            return Response(204)
        raise HttpError(405, {"message": f"{method} not allowed on {path}"})

    def _find(self, ref: str) -> Container:
        for c in self.containers.values():
            if c.id == ref or c.id.startswith(ref) or c.name == ref:
                return c
        raise _not_found(ref)

    def _list(self, query: dict) -> list[dict]:
        show_all = query.get("all", ["0"])[0] in ("1", "True", "true")
        filters = json.loads(query.get("filters", ["{}"])[0] or "{}")
        wanted = filters.get("label", [])
        out = []
        for c in self.containers.values():
            if not show_all and c.state != "running":
                continue
            ok = True
            for item in wanted:
                key, sep, value = item.partition("=")
                if key not in c.labels or (sep and c.labels[key] != value):
                    ok = False
            if ok:
                out.append(c.summary())
        return out

    def _create(self, name: str, config: dict) -> dict:
        name = name or f"auto-{secrets.token_hex(4)}"
        if any(c.name == name for c in self.containers.values()):
            raise HttpError(409, {"message": f'Conflict. The container name "/{name}" is in use'})
        c = Container(secrets.token_hex(32), name, config, self._tick())
        self.containers[c.id] = c
        return {"Id": c.id, "Warnings": []}
