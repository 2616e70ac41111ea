"""Advice from what the run measured (issue 30): the data side, the reasons for no advice, the unit of a
results-changing change, and bucket readiness from the run's own spans.

Synthetic means, facts and spans where the behaviour is the advice's logic; a real prefetch thread
and timeline where it is the measurement. No wall-clock thresholds: a CPU time is asserted only
where it is bounded by construction (a sleep spends none, a spin of 10 ms CPU spends at least 10).
"""

from __future__ import annotations

import math
import time

import pytest
import torch

from hfstream import StreamPrefetcher
from hfstream.report.advice import (CALIBRATION, CONTENTION_LOSS, EXPECTED_ERROR, MIN_SAVING, DataSide, RunFacts,
                                    advise, advise_report, comm_slowdown, measure_data_side, measured_ready)
from hfstream.cli.doctor import doctor
from hfstream.report.format import format_report
from hfstream.report.timeline import StepTimeline

DATA_BOUND = dict(data_wait_ms=40, forward_ms=10, backward_ms=15, optimizer_ms=5, exposed_comm_ms=0,
                  comm_busy_ms=float("nan"), step_ms=70)


# -- item 1: the data side, measured ----------------------------------------------------------------
def _spin(ms: float) -> None:
    """Spend ``ms`` of this thread's CPU time (however long that takes on a loaded machine)."""
    end = time.thread_time() + ms / 1e3
    while time.thread_time() < end:
        pass


class _Source:
    def __init__(self, work, n=6):
        self.work, self.n = work, n

    def __iter__(self):
        for i in range(self.n):
            self.work()
            yield {"x": torch.full((2,), float(i))}


def test_the_prefetch_thread_records_each_batchs_cpu_time_against_its_wall_time():
    sleeping = StreamPrefetcher(_Source(lambda: time.sleep(0.02)), device=torch.device("cpu"), depth=2)
    assert [int(b["x"][0]) for b in sleeping] == list(range(6))
    spinning = StreamPrefetcher(_Source(lambda: _spin(10.0)), device=torch.device("cpu"), depth=2)
    list(spinning)
    slept, spun = list(sleeping.stats.produced), list(spinning.stats.produced)
    assert len(slept) == len(spun) == 6
    for start, end, cpu in slept:       # a sleep waits: its CPU time is a small part of its wall time
        assert (end - start) * 1e3 >= 20.0 and cpu < 0.5 * (end - start) * 1e3
    assert all(cpu >= 9.5 for *_, cpu in spun)   # a spin computes: at least the 10 ms of CPU it spent
    assert measure_data_side((), slept).kind(spare_cores=0) == "waits"
    assert measure_data_side((), spun).cpu_ms >= 9.5


def test_the_timeline_measures_a_wait_in_the_step_itself_as_cpu_against_wall():
    tl = StepTimeline()
    for step in range(4):
        tl.begin_step(step)
        time.sleep(0.01)          # a loader that waits, in the step's own thread (prefetch_depth=0)
        tl.data_ready()
        tl.forward_start()
        tl.forward_end()
        tl.backward_end()
        tl.end_step()
    side = measure_data_side(tl.host_intervals)
    assert side.where == "step" and side.batches == 3 and side.wall_ms >= 10.0
    assert side.kind(spare_cores=0) == "waits", side


def test_a_waiting_producer_is_told_to_prefetch_even_without_a_spare_core():
    waits = DataSide("step", wall_ms=40.0, cpu_ms=1.0, batches=10)
    advice = advise(DATA_BOUND, RunFacts(grad_sync=None, prefetch_depth=0, spare_cores=0.0, data=waits))
    assert advice and advice[0]["setting"] == "prefetch_depth" and advice[0]["value"] == 2, advice
    assert "it waits" in advice[0]["reason"] and "1.0 ms of CPU in 40 ms" in advice[0]["reason"]


