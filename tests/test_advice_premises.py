"""Advice only where the run supports its premise (issue 45, item 4).

A change is advised only where the run's own measurement shows the mechanism it relies on, and each
advice names that measurement: prefetching only where the step waited for its batch, a bucket cap
only where it waited for communication, the bf16 wire only where the collectives took longer with
more bytes (not measured: not advised, and the report says how to measure it); a serial run gets
``overlap`` first, never a larger batch first. Means and spans by hand, no processes.
"""

from __future__ import annotations

import math

import pytest

from hfstream.report.advice import (BYTES_SHARE, MIN_SAVING, CommScaling, DataSide, RunFacts, advise, advise_report,
                                    measure_comm_scaling)
from hfstream.report.format import format_advice

MiB = 2**20
COMM_BOUND = dict(data_wait_ms=1, forward_ms=70, backward_ms=115, optimizer_ms=29, exposed_comm_ms=234,
                  comm_busy_ms=234, step_ms=455)
BYTES_BOUND = CommScaling(ms_per_mib=8.0, fixed_ms=0.5, bytes_share=0.95, buckets=7, smallest_mib=1.0, largest_mib=4.0)


def _plan(total=28_000_000):
    """GradSync's plan in the small: buckets of ``cap`` MiB and the rest, every byte in one of them."""
    def plan(cap):
        if cap >= 64 or cap * MiB >= total:
            return [total]
        size = int(cap * MiB)
        whole, rest = divmod(total, size)
        return [size] * whole + ([rest] if rest else [])
    return plan


def _settings(advice):
    return [a["setting"] for a in advice]


# -- prefetching: only where the step waited for its batch ---------------------------------------------
def test_a_step_that_did_not_wait_for_its_batch_is_not_told_to_prefetch():
    quick = dict(data_wait_ms=1, forward_ms=10, backward_ms=15, optimizer_ms=5, exposed_comm_ms=0,
                 comm_busy_ms=math.nan, step_ms=31)
    why: list[str] = []
    advice = advise(quick, RunFacts(grad_sync=None, prefetch_depth=0), why)
    assert not {"prefetch_depth", "dataloader_num_workers"} & set(_settings(advice)), advice
    assert any(w.startswith("data: the step waited 1.0 ms of 31 ms") for w in why), why
    waited = advise(dict(quick, data_wait_ms=40, step_ms=70), RunFacts(grad_sync=None, prefetch_depth=0))
    assert waited[0]["setting"] == "prefetch_depth"
    assert waited[0]["premise"] == "the step waited for its batch: 40 ms of 70 ms (the data wait, measured)"


# -- the link: a cap only where the step waited for communication ---------------------------------------
def test_a_step_that_did_not_wait_for_communication_gets_no_bucket_wire_or_mode_advice():
    hidden = dict(COMM_BOUND, exposed_comm_ms=4, step_ms=225)
    why: list[str] = []
    advice = advise(hidden, RunFacts(grad_sync="overlap", world_size=2, bucket_mb=64.0, plan=_plan(),
                                     comm_scaling=BYTES_BOUND, mode_switch_checked=True), why)
    assert not {"grad_bucket_mb", "grad_comm_dtype"} & set(_settings(advice)), advice
    assert any(w.startswith("communication: the step waited 4.0 ms of 225 ms") for w in why), why
    waited = advise(COMM_BOUND, RunFacts(grad_sync="overlap", world_size=2, bucket_mb=64.0, plan=_plan()))
    cap = next(a for a in waited if a["setting"] == "grad_bucket_mb")
    assert cap["premise"].startswith("the step waited for communication after backward: 234 ms of 455 ms")


# -- the bf16 wire: only where the collectives' time was measured to grow with their bytes --------------
def test_the_bf16_wire_is_not_advised_where_bytes_scaling_was_not_measured_and_the_reason_says_how_to():
    why: list[str] = []
    facts = RunFacts(grad_sync="overlap", world_size=2, bucket_mb=64.0, plan=_plan(),
                     comm_scaling_unmeasured="1 bucket: a line needs at least 3")
    assert "grad_comm_dtype" not in _settings(advise(COMM_BOUND, facts, why))
    said = next(w for w in why if w.startswith("grad_comm_dtype=bf16"))
    assert "was not measured (1 bucket: a line needs at least 3)" in said
    assert "run a few steps with grad_comm_dtype='bf16'" in said


