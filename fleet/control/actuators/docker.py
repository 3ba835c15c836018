"""CLOACINA_FLEET_ACTUATOR=docker: labelled agent containers on a local Docker daemon (dev only).

Every container carries ``cloacina.managed=true`` and ``cloacina.tenant=<label>``,
and every list is filtered by both labels, so one tenant's reconcile never sees
another tenant's containers.  Each container gets its own freshly minted agent
key (env CLOACINA_AGENT_API_KEY) and the server URL; the key's public lookup
part is a label too, so the key of a container that is gone can be revoked.

Every container also carries ``cloacina.installation=<this installation's id>``
(:class:`fleet.models.Installation`): two installations sharing one daemon each see only
their own (a container without the label, from before it existed, is taken as ours).

Per pool: a named pool's containers carry ``cloacina.pool=<name>`` and start with its tags,
capabilities, slots, CPU, memory and GPUs; a container without the label is the default
pool's (so containers started before pools existed are adopted).

Scale-down drains the newest container: its roster row goes to draining and
the container gets SIGTERM (runagent finishes its work and exits); a container
still running after CLOACINA_AGENT_DRAIN_TIMEOUT_S is killed.  Nothing here
blocks a tick for the length of a drain.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from agents.models import Agent, AgentState
from fleet.control.actuators.base import (
    Actuator,
    AgentHandle,
    PoolSpec,
    ReconcileResult,
    label_of,
    mint_agent_key,
    plan_pool,
    pool_specs,
    revoke_keys,
)
from fleet.control.actuators.settings import (
    CPU_SHARES_PER_CORE,
    MIN_CPU_SHARES,
    ControlSettings,
    cpu_millis,
    memory_bytes,
)
from fleet.executors.fleet import lifecycle
from fleet.models import DEFAULT_POOL, Installation, Tenant

log = logging.getLogger(__name__)

MANAGED_LABEL = "cloacina.managed"
TENANT_LABEL = "cloacina.tenant"
AGENT_LABEL = "cloacina.agent"
KEY_LABEL = "cloacina.key"
POOL_LABEL = "cloacina.pool"
INSTALLATION_LABEL = "cloacina.installation"
MANAGED_BY = "docker"
AGENT_UID = "10001:10001"


@dataclass(frozen=True)
class Box:
    """One agent container as listed by the daemon."""

    id: str
    name: str
    label: str
    key_lookup: str
    state: str  # running, created, restarting, exited, dead, …
    created: int
    pool: str = DEFAULT_POOL

    @property
    def alive(self) -> bool:
        return self.state in ("created", "running", "restarting")


def container_resources(spec: PoolSpec, s: ControlSettings) -> dict:
    """The ``containers.run`` resource arguments of one agent of ``spec``'s pool: the
    platform's (:meth:`ControlSettings.container_resources`), with the pool's CPU and memory
    where it sets them (request = limit: a pool says what each agent gets) and its GPUs."""
    kwargs: dict = s.container_resources()
    if spec.cpu:
        millis = cpu_millis("pool cpu", spec.cpu)
        kwargs["nano_cpus"] = millis * 10**6
        kwargs["cpu_shares"] = max(MIN_CPU_SHARES, millis * CPU_SHARES_PER_CORE // 1000)
    if spec.memory:
        kwargs["mem_limit"] = kwargs["mem_reservation"] = memory_bytes("pool memory", spec.memory)
    if spec.gpu:
        import docker  # lazy: the Docker SDK is optional, needed only by this actuator

        kwargs["device_requests"] = [
            docker.types.DeviceRequest(count=spec.gpu, capabilities=[["gpu"]])
        ]
    return kwargs


class DockerActuator(Actuator):
    name = "docker"

    def __init__(
        self,
        settings: ControlSettings,
        client_factory: Callable[[], object] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        import docker

        self.settings = settings
        self.client = client_factory() if client_factory else docker.from_env()
        self.clock = clock
        self._draining: dict[str, float] = {}  # container id → when the drain started
        self._installation = ""  # read from the database on first use (not at import)

    @property
    def installation(self) -> str:
        if not self._installation:
            self._installation = Installation.current_id()
        return self._installation

    def describe(self) -> str:
        return f"docker ({self.client.api.base_url}, image {self.settings.agent_image})"

    # -- listing (always filtered by label) ----------------------------------------
    def _boxes(self, label: str | None) -> list[Box]:
        filters = [f"{MANAGED_LABEL}=true"] + ([f"{TENANT_LABEL}={label}"] if label else [])
        containers = self.client.containers.list(all=True, sparse=True, filters={"label": filters})
        boxes = []
        for c in containers:
            labels = c.attrs.get("Labels") or {}
            if labels.get(INSTALLATION_LABEL, self.installation) != self.installation:
                continue  # another installation's agent on the same daemon: never ours to touch
            names = c.attrs.get("Names") or [c.id]
            boxes.append(
                Box(
                    id=c.id,
                    name=labels.get(AGENT_LABEL) or names[0].lstrip("/"),
                    label=labels.get(TENANT_LABEL, ""),
                    key_lookup=labels.get(KEY_LABEL, ""),
                    # Containers started before pools existed have no pool label: default.
                    pool=labels.get(POOL_LABEL) or DEFAULT_POOL,
                    state=c.attrs.get("State", ""),
                    created=int(c.attrs.get("Created") or 0),
                )
            )
        if label:  # belt and braces: never act on a container the filter should have excluded
            boxes = [b for b in boxes if b.label == label]
        return boxes

    def _is_draining(self, box: Box, drained_keys: set[str]) -> bool:
        return box.id in self._draining or box.key_lookup in drained_keys

    def _drained_keys(self, boxes: list[Box]) -> set[str]:
        """Keys whose agent the roster already has as draining (a drain from an earlier leader)."""
        lookups = [b.key_lookup for b in boxes if b.key_lookup]
        if not lookups:
            return set()
        return set(
            Agent.objects.filter(
                api_key__lookup__in=lookups, state=AgentState.DRAINING
            ).values_list("api_key__lookup", flat=True)
        )

    def actual(self, tenant: Tenant | str) -> list[AgentHandle]:
        boxes = [b for b in self._boxes(label_of(tenant)) if b.alive]
        drained = self._drained_keys(boxes)
        return [
            AgentHandle(b.name, b.label, b.id, "running", b.key_lookup, b.pool)
            for b in boxes
            if not self._is_draining(b, drained)
        ]

    def managed_labels(self) -> set[str]:
        return {b.label for b in self._boxes(None) if b.label}

    # -- reconcile -------------------------------------------------------------------
    def reconcile(self, tenant: Tenant, desired: int | Sequence[PoolSpec]) -> ReconcileResult:
        label = label_of(tenant)
        specs = pool_specs(desired)
        boxes = self._boxes(label)
        drained = self._drained_keys(boxes)
        crashed = self._collect(boxes, drained)
        running = [b for b in boxes if b.alive and not self._is_draining(b, drained)]
        total = sum(spec.desired for spec in specs)
        result = ReconcileResult(label, total, actual=len(running) + len(crashed))
        for spec in specs:
            mine = [b for b in running if b.pool == spec.name]
            dead = [b for b in crashed if b.pool == spec.name]
            self._reconcile_pool(tenant, label, spec, mine, dead, result)
        # Containers of a pool that is no longer asked for (deleted): drain them all.
        wanted = {spec.name for spec in specs}
        for box in [b for b in running if b.pool not in wanted]:
            self._drain(box)
            result.stopped += 1
        self._mark_managed([b.key_lookup for b in running])
        return result

    def _reconcile_pool(
        self,
        tenant: Tenant,
        label: str,
        spec: PoolSpec,
        running: list[Box],
        crashed: list[Box],
        result: ReconcileResult,
    ) -> None:
        plan = plan_pool(spec.desired, running, crashed, age=lambda b: b.created)
        for dead in plan.replace:
            self._spawn(tenant, label, dead.name, spec)
        for _ in range(plan.start):
            self._spawn(tenant, label, None, spec)
        for box in plan.drain:
            self._drain(box)
        result.restarted += len(plan.replace)
        result.started += plan.start
        result.stopped += len(plan.drain)

    def stop_all(self, tenant: Tenant | str) -> int:
        label = label_of(tenant)
        boxes = self._boxes(label)
        drained = self._drained_keys(boxes)
        self._collect(boxes, drained)
        stopping = [b for b in boxes if b.alive and not self._is_draining(b, drained)]
        for box in stopping:
            self._drain(box)
        return len(stopping)

    # -- one container ---------------------------------------------------------------
    def _spawn(
        self, tenant: Tenant, label: str, name: str | None, spec: PoolSpec | None = None
    ) -> None:
        spec = spec or PoolSpec()
        pool_part = "" if spec.is_default else f"{spec.name}-"
        name = name or f"cloacina-agent-{label}-{pool_part}{secrets.token_hex(3)}"
        key, token = mint_agent_key(tenant, f"docker actuator: {name}")
        s = self.settings
        kwargs = dict(
            image=s.agent_image,
            command=[
                "runagent",
                "--server",
                s.server_url,
                "--name",
                name,
                *spec.runagent_args(s.agent_max_concurrency),
            ],
            name=name,
            detach=True,
            environment={
                "CLOACINA_AGENT_API_KEY": token,
                "CLOACINA_SERVER_URL": s.server_url,
                "HOME": "/home/agent",
                "CLOACINA_HOME": "/home/agent/.cloacina",  # the package cache: on the tmpfs
            },
            labels={
                MANAGED_LABEL: "true",
                INSTALLATION_LABEL: self.installation,
                TENANT_LABEL: label,
                AGENT_LABEL: name,
                KEY_LABEL: key.lookup,
                # Only named pools are labelled: no pool label is the default pool, as on
                # every container started before pools existed.
                **({} if spec.is_default else {POOL_LABEL: spec.name}),
            },
            user=AGENT_UID,
            read_only=True,
            tmpfs={"/tmp": "rw,size=512m", "/home/agent": "rw,size=1g"},
            cap_drop=["ALL"],
            security_opt=["no-new-privileges:true"],
            stop_signal="SIGTERM",
            **container_resources(spec, s),
        )
        if s.docker_network:  # e.g. "host": agents reach a `serve` on this machine's 127.0.0.1
            kwargs["network"] = s.docker_network
        try:
            container = self.client.containers.run(**kwargs)
        except Exception:
            revoke_keys({key.lookup})  # never leave a valid key behind for a container that failed
            raise
        log.info("docker actuator: started %s (%s) for tenant %s", name, container.id[:12], tenant)

    def _drain(self, box: Box) -> None:
        if box.key_lookup:
            # Through the lifecycle: a drain deadline (the sweep evicts an agent past it) and
            # its bindings cleared, exactly as a drain asked for over the API.
            lifecycle.drain_agents_of_key(
                box.key_lookup, self.settings.agent_drain_timeout_s, "docker actuator"
            )
        self._draining[box.id] = self.clock()
        self.client.api.kill(box.id, signal="SIGTERM")
        log.info("docker actuator: draining %s (%s)", box.name, box.id[:12])

    def _collect(self, boxes: list[Box], drained: set[str]) -> list[Box]:
        """Remove exited containers (revoking their keys), kill overdue drains; return the crashed."""
        crashed, gone = [], []
        now = self.clock()
        for box in boxes:
            draining = self._is_draining(box, drained)
            if box.alive:
                started = self._draining.setdefault(box.id, now) if draining else None
                if started is not None and now - started > self.settings.agent_drain_timeout_s:
                    log.warning("docker actuator: %s did not drain in time; killing it", box.name)
                    self.client.api.kill(box.id, signal="SIGKILL")
                continue
            gone.append(box)
            if not draining:
                crashed.append(box)
                log.warning("docker actuator: %s exited unasked (%s)", box.name, box.state)
            self.client.api.remove_container(box.id, force=True)
            self._draining.pop(box.id, None)
        revoke_keys({b.key_lookup for b in gone if b.key_lookup})
        return crashed

    def _mark_managed(self, lookups: list[str]) -> None:
        lookups = [lookup for lookup in lookups if lookup]
        if lookups:
            Agent.objects.filter(api_key__lookup__in=lookups).exclude(managed_by=MANAGED_BY).update(
                managed_by=MANAGED_BY
            )
