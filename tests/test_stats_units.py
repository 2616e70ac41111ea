"""`gradsync/stats.py` without processes: what a step's communication cost, on the host clock and from events.

GradSync calls the recorder at each launch, completion and wait; these tests play those calls with
a scripted clock (CPU) or fake device events, and read back the `SyncStats` the report and the
timeline use. Written against the mutants of stats.py that the GradSync and timeline tests let
through (docs/design.md, "Mutation testing").
"""

import math
import types

import pytest
import torch

import hfstream.gradsync.stats as stats
from hfstream.gradsync.stats import StatsRecorder, StepTimes, union_length

CPU = torch.device("cpu")


@pytest.mark.parametrize("spans, want", [
    ([(0, 2), (1, 3), (5, 6)], 4.0),
    ([(5, 6), (0, 2), (1, 3)], 4.0),     # in any order
    ([(0, 10), (2, 3)], 10.0),           # nested
    ([(0, 1), (1, 2)], 2.0),             # touching
    ([(1, 4), (1, 4)], 3.0),             # the same span twice
    ([(2, 3)], 1.0),
    ([], 0.0),
])
def test_union_length(spans, want):
    assert union_length(spans) == want


def test_before_the_first_step_the_stats_are_of_nothing():
    rec = StatsRecorder()
    assert rec.launched_in_backward == 0
    assert rec.deferred().ready()
    s = rec.stats
    assert (s.comm_busy_ms, s.exposed_comm_ms, s.num_collectives, s.launched_in_backward) == (0.0, 0.0, 0, 0)
    assert s.bucket_spans == [] and s.finish_span == (0.0, 0.0)
    assert math.isnan(s.all_gather_busy_ms) and s.num_all_gathers == 0


class Clock:
    """``time.perf_counter`` as the test sets it (seconds)."""

    def __init__(self, monkeypatch):
        self.now = 100.0
        monkeypatch.setattr(stats.time, "perf_counter", lambda: self.now)


def _bucket(index, device=CPU):
    return types.SimpleNamespace(plan=types.SimpleNamespace(index=index, device=device),
                                 start_event=None, end_event=None, launch_time=None, end_time=None)


def test_a_cpu_step_reads_host_times_counts_the_launches_before_finish_and_the_wait_in_it(monkeypatch):
    clock, rec = Clock(monkeypatch), StatsRecorder()
    a, b, c = _bucket(0), _bucket(1), _bucket(2)
    for st, launch, done in ((a, 100.000, 100.004), (b, 100.002, 100.009)):
        clock.now = launch
        rec.launched(st, None)
        clock.now = done
        rec.completed(st)
    clock.now = 100.010
    t_enter, waits = rec.finish_entered([])
    assert (t_enter, waits) == (100.010, {})
    rec.launched(c, None)   # launched by finish(): not in backward
    clock.now = 100.013
    rec.completed(c)
    rec.finish_left([a, b, c], t_enter, 100.013, waits)
    s = rec.stats
    assert s.bucket_spans == [(0, 100.000, 100.004), (1, 100.002, 100.009), (2, 100.010, 100.013)]
    assert s.comm_busy_ms == pytest.approx(12.0)           # 0-9 and 10-13
    assert s.exposed_comm_ms == pytest.approx(3.0) and s.finish_span == (100.010, 100.013)
    assert s.num_collectives == 3 and s.launched_in_backward == rec.launched_in_backward == 2
    assert math.isnan(s.all_gather_busy_ms) and math.isnan(s.all_gather_exposed_ms) and s.num_all_gathers == 0
    assert rec.deferred().ready() and rec.deferred()() is s


def test_a_launch_at_the_instant_finish_starts_is_finishs_own():
    rec = StatsRecorder()
    st = _bucket(0)
    st.launch_time, st.end_time = 5.0, 6.0
    rec.finish_left([st], 5.0, 6.0, {})
    assert rec.launched_in_backward == 0


def _gather(rec, clock, index, launch, done, waited):
    clock.now = launch
    g = rec.gather_launching(index, CPU, events=False)
    fut = torch.futures.Future()
    rec.gather_launched(g, types.SimpleNamespace(get_future=lambda: fut))
    clock.now = done
    fut.set_result(None)   # the work completed: its callback notes the end
    g.waited = waited
    return g