def test_the_bf16_wire_is_not_advised_where_the_collectives_did_not_take_longer_with_more_bytes():
    # gloo on a loaded loopback: a collective costs about the same whatever its bytes (waiting for a core).
    flat = CommScaling(ms_per_mib=0.3, fixed_ms=20.0, bytes_share=0.06, buckets=7, smallest_mib=1.0, largest_mib=4.0)
    why: list[str] = []
    facts = RunFacts(grad_sync="overlap", world_size=2, bucket_mb=4.0, plan=_plan(), comm_scaling=flat)
    assert "grad_comm_dtype" not in _settings(advise(COMM_BOUND, facts, why))
    assert any(w.startswith("grad_comm_dtype=bf16: the run's collectives took 0.30 ms more per MiB") and
               f"6% of their time, under {BYTES_SHARE:.0%}" in w for w in why), why
    advice = advise(COMM_BOUND, RunFacts(grad_sync="overlap", world_size=2, bucket_mb=4.0, plan=_plan(),
                                         comm_scaling=BYTES_BOUND))
    wire = next(a for a in advice if a["setting"] == "grad_comm_dtype")
    assert "the run's collectives took 8.00 ms more per MiB (a line through 7 buckets of 1-4 MiB): their bytes " \
           "are 95% of their time" in wire["premise"]


def _spans(bucket_mib, ms_of, steps=4, ranks=2):
    """Each step launches every bucket at once (serial: after backward); the link takes them one at a time."""
    spans = []
    for rank in range(ranks):
        for step in range(steps):
            t = 10.0 * step
            end = t
            for i, mib in enumerate(bucket_mib):
                end += ms_of(mib) / 1e3
                spans.append((rank, "comm", f"bucket {i}", t, end))
    return spans


def test_the_collectives_time_against_their_bytes_is_measured_from_the_reports_spans():
    sizes = [4.0, 4.0, 2.0, 1.0]
    bytes_ = [int(m * MiB) for m in sizes]
    link, why = measure_comm_scaling(_spans(sizes, lambda mib: 0.5 + 10 * mib), bytes_)
    assert why == "" and link.buckets == 4 and (link.smallest_mib, link.largest_mib) == (1.0, 4.0)
    assert link.ms_per_mib == pytest.approx(10.0) and link.fixed_ms == pytest.approx(0.5)
    assert link.bytes_share == pytest.approx(110 / 112) and link.holds
    flat, _ = measure_comm_scaling(_spans(sizes, lambda mib: 20.0), bytes_)
    assert flat.ms_per_mib == pytest.approx(0.0, abs=1e-9) and not flat.holds
    assert measure_comm_scaling(_spans([4.0, 4.0, 4.2], lambda mib: 10 * mib), [4 * MiB] * 2 + [int(4.2 * MiB)])[1] \
        == "its buckets were all about one size (4-4.2 MiB)"
    assert measure_comm_scaling([], [MiB])[1] == "1 bucket: a line needs at least 3"
    assert measure_comm_scaling([], bytes_)[1] == "the report's spans do not show every bucket of the run's plan"


@pytest.mark.parametrize("ms_of, advised", [(lambda mib: 0.5 + 20 * mib, True), (lambda mib: 40.0, False)])
def test_a_report_advises_the_wire_only_where_its_own_spans_show_time_growing_with_bytes(ms_of, advised):
    sizes = [8.0, 8.0, 8.0, 4.0]
    mean = dict(data_wait_ms=1, forward_ms=70, backward_ms=115, optimizer_ms=29, exposed_comm_ms=160,
                comm_busy_ms=sum(ms_of(m) for m in sizes), step_ms=380)
    plan = lambda cap: [int(m * MiB) for m in sizes]  # noqa: E731
    report = {"mean": mean, "per_rank": [mean], "spans": _spans(sizes, ms_of), "notes": []}
    facts = RunFacts(grad_sync="serial", world_size=2, bucket_mb=8.0, plan=plan, calibration={})
    advise_report(report, facts)
    assert ("grad_comm_dtype" in _settings(report["advice"])) == advised, (report["advice"], report["ruled_out"])
    assert report["model"]["comm_scaling"]["buckets"] == 4


