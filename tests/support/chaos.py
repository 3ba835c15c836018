"""The chaos run's parts: a private PostgreSQL that can be killed, a workload whose tasks
leave a ledger, a seeded fault schedule, and the checks of the invariants afterwards.

The run has its own embedded PostgreSQL (a pgserver data directory of its own), so
stopping it with ``pg_ctl -m immediate`` touches nothing but the `serve` and agents of
the run; the test reads the outcome straight from that database with psycopg.
"""

from __future__ import annotations

import json
import random
import subprocess
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import httpx
import psycopg

from artifacts.store.testing import build_archive, manifest_toml

# -- the database -------------------------------------------------------------------------


class KillablePostgres:
    """An embedded PostgreSQL of its own, stopped with ``pg_ctl -m immediate`` (a crash:
    no checkpoint, every backend killed) and started again on the same socket."""

    def __init__(self, datadir: Path) -> None:
        import pgserver

        self.datadir = datadir
        self.server = pgserver.get_server(datadir, cleanup_mode="stop")
        query = parse_qs(urlparse(self.server.get_uri()).query)
        self.socket_dir = query["host"][0]
        self.restarts: list[float] = []  # seconds each restart kept it down

    def url(self, database: str = "postgres") -> str:
        return self.server.get_uri(database)

    def create_database(self, name: str) -> str:
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def _pg_ctl(self, *args: str) -> None:
        from pgserver._commands import pg_ctl

        pg_ctl(list(args), pgdata=self.datadir, user=self.server.system_user, timeout=60)

    def crash(self) -> None:
        self._pg_ctl("-w", "-m", "immediate", "stop")

    def start(self) -> None:
        # The arguments pgserver itself starts the server with: no TCP, this socket.
        self._pg_ctl(
            "-w", "-o", '-h ""', "-o", f"-k {self.socket_dir}",
            "-l", str(self.datadir / "log"), "start",
        )  # fmt: skip

    def restart(self, down_s: float) -> None:
        started = time.monotonic()
        self.crash()
        time.sleep(down_s)
        self.start()
        self.restarts.append(time.monotonic() - started)

    def stop(self) -> None:
        try:
            self._pg_ctl("-w", "-m", "fast", "stop")
        except subprocess.CalledProcessError:
            pass  # already down


def query(url: str, sql: str, params: tuple = ()) -> list[tuple]:
    """One query on a fresh connection (the database may have restarted since the last)."""
    deadline = time.monotonic() + 30
    while True:
        try:
            with psycopg.connect(url, autocommit=True, connect_timeout=5) as conn:
                return conn.execute(sql, params).fetchall()
        except psycopg.OperationalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


# -- the workload -------------------------------------------------------------------------

# Every task appends one line to the ledger before it returns: how often each task's
# function ran, whoever ran it.  Lines are short single writes with O_APPEND: whole.
LEDGER_SOURCE = """
import json
import os
import time


def _step(name, context):
    line = json.dumps({"run": context["run"], "task": name, "pid": os.getpid()}) + "\\n"
    fd = os.open(context["ledger"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)
    time.sleep(float(context.get("sleep_s", 0)))
    return {name: True}
""" + "".join(f"\n\ndef t{i}(context):\n    return _step('t{i}', context)\n" for i in range(10))

SHAPES: dict[str, list[tuple[str, list[str]]]] = {
    "chain": [(f"t{i}", [f"t{i - 1}"] if i else []) for i in range(5)],
    "diamond": [("t0", []), ("t1", ["t0"]), ("t2", ["t0"]), ("t3", ["t1", "t2"])],
    "fan": [("t0", []), *[(f"t{i}", ["t0"]) for i in range(1, 7)], ("t7", [f"t{i}" for i in range(1, 7)])],
}  # fmt: skip
# Ten independent tasks: a replica's kill lands on many packets at once (the two-replica case).
WIDE = "wide"
EXTRA_SHAPES: dict[str, list[tuple[str, list[str]]]] = {WIDE: [(f"t{i}", []) for i in range(10)]}
TASK_RETRIES = 5  # a run declared lost (no agent, result deadline) is retried
TASK_TIMEOUT_S = 20


def package(shape: str) -> bytes:
    tasks = [
        {"id": tid, "function": f"chaos.steps:{tid}", "dependencies": deps,
         "retries": TASK_RETRIES, "retry_backoff_s": 0.2, "timeout_s": TASK_TIMEOUT_S}
        for tid, deps in {**SHAPES, **EXTRA_SHAPES}[shape]
    ]  # fmt: skip
    return build_archive(
        {
            "cloacina.toml": manifest_toml(tasks, name=f"chaos-{shape}", workflow=shape),
            "workflow/chaos/__init__.py": "",
            "workflow/chaos/steps.py": LEDGER_SOURCE,
        }
    )