def test_a_computing_producer_without_a_spare_core_gets_no_advice_and_the_reason():
    computes = DataSide("step", wall_ms=40.0, cpu_ms=38.0, batches=10)
    why: list[str] = []
    assert advise(DATA_BOUND, RunFacts(grad_sync=None, prefetch_depth=0, spare_cores=0.0, data=computes), why) == []
    said = " ".join(why)
    assert "the loader computes" in said and "no spare core" in said and "38 ms of CPU in 40 ms" in said, why
    # With a core of its own, the same producer is prefetched.
    advice = advise(DATA_BOUND, RunFacts(grad_sync=None, prefetch_depth=0, spare_cores=1.0, data=computes))
    assert advice[0]["setting"] == "prefetch_depth"


def _gil_intervals():
    """Forward/backward intervals of the step's own thread: full CPU while no producer ran, 60 % while one did."""
    host, produced, t = [], [(99.0, 99.02, 20.0)], 100.0   # the first batch, before the steps (warm-up)
    for step in range(8):
        busy = step % 2 == 1
        for kind in ("forward", "backward"):
            wall = 0.020
            host.append((kind, t, t + wall, wall * 1e3 * (0.6 if busy else 1.0)))
            if busy:
                produced.append((t - 0.001, t + wall + 0.001, 20.0))   # a producer computing (20 of 22 ms)
            t += wall
        t += 0.005
    return host, produced


def test_a_producer_that_slows_the_steps_own_thread_is_told_to_use_worker_processes():
    host, produced = _gil_intervals()
    side = measure_data_side(host, produced)
    assert side.where == "thread" and side.share_with == pytest.approx(0.6) and side.share_without == pytest.approx(1.0)
    assert side.loss == pytest.approx(0.4) and side.loss >= CONTENTION_LOSS
    assert side.kind(spare_cores=1) == "holds_gil" and side.kind(spare_cores=0) == "contends"
    mean = dict(data_wait_ms=2, forward_ms=30, backward_ms=40, optimizer_ms=5, exposed_comm_ms=0,
                comm_busy_ms=float("nan"), step_ms=80)
    facts = RunFacts(grad_sync=None, prefetch_depth=2, spare_cores=2, cores_per_rank=2, data=side)
    advice = advise(mean, facts)
    assert advice[0]["setting"] == "dataloader_num_workers", advice
    assert "holds the GIL" in advice[0]["reason"] and "60% CPU while it ran" in advice[0]["reason"]
    # The step's compute lost 40 % of 70 ms; back in a worker process it is 42 ms again.
    assert advice[0]["model_step_ms"] == pytest.approx(80 - 2 - 0.4 * 70, abs=0.2)
    # No spare core: no worker processes, and the report says why.
    why: list[str] = []
    advice = advise(mean, RunFacts(grad_sync=None, prefetch_depth=2, spare_cores=0, data=side), why)
    assert "dataloader_num_workers" not in [a["setting"] for a in advice]
    assert any("no core for worker processes" in w for w in why), why


# -- item 4: say why not, and how sure ------------------------------------------------------------
def _report(mean, **kw):
    return {"mean": mean, "per_rank": [mean], "spans": [], "notes": [], **kw}


def test_no_advice_names_what_was_ruled_out_and_the_report_prints_it(tmp_path, capsys):
    at_ceiling = dict(data_wait_ms=0.2, forward_ms=30, backward_ms=60, optimizer_ms=5, exposed_comm_ms=0,
                      comm_busy_ms=float("nan"), step_ms=96, efficiency=95.0 / 96)
    report = advise_report(_report(at_ceiling), RunFacts(grad_sync=None, prefetch_depth=2, loadavg_1min=0.5, cores=2))
    assert report["advice"] == []
    said = " ".join(report["ruled_out"])
    assert "at the ceiling" in said and "one process, nothing to synchronise" in said, report["ruled_out"]
    assert report["load"]["loadavg_1min"] == 0.5 and report["load"]["per_core"] == 0.25
    assert not report["load"]["unreliable"]
    text = format_report(report)
    assert "no advice:" in text and "at the ceiling" in text and "load: 0.5 on 2 cores" in text
    assert all(len(line) <= 100 for line in text.splitlines())
    # The reason survives the trip through the report file and doctor.
    from hfstream.report.timeline import StreamReport

    (tmp_path / "stream_report.json").write_text(StreamReport.from_dict(report).to_json())
    capsys.readouterr()
    assert doctor(tmp_path) == 0
    out = capsys.readouterr().out
    assert "at the ceiling" in out and "no change of the candidates" not in out