# -- serial: overlap first, never a larger batch first ---------------------------------------------------
SERIAL = dict(data_wait_ms=1, forward_ms=70, backward_ms=150, optimizer_ms=20, exposed_comm_ms=200,
              comm_busy_ms=200, step_ms=442)


def test_a_serial_run_that_waits_for_communication_is_told_overlap_first():
    facts = RunFacts(grad_sync="serial", world_size=2, bucket_mb=4.0, plan=_plan(), comm_scaling=BYTES_BOUND,
                     samples_per_step=4)
    advice = advise(SERIAL, facts)
    first = advice[0]
    assert (first["setting"], first["value"], first["changes_results"]) == ("grad_sync", "overlap", False), advice
    assert first["premise"].startswith("under serial all 200 ms of communication ran after backward (200 ms "
                                       "exposed), beside a 150 ms backward")
    assert first["predicted_step_ms"] < SERIAL["step_ms"] * (1 - MIN_SAVING)
    # A switch the sweep need not check first: the same all-reduces, launched during backward.
    assert first["expected_error"] is None
    later = _settings(advice)
    assert later.index("gradient_accumulation_steps") > later.index("grad_sync")


def test_a_serial_run_waiting_for_data_as_well_still_gets_overlap_first():
    waits = dict(SERIAL, data_wait_ms=120, step_ms=562)
    advice = advise(waits, RunFacts(grad_sync="serial", world_size=2, bucket_mb=4.0, plan=_plan(), prefetch_depth=0))
    assert _settings(advice)[:2] == ["grad_sync", "prefetch_depth"], advice


def test_a_serial_run_that_overlap_cannot_help_gets_no_larger_batch_instead():
    # Backward of 5 ms: overlap would hide almost nothing of the 200 ms. A larger batch amortises the
    # communication, but it changes the results and under serial it never comes first.
    tiny_backward = dict(SERIAL, backward_ms=5, step_ms=297)
    why: list[str] = []
    advice = advise(tiny_backward, RunFacts(grad_sync="serial", world_size=2, bucket_mb=64.0, plan=_plan(),
                                            samples_per_step=4), why)
    assert "gradient_accumulation_steps" not in _settings(advice), advice
    assert any(w.startswith("gradient_accumulation_steps: under grad_sync='serial', grad_sync='overlap' comes first")
               for w in why), why


# -- each advice names the premise it checked ---------------------------------------------------------
def test_every_advice_names_the_measurement_it_checked_and_the_report_prints_it():
    gil = DataSide("thread", wall_ms=22.0, cpu_ms=20.0, batches=10, share_with=0.6, share_without=1.0)
    cases = [
        (dict(COMM_BOUND, data_wait_ms=40, step_ms=494),
         RunFacts(grad_sync="overlap", world_size=2, bucket_mb=64.0, plan=_plan(), prefetch_depth=0,
                  comm_scaling=BYTES_BOUND, samples_per_step=4, mode_switch_checked=True)),
        (dict(COMM_BOUND, data_wait_ms=60, step_ms=514),
         RunFacts(grad_sync="overlap", world_size=2, bucket_mb=4.0, plan=_plan(), prefetch_depth=2,
                  cores_per_rank=4, spare_cores=4)),
        (dict(data_wait_ms=2, forward_ms=30, backward_ms=40, optimizer_ms=5, exposed_comm_ms=0,
              comm_busy_ms=math.nan, step_ms=80),
         RunFacts(grad_sync=None, prefetch_depth=2, spare_cores=2, cores_per_rank=2, data=gil)),
        (SERIAL, RunFacts(grad_sync="serial", world_size=2, bucket_mb=4.0, plan=_plan(), comm_scaling=BYTES_BOUND)),
    ]
    seen = set()
    for mean, facts in cases:
        advice = advise(mean, facts)
        assert advice, facts
        for a, text in zip(advice, format_advice(advice)):
            seen.add(a["setting"])
            # The figure the rule hinges on, as the run measured it: the data wait, the step's own
            # thread's CPU share beside the producer, or the wait for communication.
            if facts.data is not None:
                figure = "60% CPU"
            elif a["setting"] in ("prefetch_depth", "dataloader_num_workers"):
                figure = f"{mean['data_wait_ms']:.0f} ms of {mean['step_ms']:.0f} ms"
            else:
                figure = f"{mean['exposed_comm_ms']:.0f} ms"
            assert figure in a["premise"], (figure, a)
            assert "premise: " + a["premise"] in " ".join(text.split()), text
    assert seen == {"prefetch_depth", "dataloader_num_workers", "grad_bucket_mb", "grad_sync", "grad_comm_dtype",
                    "gradient_accumulation_steps"}