def plan(total_tasks: int) -> list[str]:
    """Workflows (shape names, round robin) until they hold at least ``total_tasks``."""
    shapes, names, tasks = list(SHAPES), [], 0
    while tasks < total_tasks:
        name = shapes[len(names) % len(shapes)]
        names.append(name)
        tasks += len(SHAPES[name])
    return names


class Feeder(threading.Thread):
    """Starts the planned executions at an even pace over ``seconds``; a start that fails
    (server or database down) is retried under a new run id, so a start that did go in
    before its answer was lost is simply one more execution (the database is the truth).
    With several server URLs the starts (and retries) go round them."""

    def __init__(
        self, url: str | list[str], key: str, workflows: list[str], seconds: float,
        ledger: Path, sleep_s: float,
    ) -> None:  # fmt: skip
        super().__init__(daemon=True, name="chaos-feeder")
        self.urls = [url] if isinstance(url, str) else list(url)
        self.key, self.workflows = key, workflows
        self.seconds, self.ledger, self.sleep_s = seconds, ledger, sleep_s
        self.refused: Counter = Counter()  # HTTP status (or "no answer") of refused starts
        self.accepted: list[str] = []

    def run(self) -> None:
        gap = self.seconds / max(1, len(self.workflows))
        started = time.monotonic()
        with httpx.Client(timeout=10) as client:
            tries = 0
            for i, workflow in enumerate(self.workflows):
                time.sleep(max(0.0, started + i * gap - time.monotonic()))
                while True:
                    tries += 1
                    url = self.urls[tries % len(self.urls)]
                    context = {
                        "run": uuid.uuid4().hex, "ledger": str(self.ledger), "sleep_s": self.sleep_s
                    }  # fmt: skip
                    try:
                        answer = client.post(
                            f"{url}/api/v1/workflows/{workflow}/executions",
                            json={"context": context},
                            headers={"Authorization": f"Bearer {self.key}"},
                        )
                        if answer.status_code == 201:
                            self.accepted.append(answer.json()["id"])
                            break
                        self.refused[answer.status_code] += 1
                    except httpx.HTTPError:
                        self.refused["no answer"] += 1
                    time.sleep(0.2)


# -- the fault schedule -------------------------------------------------------------------


@dataclass(frozen=True)
class Fault:
    at_s: float
    kind: str  # kill_agent | restart_serve | restart_postgres
    pick: int  # which agent slot, or a variant


def schedule(seed: int, seconds: float, kills: int, serve_restarts: int, pg_restarts: int):
    """Faults at random moments of the run (seeded), at least MIN_GAP_S apart."""
    rng = random.Random(seed)
    kinds = ["kill_agent"] * kills + ["restart_serve"] * serve_restarts
    kinds += ["restart_postgres"] * pg_restarts
    rng.shuffle(kinds)
    slot = (seconds - 4.0) / max(1, len(kinds))
    return [
        Fault(round(2.0 + i * slot + rng.uniform(0, slot * 0.5), 2), kind, rng.randrange(1000))
        for i, kind in enumerate(kinds)
    ]


# -- the checks ---------------------------------------------------------------------------


def wait_all_terminal(url: str, timeout_s: float) -> int:
    """Poll until no execution is open (or ``timeout_s`` passes); the count still open."""
    deadline = time.monotonic() + timeout_s
    while True:
        still_open = query(
            url,
            "SELECT count(*) FROM fleet_workflowexecution "
            "WHERE status NOT IN ('Completed', 'Failed', 'Cancelled')",
        )[0][0]
        if still_open == 0 or time.monotonic() >= deadline:
            return still_open
        time.sleep(0.5)


@dataclass
class Figures:
    values: dict = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    evictions: list[tuple] = field(default_factory=list)

    def table(self) -> str:
        width = max(len(k) for k in self.values)
        return "\n".join(f"  {k.ljust(width)}  {v}" for k, v in self.values.items())


def read_ledger(path: Path) -> Counter:
    runs: Counter = Counter()
    if path.exists():
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            runs[(entry["run"], entry["task"])] += 1
    return runs