def test_a_loaded_machine_is_recorded_and_named_among_the_reasons():
    report = advise_report(_report(dict(DATA_BOUND)), RunFacts(grad_sync=None, prefetch_depth=0, spare_cores=0,
                                                               loadavg_1min=12.0, cores=2))
    assert report["load"]["unreliable"] and report["load"]["per_core"] == 6.0
    assert any("the machine was loaded" in w for w in report["ruled_out"]), report["ruled_out"]
    assert "UNRELIABLE" in format_report(report)


def test_each_advice_says_its_expected_error_or_that_it_is_not_yet_measured():
    advice = advise(DATA_BOUND, RunFacts(grad_sync=None, prefetch_depth=0))
    assert advice and all("expected_error" in a for a in advice)
    first = advice[0]
    assert first["setting"] == "prefetch_depth" and first["expected_error"] == EXPECTED_ERROR["prefetch_depth=2"]
    text = " ".join(format_report(_report(DATA_BOUND, advice=advice)).split())
    assert f"expected error: {100 * EXPECTED_ERROR['prefetch_depth=2']:.0f} %" in text
    # A kind the sweep did not measure twice says so.
    facts = RunFacts(grad_sync="overlap", world_size=2, bucket_mb=float("inf"), plan=_plan(), samples_per_step=4,
                     wire_element_bytes=2, grad_element_bytes=2)
    acc = next(a for a in advise(COMM_BOUND, facts) if a["setting"] == "gradient_accumulation_steps")
    assert acc["expected_error"] is None
    assert "expected error: not yet measured" in " ".join(format_report(_report(COMM_BOUND, advice=[acc])).split())


def test_a_prediction_keeps_only_the_share_of_its_saving_the_sweep_saw_realised():
    facts = RunFacts(grad_sync="overlap", world_size=2, bucket_mb=float("inf"), plan=_plan(),
                     wire_element_bytes=2, grad_element_bytes=2)
    step = COMM_BOUND["step_ms"]
    a = next(a for a in advise(COMM_BOUND, facts) if a["setting"] == "grad_bucket_mb")
    share, err = CALIBRATION["grad_bucket_mb/overlap"]
    assert 0 < share < 1 and a["realised_share"] == share and a["expected_error"] == err
    assert a["predicted_step_ms"] == round(step - share * (step - a["model_step_ms"]), 1) > a["model_step_ms"]
    assert a["saving"] == round(1 - a["predicted_step_ms"] / step, 4)
    # Under sharded the sweep saw none of a bucket cap's predicted saving: not advised, and it says why.
    ruled = []
    sharded = RunFacts(**{**facts.__dict__, "grad_sync": "sharded"})
    assert all(a["setting"] != "grad_bucket_mb" for a in advise(COMM_BOUND, sharded, ruled_out=ruled))
    assert any(w.startswith("grad_bucket_mb=") and "the sweep saw 0% of such predicted savings" in w for w in ruled)
    # Uncorrected, the model itself still predicts the saving.
    raw = RunFacts(**{**sharded.__dict__, "calibration": {}})
    assert any(a["setting"] == "grad_bucket_mb" for a in advise(COMM_BOUND, raw))


