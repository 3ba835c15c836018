"""What a task prints reaches its run's bounded log: real children, no database."""

from __future__ import annotations

import asyncio
import json
import textwrap
from pathlib import Path

import pytest

from agents.sandbox.task_runner import TaskRunner
from tests.support.loop import in_own_loop

STEPS = """
import logging, os, subprocess, sys, time

log = logging.getLogger("demo.steps")

def chatty(ctx):
    print("to stdout")
    print("to stderr", file=sys.stderr)
    log.info("an info record")
    log.warning("a warning")
    os.write(1, b"raw fd write\\n")
    subprocess.run([sys.executable, "-c", "print('from a subprocess')"], check=True)
    sys.stdout.write("no newline at the end")
    return {"ok": True}

def flood(ctx):
    for i in range(ctx["lines"]):
        print(f"line {i:06d}")
    return {}

def fails(ctx):
    print("about to fail")
    raise RuntimeError("bad input")

def hangs(ctx):
    print("started, now hanging", flush=True)
    time.sleep(60)

def dies(ctx):
    print("last words", flush=True)
    os._exit(7)

def ticks(ctx):
    for i in range(ctx["n"]):
        print(f"tick {i}")
        time.sleep(ctx["every_s"])
    return {}

def quiet(ctx):
    return {}
"""


@pytest.fixture
def package(tmp_path) -> Path:
    root = tmp_path / "pkg"
    for name, text in {
        "workflow/demo/__init__.py": "",
        "workflow/demo/steps.py": STEPS,
    }.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


@pytest.fixture
def runner():
    runner = TaskRunner(1, log_bytes=4096)
    runner.start()
    yield runner
    runner.close()


async def run(runner, package, name, context=None, timeout_s=10.0, log=None):
    return await runner.run(
        package, f"demo.steps:{name}", json.dumps(context or {}), timeout_s, log=log
    )


@in_own_loop
async def test_stdout_stderr_logging_and_subprocesses_are_captured_in_order(runner, package):
    outcome = await run(runner, package, "chatty")
    assert outcome.status == "success"
    text = outcome.log.text
    lines = text.splitlines()
    assert lines[:2] == ["to stdout", "to stderr"]
    assert lines[2].endswith("INFO demo.steps: an info record")
    assert lines[3].endswith("WARNING demo.steps: a warning")
    assert lines[4:] == ["raw fd write", "from a subprocess", "no newline at the end"]
    assert not outcome.log.truncated
    assert outcome.log.bytes == len(text.encode())


@in_own_loop
async def test_a_flood_keeps_only_the_last_bytes_and_says_how_many_went(runner, package):
    outcome = await run(runner, package, "flood", {"lines": 20_000})  # 240,000 bytes
    log = outcome.log
    assert log.bytes == 20_000 * 12
    assert log.truncated_bytes == log.bytes - 4096
    assert len(log.text.encode()) == 4096
    assert log.text.endswith("line 019999\n")
    assert log.render().startswith(f"[… {log.bytes - 4096} bytes truncated …]\n")


@in_own_loop
async def test_a_failure_keeps_its_log_beside_its_traceback(runner, package):
    outcome = await run(runner, package, "fails")
    assert outcome.status == "failure"
    assert outcome.log.text == "about to fail\n"
    assert "RuntimeError: bad input" in outcome.traceback


@in_own_loop
async def test_a_timed_out_task_keeps_what_it_printed_before_the_kill(runner, package):
    outcome = await run(runner, package, "hangs", timeout_s=1.0)
    assert outcome.status == "timeout"
    assert outcome.log.text == "started, now hanging\n"


@in_own_loop
async def test_a_crashed_child_keeps_its_last_words(runner, package):
    outcome = await run(runner, package, "dies")
    assert outcome.error_type == "WorkerCrashed"
    assert outcome.log.text == "last words\n"
    # The replacement child's log starts empty.
    assert (await run(runner, package, "quiet")).log.text == ""


@in_own_loop
async def test_each_run_has_its_own_log(runner, package):
    await run(runner, package, "fails")
    outcome = await run(runner, package, "quiet")
    assert outcome.log.text == "" and outcome.log.bytes == 0


@in_own_loop
async def test_the_caller_can_tail_the_log_while_the_task_runs(runner, package):
    ring = runner.new_log()
    running = asyncio.ensure_future(
        run(runner, package, "ticks", {"n": 40, "every_s": 0.1}, log=ring)
    )
    deadline = asyncio.get_running_loop().time() + 10
    while ring.since(0) is None:  # read on the loop that fills it
        assert asyncio.get_running_loop().time() < deadline, "no output while the task ran"
        await asyncio.sleep(0.02)
    assert not running.done()
    assert ring.since(0).text.startswith("tick 0\n")
    outcome = await running
    assert outcome.log.text.endswith("tick 39\n")
