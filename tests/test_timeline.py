"""The step report is consistent: parts add up to the step, exposed comm never exceeds comm
busy, the ceiling is never above the step, spans and pictures are produced."""

import dataclasses
import math
import types

import pytest
import torch

from hfstream import StreamTrainer, StreamTrainingArguments
from hfstream.cli.plot import plot_breakdown, plot_loss, plot_timeline
from hfstream.gradsync.stats import StepTimes
from hfstream.report.fields import FIELDS, KEYS, MEASURED, SHARDED_ONLY
from hfstream.report.format import format_report
from hfstream.report.timeline import StepRecord, StepTimeline, StreamReport, summarize
from tiny import lm_dataset, tiny_causal_lm, train_args


def test_ceiling_and_ratios_from_a_record():
    r = StepRecord(step=1, data_wait_ms=5, forward_ms=10, backward_ms=20, comm_busy_ms=30, exposed_comm_ms=12,
                   optimizer_ms=3, step_ms=50)
    assert r.ideal_ms == 10 + 30 + 3
    assert r.efficiency == pytest.approx(43 / 50)
    assert r.overlap == pytest.approx(1 - 12 / 30)
    native = StepRecord(step=1, data_wait_ms=0, forward_ms=10, backward_ms=20, comm_busy_ms=math.nan,
                        exposed_comm_ms=0, optimizer_ms=3, step_ms=40)
    assert native.ideal_ms == 33 and math.isnan(native.overlap)


def test_summary_skips_warmup_and_recomputes_ratios():
    recs = [StepRecord(i, 0, 10, 20, 5, 1, 2, 100 if i == 0 else 40) for i in range(5)]
    s = summarize(recs, warmup=1)
    assert s["steps"] == 4 and s["step_ms"] == 40 and s["efficiency"] == pytest.approx(s["ideal_ms"] / s["step_ms"])
    assert "efficiency" in format_report(s) and summarize([], 1) == {}


def test_timeline_ring_is_bounded():
    tl = StepTimeline(capacity=3, span_capacity=2)
    for step in range(10):
        tl.begin_step(step)
        tl.data_ready()
        tl.forward_start()
        tl.forward_end()
        tl.backward_end()
        tl.optimizer_start()
        tl.end_step()
    assert [r.step for r in tl.records] == [7, 8, 9]
    assert len(tl.spans) == 2 and {s[2] for s in tl.last_spans(2)} >= {"forward", "backward", "optimizer"}


def test_step_without_compute_is_not_recorded():
    tl = StepTimeline()
    tl.begin_step(1)
    tl.data_ready()
    tl.end_step()                     # e.g. the epoch ran out of batches
    assert not tl.records


