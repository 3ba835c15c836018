"""A fake Kubernetes API server: the paths and object shapes the `kubernetes` client calls.

Namespaces, v1 Secrets and Pods, apps/v1 Deployments (incl. the scale
subresource) and networking.k8s.io/v1 NetworkPolicies (incl. a label-selected
deletecollection).  Namespaced objects
need their namespace to exist (404 otherwise), names are unique (409), and a
Deployment's pods are synthesised from its replicas.  Pods are not ready
until the test says so (``set_ready``), like a slow cluster.
"""

from __future__ import annotations

import copy
import re
import ssl
import uuid
from datetime import UTC, datetime

from fleet.control.actuators.settings import ControlSettings
from tests.support.fakes.http_fake import FakeHttpServer, HttpError, Response

_KINDS = {
    # path segment → (api prefix, kind, list kind, apiVersion)
    "secrets": ("/api/v1", "Secret", "SecretList", "v1"),
    "pods": ("/api/v1", "Pod", "PodList", "v1"),
    "deployments": ("/apis/apps/v1", "Deployment", "DeploymentList", "apps/v1"),
    "networkpolicies": (
        "/apis/networking.k8s.io/v1",
        "NetworkPolicy",
        "NetworkPolicyList",
        "networking.k8s.io/v1",
    ),
}
_NAMESPACED = re.compile(
    r"^(?P<prefix>/api/v1|/apis/apps/v1|/apis/networking\.k8s\.io/v1)/namespaces/(?P<ns>[^/]+)/"
    r"(?P<kind>secrets|pods|deployments|networkpolicies)(?:/(?P<name>[^/]+))?(?P<sub>/scale)?$"
)


def _status(code: int, reason: str, message: str) -> HttpError:
    return HttpError(
        code,
        {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": message,
            "reason": reason,
            "code": code,
        },
    )


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _matches(labels: dict, selector: str | None) -> bool:
    for term in filter(None, (selector or "").split(",")):
        key, sep, value = term.partition("=")
        if key not in labels or (sep and labels[key] != value):
            return False
    return True


def _merge(target: dict, patch: dict) -> dict:
    """JSON merge patch (RFC 7386)."""
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, dict) and isinstance(target.get(key), dict):
            _merge(target[key], value)
        else:
            target[key] = copy.deepcopy(value)
    return target