# -- communication in backward costs the cores it runs on ----------------------------------------------
ONE_BUCKET = dict(data_wait_ms=2, forward_ms=30, backward_ms=40, optimizer_ms=5, exposed_comm_ms=22,
                  comm_busy_ms=22, step_ms=100)


def test_a_bucket_cap_is_not_advised_where_the_collectives_would_take_backwards_cores():
    # One bucket: nothing was in flight in backward, so the slow-down there was not measured. The
    # collectives' threads used 0.9 ms of CPU per ms, and no core is spare: run inside backward they
    # would take it from backward, and the step would not shorten.
    facts = dict(grad_sync="overlap", world_size=2, bucket_mb=float("inf"), plan=_plan(8_000_000), spare_cores=0.0)
    why: list[str] = []
    busy_cpu = advise(dict(ONE_BUCKET, comm_cpu_ms=19.8), RunFacts(**facts), why)
    assert "grad_bucket_mb" not in _settings(busy_cpu), busy_cpu
    assert any(w.startswith("grad_bucket_mb=") and "under 5%" in w for w in why), why
    # The same run whose collectives mostly wait on the wire (0.05 ms of CPU per ms): the cap is advised,
    # and so it is where a core is spare for them.
    wire = advise(dict(ONE_BUCKET, comm_cpu_ms=1.1), RunFacts(**facts))
    assert _settings(wire)[0] == "grad_bucket_mb", wire
    spare = advise(dict(ONE_BUCKET, comm_cpu_ms=19.8), RunFacts(**{**facts, "spare_cores": 2.0}))
    assert _settings(spare)[0] == "grad_bucket_mb", spare
    assert "no core is spare" in busy_cpu_reason(dict(ONE_BUCKET, comm_cpu_ms=8.0), facts)


def busy_cpu_reason(mean, facts):
    advice = advise(mean, RunFacts(**facts))
    return next(a["reason"] for a in advice if a["setting"] == "grad_bucket_mb")


def test_a_measured_slowdown_in_backward_wins_over_the_collectives_cpu():
    facts = RunFacts(grad_sync="overlap", world_size=2, bucket_mb=float("inf"), plan=_plan(8_000_000),
                     spare_cores=0.0, comm_slowdown=0.0)
    assert _settings(advise(dict(ONE_BUCKET, comm_cpu_ms=19.8), facts))[0] == "grad_bucket_mb"


def test_a_serial_run_with_one_bucket_is_told_overlap_with_a_cap_and_both_are_printed():
    mean = dict(data_wait_ms=2, forward_ms=30, backward_ms=60, optimizer_ms=5, exposed_comm_ms=40,
                comm_busy_ms=40, step_ms=140)
    facts = RunFacts(grad_sync="serial", world_size=2, bucket_mb=float("inf"), plan=_plan(8_000_000))
    first = advise(mean, facts)[0]
    assert (first["setting"], first["value"]) == ("grad_sync", "overlap")
    cap = first["also"]["grad_bucket_mb"]
    assert cap < 8 and first["saving"] >= 0.05 and "none of which backward can hide" in first["reason"]
    from hfstream.report.format import format_advice

    assert format_advice([first])[0].startswith(f"  advice: set grad_sync=overlap, grad_bucket_mb={cap}")
    # Under grad_bucket_mb="auto", overlap alone: the tuner chooses the cap.
    auto = advise(mean, RunFacts(grad_sync="serial", world_size=2, bucket_mb=1.0, auto_bucket=True,
                                 plan=_plan(8_000_000)))[0]
    assert (auto["setting"], auto["value"], auto.get("also")) == ("grad_sync", "overlap", None)