def test_trainer_report_parts_add_up(tmp_path):
    trainer = StreamTrainer(model=tiny_causal_lm(), train_dataset=lm_dataset(),
                            args=train_args(StreamTrainingArguments, tmp_path, max_steps=12,
                                            gradient_accumulation_steps=2, prefetch_depth=2))
    trainer.train()
    report = trainer.stream_report()
    shares = []
    for rec in list(trainer._timeline.records)[1:]:
        parts = rec.data_wait_ms + rec.forward_ms + rec.backward_ms + rec.exposed_comm_ms + rec.optimizer_ms
        # What is left is the Trainer's own bookkeeping between micro-steps (loss accumulation,
        # callbacks): small, never negative beyond clock resolution.
        assert parts <= rec.step_ms * 1.001 + 0.05
        assert rec.ideal_ms <= rec.step_ms * 1.001 + 0.05
        shares.append(parts / rec.step_ms)
    # Most of a step is in its parts; judged on the median, since one step preempted by another
    # process on a loaded machine spends its extra time in the bookkeeping between the marks.
    assert sorted(shares)[len(shares) // 2] >= 0.6, shares
    mean = report["mean"]
    assert mean["steps"] == 11 and 0 < mean["efficiency"] <= 1.0
    assert "hfstream step report" in str(report) and report.to_json().count("NaN") == 0
    spans = report["spans"]
    assert {s[1] for s in spans} >= {"data", "compute"} and all(s[4] >= s[3] for s in spans)
    for fn, arg, name in ((plot_breakdown, report, "b.png"), (plot_timeline, spans, "t.png"),
                          (plot_loss, trainer.state.log_history, "l.png")):
        assert fn(arg, tmp_path / name).stat().st_size > 5_000


def _overlap_report(rank, world_size, tmp):
    trainer = StreamTrainer(model=tiny_causal_lm(), train_dataset=lm_dataset(),
                            args=train_args(StreamTrainingArguments, tmp, max_steps=8, grad_sync="overlap",
                                            grad_bucket_mb=0.01))
    trainer.train()
    return dict(trainer.stream_report()), [r.as_dict() for r in trainer._timeline.records]


@pytest.mark.multiprocess
def test_two_rank_report_has_comm(tmp_path, run_distributed):
    for report, records in run_distributed(_overlap_report, 2, str(tmp_path), init_process_group=False, timeout=240):
        assert len(report["per_rank"]) == 2
        assert {s[0] for s in report["spans"]} == {0, 1} and any(s[1] == "comm" for s in report["spans"])
        for rec in records:
            assert rec["comm_busy_ms"] > 0
            assert rec["exposed_comm_ms"] <= rec["comm_busy_ms"]
            assert 0.0 <= rec["overlap"] <= 1.0
            parts = sum(rec[k] for k in ("data_wait_ms", "forward_ms", "backward_ms", "exposed_comm_ms", "optimizer_ms"))
            assert 0.6 * rec["step_ms"] <= parts <= rec["step_ms"] * 1.001 + 0.05


def _auto_report(rank, world_size, tmp):
    trainer = StreamTrainer(model=tiny_causal_lm(), train_dataset=lm_dataset(),
                            args=train_args(StreamTrainingArguments, tmp, max_steps=10, grad_sync="overlap",
                                            grad_bucket_mb="auto"))
    trainer.train()
    return dict(trainer.stream_report()), [r.as_dict() for r in trainer._timeline.records], trainer.grad_sync.tuning_result.steps


@pytest.mark.multiprocess
def test_a_two_rank_run_with_auto_buckets_leaves_its_tuning_steps_out_of_the_mean(tmp_path, run_distributed):
    runs = run_distributed(_auto_report, 2, str(tmp_path), init_process_group=False, timeout=240)
    for rank, (report, records, tuned) in enumerate(runs):
        assert 1 < tuned < 10
        mine = report["per_rank"][rank]
        after = [r["step_ms"] for r in records if r["step"] > tuned]   # steps 1..tuned tried caps
        assert mine["steps"] == len(after) and mine["step_ms"] == pytest.approx(sum(after) / len(after))
        assert mine["tuning_steps"] == tuned - 1 and not mine["tuning_in_mean"]   # the first step is the warm-up
        assert report["mean"]["steps"] == len(after) and report["mean"]["tuning_steps"] == tuned - 1
        assert f"tuning: {tuned - 1} steps while grad_bucket_mb='auto' tried caps" in str(StreamReport.from_dict(report))


def _host_clock(monkeypatch, reads_ms):
    import hfstream.report.timeline as timeline

    clock = iter(reads_ms)   # ms, one per clock read, in step order
    monkeypatch.setattr(timeline.time, "perf_counter", lambda: next(clock) * 1e-3)


def _step_with_comm(tl, **comm):
    tl.begin_step(1)        # two clock reads: the step's mark and the data wait's start
    tl.data_ready()
    tl.forward_start()
    tl.forward_end()
    tl.backward_end()
    tl.add_comm(**comm)
    tl.optimizer_start()
    tl.end_step()
    (rec,) = tl.records
    return rec


def test_sync_work_beyond_comm_busy_counts_as_backward(monkeypatch):
    _host_clock(monkeypatch, [0.0, 0.0, 0.0, 0.0, 1.0, 2.0, 7.0, 8.0])   # finish() takes 5 ms
    rec = _step_with_comm(StepTimeline(), comm_busy_ms=2.0, exposed_comm_ms=5.0)   # 3 ms of packing/copy-back
    assert rec.exposed_comm_ms == 2.0 and rec.backward_ms == pytest.approx(1.0 + 3.0)


def test_exposed_time_never_extends_past_the_finish_window(monkeypatch):
    """Stats that claim more exposed time than the step spent between backward and optimizer
    (a clock on another stream or device) are cut to that window: the parts never pass the step."""
    _host_clock(monkeypatch, [0.0, 0.0, 0.0, 0.0, 1.0, 2.0, 2.5, 3.0])   # finish() window: 0.5 ms
    rec = _step_with_comm(StepTimeline(), comm_busy_ms=5.0, exposed_comm_ms=0.79)
    parts = rec.data_wait_ms + rec.forward_ms + rec.backward_ms + rec.exposed_comm_ms + rec.optimizer_ms
    assert rec.exposed_comm_ms == pytest.approx(0.5) and parts <= rec.step_ms + 1e-9, (parts, rec)


def test_run_figures_leave_the_backend_alone(tmp_path):
    """Drawing a figure never switches matplotlib's backend (a notebook's inline one stays)."""
    import matplotlib

    before = matplotlib.get_backend()
    matplotlib.use("svg")          # not Agg, so a switch to Agg would show
    try:
        row = {"data_wait_ms": 1.0, "forward_ms": 2.0, "backward_ms": 3.0, "exposed_comm_ms": 0.5,
               "optimizer_ms": 1.0, "ideal_ms": 6.0}
        plot_breakdown({"mean": row, "per_rank": [row, row]}, tmp_path / "b.png")
        plot_loss([{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}], tmp_path / "l.png")
        plot_timeline([[0, "compute", "forward", 0.0, 0.002]], tmp_path / "t.png")
        assert all((tmp_path / f).read_bytes()[:4] == b"\x89PNG" for f in ("b.png", "l.png", "t.png"))
        assert matplotlib.get_backend() == "svg"
    finally:
        matplotlib.use(before)


def test_a_steps_parts_never_sum_past_the_step_when_the_host_is_preempted(monkeypatch):
    """The thread is preempted for 1 ms right as the step begins: the data wait stays inside the step."""
    import hfstream.report.timeline as timeline

    clock = iter([0.0, 1.0, 2.0, 2.0, 3.0, 4.0, 4.0, 5.0])   # ms, one per clock read, in step order
    monkeypatch.setattr(timeline.time, "perf_counter", lambda: next(clock) * 1e-3)
    tl = StepTimeline()
    tl.begin_step(1)        # two reads: the step's mark and the data wait's start, 1 ms apart
    tl.data_ready()
    tl.forward_start()
    tl.forward_end()
    tl.backward_end()
    tl.add_comm(comm_busy_ms=5.0, exposed_comm_ms=0.0)
    tl.optimizer_start()
    tl.end_step()
    (rec,) = tl.records
    parts = rec.data_wait_ms + rec.forward_ms + rec.backward_ms + rec.exposed_comm_ms + rec.optimizer_ms
    assert rec.data_wait_ms > 0 and parts <= rec.step_ms, (parts, rec)


# -- one table of fields, one vocabulary ---------------------------------------------------------

def test_every_report_key_is_one_row_of_the_field_table():
    """The record's measured fields, the derived ones, the summary's keys and the printed rows all
    come from one table; a row's label is its key without the unit, so the table reads like the logs."""
    assert {f.name for f in dataclasses.fields(StepRecord)} - {"step"} == set(MEASURED)
    rec = StepRecord(1, 1, 10, 20, 30, 12, 3, 50, all_gather_busy_ms=8, all_gather_exposed_ms=2)
    assert set(rec.as_dict()) == {"step", *KEYS}
    assert set(summarize([rec], warmup=0)) == {"steps", *KEYS}
    plain = summarize([StepRecord(1, 1, 10, 20, 30, 12, 3, 50)], warmup=0)
    assert set(plain) == {"steps", *KEYS} - set(SHARDED_ONLY)
    assert len(set(KEYS)) == len(KEYS) and len({f.label for f in FIELDS}) == len(FIELDS)
    for f in FIELDS:
        assert f.label.replace("-", "_").replace(" ", "_") + ("_ms" if f.unit == "ms" else "") == f.key
        assert f.source in ("measured", "derived") and f.modes in ("all", "comm", "sharded") and f.meaning
    rows = [line[2:].split("  ")[0] for line in format_report(summarize([rec], warmup=0)).splitlines()[1:]]
    assert rows[:len(FIELDS)] == [f.label for f in FIELDS]


def test_advice_is_printed_under_the_table():
    report = {"mean": summarize([StepRecord(1, 1, 10, 20, 30, 12, 3, 50)], warmup=0), "notes": ["a note"],
              "advice": [{"setting": "prefetch_depth", "value": 2, "predicted_step_ms": 41.5,
                          "reason": "the step waited 9.0 ms for data"}]}
    lines = format_report(report).splitlines()
    assert lines[-2:] == ["  advice: set prefetch_depth=2 (predicted 41.50 ms)", "      the step waited 9.0 ms for data"]
    assert lines[-3] == "  note: a note" and "advice" not in format_report({"mean": report["mean"]})


# -- an accelerator's events, faked: resolve() never waits, spans share one reference -------------

class FakeGPU:
    """A device whose clock (ms) the test moves; events complete once ``finished`` reaches them."""

    def __init__(self):
        self.now, self.finished, self.waits = 0.0, -1.0, 0

    def event(self, at=None):
        ev = FakeEvent(self)
        ev.t = self.now if at is None else at
        return ev


class FakeEvent:
    def __init__(self, gpu):
        self.gpu, self.t = gpu, None

    def record(self, stream=None):
        self.t = self.gpu.now

    def query(self):
        return self.t <= self.gpu.finished

    def synchronize(self):
        if not self.query():
            self.gpu.waits += 1
            self.gpu.finished = self.t

    def elapsed_time(self, other):
        assert self.query() and other.query(), "elapsed_time of an event not completed"
        return other.t - self.t


def _device_timeline(monkeypatch, gpu, device=torch.device("cuda", 1)):
    """A timeline on ``device`` whose events are ``gpu``'s; ``gpu.devices`` collects where each was recorded."""
    import hfstream.report.timeline as timeline

    gpu.devices = []
    monkeypatch.setattr(timeline, "streams", types.SimpleNamespace(
        new_event=lambda device, enable_timing=False: FakeEvent(gpu),
        current_stream=lambda device: gpu.devices.append(device)))
    tl = StepTimeline(device=device)
    assert tl._clock.device_events
    return tl


def _device_step(tl, gpu, step, comm=None):
    tl.begin_step(step)
    tl.data_ready()
    tl.forward_start()
    gpu.now += 3
    tl.forward_end()
    gpu.now += 5
    tl.backward_end()
    if comm is not None:
        tl.add_comm_later(comm)
    tl.optimizer_start()
    gpu.now += 2
    tl.end_step()


def test_resolve_never_waits_on_an_unfinished_step(monkeypatch):
    gpu = FakeGPU()
    tl = _device_timeline(monkeypatch, gpu)
    for step in range(1, 41):
        _device_step(tl, gpu, step)
        gpu.finished = gpu.now - 15          # the device runs a step and a half behind the host
    assert gpu.waits == 0
    resolved = [r.step for r in tl.records]
    assert resolved == list(range(1, len(resolved) + 1)) and 30 <= len(resolved) < 40   # in order, lagging
    assert tl.summary(wait=False)["steps"] == 38 - 1 and gpu.waits == 0    # the periodic log: steps 39, 40 run
    assert tl.last_step == 38
    # A step whose GradSync events have not completed waits in turn, and so do the steps after it.
    comm = LateStats()
    _device_step(tl, gpu, 41, comm=comm)
    _device_step(tl, gpu, 42)
    gpu.finished = gpu.now
    tl.resolve()
    assert tl.last_step == 40 and gpu.waits == 0
    comm.done = True
    tl.resolve()
    assert tl.last_step == 42 and tl.records[-2].comm_busy_ms == 1.0
    # The report at the end of training waits, once, for whatever is left.
    _device_step(tl, gpu, 43)
    assert tl.summary(warmup=0)["steps"] == 43 and tl.last_step == 43 and gpu.waits == 1


class LateStats:
    """A step's `GradSync.stats_deferred()`: complete when the test says so."""

    done = False

    def ready(self):
        return self.done

    def place_from(self, host_time, event):
        pass

    def __call__(self):
        assert self.done, "read before its events completed"
        return types.SimpleNamespace(comm_busy_ms=1.0, exposed_comm_ms=0.0, bucket_spans=[])


def test_spans_are_placed_from_one_reference_per_step(monkeypatch):
    """The host launched the bucket 2 ms into the step while the device ran it 15 ms in (the host runs
    ahead): the comm span is drawn where the device ran it, on the compute spans' clock."""
    gpu = FakeGPU()
    tl = _device_timeline(monkeypatch, gpu)
    gpu.now = 100.0
    tl.begin_step(1)
    host_start = tl._cur.host_start
    tl.data_ready()
    tl.forward_start()
    gpu.now = 110.0
    tl.forward_end()
    gpu.now = 130.0
    tl.backward_end()
    # GradSync's events: the bucket on the comm stream from 115 to 135, the compute stream's stall
    # in finish() from 130 to 135; host times of the launch and the wait as the host saw them.
    launches = [(0, "dev", host_start + 0.002, None, gpu.event(115.0), gpu.event(135.0))]
    waits = {"dev": (gpu.event(130.0), gpu.event(135.0))}
    stats = StepTimes(launches, (host_start + 0.003, host_start + 0.004), waits, 1, None)
    tl.add_comm_later(stats, (host_start + 0.003, host_start + 0.004))
    gpu.now = 135.0
    tl.optimizer_start()
    gpu.now = 140.0
    tl.end_step()
    assert not tl.records                       # not complete yet: nothing was waited for
    gpu.finished = 140.0
    spans = {name: (round((a - host_start) * 1e3, 6), round((b - host_start) * 1e3, 6))
             for _, _, name, a, b in tl.last_spans(wait=False)}
    assert spans["forward"] == (0.0, 10.0) and spans["backward"] == (10.0, 30.0)
    assert spans["bucket 0"] == (15.0, 35.0)                 # not at the host's launch, 2 ms in
    assert spans["exposed comm"] == (30.0, 35.0) and spans["optimizer"] == (35.0, 40.0)
    (rec,) = tl.records
    assert rec.comm_busy_ms == pytest.approx(20.0) and rec.exposed_comm_ms == 5.0 and rec.step_ms == 40.0
    assert gpu.waits == 0
    # Every mark went to the model's device's stream (cuda:1), not to the current device's: GradSync's
    # events for finish() are there, so the exposed time and the step's windows share one stream.
    assert gpu.devices and set(gpu.devices) == {torch.device("cuda", 1)}


def test_design_doc_names_every_field_of_the_report():
    """docs/design.md section 4 maps each name to its meaning: every key, as the table prints it."""
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "design.md").read_text()
    section = doc[doc.index("## 4. "):doc.index("## 5. ")]
    for f in FIELDS:
        assert f"| `{f.key}` | {f.label} |" in section, f.key


