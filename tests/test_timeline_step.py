"""`StepTimeline` on CPU, one step of two micro-batches on a scripted host clock: every field and span.

The clock returns the times below, one per read, in the order the trainer marks a step; each
expected number is read off this script (ms):

    begin_step 0 (the step's mark), 0 (the data wait's start); data_ready 2
    micro-batch 1: forward 2-5, backward 5-9; micro-batch 2: forward 10-13, backward 13-17
    optimizer 20-24 (finish() waited 17-20; its windows: 9-10 and 17-20, 4 ms)
    GradSync: bucket 0 busy 6-12 (6 ms), 3 ms of it exposed
"""

from __future__ import annotations

import math

import pytest

import hfstream.report.timeline as timeline
from hfstream.report.timeline import StepTimeline, combine_ranks, summarize

READS_MS = [0.0, 0.0, 2.0, 2.0, 5.0, 9.0, 10.0, 13.0, 17.0, 20.0, 24.0]


def _step(monkeypatch, tl, step=1, offset_ms=0.0, tuning=False, scale=1.0, **gathers):
    """One step of the script above, ``scale`` times as long, from ``offset_ms`` on."""
    clock = iter(READS_MS)
    monkeypatch.setattr(timeline.time, "perf_counter", lambda: (scale * next(clock) + offset_ms) * 1e-3)
    at = lambda ms: (scale * ms + offset_ms) * 1e-3  # noqa: E731
    tl.begin_step(step, tuning=tuning) if tuning else tl.begin_step(step)
    tl.data_ready()
    for _ in range(2):
        tl.forward_start()
        tl.forward_end()
        tl.backward_end()
    tl.add_comm(comm_busy_ms=6.0, exposed_comm_ms=3.0, bucket_spans=[(0, at(6.0), at(12.0))],
                exposed_span=(at(17.0), at(20.0)), **gathers)
    tl.optimizer_start()
    tl.end_step()


def test_one_step_of_two_micro_batches_gives_each_part_and_the_ceiling(monkeypatch):
    tl = StepTimeline(rank=3)
    _step(monkeypatch, tl)
    (rec,) = tl.records
    assert (rec.step, rec.data_wait_ms, rec.forward_ms, rec.backward_ms, rec.comm_busy_ms, rec.exposed_comm_ms,
            rec.optimizer_ms, rec.step_ms) == pytest.approx((1, 2.0, 6.0, 8.0, 6.0, 3.0, 4.0, 24.0))
    assert rec.ideal_ms == pytest.approx(6.0 + 8.0 + 4.0)          # forward + max(backward, busy) + optimizer
    assert rec.efficiency == pytest.approx(18.0 / 24.0) and rec.overlap == pytest.approx(0.5)
    assert not rec.sharded and math.isnan(rec.cross_step_limit_ms) and math.isnan(rec.reduce_scatter_busy_ms)
    spans = sorted((lane, name, round(a * 1e3, 6), round(b * 1e3, 6)) for r, lane, name, a, b in tl.last_spans()
                   if r == 3)
    assert spans == sorted([
        ("data", "data wait", 0.0, 2.0),
        ("compute", "forward", 2.0, 5.0), ("compute", "backward", 5.0, 9.0),
        ("compute", "forward", 10.0, 13.0), ("compute", "backward", 13.0, 17.0),
        ("compute", "exposed comm", 17.0, 20.0), ("compute", "optimizer", 20.0, 24.0),
        ("comm", "bucket 0", 6.0, 12.0)])
    assert tl.last_step == 1