def check_invariants(url: str, ledger: Path, killed: set[str] | None) -> Figures:
    """Every invariant of the run, from the rows and the ledger; the figures to print.

    ``killed``: the agents the schedule killed, which must be exactly the ones evicted
    (once each); None when agents are also evicted for other reasons (a replica's
    death outlives the liveness window of the agents connected to it)."""
    f = Figures()
    v = f.values
    execs = query(url, "SELECT status, count(*) FROM fleet_workflowexecution GROUP BY status")
    statuses = dict(execs)
    v["executions"] = sum(statuses.values())
    v["executions by status"] = statuses
    open_ones = {s: n for s, n in statuses.items() if s not in ("Completed", "Failed", "Cancelled")}
    if open_ones:
        f.violations.append(f"executions not terminal: {open_ones}")
    tasks = dict(query(url, "SELECT status, count(*) FROM fleet_taskexecution GROUP BY status"))
    v["tasks"] = sum(tasks.values())
    v["tasks by status"] = tasks

    applied = query(
        url,
        """SELECT t.id, t.status,
                  count(o.id) FILTER (WHERE o.applied AND o.outcome = 'success'),
                  count(o.id) FILTER (WHERE o.applied),
                  count(o.id) FILTER (WHERE NOT o.applied)
           FROM fleet_taskexecution t LEFT JOIN fleet_taskoutcome o ON o.task_execution_id = t.id
           GROUP BY t.id, t.status""",
    )
    doubled = [r for r in applied if r[2] > 1]
    unbacked = [r for r in applied if r[1] == "Completed" and r[2] != 1]
    v["duplicate completions (applied successes > 1)"] = len(doubled)
    v["applied outcomes (all kinds)"] = sum(r[3] for r in applied)
    v["outcomes recorded, not applied (late/duplicate)"] = sum(r[4] for r in applied)
    v["tasks retried (attempt > 1)"] = query(
        url, "SELECT count(*) FROM fleet_taskexecution WHERE attempt > 1"
    )[0][0]
    if doubled:
        f.violations.append(f"{len(doubled)} tasks completed more than once: {doubled[:3]}")
    if unbacked:
        f.violations.append(f"{len(unbacked)} Completed tasks without one applied success")

    # The ledger: how often each task's function ran to its return.
    ran = read_ledger(ledger)
    runs = dict(query(url, "SELECT input_context->>'run', id::text FROM fleet_workflowexecution"))
    status_of = {
        (execution, task): status
        for execution, task, status in query(
            url, "SELECT workflow_execution_id::text, task_name, status FROM fleet_taskexecution"
        )
    }
    v["task functions run"] = sum(ran.values())
    v["duplicate executions (a function ran again)"] = sum(n - 1 for n in ran.values())
    not_completed = [
        (run, task) for (run, task) in ran if status_of.get((runs.get(run), task)) != "Completed"
    ]
    if not_completed:
        f.violations.append(
            f"{len(not_completed)} tasks ran to success but are not Completed: {not_completed[:3]}"
        )
    never_ran = sum(1 for key, status in status_of.items() if status == "Completed") - len(
        {(runs.get(run), task) for run, task in ran}
    )
    if never_ran:
        f.violations.append(f"{never_ran} Completed tasks never ran (no ledger line)")

    # The outbox: nothing left in flight.
    open_rows = query(
        url, "SELECT state, count(*) FROM delivery_outbox WHERE state <> 'acked' GROUP BY state"
    )
    v["outbox rows not acked"] = dict(open_rows)
    if open_rows:
        f.violations.append(f"orphaned outbox rows: {dict(open_rows)}")

    # Evictions: exactly the agents the schedule killed, and the work they held moved.
    evictions = query(url, "SELECT agent_name, reassigned, reason FROM fleet_eviction")
    f.evictions = query(
        url,
        "SELECT to_char(evicted_at, 'HH24:MI:SS.MS'), agent_name, reason, "
        "to_char(last_heartbeat, 'HH24:MI:SS.MS'), in_flight, reassigned "
        "FROM fleet_eviction ORDER BY evicted_at",
    )
    evicted = {name for name, _, _ in evictions}
    v["agents killed"] = len(killed or ())
    v["evictions"] = len(evictions)
    v["work reassigned (Eviction.reassigned)"] = sum(r for _, r, _ in evictions)
    moves = query(
        url, "SELECT coalesce(sum(jsonb_array_length(former_agents)), 0) FROM delivery_outbox"
    )[0][0]
    v["packets moved (outbox former_agents)"] = int(moves)
    if killed is not None and evicted != killed:
        f.violations.append(f"evicted {sorted(evicted)} but the schedule killed {sorted(killed)}")
    if killed is not None and len(evictions) != len(evicted):
        f.violations.append(f"an agent was evicted twice: {sorted(n for n, *_ in evictions)}")
    if int(moves) != v["work reassigned (Eviction.reassigned)"]:
        f.violations.append(
            f"{moves} packets moved but the evictions count {v['work reassigned (Eviction.reassigned)']}"
        )
    return f
