"""The fleet executor's estimate of free agent slots counts a freed slot once, whether
its probe read the slot free or this process saw the outcome (round i17-relay)."""

from __future__ import annotations

import asyncio
import uuid

from fleet.engine.events import ExecutionStatus
from fleet.executors.fleet.capacity_estimate import CapacityEstimate
from fleet.executors.fleet.delivery.rendezvous import Outcome, Rendezvous


def _busy_fleet(slots: int) -> CapacityEstimate:
    """Every one of ``slots`` taken by this process, as a probe has read it."""
    estimate = CapacityEstimate()
    estimate.probe_started(0)
    estimate.probe_read(0, slots)
    return estimate


def test_an_outcome_committed_before_the_probe_read_is_not_added_again():
    estimate = _busy_fleet(64)
    # Nine outcomes were committed and handed over (numbers 1-9) before the probe's
    # query; their waiters wake while it runs, and after: the probe reads 9 free.
    estimate.probe_started(9)
    for posted in (1, 2, 3, 4):
        assert estimate.give_back(posted)
    estimate.probe_read(9, 64)
    assert estimate.available() == 9
    for posted in (5, 6, 7, 8, 9):
        assert not estimate.give_back(posted)
    assert estimate.available() == 9


def test_an_outcome_handed_over_after_the_probe_started_is_added():
    estimate = _busy_fleet(64)
    estimate.probe_started(3)
    assert estimate.give_back(4)  # committed after the query went out: not in its figure
    estimate.probe_read(3, 64)
    assert estimate.give_back(5)
    assert estimate.available() == 3 + 2


def test_a_slot_whose_outcome_number_is_unknown_is_added_as_before():
    estimate = _busy_fleet(64)
    estimate.probe_started(0)
    estimate.probe_read(0, 64)
    assert estimate.give_back(0)  # read from the database, a cancel, an error
    assert estimate.available() == 1


def test_slots_taken_while_the_probe_ran_stay_taken():
    estimate = _busy_fleet(4)
    estimate.probe_started(0)
    estimate.probe_read(4, 4)
    estimate.probe_started(0)
    estimate.delta -= 2  # two placements committed while the query ran
    estimate.probe_read(4, 4)  # it read them free
    assert estimate.available() == 2


def test_a_failed_probe_forgets_its_mark():
    estimate = _busy_fleet(8)
    estimate.probe_started(5)
    estimate.probe_failed()
    assert estimate.available() == 1  # unknown: dispatch finds out
    assert estimate.give_back(5)  # no probe read it


def test_outcomes_handed_to_local_waiters_are_numbered_in_order():
    rendezvous = Rendezvous()

    async def scenario():
        ids = [uuid.uuid4() for _ in range(3)]
        futures = [rendezvous.register(task_id) for task_id in ids]
        done = Outcome(1, ExecutionStatus.COMPLETED)
        elsewhere = rendezvous.wake_many([(ids[0], done), (ids[1], done), (uuid.uuid4(), done)])
        assert rendezvous.wake(ids[2], done)
        outcomes = [await asyncio.wait_for(future, 1) for future in futures]
        return [o.posted for o in outcomes], len(elsewhere), rendezvous.posted

    assert asyncio.run(scenario()) == ([1, 2, 3], 1, 3)


def test_outcomes_whose_commit_went_out_before_the_probe_are_not_added_again():
    # The result batch sent its COMMIT, the probe's query read the slots free, and only
    # then did the batch hand its outcomes to their waiters (a busy database thread).
    rendezvous = Rendezvous()
    estimate = _busy_fleet(64)

    async def scenario():
        ids = [uuid.uuid4() for _ in range(2)]
        futures = [rendezvous.register(task_id) for task_id in ids]
        coming = rendezvous.commit_coming(2)
        estimate.probe_started(rendezvous.mark())
        estimate.probe_read(2, 64)
        done = Outcome(1, ExecutionStatus.COMPLETED)
        rendezvous.wake_many([(task_id, done) for task_id in ids])
        rendezvous.commit_done(coming)
        outcomes = [await asyncio.wait_for(future, 1) for future in futures]
        return [estimate.give_back(o.posted) for o in outcomes], rendezvous.mark()

    assert asyncio.run(scenario()) == ([False, False], 2)
    assert estimate.available() == 2