def test_sharded_steps_carry_the_gathers_waited_for_and_keep_the_others_for_the_next(monkeypatch):
    clock, rec = Clock(monkeypatch), StatsRecorder()
    rec.record_gathers()
    g0 = _gather(rec, clock, 0, 100.000, 100.005, waited=True)
    rec.record_gathers()   # a second call keeps what is in flight
    _gather(rec, clock, 1, 100.001, 100.008, waited=False)
    assert g0.end_time == 100.005
    for entered_at, left_at in ((100.002, 100.004), (100.006, 100.007)):   # two forward waits: 2 + 1 ms
        clock.now = entered_at
        entered = rec.wait_entered(CPU, events=False)
        clock.now = left_at
        rec.wait_left(CPU, entered)
    rec.finish_left([], 100.01, 100.01, {})
    s = rec.stats
    assert s.num_all_gathers == 1 and s.all_gather_spans == [(0, 100.000, 100.005)]
    assert s.all_gather_busy_ms == pytest.approx(5.0) and s.all_gather_exposed_ms == pytest.approx(3.0)
    # The next step: the gather left in flight, now waited for, and no wait of its own.
    rec._gathers[0].waited = True
    rec.finish_left([], 100.02, 100.02, {})
    s = rec.stats
    assert s.all_gather_spans == [(1, 100.001, 100.008)] and s.all_gather_exposed_ms == 0.0
    rec.finish_left([], 100.03, 100.03, {})
    assert rec.stats.num_all_gathers == 0 and rec.stats.all_gather_busy_ms == 0.0


# -- an accelerator's events, faked ----------------------------------------------------------------

class Device:
    """A device clock (ms) the test moves; an event completes once ``finished`` reaches it."""

    def __init__(self, name):
        self.name, self.now, self.finished = name, 0.0, math.inf


class Event:
    def __init__(self, dev):
        self.dev, self.t, self.synchronized = dev, None, 0

    def record(self, stream=None):
        self.t = self.dev.now

    def query(self):
        return self.t is not None and self.t <= self.dev.finished

    def synchronize(self):   # the host waits until the device has passed this event
        self.synchronized += 1
        self.dev.finished = max(self.dev.finished, self.t)

    def elapsed_time(self, other):
        if other.dev is not self.dev:
            raise RuntimeError("events of different devices")
        if not (self.query() and other.query()):   # CUDA: cudaErrorNotReady
            raise RuntimeError("elapsed_time of an event that has not completed")
        return other.t - self.t


@pytest.fixture
def devices(monkeypatch):
    found = {}

    def new_event(device, enable_timing=False):
        assert enable_timing
        return Event(found.setdefault(str(device), Device(str(device))))

    monkeypatch.setattr(stats, "streams", types.SimpleNamespace(new_event=new_event,
                                                                current_stream=lambda device: None))
    return found


def _device_bucket(rec, clock, devices, index, device, host_launch, t0, t1):
    st = _bucket(index, device)
    clock.now = host_launch
    dev = devices.setdefault(device, Device(device))
    dev.now = t0
    rec.launched(st, "side stream")
    dev.now = t1
    rec.completed(st)
    return st


def test_device_spans_are_placed_from_the_first_launch_or_the_steps_reference(monkeypatch, devices):
    clock, rec = Clock(monkeypatch), StatsRecorder()
    a = _device_bucket(rec, clock, devices, 0, "cuda:0", 100.000, 10.0, 14.0)
    b = _device_bucket(rec, clock, devices, 1, "cuda:0", 100.001, 12.0, 20.0)   # host time ignored: device times
    dev = devices["cuda:0"]
    dev.now = 18.0
    t_enter, waits = rec.finish_entered(["cuda:0"])
    dev.now = 20.0
    dev.finished = 19.0   # the device is behind: the step is not ready
    rec.finish_left([a, b], t_enter, 100.5, waits)
    times = rec.deferred()
    assert not times.ready()
    s = times()            # read anyway (the end of a run): it waits for the events, not fails on them
    assert times.ready()
    # Anchored at the first launch's host time (100 s) and event (10 ms): device times from there.
    assert [(i, round(x, 6), round(y, 6)) for i, x, y in s.bucket_spans] == [(0, 100.0, 100.004), (1, 100.002, 100.01)]
    assert s.comm_busy_ms == pytest.approx(10.0)
    assert s.exposed_comm_ms == pytest.approx(2.0)   # the compute stream's stall (18 -> 20), not the host's 500 ms
    assert s.finish_span is None                     # no reference: not placed


