"""The task runner's child sockets on both event loops the agent runs on: one reader per
child for all its replies (not a ``sock_recv`` per reply), released on the loop's own
thread when ``close()`` runs in another; one timer per run for the output watch and the
timeout (docs/performance.md, "Round i17-recv"); a request written straight into the
socket, the loop writing only what it did not take (session 16)."""

from __future__ import annotations

import asyncio
import json
import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from agents.sandbox.task_runner import TaskRunner
from tests.integration.test_task_runner import STEPS, write_package

uvloop = pytest.importorskip("uvloop")


def _counting(base: type) -> type:
    """``base`` (an event loop class) counting its readers, ``sock_recv``s and timers."""

    class Counting(base):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.calls: Counter[str] = Counter()

        def add_reader(self, fd: Any, callback: Callable[..., Any], *args: Any) -> None:
            self.calls["add_reader"] += 1
            super().add_reader(fd, callback, *args)

        def call_later(
            self, delay: float, callback: Callable[..., Any], *args: Any, **kw: Any
        ) -> Any:
            self.calls["timers"] += 1
            self._in_call_later = True  # asyncio's call_later goes through call_at
            try:
                return super().call_later(delay, callback, *args, **kw)
            finally:
                self._in_call_later = False

        def call_at(self, when: float, callback: Callable[..., Any], *args: Any, **kw: Any) -> Any:
            if not getattr(self, "_in_call_later", False):
                self.calls["timers"] += 1
            return super().call_at(when, callback, *args, **kw)

        async def sock_recv(self, sock: Any, n: int) -> bytes:
            self.calls["sock_recv"] += 1
            return await super().sock_recv(sock, n)

        async def sock_sendall(self, sock: Any, data: Any) -> None:
            self.calls["sock_sendall"] += 1
            await super().sock_sendall(sock, data)

    return Counting


LOOPS = {
    "asyncio": _counting(asyncio.SelectorEventLoop),
    "uvloop": _counting(uvloop.Loop),
}


def _run_on(loop_class: type, main: Callable[[], Any]) -> Any:
    """``main()`` on a fresh loop of ``loop_class``, in a thread of its own."""
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            with asyncio.Runner(loop_factory=loop_class) as runner:
                outcome["result"] = runner.run(main())
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            outcome["error"] = exc

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


@pytest.fixture
def package(tmp_path: Path) -> Path:
    return write_package(
        tmp_path / "pkg",
        {
            "workflow/demo/__init__.py": "",
            "workflow/demo/steps.py": STEPS,
            "workflow/helper.py": "WHERE = 'workflow'\n",
            "vendor/vendored_lib/__init__.py": "VERSION = '1'\n",
        },
    )


async def _echo(runner: TaskRunner, package: Path, n: int) -> dict:
    outcome = await runner.run(package, "demo.steps:echo", json.dumps({"n": n}), 5.0)
    assert outcome.status == "success"
    return outcome.output


@pytest.mark.parametrize("loop_name", sorted(LOOPS))
def test_a_child_s_replies_come_through_one_reader(loop_name: str, package: Path) -> None:
    """Ten tasks on one child register one reader on its socket and no ``sock_recv``
    (which on uvloop makes and drops a poll handle per reply), and a timer each: a task
    that answers before the output watch is due never has its timeout's timer."""

    async def main() -> Counter:
        loop = asyncio.get_running_loop()
        runner = TaskRunner(1)
        await asyncio.to_thread(runner.start)
        try:
            outputs = [await _echo(runner, package, n) for n in range(10)]
        finally:
            await asyncio.to_thread(runner.close)
        assert [o["seen"] for o in outputs] == [{"n": n} for n in range(10)]
        return loop.calls

    calls = _run_on(LOOPS[loop_name], main)
    assert calls["sock_recv"] == 0
    assert calls["add_reader"] == 1
    assert calls["timers"] == 10
    # Each request went straight into the idle child's socket buffer (session 16).
    assert calls["sock_sendall"] == 0