class FakeKubernetesApi(FakeHttpServer):
    def __init__(self, tls: ssl.SSLContext | None = None) -> None:
        super().__init__(tls)
        self.namespaces: dict[str, dict] = {}
        self.objects: dict[tuple[str, str, str], dict] = {}  # (kind, namespace, name) → object
        self.scheme = "https" if tls else "http"

    @property
    def host(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    # -- test controls -----------------------------------------------------------------
    def get(self, kind: str, namespace: str, name: str) -> dict | None:
        with self.lock:
            return copy.deepcopy(self.objects.get((kind, namespace, name)))

    def set_ready(self, namespace: str, name: str = "cloacina-agent") -> None:
        """The Deployment's rollout finishes: every replica is updated and ready."""
        with self.lock:
            dep = self.objects[("deployments", namespace, name)]
            n = dep["spec"].get("replicas", 1)
            dep["status"] = {
                "observedGeneration": dep["metadata"]["generation"],
                "replicas": n,
                "updatedReplicas": n,
                "readyReplicas": n,
                "availableReplicas": n,
            }

    # -- the API -----------------------------------------------------------------------
    def route(self, method: str, path: str, query: dict, body: object) -> Response:
        selector = query.get("labelSelector", [None])[0]
        if path == "/api/v1/namespaces":
            if method == "GET":
                items = [
                    n
                    for n in self.namespaces.values()
                    if _matches(n["metadata"].get("labels") or {}, selector)
                ]
                return Response(body=self._list("NamespaceList", "v1", items))
            if method == "POST":
                return Response(201, self._create_namespace(body))
        m = re.fullmatch(r"/api/v1/namespaces/([^/]+)", path)
        if m and method == "GET":
            ns = self.namespaces.get(m.group(1))
            if ns is None:
                raise _status(404, "NotFound", f'namespaces "{m.group(1)}" not found')
            return Response(body=ns)
        m = _NAMESPACED.match(path)
        if not m:
            raise _status(
                404,
                "NotFound",
                f"the server could not find the requested resource ({method} {path})",
            )
        ns, kind, name, sub = m.group("ns"), m.group("kind"), m.group("name"), m.group("sub")
        prefix, kind_name, list_kind, api_version = _KINDS[kind]
        if m.group("prefix") != prefix:
            raise _status(404, "NotFound", f"{kind} are not served under {m.group('prefix')}")
        if kind == "pods":
            return Response(body=self._list(list_kind, "v1", self._pods(ns, selector)))
        if name is None:
            if method == "GET":
                items = [
                    o for (k, n, _), o in self.objects.items()
                    if k == kind and n == ns and _matches(o["metadata"].get("labels") or {}, selector)
                ]  # fmt: skip
                return Response(body=self._list(list_kind, api_version, items))
            if method == "POST":
                return Response(201, self._create(kind, kind_name, api_version, ns, body))
            if method == "DELETE":
                return Response(
                    body=self._delete_collection(kind, list_kind, api_version, ns, selector)
                )
        key = (kind, ns, name)
        current = self.objects.get(key)
        if current is None:
            raise _status(404, "NotFound", f'{kind} "{name}" not found')
        if sub == "/scale":
            return Response(body=self._scale(current, method, body))
        if method == "GET":
            return Response(body=current)
        if method == "PUT":
            return Response(body=self._replace(kind, current, body))
        if method == "PATCH":
            return Response(body=self._replace(kind, current, _merge(copy.deepcopy(current), body)))
        if method == "DELETE":
            del self.objects[key]
            return Response(body={"kind": "Status", "apiVersion": "v1", "status": "Success"})
        raise _status(405, "MethodNotAllowed", f"{method} {path}")

    @staticmethod
    def _list(kind: str, api_version: str, items: list[dict]) -> dict:
        return {
            "kind": kind,
            "apiVersion": api_version,
            "metadata": {"resourceVersion": "1"},
            "items": items,
        }

    @staticmethod
    def _stamp(obj: dict, namespace: str | None) -> dict:
        meta = obj.setdefault("metadata", {})
        meta.setdefault("uid", str(uuid.uuid4()))
        meta.setdefault("creationTimestamp", _now())
        meta["resourceVersion"] = str(uuid.uuid4().int % 10**8)
        if namespace:
            meta["namespace"] = namespace
        return obj

    def _create_namespace(self, body: dict) -> dict:
        name = body["metadata"]["name"]
        if name in self.namespaces:
            raise _status(409, "AlreadyExists", f'namespaces "{name}" already exists')
        obj = self._stamp(copy.deepcopy(body), None)
        obj["status"] = {"phase": "Active"}
        # Kubernetes labels every namespace with its own name (the NetworkPolicy relies on it).
        obj["metadata"].setdefault("labels", {})["kubernetes.io/metadata.name"] = name
        self.namespaces[name] = obj
        return obj

    def _create(self, kind: str, kind_name: str, api_version: str, ns: str, body: dict) -> dict:
        if ns not in self.namespaces:
            raise _status(404, "NotFound", f'namespaces "{ns}" not found')
        name = body["metadata"]["name"]
        if (kind, ns, name) in self.objects:
            raise _status(409, "AlreadyExists", f'{kind} "{name}" already exists')
        if body.get("kind") not in (None, kind_name) or body.get("apiVersion") not in (
            None,
            api_version,
        ):
            raise _status(400, "BadRequest", f"wrong kind/apiVersion for {kind}")
        obj = self._stamp(copy.deepcopy(body), ns)
        if kind == "deployments":
            obj["metadata"]["generation"] = 1
            obj["spec"].setdefault("replicas", 1)
            obj["status"] = {"observedGeneration": 1, "replicas": obj["spec"]["replicas"]}
        self.objects[(kind, ns, name)] = obj
        return obj

    def _delete_collection(
        self, kind: str, list_kind: str, api_version: str, ns: str, selector: str | None
    ) -> dict:
        """deletecollection: removes the matching objects and answers with them, as a list
        (like the real API server; a namespace that does not exist simply has none)."""
        doomed = [
            key
            for key, obj in self.objects.items()
            if key[:2] == (kind, ns) and _matches(obj["metadata"].get("labels") or {}, selector)
        ]
        return self._list(list_kind, api_version, [self.objects.pop(key) for key in doomed])

    def _replace(self, kind: str, current: dict, body: dict) -> dict:
        obj = copy.deepcopy(body)
        obj.setdefault("metadata", {})
        for field in ("uid", "creationTimestamp", "namespace", "generation"):
            if field in current["metadata"]:
                obj["metadata"][field] = current["metadata"][field]
        if kind == "deployments":
            obj["status"] = current.get("status", {})
            if obj["spec"] != current["spec"]:
                obj["metadata"]["generation"] = current["metadata"]["generation"] + 1
        self._stamp(obj, current["metadata"]["namespace"])
        key = (kind, current["metadata"]["namespace"], current["metadata"]["name"])
        self.objects[key] = obj
        return obj

    def _scale(self, dep: dict, method: str, body: dict | None) -> dict:
        if method == "PATCH":
            replicas = (body or {}).get("spec", {}).get("replicas")
            if not isinstance(replicas, int) or replicas < 0:
                raise _status(422, "Invalid", f"spec.replicas: Invalid value: {replicas!r}")
            if replicas != dep["spec"].get("replicas"):
                dep["spec"]["replicas"] = replicas
                dep["metadata"]["generation"] += 1
                dep["status"]["replicas"] = replicas
                ready = dep["status"].get("readyReplicas") or 0
                if ready > replicas:  # scaling down removes pods at once here
                    dep["status"]["readyReplicas"] = replicas
                    dep["status"]["updatedReplicas"] = replicas
        meta = dep["metadata"]
        return {
            "apiVersion": "autoscaling/v1",
            "kind": "Scale",
            "metadata": {"name": meta["name"], "namespace": meta["namespace"]},
            "spec": {"replicas": dep["spec"]["replicas"]},
            "status": {"replicas": dep["status"].get("replicas", 0)},
        }

    def _pods(self, ns: str, selector: str | None) -> list[dict]:
        pods = []
        for (kind, n, name), dep in self.objects.items():
            if kind != "deployments" or n != ns:
                continue
            labels = dep["spec"]["template"]["metadata"].get("labels") or {}
            ready = dep.get("status", {}).get("readyReplicas") or 0
            for i in range(dep["spec"].get("replicas", 1)):
                if not _matches(labels, selector):
                    continue
                pods.append(
                    {
                        "apiVersion": "v1",
                        "kind": "Pod",
                        "metadata": {"name": f"{name}-{i}", "namespace": ns, "labels": labels},
                        "spec": copy.deepcopy(dep["spec"]["template"]["spec"]),
                        "status": {"phase": "Running" if i < ready else "Pending"},
                    }
                )
        return pods


# The control settings of the tests that run the Kubernetes actuator against this fake.
SETTINGS = ControlSettings(
    server_url="http://cloacina.cloacina.svc:8000",
    agent_image="ghcr.io/example/cloacina:1.0",
    agent_max_concurrency=2,
    agent_cpu_request="100m",
    agent_cpu_limit="1",
    agent_memory_request="256Mi",
    agent_memory_limit="1Gi",
    agent_drain_timeout_s=120,
    server_namespace="cloacina",
    server_pod_labels="app.kubernetes.io/name=cloacina,app.kubernetes.io/component=server",
)
