"""CLOACINA_FLEET_ACTUATOR=kubernetes: one agent Deployment per tenant pool, replicas = its count.

The default pool's Deployment is ``cloacina-agent`` (as before pools), a named pool's
``cloacina-agent-<pool>``, labelled ``cloacina.io/pool``, with its own Secret and
NetworkPolicy (:mod:`fleet.control.actuators.kubernetes_manifests`).

Each tenant gets its own namespace ``cloacina-tenant-<slug>`` (see
:mod:`fleet.control.actuators.naming`); everything the actuator reads or writes for a
tenant lives there, so it can never touch another tenant's workloads.

Keys: one shared agent key per tenant, in the Secret ``cloacina-agent-key``
that the pods read at start.  It is re-minted on a scale-up of a Deployment
whose pods are all ready (a finished rollout) or when the Secret is missing.
While pods are still coming up a scale-up reuses the current key, so a slow
cluster never gets a new key minted on every tick.  A superseded key is
revoked once the rollout is complete and no registered agent still uses it.

Scale-down lowers ``replicas``; the ReplicaSet controller deletes the newest
pods first and each gets SIGTERM with ``terminationGracePeriodSeconds`` =
CLOACINA_AGENT_DRAIN_TIMEOUT_S, during which runagent finishes its work.
"""

from __future__ import annotations

import base64
import logging
from collections.abc import Sequence

from django.db.models import Q
from kubernetes import client as k8s
from kubernetes.client.rest import ApiException

from agents.models import ACTIVE_STATES, Agent
from fleet.control.actuators import kubernetes_manifests as m
from fleet.control.actuators.base import (
    Actuator,
    AgentHandle,
    PoolSpec,
    ReconcileResult,
    label_of,
    mint_agent_key,
    pool_specs,
    revoke_keys,
)
from fleet.control.actuators.naming import NAMESPACE_PREFIX
from fleet.control.actuators.settings import ControlSettings
from fleet.models import DEFAULT_POOL, ApiKey, Tenant

log = logging.getLogger(__name__)

KEY_LABEL_PREFIX = "kubernetes actuator: "
# The API server rejects (instead of silently dropping) any field it does not know.
STRICT = "Strict"


def key_label(ns: str, pool: str = DEFAULT_POOL) -> str:
    """The label of a pool's minted keys (the default pool's is the namespace's, as before)."""
    return KEY_LABEL_PREFIX + ns if pool == DEFAULT_POOL else f"{KEY_LABEL_PREFIX}{ns}/{pool}"


def _missing(exc: ApiException) -> bool:
    return exc.status == 404


