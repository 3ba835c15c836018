"""The task runner: real child processes, real timeouts, real crashes (no database)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from agents.sandbox.task_runner import TaskRunner
from tests.support.loop import in_own_loop, run_async

REPO = Path(__file__).resolve().parents[2]

STEPS = """
import asyncio, ctypes, math, os, time
import helper

def echo(ctx):
    return {"seen": ctx, "pid": os.getpid()}

def noop(ctx):
    return None

def boom(ctx):
    raise KeyError("no such key: " + ctx.get("key", "?"))

def sleepy(ctx):
    time.sleep(ctx["sleep_s"])
    return {"slept": ctx["sleep_s"]}

def exits(ctx):
    os._exit(3)

def segfault(ctx):
    ctypes.string_at(0)

def gives_nan(ctx):
    return {"x": math.nan}

def gives_set(ctx):
    return {"x": {1, 2}}

def gives_list(ctx):
    return [1, 2]

async def async_add(ctx):
    await asyncio.sleep(0.01)
    return {"sum": ctx["a"] + ctx["b"]}

def which_helper(ctx):
    return {"helper": helper.WHERE, "vendored": __import__("vendored_lib").VERSION}

def imports_server(ctx):
    import cloacina_site  # noqa: F401  (must not be importable in a task)
    return {}

def exits_cleanly(ctx):
    raise SystemExit(2)
