"""API fuzzing: schemathesis against the server's own OpenAPI document.

A real `serve` answers every operation of ``/api/v1/openapi.json`` while the
schemathesis CLI generates requests for it (examples, coverage and fuzzing
phases: valid and invalid data), once per caller: no key, and a key of each
role (agent, read, write, admin).  The runs happen side by side against one
server.  Every response must be a non-5xx with a documented status code, a
documented content type and a body that matches the documented schema;
invalid data must be refused with a 4xx; an operation must not ignore its
authentication.

The path parameters of the document get real ids (an execution, a schedule, an
agent, a package, an artifact digest) as examples, so the generated requests reach
past the 404s into the code behind them.

A second set of runs, one per key role, sends hostile bodies instead of the
generated ones (tests/support/fuzz_hostile_hooks.py): NaN and ±Infinity, lone surrogates as
raw bytes and escaped, NUL characters, and package uploads whose manifest holds a
NUL in a routing string.  Only "never a 5xx, always a documented answer" is checked
there: the generated case no longer describes what was sent.

``CLOACINA_FUZZ_EXAMPLES`` (default 12) bounds the fuzzing phase per
operation; ``CLOACINA_FUZZ_SEED`` fixes the generation (default 7).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.support import fuzz_hostile_hooks as hostile_hooks
from tests.support.processes import Processes

ROLES = ("none", "agent", "read", "write", "admin")
CHECKS = ",".join(
    [
        "not_a_server_error",
        "status_code_conformance",
        "content_type_conformance",
        "response_headers_conformance",
        "response_schema_conformance",
        "negative_data_rejection",
        "positive_data_acceptance",
        "ignored_auth",
        "unsupported_method",
    ]
)
# What the hostile runs check: their requests are no longer the generated cases, so
# acceptance of valid data and rejection of invalid data do not apply.
HOSTILE_CHECKS = ",".join(
    [
        "not_a_server_error",
        "status_code_conformance",
        "content_type_conformance",
        "response_schema_conformance",
    ]
)
HOSTILE = "hostile"  # the phases marker of a hostile run
HOSTILE_EXAMPLES = 6  # one of each JSON mutation per operation, give or take
REPO_ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = int(os.environ.get("CLOACINA_FUZZ_EXAMPLES", "12"))
SEED = int(os.environ.get("CLOACINA_FUZZ_SEED", "7"))
RUN_TIMEOUT_S = 240.0
ALLOWED = "examples,coverage,fuzzing"
REFUSED = "examples,fuzzing"
REFUSED_EXAMPLES = 3
PARALLEL_RUNS = 3  # schemathesis processes at once (the server is the bottleneck)
TESTED = re.compile(r"Tested:\s+(\d+)")
# Rules a schema cannot state, so schema-valid requests may still get a 4xx naming the
# problem: whether uploaded bytes are a valid package (an archive holding a valid
# manifest and sources), a desired_count above the tenant's (new) limit, a
# provision/deprovision at a bound (409) — reachable since those take an optional
# reason body and get many generated requests — and whether a string is a cron
# expression and an IANA timezone (a removed schedule is then a 404).
CONFIG = """
[[operations]]
include-method = "POST"
include-path-regex = "^/api/v1/packages"
checks.positive_data_acceptance.expected-statuses = [
  "2XX", "400", "401", "403", "404", "409", "413", "422",
]

[[operations]]
include-path-regex = "^/api/v1/schedules"
checks.positive_data_acceptance.expected-statuses = ["2XX", "401", "403", "404", "409", "422"]

[[operations]]
include-method = "PUT"
include-path-regex = "^/api/v1/admin/tenants/"
checks.positive_data_acceptance.expected-statuses = ["2XX", "401", "403", "404", "409", "422"]

[[operations]]
include-method = "POST"
include-path-regex = "^/api/v1/fleet/(de)?provision$"
checks.positive_data_acceptance.expected-statuses = ["2XX", "401", "403", "404", "409"]
"""


@pytest.fixture
def procs(transactional_db, tmp_path):
    with Processes(tmp_path) as procs:
        yield procs


def _seed() -> dict:
    """Two tenants, a key of every role, a package, an execution, a schedule and an agent of
    tenant A."""
    from agents.protocol.triples import host_triple
    from fleet.executors.fleet import roster
    from fleet.models import ApiKey
    from fleet.schedules.service import ScheduleSpec, create_schedule
    from tests.support.factories import make_tenant, publish_example, start

    tenant = make_tenant("acme")
    make_tenant("globex")
    keys = {role: ApiKey.mint(role, tenant=tenant)[1] for role in ("agent", "read", "write")}
    keys["admin"] = ApiKey.mint("admin")[1]
    package = publish_example(tenant)
    execution, _tasks = start(tenant, package.workflow_name, {"fuzz": True})
    schedule = create_schedule(tenant, ScheduleSpec(package.workflow_name, "0 0 1 1 *"))
    agent_key = ApiKey.verify(keys["agent"])
    agent, leaver = (
        roster.register(agent_key, roster.Registration(name=name, target_triple=host_triple()))
        for name in ("fuzz-agent", "fuzz-leaver")
    )
    return {
        "keys": keys,
        "examples": {
            "execution_id": str(execution.pk),
            "schedule_id": str(schedule.pk),
            "agent_id": str(agent.pk),
            "leaver_id": str(leaver.pk),  # deregistered by the examples: not the one that beats
            "digest": package.digest,
            "name": package.name,
            "version": package.version,
            "workflow": package.workflow_name,
            "tenant": tenant.name,
            # Run by the server as soon as it starts: its log is there to read.
            "task_name": "extract",
        },
    }


def _document(url: str, examples: dict) -> dict:
    """The server's document with real ids as path-parameter examples."""
    document = httpx.get(f"{url}/api/v1/openapi.json", timeout=10).raise_for_status().json()
    for route, item in document["paths"].items():
        for operation in item.values():
            for parameter in operation.get("parameters", []):
                name = parameter["name"]
                if name == "agent_id" and route.endswith("/deregister"):
                    name = "leaver_id"
                if parameter["in"] == "path" and name in examples:
                    parameter["example"] = examples[name]
    return document


