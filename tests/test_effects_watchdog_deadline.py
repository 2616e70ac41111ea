"""Effect: the step watchdog and finish()'s bounded wait fire at their deadline, not before, not after.

Both read ``time.monotonic``; here it is a fake clock the test moves by hand, so "exactly when"
is a statement about the clock, not about a loaded machine. The watchdog thread is observed
through its own clock reads: after the clock is moved, two more reads by that thread mean one
whole look (read, compare, report or exit) saw the new time. ``os._exit`` is replaced by a
recorder, so the exit stage can be watched without ending pytest.
"""

from __future__ import annotations

import datetime
import threading
import types

import pytest

import hfstream.gradsync.faults as faults
import hfstream.trainer.watchdog as watchdog

GUARD_S = 30.0   # a hang guard on waiting for the watchdog thread, not a speed threshold


class FakeClock:
    """``monotonic()`` returns ``now``; counts the reads made by the watchdog's thread."""

    def __init__(self, now: float = 0.0):
        self.now = now
        self.cond = threading.Condition()
        self.thread_reads = 0

    def monotonic(self) -> float:
        with self.cond:
            if threading.current_thread().name == "hfstream-watchdog":
                self.thread_reads += 1
                self.cond.notify_all()
            return self.now

    def move_to(self, t: float) -> None:
        """Set the time, then return once the watchdog has looked at it (a whole poll after)."""
        with self.cond:
            self.now = t
            seen = self.thread_reads
            assert self.cond.wait_for(lambda: self.thread_reads >= seen + 2, timeout=GUARD_S), "watchdog stopped"


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock(100.0)
    exits = []
    monkeypatch.setattr(watchdog, "time", types.SimpleNamespace(monotonic=fake.monotonic))
    monkeypatch.setattr(watchdog, "os", types.SimpleNamespace(_exit=lambda code: exits.append((fake.now, code))))
    shutdowns = []   # logging.shutdown(): the process's log handlers flushed before os._exit skips them
    monkeypatch.setattr(watchdog, "logging", types.SimpleNamespace(shutdown=lambda: shutdowns.append(fake.now)))
    fake.exits, fake.shutdowns = exits, shutdowns
    return fake


def test_the_watchdog_reports_at_report_after_s_and_exits_at_exit_after_s_counted_from_the_last_progress(clock):
    wd = watchdog.StepWatchdog(report_after_s=10.0, exit_after_s=30.0, describe=lambda: "bucket 3 pending",
                               rank=1, poll_s=0.001)
    try:
        wd.watch("inside step 5")                  # progress at t=100
        clock.move_to(109.5)
        assert wd.reports == [] and clock.exits == []
        clock.move_to(110.0)                       # exactly report_after_s: reported, once
        assert len(wd.reports) == 1 and "rank 1 has been inside step 5 for 10 s" in wd.reports[0]
        assert "bucket 3 pending" in wd.reports[0]
        clock.move_to(129.5)
        assert len(wd.reports) == 1 and clock.exits == []
        wd.watch("inside step 6")                  # progress at t=129.5: both stages count from here
        clock.move_to(139.0)
        assert len(wd.reports) == 1 and clock.exits == []
        clock.move_to(139.5)
        assert len(wd.reports) == 2 and "inside step 6" in wd.reports[1]
        clock.move_to(159.0)
        assert clock.exits == []
        clock.move_to(159.5)                       # exactly exit_after_s after the last progress
        assert clock.exits and clock.exits[0] == (159.5, 124) and clock.shutdowns[0] == 159.5
    finally:
        wd.close()


def test_a_step_that_ended_is_not_watched_until_the_next_begins(clock):
    wd = watchdog.StepWatchdog(report_after_s=10.0, exit_after_s=30.0, describe=str, poll_s=0.001)
    try:
        looks = threading.Semaphore(0)
        real_wait = wd._closed.wait
        wd._closed = types.SimpleNamespace(wait=lambda t: (looks.release(), real_wait(t))[1], set=wd._closed.set)
        wd.begin(3)
        wd.end()                                   # between steps, outside train(): nothing to watch
        clock.now = 200.0                          # past both limits; an idle watchdog does not read the clock
        while looks.acquire(blocking=False):       # the looks made before
            pass
        for _ in range(3):                         # three whole looks of the thread at t=200
            assert looks.acquire(timeout=GUARD_S)
        assert wd.reports == [] and clock.exits == []
        wd.begin(4)                                # t=200
        clock.move_to(210.0)
        assert len(wd.reports) == 1 and "rank 0 has been inside step 4 for 10 s" in wd.reports[0]
    finally:
        wd.close()


def test_a_report_made_stale_by_progress_is_dropped_even_for_a_phase_of_the_same_name(clock):
    wd = watchdog.StepWatchdog(report_after_s=10.0, exit_after_s=None, describe=str, poll_s=3600.0)
    try:
        wd.watch("loading the batches of step 5")
        since = wd._since                          # what the thread read before it described the step
        clock.now = 105.0
        wd.watch("loading the batches of step 5")  # progress meanwhile, the same phase's name
        wd._report("loading the batches of step 5", since, 10.0)
        assert wd.reports == []
        wd._report("loading the batches of step 5", wd._since, 10.0)
        assert len(wd.reports) == 1
    finally:
        wd.close()


def test_close_waits_two_polls_and_a_second_for_the_thread_and_no_longer(clock):
    wd = watchdog.StepWatchdog(report_after_s=10.0, exit_after_s=None, describe=str, poll_s=0.25)
    thread, joins = wd._thread, []
    wd._thread = types.SimpleNamespace(join=lambda timeout=None: joins.append(timeout))
    wd.close()
    thread.join(GUARD_S)
    assert joins == [1.5] and not thread.is_alive()


class FakeWork:
    """A collective that takes ``takes_s`` of the fake clock and completes (or not) within its timeout."""

    def __init__(self, clock, takes_s: float, waits: list):
        self.clock, self.takes_s, self.waits = clock, takes_s, waits

    def wait(self, timeout: datetime.timedelta | None = None):
        self.waits.append(timeout.total_seconds())
        spent = min(self.takes_s, timeout.total_seconds())
        self.clock.now += spent
        return self.takes_s <= timeout.total_seconds()


def test_finish_waits_for_every_bucket_under_one_deadline_not_a_timeout_each(monkeypatch):
    clock = FakeClock(0.0)
    monkeypatch.setattr(faults, "time", types.SimpleNamespace(monotonic=clock.monotonic))
    waits, completed = [], []
    # 10 s for the whole step: bucket 0 takes 4 s, bucket 1 would take 7 s (6 s are left), bucket 2 1 s.
    states = [types.SimpleNamespace(work=FakeWork(clock, s, waits), index=i) for i, s in enumerate((4.0, 7.0, 1.0))]
    failed, error = faults.wait_in_order(states, timeout_s=10.0, enforced_by_backend=False,
                                         on_complete=lambda st: completed.append(st.index))
    assert waits == [pytest.approx(10.0), pytest.approx(6.0)]   # the second wait gets what is left
    assert clock.now == pytest.approx(10.0)                     # given up at the deadline, not at 4 + 10 s
    assert completed == [0] and [st.index for st in failed] == [1, 2]
    assert "within timeout=10 s" in str(error)
