"""CLOACINA_FLEET_ACTUATOR=process: local `runagent` child processes, per tenant.

Each child gets a freshly minted tenant-scoped agent key through its
environment (CLOACINA_AGENT_API_KEY: never argv, never logged) and otherwise an
allow-listed environment: never the database URL, the secret key or anything
else the server was given (its own task children get even less:
agents/sandbox/task_isolation.py).  Scale-down drains the newest child first: its roster row is
marked draining (the dispatcher stops choosing it) and it gets SIGTERM, on
which `runagent` finishes its in-flight work, deregisters and exits; only a
child still running after CLOACINA_AGENT_DRAIN_TIMEOUT_S is killed.  A child
that exits without being asked is restarted under the same name (so its
registration replaces the dead one at once).  The key of every child that is
gone is revoked.

Agents are started per pool (:class:`~fleet.control.actuators.base.PoolSpec`): a pool's
children get its ``--tags`` (with ``pool:<name>``), ``--capabilities`` and
``--max-concurrency`` and are named ``proc-<pid>-<pool>-<n>`` (the default pool's
``proc-<pid>-<n>``, as before pools); each pool is counted, grown and drained on its own,
and the children of a pool no longer asked for are drained.

Children die with the server (PR_SET_PDEATHSIG), so a killed leader never
leaves orphans for its successor to double-count.  PDEATHSIG fires when the
*thread* that forked exits, so every spawn happens on one long-lived thread.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from agents.models import Agent
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
from fleet.executors.fleet import lifecycle
from fleet.models import DEFAULT_POOL, Tenant

log = logging.getLogger(__name__)

MANAGED_BY = "process"
PR_SET_PDEATHSIG = 1
# What a runagent child inherits from the server, by exact name or prefix.  An allow-list:
# the server's secrets (DATABASE_URL, CLOACINA_SECRET_KEY, PG*, …) and whatever is added
# to its environment later stay behind without anyone remembering to scrub them.
AGENT_ENV_NAMES = frozenset(
    {
        "PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TZ", "TMPDIR",
        "PYTHONPATH", "PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE", "VIRTUAL_ENV",
        "SSL_CERT_FILE", "SSL_CERT_DIR", "DJANGO_SETTINGS_MODULE",
        "CLOACINA_HOME",  # the agent's package cache and config.toml; its tasks never see it
        "CLOACINA_LOG_LEVEL", "CLOACINA_WIRE_FORMAT",
        "CLOACINA_AGENT_CA_CERT", "CLOACINA_AGENT_CLIENT_CERT", "CLOACINA_AGENT_CLIENT_KEY",
        "CLOACINA_TASK_USER", "CLOACINA_TASK_PYTHON",
    }
)  # fmt: skip
AGENT_ENV_PREFIXES = ("LC_",)
REPO = Path(__file__).resolve().parents[3]

try:
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux: children may outlive a killed server
    _prctl = None


def _die_with_parent() -> None:  # runs in the forked child, before exec
    if _prctl is not None:
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def agent_environment(environ: dict | os._Environ, extra: frozenset[str] = frozenset()) -> dict:
    """The allow-listed part of ``environ`` a runagent child inherits."""
    return {
        name: value
        for name, value in environ.items()
        if name in AGENT_ENV_NAMES or name in extra or name.startswith(AGENT_ENV_PREFIXES)
    }


@dataclass
class Child:
    name: str
    label: str
    tenant_id: int
    key_lookup: str
    proc: subprocess.Popen
    seq: int
    log_path: Path
    pool: str = DEFAULT_POOL
    draining_since: float | None = None

    def handle(self) -> AgentHandle:
        state = "draining" if self.draining_since is not None else "running"
        return AgentHandle(
            self.name, self.label, str(self.proc.pid), state, self.key_lookup, self.pool
        )


class ProcessActuator(Actuator):
    name = "process"

    def __init__(
        self,
        server_url: str | None,
        max_concurrency: int = 4,
        drain_timeout_s: float = 300.0,
        log_dir: Path | None = None,
        manage_py: Path = REPO / "manage.py",
        python: str = sys.executable,
        extra_args: tuple[str, ...] = (),
        pass_env: tuple[str, ...] = (),
    ) -> None:
        """``pass_env``: more variable names the children may inherit (tests, operators)."""
        self.server_url = server_url
        self.max_concurrency = max_concurrency
        self.drain_timeout_s = drain_timeout_s
        self.log_dir = log_dir or Path(os.environ.get("CLOACINA_HOME", ".")) / "agents"
        self.manage_py = manage_py
        self.python = python
        self.extra_args = extra_args
        self.pass_env = frozenset(pass_env)
        self._children: dict[str, list[Child]] = {}
        self._seq = itertools.count(1)
        self._lock = threading.RLock()
        self._spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="process-actuator")

    def bind_server(self, server_url: str) -> None:
        """Set the URL children connect to (known only once `serve` is listening)."""
        self.server_url = server_url

    def describe(self) -> str:
        return f"process (agents connect to {self.server_url or '<not yet listening>'})"

    # -- queries ---------------------------------------------------------------------
    def actual(self, tenant: Tenant | str) -> list[AgentHandle]:
        # No reaping here: a crash must be seen by reconcile, which restarts it under its name.
        with self._lock:
            return [
                c.handle()
                for c in self._children.get(label_of(tenant), [])
                if c.draining_since is None and c.proc.poll() is None
            ]

    def draining(self, tenant: Tenant | str) -> list[AgentHandle]:
        with self._lock:
            return [
                c.handle()
                for c in self._children.get(label_of(tenant), [])
                if c.draining_since is not None
            ]

    def managed_labels(self) -> set[str]:
        with self._lock:
            return {label for label, kids in self._children.items() if kids}

    # -- reconcile -------------------------------------------------------------------
    def reconcile(self, tenant: Tenant, desired: int | Sequence[PoolSpec]) -> ReconcileResult:
        label = label_of(tenant)
        specs = pool_specs(desired)
        with self._lock:
            crashed = self._reap(label)
            kids = self._children.setdefault(label, [])
            running = [c for c in kids if c.draining_since is None]
            total = sum(spec.desired for spec in specs)
            result = ReconcileResult(label, total, actual=len(running) + len(crashed))
            if self.server_url is None:
                result.notes.append("server not listening yet: nothing started")
                return result
            for spec in specs:
                self._reconcile_pool(tenant, label, spec, kids, crashed, result)
            # Agents of a pool that is no longer asked for (deleted): drain them all.
            wanted = {spec.name for spec in specs}
            for child in [c for c in kids if c.draining_since is None and c.pool not in wanted]:
                self._drain(child)
                result.stopped += 1
            self._mark_managed(kids)
            return result

    def _reconcile_pool(
        self,
        tenant: Tenant,
        label: str,
        spec: PoolSpec,
        kids: list[Child],
        crashed: list[Child],
        result: ReconcileResult,
    ) -> None:
        running = [c for c in kids if c.draining_since is None and c.pool == spec.name]
        mine = [c for c in crashed if c.pool == spec.name]
        plan = plan_pool(spec.desired, running, mine, age=lambda c: c.seq)
        for dead in plan.replace:
            kids.append(self._spawn(tenant, label, dead.name, spec))
        for _ in range(plan.start):
            kids.append(self._spawn(tenant, label, None, spec))
        for child in plan.drain:
            self._drain(child)
        result.restarted += len(plan.replace)
        result.started += plan.start
        result.stopped += len(plan.drain)

    def stop_all(self, tenant: Tenant | str) -> int:
        label = label_of(tenant)
        with self._lock:
            self._reap(label)
            stopping = [c for c in self._children.get(label, []) if c.draining_since is None]
            for child in stopping:
                self._drain(child)
            return len(stopping)

    # -- lifecycle of one child ----------------------------------------------------
    def _spawn(
        self, tenant: Tenant, label: str, name: str | None, spec: PoolSpec | None = None
    ) -> Child:
        spec = spec or PoolSpec()
        seq = next(self._seq)
        pool_part = "" if spec.is_default else f"{spec.name}-"
        name = name or f"proc-{os.getpid()}-{pool_part}{seq}"
        key, token = mint_agent_key(tenant, f"process actuator: {name}")
        env = agent_environment(os.environ, self.pass_env)
        env["CLOACINA_AGENT_API_KEY"] = token
        args = [
            self.python,
            str(self.manage_py),
            "runagent",
            "--server",
            str(self.server_url),
            "--name",
            name,
            *spec.runagent_args(self.max_concurrency),
            *self.extra_args,
        ]
        # Agent logs name tasks and their errors: not for the task user's eyes.
        self.log_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        with contextlib.suppress(PermissionError):  # made by an older version, 0755
            os.chmod(self.log_dir, 0o700)
        log_path = self.log_dir / f"{label}-{name}.log"

        def start() -> subprocess.Popen:
            with log_path.open("ab") as out:
                return subprocess.Popen(
                    args,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    cwd=str(self.manage_py.parent),
                    preexec_fn=_die_with_parent,
                )

        try:
            proc = self._spawner.submit(start).result()
        except Exception:
            revoke_keys({key.lookup})  # never leave a valid key behind for a child that never ran
            raise
        log.info(
            "process actuator: started agent %s (pid %d) for tenant %s; log %s",
            name,
            proc.pid,
            tenant.name,
            log_path,
        )
        return Child(name, label, tenant.pk, key.lookup, proc, seq, log_path, spec.name)

    def _drain(self, child: Child) -> None:
        # Stop new work first (the dispatcher only picks live agents), then let it finish.
        # Through the lifecycle: a drain deadline and its bindings cleared, as over the API.
        lifecycle.drain_agents_of_key(child.key_lookup, self.drain_timeout_s, "process actuator")
        child.draining_since = time.monotonic()
        if child.proc.poll() is None:
            child.proc.send_signal(signal.SIGTERM)
        log.info("process actuator: draining agent %s (pid %d)", child.name, child.proc.pid)

    def _reap(self, label: str) -> list[Child]:
        """Forget exited children (revoking their keys); kill overdue drains; return the crashed."""
        kids = self._children.get(label, [])
        crashed, gone = [], []
        now = time.monotonic()
        for child in kids:
            code = child.proc.poll()
            if code is None:
                if (
                    child.draining_since is not None
                    and now - child.draining_since > self.drain_timeout_s
                ):
                    log.warning(
                        "process actuator: agent %s did not drain within %.0fs; killing it",
                        child.name,
                        self.drain_timeout_s,
                    )
                    child.proc.kill()
                continue
            gone.append(child)
            if child.draining_since is None:
                crashed.append(child)
                log.warning(
                    "process actuator: agent %s (pid %d) exited with code %s unasked; see %s",
                    child.name,
                    child.proc.pid,
                    code,
                    child.log_path,
                )
        if gone:
            revoke_keys({c.key_lookup for c in gone})
            self._children[label] = [c for c in kids if c not in gone]
        return crashed

    def _mark_managed(self, kids: list[Child]) -> None:
        lookups = [c.key_lookup for c in kids]
        if lookups:
            Agent.objects.filter(api_key__lookup__in=lookups).exclude(managed_by=MANAGED_BY).update(
                managed_by=MANAGED_BY
            )

    # -- giving up the fleet -------------------------------------------------------
    def leadership_lost(self) -> None:
        """Another server drives the fleet now: drain every child so agents are not doubled."""
        with self._lock:
            for label in list(self._children):
                self.stop_all(label)

    def shutdown(self, wait_s: float = 20.0) -> None:
        """Drain all children, wait up to ``wait_s`` for them, kill the rest, revoke every key."""
        with self._lock:
            children = [c for kids in self._children.values() for c in kids]
            for child in children:
                if child.draining_since is None:
                    try:
                        self._drain(child)
                    except Exception:  # the database may already be gone; the signal matters
                        child.draining_since = time.monotonic()
                        if child.proc.poll() is None:
                            child.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + wait_s
            for child in children:
                try:
                    child.proc.wait(timeout=max(deadline - time.monotonic(), 0.01))
                except subprocess.TimeoutExpired:
                    child.proc.kill()
                    child.proc.wait()
            try:
                revoke_keys({c.key_lookup for c in children})
            except Exception:
                log.exception("process actuator: could not revoke the keys of stopped agents")
            self._children.clear()
        self._spawner.shutdown(wait=False)