def _operations(document: dict) -> list[tuple[str, str, dict]]:
    return [
        (method, path, operation)
        for path, item in document["paths"].items()
        for method, operation in item.items()
    ]


def _subset(document: dict, keep, path: Path) -> Path | None:
    """A copy of ``document`` with only the operations ``keep(operation)`` accepts."""
    paths: dict = {}
    for method, route, operation in _operations(document):
        if keep(operation):
            paths.setdefault(route, {})[method] = operation
    if not paths:
        return None
    path.write_text(json.dumps({**document, "paths": paths}))
    return path


def _plan(document: dict, tmp_path: Path) -> list[tuple[str, Path, str]]:
    """(role, document file, phases): every phase on the operations a role may call
    (``x-roles``), a few requests on the ones it may not (their 401/403 answers)."""
    for _m, route, operation in _operations(document):
        assert operation.get("x-roles"), f"{route}: no x-roles in the document"
    runs = [("none", _subset(document, lambda op: True, tmp_path / "all.json"), REFUSED)]
    for role in ROLES[1:]:
        allowed = _subset(
            document, lambda op, r=role: r in op["x-roles"], tmp_path / f"{role}.json"
        )
        refused = _subset(
            document, lambda op, r=role: r not in op["x-roles"], tmp_path / f"not-{role}.json"
        )
        if allowed:
            runs.append((role, allowed, ALLOWED))
        if refused:
            runs.append((role, refused, REFUSED))
        hostile = _subset(
            document,
            lambda op, r=role: r in op["x-roles"] and "requestBody" in op,
            tmp_path / f"hostile-{role}.json",
        )
        if hostile:
            runs.append((role, hostile, HOSTILE))
    return runs


def _start_run(
    schema: Path, phases: str, base_url: str, key: str | None, workdir: Path
) -> subprocess.Popen:
    workdir.mkdir()
    (workdir / "schemathesis.toml").write_text(CONFIG)
    env = dict(os.environ)
    if phases == HOSTILE:
        env["SCHEMATHESIS_HOOKS"] = "tests.support.fuzz_hostile_hooks"
        env["CLOACINA_FUZZ_HOSTILE_LOG"] = str(workdir / "hostile.log")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        checks, phases, examples = HOSTILE_CHECKS, "examples,fuzzing", HOSTILE_EXAMPLES
    else:
        checks, examples = CHECKS, EXAMPLES if phases == ALLOWED else REFUSED_EXAMPLES
    args = [
        sys.executable, "-m", "schemathesis.cli",
        "--config-file", str(workdir / "schemathesis.toml"),
        "run", str(schema),
        "--url", base_url,
        "--checks", checks,
        "--phases", phases,
        "--max-examples", str(examples),
        "--seed", str(SEED),
        "--generation-database", "none",
        "--no-shrink",
        "--workers", "1",
        "--request-timeout", "30",
        "--no-color",
        "--suppress-health-check", "all",
    ]  # fmt: skip
    if key is not None:
        args += ["--header", f"Authorization: Bearer {key}"]
    return subprocess.Popen(
        args, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


@pytest.mark.e2e
def test_every_operation_for_every_caller_keeps_to_the_document(procs, tmp_path):
    seeded = _seed()
    server = procs.serve()
    document = _document(server.url, seeded["examples"])
    plan = _plan(document, tmp_path)
    results: list[tuple[str, Path, int, str]] = []
    pending = list(plan)
    running: list[tuple[str, Path, subprocess.Popen]] = []
    while pending or running:
        while pending and len(running) < PARALLEL_RUNS:
            role, schema, phases = pending.pop(0)
            workdir = tmp_path / f"st-{len(results) + len(running)}-{role}-{schema.stem}"
            key = seeded["keys"].get(role)
            running.append((role, schema, _start_run(schema, phases, server.url, key, workdir)))
        role, schema, run = running.pop(0)
        output = run.communicate(timeout=RUN_TIMEOUT_S)[0]
        (tmp_path / f"{role}-{schema.stem}.txt").write_text(output)
        results.append((role, schema, run.returncode, output))

    failed = [(role, schema, output) for role, schema, code, output in results if code != 0]
    assert not failed, "\n\n".join(
        f"===== schemathesis as {role} on {schema.name} =====\n{output[-12000:]}"
        for role, schema, output in failed
    )
    for role, schema, _code, output in results:
        expected = len(_operations(json.loads(schema.read_text())))
        tested = TESTED.search(output)
        assert tested and int(tested.group(1)) == expected, (
            f"{role} on {schema.name}: not all {expected} operations tested:\n{output[-3000:]}"
        )
    # Every hostile body was sent, and refused with a 4xx naming it (401/403 do not count).
    sent: dict[str, set[int]] = {}
    for log in tmp_path.glob("st-*/hostile.log"):
        for line in log.read_text().splitlines():
            mutation, status = line.split("\t")
            sent.setdefault(mutation, set()).add(int(status))
    expected = {m.__name__.lstrip("_") for m in hostile_hooks.JSON_MUTATIONS} | {"manifest_nul"}
    assert set(sent) == expected, sent
    assert all(s in (400, 404, 413, 422) for m in sent.values() for s in m), sent
    # The server took all of it and still serves.
    assert httpx.get(f"{server.url}/healthz", timeout=5).status_code == 200
    assert "Traceback" not in server.process.output(), server.process.tail(80)