"""


def write_package(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


@pytest.fixture
def package(tmp_path) -> Path:
    return write_package(
        tmp_path / "pkg",
        {
            "workflow/demo/__init__.py": "",
            "workflow/demo/steps.py": STEPS,
            # helper exists in both: workflow/ must win over vendor/.
            "workflow/helper.py": "WHERE = 'workflow'\n",
            "vendor/helper.py": "WHERE = 'vendor'\n",
            "vendor/vendored_lib/__init__.py": "VERSION = '9.9'\n",
        },
    )


@pytest.fixture
def runner():
    runner = TaskRunner(2)
    runner.start()
    yield runner
    runner.close()


async def run(runner, package, name, context=None, timeout_s=5.0):
    return await runner.run(package, f"demo.steps:{name}", json.dumps(context or {}), timeout_s)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes.
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


@in_own_loop
async def test_it_runs_a_task_with_the_decoded_context(runner, package):
    outcome = await run(runner, package, "echo", {"a": 1, "nested": {"b": [1, 2]}})
    assert outcome.status == "success"
    assert outcome.output["seen"] == {"a": 1, "nested": {"b": [1, 2]}}
    assert outcome.output["pid"] in runner.child_pids()
    assert outcome.output["pid"] != os.getpid()


@in_own_loop
async def test_tasks_one_after_another_run_in_the_child_freed_last(runner, package):
    """The child freed last takes the next task (its memory still in the CPU's caches),
    not each child in turn; tasks at once still get a child each."""
    assert len(runner.child_pids()) > 1
    pids = {(await run(runner, package, "echo")).output["pid"] for _ in range(4)}
    assert len(pids) == 1
    together = await asyncio.gather(
        *(run(runner, package, "sleepy", {"sleep_s": 0.2}) for _ in range(2))
    )
    assert all(o.status == "success" for o in together)


@in_own_loop
async def test_a_replaced_child_still_booting_is_taken_last(package):
    runner = TaskRunner(2, fresh_child_per_task=True)
    runner.start()
    try:
        booted = set(runner.child_pids())
        first = (await run(runner, package, "echo")).output["pid"]
        # Its child was retired; the other one, booted at start, takes the next task.
        second = (await run(runner, package, "echo")).output["pid"]
        assert first in booted and second in booted and first != second
    finally:
        runner.close()


@in_own_loop
async def test_it_turns_none_into_an_empty_output(runner, package):
    outcome = await run(runner, package, "noop")
    assert (outcome.status, outcome.output) == ("success", {})


@in_own_loop
async def test_it_reports_an_exception_with_type_message_and_traceback(runner, package):
    outcome = await run(runner, package, "boom", {"key": "colour"})
    assert outcome.status == "failure"
    assert outcome.error_type == "KeyError"
    assert "no such key: colour" in outcome.error_message
    assert 'raise KeyError("no such key: "' in outcome.traceback
    assert "in boom" in outcome.traceback
    # The child survived its task's exception and keeps serving.
    assert (await run(runner, package, "noop")).status == "success"


@in_own_loop
async def test_it_kills_a_task_at_its_timeout_and_keeps_its_capacity(runner, package):
    before = set(runner.child_pids())
    started = time.monotonic()
    outcome = await run(runner, package, "sleepy", {"sleep_s": 30}, timeout_s=0.5)
    elapsed = time.monotonic() - started
    assert outcome.status == "timeout"
    assert outcome.error_type == "TaskTimeout"
    assert outcome.error_message == "task exceeded its 0.5s timeout"
    assert 0.45 <= elapsed < 3.0
    after = set(runner.child_pids())
    killed = before - after
    assert len(killed) == 1 and len(after) == 2
    assert not pid_alive(killed.pop())
    # Both slots (the replacement included) run tasks again.
    results = [await run(runner, package, "sleepy", {"sleep_s": 0.01}) for _ in range(4)]
    assert [r.status for r in results] == ["success"] * 4


@in_own_loop
async def test_a_replacement_childs_boot_does_not_count_against_the_next_timeout(runner, package):
    await run(runner, package, "sleepy", {"sleep_s": 30}, timeout_s=0.2)
    await run(runner, package, "sleepy", {"sleep_s": 30}, timeout_s=0.2)
    # Both children were just replaced; a tight timeout must still fit the task alone.
    outcome = await run(runner, package, "sleepy", {"sleep_s": 0.01}, timeout_s=0.3)
    assert outcome.status == "success"


@in_own_loop
@pytest.mark.parametrize(
    ("task", "message"),
    [
        ("exits", "the task worker process exited with status 3 while running the task"),
        ("segfault", "the task worker process was killed by SIGSEGV while running the task"),
    ],
)
async def test_a_crashing_child_is_a_worker_crashed_failure_and_is_replaced(
    runner, package, task, message
):
    outcome = await run(runner, package, task)
    assert (outcome.status, outcome.error_type) == ("failure", "WorkerCrashed")
    assert outcome.error_message == message
    assert len(runner.child_pids()) == 2
    assert [(await run(runner, package, "noop")).status for _ in range(3)] == ["success"] * 3


@in_own_loop
@pytest.mark.parametrize(
    ("task", "message"),
    [
        ("gives_nan", "task output is not valid JSON: Out of range float values"),
        ("gives_set", "task output is not JSON-serialisable: Object of type set"),
        ("gives_list", "task output must be a JSON object (dict) or None, got list"),
    ],
)
async def test_it_refuses_output_that_is_not_a_json_object(runner, package, task, message):
    outcome = await run(runner, package, task)
    assert (outcome.status, outcome.error_type) == ("failure", "InvalidTaskOutput")
    assert outcome.error_message.startswith(message)
    assert outcome.output is None


@in_own_loop
async def test_it_runs_async_functions(runner, package):
    outcome = await run(runner, package, "async_add", {"a": 2, "b": 3})
    assert (outcome.status, outcome.output) == ("success", {"sum": 5})


@in_own_loop
async def test_workflow_comes_first_then_vendor_on_the_import_path(runner, package):
    outcome = await run(runner, package, "which_helper")
    assert outcome.output == {"helper": "workflow", "vendored": "9.9"}


@in_own_loop
async def test_two_packages_with_the_same_module_names_each_see_their_own(tmp_path, runner):
    first = write_package(tmp_path / "one", {"workflow/steps.py": "def v(ctx): return {'v': 1}\n"})
    second = write_package(tmp_path / "two", {"workflow/steps.py": "def v(ctx): return {'v': 2}\n"})
    runner_one = TaskRunner(1)  # one child, so it must switch packages back and forth
    runner_one.start()
    try:
        seen = [
            (await runner_one.run(pkg, "steps:v", "{}", 5)).output["v"]
            for pkg in (first, second, first, second)
        ]
    finally:
        runner_one.close()
    assert seen == [1, 2, 1, 2]


@in_own_loop
async def test_a_task_cannot_import_the_server(runner, package):
    outcome = await run(runner, package, "imports_server")
    assert (outcome.status, outcome.error_type) == ("failure", "ModuleNotFoundError")


@in_own_loop
async def test_system_exit_in_a_task_is_a_failure_not_a_dead_child(runner, package):
    pids = set(runner.child_pids())
    outcome = await run(runner, package, "exits_cleanly")
    assert (outcome.status, outcome.error_type) == ("failure", "SystemExit")
    assert set(runner.child_pids()) == pids


@in_own_loop
async def test_a_bad_function_spec_is_a_failure(runner, package):
    outcome = await runner.run(package, "demo.steps", "{}", 5)
    assert outcome.error_type == "ValueError"
    assert "not of the form 'module:function'" in outcome.error_message
    outcome = await runner.run(package, "demo.missing:f", "{}", 5)
    assert outcome.error_type == "ModuleNotFoundError"


@in_own_loop
async def test_tasks_run_in_parallel_up_to_capacity(runner, package):
    import asyncio

    started = time.monotonic()
    outcomes = await asyncio.gather(
        *[run(runner, package, "sleepy", {"sleep_s": 0.4}) for _ in range(2)]
    )
    assert [o.status for o in outcomes] == ["success", "success"]
    assert time.monotonic() - started < 0.75  # two at once, not one after the other


@in_own_loop
async def test_busy_counts_running_tasks(runner, package):
    import asyncio

    task = asyncio.ensure_future(run(runner, package, "sleepy", {"sleep_s": 0.3}))
    await asyncio.sleep(0.1)
    assert (runner.busy, runner.capacity) == (1, 2)
    await task
    assert runner.busy == 0


@in_own_loop
async def test_a_no_op_round_trip_is_well_under_five_ms(runner, package):
    for _ in range(20):  # warm the import cache of both children
        await run(runner, package, "noop")
    samples = []
    for _ in range(200):
        started = time.perf_counter()
        await run(runner, package, "noop")
        samples.append(time.perf_counter() - started)
    assert statistics.median(samples) < 0.005


@in_own_loop
async def test_a_cancelled_run_leaves_no_answer_behind_for_the_next_task(runner, package):
    import asyncio

    task = asyncio.ensure_future(run(runner, package, "sleepy", {"sleep_s": 0.3}))
    await asyncio.sleep(0.1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # Both slots answer their own task (the cancelled one's child was replaced, so its
    # late reply cannot reach the next task), and the pool kept its capacity.
    outcomes = await asyncio.gather(*[run(runner, package, "echo", {"n": i}) for i in range(4)])
    assert [o.output["seen"] for o in outcomes] == [{"n": i} for i in range(4)]
    assert len(runner.child_pids()) == 2 and runner.busy == 0


def test_close_stops_every_child_even_a_busy_one(package):
    import asyncio

    runner = TaskRunner(2)
    runner.start()
    pids = runner.child_pids()

    async def scenario():
        task = asyncio.ensure_future(run(runner, package, "sleepy", {"sleep_s": 30}))
        await asyncio.sleep(0.2)
        await asyncio.to_thread(runner.close)
        return await task

    outcome = run_async(scenario())
    assert (outcome.status, outcome.error_type) == ("failure", "TaskRunnerClosed")
    assert not any(pid_alive(pid) for pid in pids)


def test_children_exit_when_their_parent_is_killed(tmp_path, package):
    script = f"""
import asyncio, json, sys, time
sys.path.insert(0, {str(REPO)!r})
from agents.sandbox.task_runner import TaskRunner
runner = TaskRunner(2)
runner.start()
print(json.dumps(runner.child_pids()), flush=True)
async def main():
    await runner.run({str(package)!r}, "demo.steps:sleepy", '{{"sleep_s": 60}}', 120)
asyncio.run(main())
"""
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    pids = json.loads(parent.stdout.readline())
    time.sleep(0.2)  # one child is now busy in a 60 s task
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 5
    while any(pid_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(pid_alive(pid) for pid in pids)


def test_the_runtime_modules_import_no_django():
    code = (
        "import sys; import agents.sandbox.task_runner, agents.sandbox.package_cache, "
        "agents.sandbox.task_child; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('django', 'fleet', 'artifacts')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"