def test_a_step_under_a_millisecond_has_an_efficiency():
    from hfstream.report.timeline import StepRecord

    fast = StepRecord(step=0, data_wait_ms=0.0, forward_ms=0.2, backward_ms=0.3, comm_busy_ms=0.1,
                      exposed_comm_ms=0.0, optimizer_ms=0.1, step_ms=0.8)
    assert fast.efficiency == pytest.approx(0.6 / 0.8)
    assert math.isnan(StepRecord(0, 0.0, 0.0, 0.0, math.nan, 0.0, 0.0, 0.0).efficiency)


def test_a_steps_communication_adds_up_over_the_stats_it_is_given():
    from hfstream.report.timeline import _add_comm, _PendingStep

    p = _PendingStep(step=3)
    _add_comm(p, 4.0, 1.0, [(0, 0.0, 0.004)], math.nan, math.nan, ())
    _add_comm(p, 2.5, 0.5, [(1, 0.004, 0.0065)], 1.5, 0.25, [(0, 0.0, 0.0015)])
    assert (p.comm_busy_ms, p.exposed_comm_ms) == (6.5, 1.5)   # NaN where not measured, until a number comes
    assert (p.all_gather_busy_ms, p.all_gather_exposed_ms) == (1.5, 0.25)
    assert [name for name, *_ in p.comm_spans] == ["bucket 0", "bucket 1", "gather 0"]


