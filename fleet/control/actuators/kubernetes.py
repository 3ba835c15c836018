"""CLOACINA_FLEET_ACTUATOR=kubernetes: one agent Deployment per tenant, replicas = desired_count.

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

from kubernetes import client as k8s
from kubernetes.client.rest import ApiException

from agents.models import ACTIVE_STATES, Agent
from fleet.control.actuators import kubernetes_manifests as m
from fleet.control.actuators.base import (
    Actuator,
    AgentHandle,
    ReconcileResult,
    label_of,
    mint_agent_key,
    revoke_keys,
)
from fleet.control.actuators.naming import NAMESPACE_PREFIX
from fleet.control.actuators.settings import ControlSettings
from fleet.models import ApiKey, Tenant

log = logging.getLogger(__name__)

KEY_LABEL_PREFIX = "kubernetes actuator: "
# The API server rejects (instead of silently dropping) any field it does not know.
STRICT = "Strict"


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
                ns, label_selector=f"{m.APP_LABEL}={m.AGENT_NAME},{m.TENANT_LABEL}={label}"
            )
        except ApiException as exc:
            if _missing(exc):
                return []
            raise
        return [
            AgentHandle(p.metadata.name, label, p.metadata.name, "running")
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

    def _deployment(self, ns: str) -> k8s.V1Deployment | None:
        try:
            return self.apps.read_namespaced_deployment(m.AGENT_NAME, ns)
        except ApiException as exc:
            if _missing(exc):
                return None
            raise

    def _secret_lookup(self, ns: str) -> str | None:
        """The lookup of the key currently in the tenant's Secret (None: no Secret)."""
        try:
            secret = self.core.read_namespaced_secret(m.SECRET_NAME, ns)
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
    def reconcile(self, tenant: Tenant, desired: int) -> ReconcileResult:
        label = label_of(tenant)
        ns = self.namespace_for(label)
        dep = self._deployment(ns)
        current = (dep.spec.replicas or 0) if dep is not None else 0
        result = ReconcileResult(label, desired, actual=current)
        if dep is None:
            if desired == 0:
                return result  # nothing to run: create no namespace for an idle tenant
            self._ensure_namespace(ns, label)
            self._ensure_network_policy(ns, label)
            self._rotate_key(tenant, ns, label)
            body = m.render_deployment(ns, label, desired, self.settings)
            self.apps.create_namespaced_deployment(ns, body, field_validation=STRICT)
            result.started = desired
            log.info(
                "kubernetes actuator: created %s/%s with %d replicas", ns, m.AGENT_NAME, desired
            )
            return result
        self._ensure_network_policy(ns, label)
        current_lookup = self._secret_lookup(ns)
        if desired > current:
            if current_lookup is None or self.rollout_complete(dep):
                current_lookup = self._rotate_key(tenant, ns, label)
            else:
                result.notes.append("pods not ready yet: scaled up with the current key")
            result.started = desired - current
        elif desired < current:
            result.stopped = current - desired
        if desired != current:
            self.apps.patch_namespaced_deployment_scale(
                m.AGENT_NAME, ns, {"spec": {"replicas": desired}}
            )
            log.info("kubernetes actuator: %s replicas %d → %d", ns, current, desired)
        elif self.rollout_complete(dep) and current_lookup:
            self._revoke_superseded(tenant, ns, current_lookup)
        return result

    def stop_all(self, tenant: Tenant | str) -> int:
        label = label_of(tenant)
        ns = self.namespace_for(label)
        dep = self._deployment(ns)
        stopped = (dep.spec.replicas or 0) if dep is not None else 0
        if stopped:
            self.apps.patch_namespaced_deployment_scale(m.AGENT_NAME, ns, {"spec": {"replicas": 0}})
        if not self.settings.network_policy:
            self._remove_network_policies(ns, label)  # a disabled tenant's too
        try:
            self.core.delete_namespaced_secret(m.SECRET_NAME, ns)
        except ApiException as exc:
            if not _missing(exc):
                raise
        revoke_keys(
            set(
                ApiKey.objects.filter(
                    label=KEY_LABEL_PREFIX + ns, revoked_at__isnull=True
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

    def _rotate_key(self, tenant: Tenant, ns: str, label: str) -> str:
        """Mint the tenant's new shared key and put it in the Secret; return its lookup."""
        key, token = mint_agent_key(tenant, KEY_LABEL_PREFIX + ns)
        body = m.render_secret(ns, label, token, key.lookup)
        try:
            self.core.replace_namespaced_secret(m.SECRET_NAME, ns, body, field_validation=STRICT)
        except ApiException as exc:
            if not _missing(exc):
                revoke_keys({key.lookup})
                raise
            self.core.create_namespaced_secret(ns, body, field_validation=STRICT)
        log.info("kubernetes actuator: minted a new agent key for %s", ns)
        return key.lookup

    def _revoke_superseded(self, tenant: Tenant, ns: str, current_lookup: str) -> int:
        """Revoke older keys of this tenant's Deployment that no registered agent uses any more."""
        stale = set(
            ApiKey.objects.filter(
                tenant=tenant, label=KEY_LABEL_PREFIX + ns, revoked_at__isnull=True
            )
            .exclude(lookup=current_lookup)
            .values_list("lookup", flat=True)
        )
        in_use = set(
            Agent.objects.filter(api_key__lookup__in=stale)
            .filter(state__in=ACTIVE_STATES)
            .values_list("api_key__lookup", flat=True)
        )
        return revoke_keys(stale - in_use)

    def _ensure_network_policy(self, ns: str, label: str) -> None:
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
        body = m.render_network_policy(ns, label, server, self.settings.cluster_dns())
        try:
            existing = self.net.read_namespaced_network_policy(m.AGENT_NAME, ns)
        except ApiException as exc:
            if not _missing(exc):
                raise
            self.net.create_namespaced_network_policy(ns, body, field_validation=STRICT)
            return
        if self.api_client.sanitize_for_serialization(existing.spec) != body["spec"]:
            self.net.replace_namespaced_network_policy(
                m.AGENT_NAME, ns, body, field_validation=STRICT
            )

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
