"""The loop inbox: calls from threads reach the event loop in order, many per wake-up;
the delivery pool's calls answer through it (fleet/engine/loop_inbox.py)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from fleet.engine import loop_inbox
from fleet.engine.db_threads import DbThreadPool


def _in_thread(fn) -> None:
    thread = threading.Thread(target=fn)
    thread.start()
    thread.join()


def test_posts_of_threads_run_in_order_in_one_wake_up():
    async def main() -> tuple[list[int], int]:
        inbox = loop_inbox.inbox(asyncio.get_running_loop())
        seen: list[int] = []
        done = asyncio.Event()
        # The loop is busy (this coroutine holds it) while the threads post: one drain.
        _in_thread(lambda: [inbox.post(seen.append, i) for i in range(50)])
        _in_thread(lambda: [inbox.post(seen.append, i) for i in range(50, 100)])
        _in_thread(lambda: inbox.post(done.set))
        await asyncio.wait_for(done.wait(), 5)
        return seen, inbox.drains

    seen, drains = asyncio.run(main())
    assert seen == list(range(100))
    assert drains == 1


def test_a_failing_call_does_not_cost_the_others_theirs():
    def boom() -> None:
        raise ValueError("boom")

    async def main() -> list[str]:
        inbox = loop_inbox.inbox(asyncio.get_running_loop())
        seen: list[str] = []
        done = asyncio.Event()
        _in_thread(
            lambda: (inbox.post(boom), inbox.post(seen.append, "after"), inbox.post(done.set))
        )
        await asyncio.wait_for(done.wait(), 5)
        return seen

    assert asyncio.run(main()) == ["after"]


def test_a_closed_loop_drops_posts_without_raising():
    loop = asyncio.new_event_loop()
    inbox = loop_inbox.inbox(loop)
    loop.close()
    assert inbox.post(print, "never") is False
    assert inbox.post(print, "never again") is False  # not stuck as "scheduled"


def test_every_loop_has_its_own_inbox():
    async def mine() -> loop_inbox.LoopInbox:
        loop = asyncio.get_running_loop()
        assert loop_inbox.inbox(loop) is loop_inbox.inbox(loop)
        return loop_inbox.inbox(loop)

    assert asyncio.run(mine()) is not asyncio.run(mine())


def test_pool_calls_answer_through_the_inbox_after_what_the_thread_posted():
    pool = DbThreadPool(2, "inbox-test")

    async def main() -> tuple[list[str], int]:
        loop = asyncio.get_running_loop()
        inbox = loop_inbox.inbox(loop)
        seen: list[str] = []

        def work() -> str:
            inbox.post(seen.append, "woken")  # e.g. ready events, waiters' outcomes
            return "answer"

        before = inbox.posts
        seen.append(await pool.call(work))
        return seen, inbox.posts - before

    try:
        seen, posts = asyncio.run(main())
    finally:
        pool.close()
    # The answer came through the inbox too, after what the thread posted before it
    # (whether in the same drain depends on when the loop wakes: the first test holds it).
    assert seen == ["woken", "answer"]
    assert posts == 2


def test_pool_call_raises_the_call_s_exception():
    pool = DbThreadPool(1, "inbox-test")

    def fail() -> None:
        raise LookupError("no such row")

    try:
        with pytest.raises(LookupError, match="no such row"):
            asyncio.run(pool.call(fail))
    finally:
        pool.close()


def test_a_call_cancelled_before_a_thread_takes_it_never_runs():
    pool = DbThreadPool(1, "inbox-test")
    ran: list[str] = []
    release = threading.Event()

    async def main() -> None:
        busy = asyncio.ensure_future(pool.call(release.wait, 5))
        await asyncio.sleep(0)  # the only thread now waits in release.wait
        queued = asyncio.ensure_future(pool.call(ran.append, "cancelled one"))
        await asyncio.sleep(0)
        queued.cancel()
        await asyncio.gather(queued, return_exceptions=True)
        release.set()
        assert await busy is True
        await pool.call(ran.append, "next one")

    try:
        asyncio.run(main())
    finally:
        pool.close()
    assert ran == ["next one"]


def test_a_closed_pool_refuses_calls():
    pool = DbThreadPool(1, "inbox-test")
    pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        asyncio.run(pool.call(print))