def test_host_intervals_cover_the_data_wait_forward_and_backward_in_order(monkeypatch):
    # What the advice reads of the host's time (`measure_data_side`): each part of a step, in order,
    # with the thread's CPU time in it (clocks that tick at each read).
    import itertools

    import hfstream.report.timeline as timeline_module
    walls, cpus = itertools.count(10.0, 0.125), itertools.count(1.0, 0.0625)
    monkeypatch.setattr(timeline_module.time, "perf_counter", lambda: next(walls))
    monkeypatch.setattr(timeline_module.time, "thread_time", lambda: next(cpus))
    tl = StepTimeline()
    tl.begin_step(1)
    start = tl._cur.host_start
    tl.data_ready()
    tl.forward_start()
    tl.forward_end()
    tl.backward_end()
    assert [kind for kind, *_ in tl.host_intervals] == ["data", "forward", "backward"], tl.host_intervals
    (_, d0, d1, dcpu), (_, f0, f1, fcpu), (_, b0, b1, bcpu) = tl.host_intervals
    assert d0 == start < d1 <= f0 < f1 == b0 < b1
    assert dcpu > 0 and fcpu > 0 and bcpu > 0 and dcpu % 62.5 == 0   # whole ticks of the CPU clock, in ms


def _spin(ms: float) -> None:
    """Spend ``ms`` of this thread's CPU time."""
    import time

    end = time.thread_time() + ms / 1e3
    while time.thread_time() < end:
        pass