class KubernetesActuator(Actuator):
    name = "kubernetes"

    def __init__(
        self,
        settings: ControlSettings,
        api_client: k8s.ApiClient,
        own_namespace: str | None = None,
    ) -> None:
        self.settings = settings
        self.api_client = api_client
        self.core = k8s.CoreV1Api(api_client)
        self.apps = k8s.AppsV1Api(api_client)
        self.net = k8s.NetworkingV1Api(api_client)
        self.own_namespace = own_namespace
        self._policy_warned: set[str] = set()
        self._policies_removed: set[str] = set()  # namespaces cleared with the toggle off

    def describe(self) -> str:
        return (
            f"kubernetes ({self.api_client.configuration.host}, image {self.settings.agent_image})"
        )

    @staticmethod
    def namespace_for(label: str) -> str:
        return NAMESPACE_PREFIX + label

    # -- queries ---------------------------------------------------------------------
    def actual(self, tenant: Tenant | str) -> list[AgentHandle]:
        label = label_of(tenant)
        ns = self.namespace_for(label)
        try:
            pods = self.core.list_namespaced_pod(
                ns, label_selector=f"{m.MANAGED_LABEL}=true,{m.TENANT_LABEL}={label}"
            )
        except ApiException as exc:
            if _missing(exc):
                return []
            raise
        return [
            AgentHandle(
                p.metadata.name,
                label,
                p.metadata.name,
                "running",
                "",
                (p.metadata.labels or {}).get(m.POOL_LABEL) or DEFAULT_POOL,
            )  # fmt: skip
            for p in pods.items
            if p.metadata.deletion_timestamp is None
            and (p.status is None or p.status.phase in (None, "Pending", "Running"))
        ]

    def managed_labels(self) -> set[str]:
        spaces = self.core.list_namespace(label_selector=f"{m.MANAGED_LABEL}=true")
        return {
            (ns.metadata.labels or {}).get(m.TENANT_LABEL, "")
            for ns in spaces.items
            if (ns.metadata.labels or {}).get(m.TENANT_LABEL)
        }

    def _deployment(self, ns: str, pool: str = DEFAULT_POOL) -> k8s.V1Deployment | None:
        try:
            return self.apps.read_namespaced_deployment(m.deployment_name(pool), ns)
        except ApiException as exc:
            if _missing(exc):
                return None
            raise

    def _secret_lookup(self, ns: str, pool: str = DEFAULT_POOL) -> str | None:
        """The lookup of the key currently in the pool's Secret (None: no Secret)."""
        try:
            secret = self.core.read_namespaced_secret(m.secret_name(pool), ns)
        except ApiException as exc:
            if _missing(exc):
                return None
            raise
        return (secret.metadata.annotations or {}).get(m.KEY_ANNOTATION, "")

    @staticmethod
    def rollout_complete(dep: k8s.V1Deployment) -> bool:
        """All requested pods exist from the current template and are ready."""
        want = dep.spec.replicas or 0
        status = dep.status or k8s.V1DeploymentStatus()
        observed = (status.observed_generation or 0) >= (dep.metadata.generation or 0)
        return (
            observed
            and (status.ready_replicas or 0) >= want
            and (status.updated_replicas or 0) >= want
        )

    # -- reconcile -------------------------------------------------------------------
    def reconcile(self, tenant: Tenant, desired: int | Sequence[PoolSpec]) -> ReconcileResult:
        label = label_of(tenant)
        ns = self.namespace_for(label)
        specs = pool_specs(desired)
        result = ReconcileResult(label, sum(spec.desired for spec in specs), actual=0)
        for spec in specs:
            self._reconcile_pool(tenant, ns, label, spec, result)
        # A pool no longer asked for (deleted): its Deployment goes to 0 replicas.
        wanted = {spec.name for spec in specs}
        for dep in self._pool_deployments(ns):
            pool = (dep.metadata.labels or {}).get(m.POOL_LABEL, "")
            if pool not in wanted and (dep.spec.replicas or 0) > 0:
                result.stopped += dep.spec.replicas
                self.apps.patch_namespaced_deployment_scale(
                    dep.metadata.name, ns, {"spec": {"replicas": 0}}
                )
                log.info("kubernetes actuator: pool %s of %s is gone: 0 replicas", pool, ns)
        return result

    def _pool_deployments(self, ns: str) -> list[k8s.V1Deployment]:
        """The named pools' Deployments in the namespace (the default one has no pool label)."""
        try:
            return self.apps.list_namespaced_deployment(
                ns, label_selector=f"{m.MANAGED_LABEL}=true,{m.POOL_LABEL}"
            ).items
        except ApiException as exc:
            if _missing(exc):
                return []
            raise

    def _reconcile_pool(
        self, tenant: Tenant, ns: str, label: str, spec: PoolSpec, result: ReconcileResult
    ) -> None:
        desired, name = spec.desired, m.deployment_name(spec.name)
        dep = self._deployment(ns, spec.name)
        current = (dep.spec.replicas or 0) if dep is not None else 0
        result.actual += current
        if dep is None:
            if desired == 0:
                return  # nothing to run: create no namespace for an idle tenant
            self._ensure_namespace(ns, label)
            self._ensure_network_policy(ns, label, spec.name)
            self._rotate_key(tenant, ns, label, spec.name)
            body = m.render_deployment(ns, label, desired, self.settings, spec)
            self.apps.create_namespaced_deployment(ns, body, field_validation=STRICT)
            result.started += desired
            log.info("kubernetes actuator: created %s/%s with %d replicas", ns, name, desired)
            return
        self._ensure_network_policy(ns, label, spec.name)
        current_lookup = self._secret_lookup(ns, spec.name)
        if desired > current:
            if current_lookup is None or self.rollout_complete(dep):
                current_lookup = self._rotate_key(tenant, ns, label, spec.name)
            else:
                result.notes.append("pods not ready yet: scaled up with the current key")
            result.started += desired - current
        elif desired < current:
            result.stopped += current - desired
        if desired != current:
            self.apps.patch_namespaced_deployment_scale(name, ns, {"spec": {"replicas": desired}})
            log.info("kubernetes actuator: %s/%s replicas %d → %d", ns, name, current, desired)
        elif self.rollout_complete(dep) and current_lookup:
            self._revoke_superseded(tenant, ns, current_lookup, spec.name)

    def stop_all(self, tenant: Tenant | str) -> int:
        label = label_of(tenant)
        ns = self.namespace_for(label)
        stopped = 0
        for pool, dep in [
            (DEFAULT_POOL, self._deployment(ns)),
            *(
                ((d.metadata.labels or {}).get(m.POOL_LABEL, ""), d)
                for d in self._pool_deployments(ns)
            ),
        ]:
            replicas = (dep.spec.replicas or 0) if dep is not None else 0
            if replicas:
                self.apps.patch_namespaced_deployment_scale(
                    dep.metadata.name, ns, {"spec": {"replicas": 0}}
                )
                stopped += replicas
            try:
                self.core.delete_namespaced_secret(m.secret_name(pool), ns)
            except ApiException as exc:
                if not _missing(exc):
                    raise
        if not self.settings.network_policy:
            self._remove_network_policies(ns, label)  # a disabled tenant's too
        revoke_keys(
            set(
                ApiKey.objects.filter(
                    Q(label=KEY_LABEL_PREFIX + ns)
                    | Q(label__startswith=f"{KEY_LABEL_PREFIX}{ns}/"),
                    revoked_at__isnull=True,
                ).values_list("lookup", flat=True)
            )
        )
        return stopped

    # -- pieces ----------------------------------------------------------------------
    def _ensure_namespace(self, ns: str, label: str) -> None:
        try:
            self.core.read_namespace(ns)
        except ApiException as exc:
            if not _missing(exc):
                raise
            try:
                self.core.create_namespace(m.render_namespace(ns, label), field_validation=STRICT)
            except ApiException as create_exc:
                if create_exc.status != 409:  # created meanwhile: fine
                    raise

    def _rotate_key(self, tenant: Tenant, ns: str, label: str, pool: str = DEFAULT_POOL) -> str:
        """Mint the pool's new shared key and put it in its Secret; return its lookup."""
        key, token = mint_agent_key(tenant, key_label(ns, pool))
        body = m.render_secret(ns, label, token, key.lookup, pool)
        try:
            self.core.replace_namespaced_secret(
                m.secret_name(pool), ns, body, field_validation=STRICT
            )
        except ApiException as exc:
            if not _missing(exc):
                revoke_keys({key.lookup})
                raise
            self.core.create_namespaced_secret(ns, body, field_validation=STRICT)
        log.info("kubernetes actuator: minted a new agent key for %s (pool %s)", ns, pool)
        return key.lookup

    def _revoke_superseded(
        self, tenant: Tenant, ns: str, current_lookup: str, pool: str = DEFAULT_POOL
    ) -> int:
        """Revoke older keys of this pool's Deployment that no registered agent uses any more."""
        stale = set(
            ApiKey.objects.filter(tenant=tenant, label=key_label(ns, pool), revoked_at__isnull=True)
            .exclude(lookup=current_lookup)
            .values_list("lookup", flat=True)
        )
        in_use = set(
            Agent.objects.filter(api_key__lookup__in=stale)
            .filter(state__in=ACTIVE_STATES)
            .values_list("api_key__lookup", flat=True)
        )
        return revoke_keys(stale - in_use)

    def _ensure_network_policy(self, ns: str, label: str, pool: str = DEFAULT_POOL) -> None:
        if not self.settings.network_policy:
            self._remove_network_policies(ns, label)
            return
        server = m.server_coordinates(self.settings, self.own_namespace)
        if server is None:
            if ns not in self._policy_warned:
                self._policy_warned.add(ns)
                log.warning(
                    "kubernetes actuator: NOT installing the NetworkPolicy in %s: the server's "
                    "namespace, pod labels or port are unknown (set CLOACINA_SERVER_NAMESPACE, "
                    "CLOACINA_SERVER_POD_LABELS and CLOACINA_SERVER_PORT)",
                    ns,
                )
            return
        body = m.render_network_policy(ns, label, server, self.settings.cluster_dns(), pool=pool)
        name = m.deployment_name(pool)
        try:
            existing = self.net.read_namespaced_network_policy(name, ns)
        except ApiException as exc:
            if not _missing(exc):
                raise
            self.net.create_namespaced_network_policy(ns, body, field_validation=STRICT)
            return
        if self.api_client.sanitize_for_serialization(existing.spec) != body["spec"]:
            self.net.replace_namespaced_network_policy(name, ns, body, field_validation=STRICT)

    def _remove_network_policies(self, ns: str, label: str) -> None:
        """The toggle is off: delete the policies an earlier run installed (once per namespace).

        Label-selected, so it removes exactly what this actuator made, under any name; the
        setting is read at boot, so one successful delete per namespace per process suffices.
        """
        if ns in self._policies_removed:
            return
        try:
            self.net.delete_collection_namespaced_network_policy(
                ns, label_selector=f"{m.MANAGED_LABEL}=true,{m.TENANT_LABEL}={label}"
            )
        except ApiException as exc:
            if not _missing(exc):
                raise
        self._policies_removed.add(ns)


def secret_token(secret_body: dict) -> str:
    """Decode the token from a rendered or stored Secret body (tests, debugging)."""
    return base64.b64decode(secret_body["data"][m.SECRET_KEY]).decode()