def test_stopping_a_gil_holding_prefetch_charges_every_micro_batch_of_the_step():
    # The producer thread holds the GIL: forward and backward got half the CPU while it ran. Loaded in
    # the step itself instead, each of the step's micro-batches costs its 10 ms there.
    data = DataSide("thread", wall_ms=10.0, cpu_ms=10.0, batches=8, share_with=0.5, share_without=1.0)
    mean = dict(data_wait_ms=1, forward_ms=40, backward_ms=60, optimizer_ms=5, exposed_comm_ms=0,
                comm_busy_ms=0, step_ms=110)
    got = {}
    for accum in (1, 2):
        facts = RunFacts(grad_sync=None, prefetch_depth=2, gradient_accumulation_steps=accum, data=data,
                         spare_cores=0, calibration={})   # the model's own figure
        got[accum] = next(a for a in advise(mean, facts) if a["setting"] == "prefetch_depth")
    assert got[1]["value"] == got[2]["value"] == 0
    assert got[2]["model_step_ms"] == pytest.approx(got[1]["model_step_ms"] + 10.0, abs=0.2)



# -- item 3: a change of the effective batch, in its own unit -------------------------------------
def _plan(total=16 * 2**20, cap_default=4.0):
    return lambda cap: ([total] if cap >= 64 else [int(cap * 2**20)] * max(1, int(total / (cap * 2**20))))


COMM_BOUND = dict(data_wait_ms=1, forward_ms=30, backward_ms=60, optimizer_ms=5, exposed_comm_ms=45,
                  comm_busy_ms=50, step_ms=141)


def test_a_larger_effective_batch_is_predicted_as_its_new_step_and_per_sample():
    facts = RunFacts(grad_sync="overlap", world_size=2, bucket_mb=float("inf"), plan=_plan(), samples_per_step=4,
                     wire_element_bytes=2, grad_element_bytes=2)   # no bf16 candidate
    advice = advise(COMM_BOUND, facts)
    acc = next(a for a in advice if a["setting"] == "gradient_accumulation_steps")
    fixed = 141 - 1 - 30 - 60
    new_step = 2 * (141 - fixed) + fixed
    assert acc["predicted_step_ms"] == pytest.approx(new_step)     # the step it will produce, longer
    assert acc["ms_per_sample"] == pytest.approx(141 / 4, abs=1e-3)
    assert acc["predicted_ms_per_sample"] == pytest.approx(new_step / 8, abs=1e-3)
    assert acc["saving"] == pytest.approx(1 - new_step / (2 * 141), abs=1e-4)
    assert "ms a step of more samples" in format_report(_report(COMM_BOUND, advice=[acc]))


def test_a_change_of_results_never_comes_before_a_results_keeping_change_that_saves_five_percent():
    # A 10 ms data wait loaded in the step (prefetching saves 7 % of the step) and 41 ms paid once per
    # step (accumulating twice the micro-batches saves 15 % per sample): prefetching still comes first.
    mean = dict(COMM_BOUND, data_wait_ms=10)
    facts = RunFacts(grad_sync="overlap", world_size=2, prefetch_depth=0, plan=None, samples_per_step=4,
                     data=DataSide("step", wall_ms=10.0, cpu_ms=0.5, batches=10),
                     calibration={})   # the order rule on the model's own figures
    advice = advise(mean, facts)
    assert [a["setting"] for a in advice] == ["prefetch_depth", "gradient_accumulation_steps"], advice
    keep, change = advice
    assert MIN_SAVING <= keep["saving"] < change["saving"]


# -- item 2: predictions from the run's own timeline ----------------------------------------------
def _spans(ready, steps=3, bwd=(0.0, 0.060)):
    """Backward spans and the buckets launched at the given fractions of them, on two ranks."""
    out = []
    for rank in range(2):
        for s in range(steps):
            t0 = 10.0 * s + bwd[0]
            t1 = 10.0 * s + bwd[1]
            out.append([rank, "compute", "backward", t0, t1])
            for i, r in enumerate(ready):
                launch = t0 + r * (t1 - t0)
                out.append([rank, "comm", f"bucket {i}", launch, launch + 0.012])
    return out