def _on_another_thread(fn) -> None:
    import threading

    t = threading.Thread(target=fn)   # a fresh thread: its own CPU clock is near zero
    t.start()
    t.join()


def test_marks_taken_on_the_autograd_engines_thread_count_the_training_threads_cpu_time():
    # On an accelerator the engine runs backward's final callback on its device thread: GradSync's,
    # which marks the backward's end (and, with a further backward in the step, the next forward's
    # start). The interval's CPU time is still the training thread's, on one clock at both ends,
    # whichever thread built the timeline.
    built = []
    _on_another_thread(lambda: built.append(StepTimeline()))
    tl = built[0]
    tl.begin_step(1)
    tl.data_ready()
    tl.forward_start()
    tl.forward_end()
    _spin(30.0)                             # the backward, on the training thread
    _on_another_thread(tl.backward_end)
    _on_another_thread(tl.forward_start)    # a second forward of the step (FGM, SAM) opened there too
    _spin(20.0)
    tl.forward_end()
    (kind, b0, b1, backward_cpu), (kind2, f0, f1, forward_cpu) = list(tl.host_intervals)[-2:]
    assert (kind, kind2) == ("backward", "forward")
    assert 29.0 <= backward_cpu <= (b1 - b0) * 1e3 + 1.0, (backward_cpu, (b1 - b0) * 1e3)
    assert 19.0 <= forward_cpu <= (f1 - f0) * 1e3 + 1.0, (forward_cpu, (f1 - f0) * 1e3)


