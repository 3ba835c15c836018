"""Task children under resource limits, a fresh child per task (agents/sandbox/task_limits.py):
real processes hitting real rlimits (no database)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agents.sandbox.task_limits import ChildLimits
from agents.sandbox.task_runner import TaskRunner
from tests.support.loop import in_own_loop

MIB = 1024 * 1024
STEPS = """
import os, resource

def limits(ctx):
    return {
        "pid": os.getpid(),
        "cpu": list(resource.getrlimit(resource.RLIMIT_CPU)),
        "as": list(resource.getrlimit(resource.RLIMIT_AS)),
        "nofile": list(resource.getrlimit(resource.RLIMIT_NOFILE)),
        "core": list(resource.getrlimit(resource.RLIMIT_CORE)),
    }

def spin(ctx):
    while True:
        pass

def allocate(ctx):
    block = bytearray(ctx["mib"] * 1024 * 1024)
    return {"allocated": len(block)}

def open_files(ctx):
    handles = [open(os.devnull) for _ in range(ctx["count"])]
    return {"opened": len(handles)}
"""
LIMITS = ChildLimits(cpu_seconds=1, address_space_bytes=256 * MIB, open_files=32)


@pytest.fixture
def package(tmp_path) -> Path:
    steps = tmp_path / "pkg" / "workflow" / "limited" / "steps.py"
    steps.parent.mkdir(parents=True)
    (steps.parent / "__init__.py").write_text("")
    steps.write_text(STEPS)
    return tmp_path / "pkg"


@pytest.fixture
def runner():
    runner = TaskRunner(1, limits=LIMITS, fresh_child_per_task=True)
    runner.start()
    yield runner
    runner.close()


async def run(runner, package, name, context=None, timeout_s=20.0):
    return await runner.run(package, f"limited.steps:{name}", json.dumps(context or {}), timeout_s)


@in_own_loop
async def test_every_task_gets_a_new_child_with_the_limits_applied(runner, package):
    first = await run(runner, package, "limits")
    second = await run(runner, package, "limits")
    assert (first.status, second.status) == ("success", "success")
    assert first.output["pid"] != second.output["pid"]  # a child is never reused
    assert len(runner.child_pids()) == 1  # and the capacity stays what it was
    assert first.output["cpu"] == [1, 2]
    assert first.output["as"] == [256 * MIB, 256 * MIB]
    assert first.output["nofile"] == [32, 32]
    assert first.output["core"] == [0, 0]


@in_own_loop
async def test_a_task_past_its_cpu_seconds_fails_and_the_next_one_runs(runner, package):
    outcome = await run(runner, package, "spin")
    assert outcome.status == "failure"
    assert outcome.error_type == "WorkerCrashed"
    assert "exceeded its CPU time limit" in outcome.error_message
    assert outcome.duration_s < 15.0  # the limit stopped it, not the 20 s timeout
    assert (await run(runner, package, "limits")).status == "success"


@in_own_loop
async def test_a_task_past_its_address_space_gets_a_memory_error(runner, package):
    outcome = await run(runner, package, "allocate", {"mib": 512})
    assert (outcome.status, outcome.error_type) == ("failure", "MemoryError")
    fits = await run(runner, package, "allocate", {"mib": 16})
    assert fits.output == {"allocated": 16 * MIB}


@in_own_loop
async def test_a_task_past_its_open_files_gets_emfile(runner, package):
    outcome = await run(runner, package, "open_files", {"count": 64})
    assert (outcome.status, outcome.error_type) == ("failure", "OSError")
    assert "Too many open files" in outcome.error_message
    assert (await run(runner, package, "open_files", {"count": 8})).output == {"opened": 8}


def test_limits_below_what_the_interpreter_needs_are_refused():
    with pytest.raises(ValueError, match="address_space_bytes must be >= "):
        ChildLimits(address_space_bytes=32 * MIB)
    with pytest.raises(ValueError, match="open_files must be >= 16"):
        ChildLimits(open_files=3)
    with pytest.raises(ValueError, match="cpu_seconds must be >= 1"):
        ChildLimits(cpu_seconds=0)