def test_bucket_readiness_comes_from_the_runs_spans_not_from_the_bytes():
    late = [0.64, 0.8, 0.9, 1.0]     # a tied embedding arriving last: nothing ready before 64 % of backward
    assert measured_ready(_spans(late), 4) == pytest.approx(late)
    assert measured_ready(_spans(late), 5) is None     # a bucket never seen: not measured
    facts = lambda: RunFacts(grad_sync="overlap", world_size=2, bucket_mb=4.0, plan=_plan(),   # noqa: E731
                             wire_element_bytes=2, grad_element_bytes=2, calibration={})
    measured = advise_report(_report(dict(COMM_BOUND), spans=_spans(late)), facts())
    proportional = advise_report(_report(dict(COMM_BOUND)), facts())
    assert measured["model"]["bucket_ready"] == "measured"
    assert proportional["model"]["bucket_ready"] == "bytes-proportional"
    cap = lambda r: next((a for a in r["advice"] if a["setting"] == "grad_bucket_mb"), None)  # noqa: E731
    # Bytes-proportional readiness promises smaller buckets hide the link behind backward; the run's
    # own launches say it cannot start before 64 % of backward: smaller buckets would not save 5 %.
    assert cap(proportional) is not None and cap(measured) is None, (proportional["advice"], measured["advice"])
    assert any(w.startswith("grad_bucket_mb=") and "under 5%" in w for w in measured["ruled_out"])
    # Never more hidden than the overlapping compute holds: buckets all launched at the end of
    # backward (one bucket's worth of gradients arriving last) can hide nothing, whatever the cap.
    last = advise_report(_report(dict(COMM_BOUND), spans=_spans([1.0] * 4)), facts())
    assert cap(last) is None and not [a for a in last["advice"] if not a["changes_results"]], last["advice"]


def test_backwards_slow_down_under_communication_is_fitted_from_the_runs_spans():
    spans = []
    for s, inflight in enumerate((0.0, 0.010, 0.020, 0.030)):   # seconds of comm in flight in each backward
        t0 = 10.0 * s
        length = 0.040 + 0.5 * inflight                          # 0.5 ms of backward per ms in flight
        spans.append([0, "compute", "backward", t0, t0 + length])
        if inflight:
            spans.append([0, "comm", "bucket 0", t0, t0 + inflight])
    assert comm_slowdown(spans) == pytest.approx(0.5, rel=1e-6)
    flat = [s for s in spans if s[1] == "compute"]   # no comm anywhere: nothing to fit from
    assert comm_slowdown(flat) is None
    assert math.isfinite(comm_slowdown(spans))


def test_one_slow_step_does_not_carry_the_slowdown_fit():
    # The spans of a loaded CI run (2 ranks, 9 steps): every backward ~10 ms with ~0.2 ms of comm in
    # flight, but one stretched to 82 ms by the machine while 3 ms of comm happened to be in flight. A
    # least-squares line says over 20 ms of backward per ms in flight, which ruled every bucket cap out.
    spans = []
    for rank in (0, 1):
        for s in range(9):
            t0 = 1.0 * s
            inflight, length = (0.003, 0.082) if (rank, s) == (0, 1) else (0.0002 + 0.00002 * s, 0.010 + 0.0001 * s)
            spans.append([rank, "compute", "backward", t0, t0 + length])
            spans.append([rank, "comm", "bucket 0", t0 + length - inflight, t0 + length + 0.015])
    k = comm_slowdown(spans)
    assert k is None or k <= 1.0, k
    # Backwards that really slow down with more in flight are still fitted, and never past 1 ms per ms
    # (a collective sharing the cores can at worst stop backward while it runs).
    steep = []
    for s, inflight in enumerate((0.0, 0.010, 0.020, 0.030)):
        t0 = 10.0 * s
        steep.append([0, "compute", "backward", t0, t0 + 0.040 + 3.0 * inflight])
        if inflight:
            steep.append([0, "comm", "bucket 0", t0, t0 + inflight])
    assert comm_slowdown(steep) == 1.0