def test_without_a_clock_for_another_thread_an_interval_marked_there_has_no_cpu_time(monkeypatch):
    import time

    monkeypatch.delattr(time, "pthread_getcpuclockid")   # not Unix
    tl = StepTimeline()
    tl.begin_step(1)
    tl.data_ready()
    tl.forward_start()
    tl.forward_end()
    _on_another_thread(tl.backward_end)
    (_, _, _, forward_cpu), (kind, _, _, backward_cpu) = list(tl.host_intervals)[-2:]
    assert kind == "backward" and math.isnan(backward_cpu) and forward_cpu >= 0


class PlacedLater(LateStats):
    """`LateStats`, complete, that also records where it was placed from."""

    done = True

    def __init__(self):
        self.placed = []

    def place_from(self, host_time, event):
        self.placed.append((host_time, event))


def test_deferred_stats_are_placed_on_the_device_clock_only_where_there_are_device_events(monkeypatch):
    cpu = StepTimeline()
    cpu.begin_step(1)
    late = PlacedLater()
    cpu.add_comm_later(late)
    assert late.placed == []          # on CPU every span is a host time already
    gpu = FakeGPU()
    dev = _device_timeline(monkeypatch, gpu)
    dev.begin_step(1)
    late = PlacedLater()
    dev.add_comm_later(late)
    assert len(late.placed) == 1 and late.placed[0] == (dev._cur.host_start, dev._cur.start)