def test_a_reference_places_spans_and_the_stall_on_the_steps_clock(monkeypatch, devices):
    clock, rec = Clock(monkeypatch), StatsRecorder()
    dev = devices.setdefault("cuda:0", Device("cuda:0"))
    dev.now = 5.0
    step_start = Event(dev)
    step_start.record()
    a = _device_bucket(rec, clock, devices, 0, "cuda:0", 100.0, 10.0, 14.0)
    dev.now = 12.0
    t_enter, waits = rec.finish_entered(["cuda:0"])
    dev.now = 14.0
    rec.finish_left([a], t_enter, 100.1, waits)
    times = rec.deferred()
    times.place_from(50.0, step_start)   # the step began at host 50 s, device 5 ms
    s = times()
    assert [(i, round(x, 6), round(y, 6)) for i, x, y in s.bucket_spans] == [(0, 50.005, 50.009)]
    assert s.exposed_comm_ms == pytest.approx(2.0)
    assert tuple(round(x, 6) for x in s.finish_span) == (50.007, 50.009)
    times.place_from(0.0, step_start)    # once resolved, a later reference changes nothing
    assert times() is s


def test_another_devices_events_are_placed_from_their_own_first_launch(monkeypatch, devices):
    clock, rec = Clock(monkeypatch), StatsRecorder()
    here = devices.setdefault("cuda:0", Device("cuda:0"))
    here.now = 1.0
    reference = Event(here)
    reference.record()
    a = _device_bucket(rec, clock, devices, 0, "cuda:0", 100.0, 3.0, 4.0)
    b = _device_bucket(rec, clock, devices, 1, "cuda:1", 200.0, 50.0, 53.0)
    t_enter, waits = rec.finish_entered(["cuda:0", "cuda:1"])   # a side stream on each: a wait on each
    rec.finish_left([a, b], t_enter, t_enter, waits)
    times = rec.deferred()
    times.place_from(10.0, reference)
    spans = [(i, round(x, 6), round(y, 6)) for i, x, y in times().bucket_spans]
    assert spans == [(0, 10.002, 10.003), (1, 200.0, 200.003)]


def test_the_exposed_time_is_the_longest_stall_of_the_devices(monkeypatch, devices):
    clock, rec = Clock(monkeypatch), StatsRecorder()
    for name in ("cuda:0", "cuda:1"):
        devices.setdefault(name, Device(name))
    t_enter, waits = rec.finish_entered(["cuda:0", "cuda:1"])
    devices["cuda:0"].now, devices["cuda:1"].now = 1.0, 4.0
    rec.finish_left([], t_enter, t_enter, waits)
    assert rec.stats.exposed_comm_ms == 4.0
    assert all(after.synchronized == 1 for _, after in waits.values())


def test_device_gathers_and_the_forwards_stalls_for_them(monkeypatch, devices):
    clock, rec = Clock(monkeypatch), StatsRecorder()
    dev = devices.setdefault("cuda:0", Device("cuda:0"))
    rec.record_gathers()
    clock.now, dev.now = 100.0, 2.0
    g = rec.gather_launching(3, "cuda:0", events=True)
    fut = torch.futures.Future()
    rec.gather_launched(g, types.SimpleNamespace(get_future=lambda: fut))
    dev.now = 9.0
    fut.set_result(None)
    g.waited = True
    dev.now = 6.0
    entered = rec.wait_entered("cuda:0", events=True)
    dev.now = 9.5
    rec.wait_left("cuda:0", entered)
    rec.finish_left([], 100.1, 100.1, {})
    times = rec.deferred()
    dev.finished = 9.2
    assert not times.ready()   # the wait's end event is not complete yet
    dev.finished = math.inf
    s = times()
    assert s.num_all_gathers == 1 and s.all_gather_busy_ms == pytest.approx(7.0)
    assert s.all_gather_exposed_ms == pytest.approx(3.5)
    assert [(i, round(x, 6), round(y, 6)) for i, x, y in s.all_gather_spans] == [(3, 100.0, 100.007)]


def test_a_step_of_host_times_is_resolved_at_once_and_one_with_events_only_when_read(monkeypatch, devices):
    rec = StatsRecorder()
    rec.finish_left([], 1.0, 2.0, {})
    assert rec._last._stats is not None
    t_enter, waits = rec.finish_entered(["cuda:0"])
    rec.finish_left([], t_enter, t_enter, waits)
    assert rec._last._stats is None   # never waits on the device when it records
    assert StepTimes([], (0.0, 0.0), {}, 0, None)().num_collectives == 0