@pytest.mark.parametrize("loop_name", sorted(LOOPS))
def test_a_request_larger_than_the_socket_takes_goes_the_loop_s_way(
    loop_name: str, package: Path
) -> None:
    """A context larger than the socket's buffer: what one send did not take is written by
    the loop as the child reads, in order, and the task sees its whole input."""

    async def main() -> tuple[int, Counter]:
        loop = asyncio.get_running_loop()
        runner = TaskRunner(1)
        await asyncio.to_thread(runner.start)
        try:
            big = "z" * (4 << 20)
            output = await runner.run(package, "demo.steps:echo", json.dumps({"big": big}), 10.0)
            after = await _echo(runner, package, 1)
        finally:
            await asyncio.to_thread(runner.close)
        assert output.status == "success" and output.output["seen"] == {"big": big}
        assert after["seen"] == {"n": 1}
        return len(output.output["seen"]["big"]), loop.calls

    size, calls = _run_on(LOOPS[loop_name], main)
    assert size == 4 << 20
    assert calls["sock_sendall"] == 1


@pytest.mark.parametrize("loop_name", sorted(LOOPS))
@pytest.mark.parametrize("timeout_s", [0.0, 0.02, 0.3])
def test_a_timeout_before_or_after_the_output_watch_ends_the_run(
    loop_name: str, timeout_s: float, package: Path
) -> None:
    """The one timer serves a timeout shorter than the output watch (0.05 s), and one
    longer (the watch first, then the deadline); the child is replaced either way."""

    async def main() -> tuple[str, str, dict]:
        runner = TaskRunner(1)
        await asyncio.to_thread(runner.start)
        try:
            context = json.dumps({"sleep_s": 30})
            hung = await runner.run(package, "demo.steps:sleepy", context, timeout_s)
            after = await _echo(runner, package, 1)
        finally:
            await asyncio.to_thread(runner.close)
        return hung.status, hung.error_type, after["seen"]

    assert _run_on(LOOPS[loop_name], main) == ("timeout", "TaskTimeout", {"n": 1})


@pytest.mark.parametrize("loop_name", sorted(LOOPS))
def test_close_from_a_thread_releases_the_readers_on_the_loop(
    loop_name: str, package: Path
) -> None:
    """The agent closes its runner in a thread while its loop runs.  Each idle child's
    reader is taken off the loop before its socket closes: the child sees EOF and exits
    by itself (status 0, not killed after the grace), and a new runner on the same loop,
    whose sockets reuse the descriptors' numbers, runs tasks."""

    async def main() -> list[int | None]:
        first = TaskRunner(2)
        await asyncio.to_thread(first.start)
        await asyncio.gather(*(_echo(first, package, n) for n in range(4)))
        processes = [slot.process for slot in first._slots]
        await asyncio.to_thread(first.close)
        second = TaskRunner(2)
        await asyncio.to_thread(second.start)
        try:
            await asyncio.gather(*(_echo(second, package, n) for n in range(4)))
        finally:
            await asyncio.to_thread(second.close)
        return [process.returncode for process in processes]

    assert _run_on(LOOPS[loop_name], main) == [0, 0]


@pytest.mark.parametrize("loop_name", sorted(LOOPS))
def test_a_child_that_dies_between_tasks_fails_the_next_one_and_is_replaced(
    loop_name: str, package: Path
) -> None:
    """A child gone while idle (its socket at EOF under the kept reader) fails the next
    task as a crash, not a hang or a spinning reader, and its replacement runs the one
    after."""

    async def main() -> tuple[str, str, str]:
        runner = TaskRunner(1)
        await asyncio.to_thread(runner.start)
        try:
            await _echo(runner, package, 0)
            process = runner._slots[0].process
            process.kill()
            await asyncio.to_thread(process.wait)
            await asyncio.sleep(0.05)  # the reader sees the EOF while nothing waits
            crashed = await runner.run(package, "demo.steps:echo", "{}", 5.0)
            after = await _echo(runner, package, 1)
        finally:
            await asyncio.to_thread(runner.close)
        return crashed.status, crashed.error_type, json.dumps(after["seen"])

    assert _run_on(LOOPS[loop_name], main) == ("failure", "WorkerCrashed", '{"n": 1}')