def test_the_reports_json_keeps_every_value_and_writes_unmeasured_ones_as_null():
    import json

    from hfstream.report.timeline import StreamReport

    row = {"step_ms": 12.5, "comm_busy_ms": math.nan, "steps": 3}
    report = StreamReport(mean=row, per_rank=[row, {**row, "step_ms": 13.0}], spans=[[0, "compute", "forward", 0.0, 1.5]],
                          grad_sync="overlap", notes=["a note"])
    back = json.loads(report.to_json())
    null = {**row, "comm_busy_ms": None}
    assert back == {"mean": null, "per_rank": [null, {**null, "step_ms": 13.0}],
                    "spans": [[0, "compute", "forward", 0.0, 1.5]], "grad_sync": "overlap", "notes": ["a note"]}


def test_a_step_without_an_optimizer_mark_counts_its_optimizer_time_from_the_last_backward(monkeypatch):
    # Two micro-steps; the step ends with no optimizer_start() (a caller of the timeline that does
    # not mark it): what follows the last backward is the optimizer's, not what follows the first.
    _host_clock(monkeypatch, [0.0, 0.0, 1.0, 1.0, 2.0, 4.0, 4.0, 5.0, 7.0, 10.0])
    tl = StepTimeline()
    tl.begin_step(1)          # the step's mark, the data wait's start
    tl.data_ready()           # 1.0
    for _ in range(2):
        tl.forward_start()    # 1.0, then 4.0
        tl.forward_end()      # 2.0, then 5.0
        tl.backward_end()     # 4.0, then 7.0
    tl.end_step()             # 10.0
    (rec,) = tl.records
    assert (rec.forward_ms, rec.backward_ms, rec.optimizer_ms, rec.step_ms) == (2.0, 4.0, 3.0, 10.0), rec