def test_sharded_gathers_are_communication_taken_out_of_the_forward(monkeypatch):
    tl = StepTimeline()
    _step(monkeypatch, tl, all_gather_busy_ms=2.0, all_gather_exposed_ms=1.0,
          all_gather_spans=[(0, 1e-3, 3e-3)])
    (rec,) = tl.records
    assert rec.sharded and rec.forward_ms == pytest.approx(5.0)      # the forward's 1 ms wait is comm
    assert (rec.comm_busy_ms, rec.exposed_comm_ms) == pytest.approx((8.0, 4.0))
    assert (rec.reduce_scatter_busy_ms, rec.reduce_scatter_exposed_ms) == pytest.approx((6.0, 3.0))
    assert rec.cross_step_limit_ms == pytest.approx(max(5.0 + 8.0 + 4.0, 8.0))
    assert rec.efficiency == pytest.approx(17.0 / 24.0)
    assert ("comm", "gather 0", 1.0, 3.0) in [(lane, n, a * 1e3, b * 1e3) for _, lane, n, a, b in tl.last_spans()]


def test_summaries_skip_the_warmup_steps_and_average_ranks(monkeypatch):
    tl = StepTimeline()
    _step(monkeypatch, tl, step=1)
    _step(monkeypatch, tl, step=2, offset_ms=100.0)
    assert [r.step for r in tl.records] == [1, 2]
    one = tl.summary()                       # warmup 1: step 2 only
    assert one["steps"] == 1 and one["step_ms"] == pytest.approx(24.0)
    assert tl.summary(since_step=0)["steps"] == 2
    assert summarize(list(tl.records), warmup=5)["steps"] == 2   # fewer steps than the warmup: all of them
    assert summarize([], warmup=1) == {}
    other = dict(one, step_ms=36.0, steps=3.0)
    both = combine_ranks([one, {}, other])
    assert both["step_ms"] == pytest.approx(30.0) and both["steps"] == pytest.approx(2.0)
    assert both["efficiency"] == pytest.approx(both["ideal_ms"] / both["step_ms"])
    assert "all_gather_busy_ms" not in both
    assert combine_ranks([{}, {}]) == {}


def test_tuning_steps_stay_out_of_the_mean_and_are_reported_apart(monkeypatch):
    # Steps 1-4 ran while grad_bucket_mb="auto" tried caps (48 ms each), 5-7 on the cap it kept (24 ms);
    # step 1 is the warm-up, in neither.
    from hfstream.report.format import format_report

    tl = StepTimeline()
    for step in range(1, 8):
        _step(monkeypatch, tl, step=step, offset_ms=100.0 * step, tuning=step <= 4, scale=2.0 if step <= 4 else 1.0)
    one = tl.summary()                       # warm-up: step 1
    assert one["steps"] == 3 and one["step_ms"] == pytest.approx(24.0)
    assert one["efficiency"] == pytest.approx(18.0 / 24.0)
    assert (one["tuning_steps"], one["tuning_step_ms"], one["tuning_in_mean"]) == (3.0, pytest.approx(48.0), False)
    both = combine_ranks([one, one])
    assert both["steps"] == 3 and both["tuning_steps"] == 3 and both["tuning_step_ms"] == pytest.approx(48.0)
    text = format_report({"mean": both, "per_rank": [one, one]})
    assert text.splitlines()[:2] == [
        "hfstream step report (mean of 3 steps after warm-up, 2 ranks)",
        "  tuning: 3 steps while grad_bucket_mb='auto' tried caps, 48.00 ms a step, not in the mean"]


def test_a_run_that_only_tuned_reports_the_tuning_steps_as_its_mean_and_says_so(monkeypatch):
    from hfstream.report.format import format_report

    tl = StepTimeline()
    for step in range(1, 4):
        _step(monkeypatch, tl, step=step, offset_ms=100.0 * step, tuning=True)
    only = tl.summary()
    assert only["steps"] == 2 and only["tuning_steps"] == 2 and only["tuning_in_mean"] is True
    assert "2 steps while grad_bucket_mb='auto' tried caps, 24.00 ms a step, and no step after them: the mean is " \
           "theirs" in format_report(only)
    plain = StepTimeline()                   # no tuning: the report's keys as ever
    _step(monkeypatch, plain, step=1)
    assert not any(key.startswith("tuning") for key in plain.summary(warmup=0))
    assert "tuning" not in format_report(plain.summary(warmup=0))
