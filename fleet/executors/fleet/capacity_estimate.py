"""Free agent slots cluster-wide as this process sees them: the fleet executor's
``has_capacity`` hint, kept between the capacity probe's database reads (a hint only: the
reservation in the placement statement decides)."""

from __future__ import annotations


class CapacityEstimate:
    """Free agent slots cluster-wide, as seen by this process (a hint; reservation decides).

    ``probed`` is the last database figure; ``delta`` the slots this process took
    (-1) or saw freed (+1) since; ``claiming`` the placements in progress.

    A run's slot is free in the database from its outcome's commit, but this process
    counts it free only when the waiter wakes (:meth:`give_back`), which is later — tens
    of milliseconds when the loop is busy.  A probe reading in between counted the slot
    free once in its figure and once more in ``delta``: in fleetbench's drain a probe
    overshot by 9–18 slots at a time, and 30–240 placements of 2,000 were claimed and
    released again for want of the slot (a miss costs a claim, a release and the census
    of its wait reason, and the task waits 50 ms or, missing twice, a scheduler tick).
    So each outcome handed to a local waiter is numbered when handed over
    (:attr:`~fleet.executors.fleet.delivery.rendezvous.Rendezvous.posted`, after its
    commit), a probe notes that number before its query (``mark``), and a slot whose
    outcome was numbered no later than that is not added again.
    """

    def __init__(self) -> None:
        self.probed: int | None = None
        self.delta = 0
        self.claiming = 0
        self.total = 0  # slots in all on those agents, at the last probe (for metrics)
        self.seen_upto = 0  # outcomes numbered up to this were free in the last probe's figure
        self._mark: int | None = None  # the probe in progress: its number, its start's delta
        self._before = 0
        self._counted_twice = 0  # given back while it ran, yet numbered before it

    def available(self) -> int:
        if self.probed is None:
            return 1  # unknown (no probe yet, or the database is away): let dispatch find out
        return self.probed + self.delta - self.claiming

    def give_back(self, posted: int = 0) -> bool:
        """A run's slot is free again; ``posted`` its outcome's number (0: not known).
        False when the last probe's figure counted it free already."""
        if posted and posted <= self.seen_upto:
            return False
        self.delta += 1
        if posted and self._mark is not None and posted <= self._mark:
            self._counted_twice += 1  # the running probe's figure will count it too
        return True

    def probe_started(self, mark: int) -> None:
        """Before the probe's query: ``mark`` is the last outcome number handed over."""
        self._mark, self._before, self._counted_twice = mark, self.delta, 0

    def probe_read(self, free: int, total: int) -> None:
        """The probe's figures: what this process took or gave back since its start, and
        did not count already, stays on top of them."""
        self.probed, self.total = free, total
        self.delta -= self._before + self._counted_twice
        if self._mark is not None:
            self.seen_upto = max(self.seen_upto, self._mark)
        self._mark = None

    def probe_failed(self) -> None:
        self.probed, self._mark = None, None
