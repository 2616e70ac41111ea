"""The advice model's small parts, each on a case worked by hand.

Written against the survivors of a mutation run over `hfstream/report/advice.py` (docs/design.md,
"Mutation testing"): the readiness curve between its points, a producer's CPU share below 1 ms a
batch, the step thread's evidence, backward's slow-down under communication, sharded under
accumulation, the ruled-out reasons of the workers advice, a bucket advice's value, and the
facts read from a trainer.
"""

from __future__ import annotations

import math
import os
import types

import pytest
import torch

from hfstream.report.advice import (BUCKET_CANDIDATES_MB, CommScaling, DataSide, RunFacts, _comm_step, _Link,
                                    _overlap_schedule, _Parts, _ready, advise, facts_from_trainer)

# A run whose collectives took longer in proportion to their bytes (the bf16 wire's premise).
BYTES_BOUND = CommScaling(ms_per_mib=8.0, fixed_ms=0.5, bytes_share=0.95, buckets=7, smallest_mib=1.0, largest_mib=4.0)


def test_readiness_is_interpolated_between_the_measured_points():
    # Points (share of the bytes, fraction of backward): a quarter of the bytes ready at half of
    # backward, all at the end. Two equal buckets: the first ends at half the bytes.
    curve = [(0.25, 0.5), (1.0, 1.0)]
    assert _ready([1.0, 1.0], curve) == pytest.approx([0.5 + 0.5 * (0.25 / 0.75), 1.0])
    # Before the first point: from (0, 0).
    assert _ready([1.0, 9.0], [(0.5, 0.8), (1.0, 1.0)]) == pytest.approx([0.16, 1.0])
    assert _ready([1.0, 3.0]) == pytest.approx([0.25, 1.0])   # no curve: in proportion to the bytes


def test_a_producer_faster_than_a_millisecond_still_has_a_cpu_share():
    assert DataSide("thread", wall_ms=0.5, cpu_ms=0.2, batches=4).cpu_share == pytest.approx(0.4)
    assert math.isnan(DataSide("thread", wall_ms=0.0, cpu_ms=0.0, batches=4).cpu_share)


def test_the_step_threads_share_is_evidence_only_for_a_producer_thread():
    on_thread = DataSide("thread", wall_ms=10, cpu_ms=9, batches=4, share_with=0.6, share_without=0.95)
    assert "own thread got 60% CPU while it ran, 95% while it did not" in on_thread.evidence()
    in_step = DataSide("step", wall_ms=10, cpu_ms=9, batches=4, share_with=0.6)
    assert "own thread" not in in_step.evidence()
    unmeasured = DataSide("thread", wall_ms=10, cpu_ms=9, batches=4)
    assert "own thread" not in unmeasured.evidence()


def _link_parts(mean, facts, buckets):
    parts = _Parts(mean["data_wait_ms"], mean["forward_ms"], mean["backward_ms"], mean["optimizer_ms"],
                   mean["exposed_comm_ms"], mean["comm_busy_ms"], mean["step_ms"])
    return _Link(facts, parts, buckets), parts


MEAN = dict(data_wait_ms=0, forward_ms=30, backward_ms=60, optimizer_ms=6, exposed_comm_ms=20,
            comm_busy_ms=50, step_ms=116)
BUCKETS = [4 * 2**20] * 4


def test_backwards_slowdown_under_communication_lengthens_an_overlapped_prediction():
    plain = RunFacts(grad_sync="overlap", world_size=2)
    slowed = RunFacts(grad_sync="overlap", world_size=2, comm_slowdown=0.5)
    link, parts = _link_parts(MEAN, plain, BUCKETS)
    # The run hid 30 of its 50 ms: with 0.5 ms of backward per ms in flight, backward alone is 45 ms,
    # and the candidate's collectives in flight in it add half of their time inside it back.
    base = 60 - 0.5 * (50 - 20)
    _, inside = _overlap_schedule([link.allreduce(b) for b in BUCKETS], _ready(BUCKETS), base)
    assert 0 < inside <= base
    stretched = dict(MEAN, backward_ms=base + 0.5 * inside)   # that backward, with no slow-down modelled
    link_s, parts_s = _link_parts(stretched, plain, BUCKETS)
    assert _comm_step("overlap", BUCKETS, link, parts, slowed, 6) == pytest.approx(
        _comm_step("overlap", BUCKETS, link_s, parts_s, plain, 6))
    # Serial runs nothing during backward: the slow-down does not apply.
    assert _comm_step("serial", BUCKETS, link, parts, slowed, 6) == pytest.approx(
        _comm_step("serial", BUCKETS, link, parts, plain, 6))


def test_sharded_under_accumulation_adds_the_earlier_micro_steps_compute():
    one = RunFacts(grad_sync="sharded", world_size=2, gradient_accumulation_steps=1)
    two = RunFacts(grad_sync="sharded", world_size=2, gradient_accumulation_steps=2)
    link, parts = _link_parts(MEAN, one, BUCKETS)
    # Two micro-steps of 15 + 30 ms: the first is plain compute, the last the one-micro-step schedule.
    half = dict(MEAN, forward_ms=15, backward_ms=30)
    link_h, parts_h = _link_parts(half, one, BUCKETS)
    assert _comm_step("sharded", BUCKETS, link, parts, two, 6) == pytest.approx(
        15 + 30 + _comm_step("sharded", BUCKETS, link_h, parts_h, one, 6))


STILL_WAITING = dict(data_wait_ms=20, forward_ms=10, backward_ms=15, optimizer_ms=5, exposed_comm_ms=0,
                     comm_busy_ms=float("nan"), step_ms=50)


def test_a_prefetched_producer_faster_than_the_step_is_ruled_out_as_the_hand_over():
    why = []
    fast = DataSide("thread", wall_ms=5.0, cpu_ms=4.5, batches=6)
    assert advise(STILL_WAITING, RunFacts(grad_sync=None, prefetch_depth=2, spare_cores=2, cores_per_rank=4,
                                          data=fast), why) == []
    assert any(w.startswith("dataloader_num_workers: the producer takes 5.0 ms per batch") and "hand-over" in w
               for w in why), why


@pytest.mark.parametrize("spare, said", [(0.0, "no spare core"), (1.5, "already use the 1 core(s) per rank there "
                                          "are for them"), (2.0, None), (2.5, None)])
def test_a_computing_producer_gets_workers_only_with_two_spare_cores(spare, said):
    # One worker would be no more producers than the prefetch thread already is: two need two cores.
    why = []
    slow = DataSide("thread", wall_ms=60.0, cpu_ms=58.0, batches=6)   # computes, slower than the step
    advice = advise(STILL_WAITING, RunFacts(grad_sync=None, prefetch_depth=2, spare_cores=spare, cores_per_rank=4,
                                            data=slow, calibration={}), why)
    workers = [a for a in advice if a["setting"] == "dataloader_num_workers"]
    if said is None:
        assert workers and workers[0]["value"] == 2, (advice, why)
    else:
        assert not workers and any(w.startswith("dataloader_num_workers") and said in w for w in why), why


def test_a_bucket_advice_names_a_candidate_cap():
    mean = dict(data_wait_ms=1, forward_ms=70, backward_ms=115, optimizer_ms=29, exposed_comm_ms=234,
                comm_busy_ms=234, step_ms=455)
    plan = lambda cap: [28_000_000] if cap >= 64 else [int(cap * 2**20)] * max(1, int(28_000_000 / (cap * 2**20)))  # noqa: E731
    advice = advise(mean, RunFacts(grad_sync="overlap", world_size=2, bucket_mb=64.0, plan=plan))
    caps = [a for a in advice if a["setting"] == "grad_bucket_mb"]
    assert caps and caps[0]["value"] in BUCKET_CANDIDATES_MB and caps[0]["value"] != 64.0, advice


class _FakeSync:
    world_size = 2
    comm_dtype = None
    bucket_mb = cap_mb = 4.0   # as asked, and in use
    tuning = None
    process_group = None   # dist.get_backend fails without a group: the default guess

    def __init__(self, dtype):
        self.hooked_parameters = [("w", torch.zeros(3, dtype=dtype)), ("b", torch.zeros(3, dtype=dtype))]

    def plan_for(self, cap):
        return [types.SimpleNamespace(nbytes=int(cap * 2**20))] * 2


def _trainer(accelerator, dtype=torch.bfloat16):
    args = types.SimpleNamespace(device="cpu", prefetch_depth=2, dataloader_num_workers=0,
                                 gradient_accumulation_steps=2, grad_bucket_mb=4.0, per_device_train_batch_size=8)
    return types.SimpleNamespace(args=args, grad_sync=_FakeSync(dtype), accelerator=accelerator,
                                 grad_sync_mode="overlap", _timeline=None, _prefetcher=None)


def test_the_facts_of_a_trainer_are_read_from_its_sync_args_and_node(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    facts = facts_from_trainer(_trainer(types.SimpleNamespace(num_processes=2)))
    assert (facts.grad_sync, facts.world_size) == ("overlap", 2)
    assert facts.grad_element_bytes == facts.wire_element_bytes == 2   # bf16 gradients, no comm_dtype
    assert facts.bucket_mb == 4.0 and facts.plan(1.0) == [2**20, 2**20] and facts.backend == "gloo"
    assert facts.samples_per_step == 16                                  # 8 a micro-batch, 2 micro-batches
    cores = os.cpu_count() or 1
    assert facts.spare_cores == pytest.approx((cores - 2 * torch.get_num_threads()) / 2)
    assert facts.cores_per_rank == max(1, cores // 2)
    # An accelerator that does not say how many processes: one, and nothing to synchronise.
    alone = facts_from_trainer(_trainer(types.SimpleNamespace()))
    assert (alone.grad_sync, alone.world_size) == (None, 1)


def test_counts_are_singular_for_one_only():
    from hfstream.report.advice import _count
    assert [_count(n, "bucket") for n in (0, 1, 2)] == ["0 buckets", "1 bucket", "2 buckets"]


def test_a_step_under_a_millisecond_is_still_measured():
    # A tiny model's step (0.5 ms) is a step, not "not measured".
    from hfstream.report.advice import advise
    tiny = {k: v / 232 for k, v in MEAN.items()}   # the same shape, 0.5 ms a step
    why = []
    advise(tiny, RunFacts(grad_sync="overlap", world_size=2, bucket_mb=25.0), ruled_out=why)
    assert not any("no step was measured" in w for w in why), why


def test_communication_under_a_millisecond_is_still_communication():
    # Collectives that took 0.5 ms in flight were measured: the comm advice models them. Only a run
    # with no communication time at all is ruled out as "not measured".
    plan = lambda cap: [int(cap * 2**20)] * 4   # noqa: E731
    facts = RunFacts(grad_sync="overlap", world_size=2, bucket_mb=4.0, plan=plan)
    for busy, said in ((0.5, False), (0.0, True)):
        why = []
        advise(dict(MEAN, comm_busy_ms=busy, exposed_comm_ms=busy), facts, ruled_out=why)
        assert any("no communication time measured" in w for w in why) == said, (busy, why)


def test_a_partly_overlapped_compute_interval_is_neither_with_nor_without_the_producer():
    # The step thread's CPU share is read from compute intervals the producer covered (half or
    # more: "with") or hardly touched (a tenth or less: "without"); one covered by 30 % is neither.
    from hfstream.report.advice import measure_data_side
    ms = 1e-3
    produced = [(0.0, 0.01, 9.0)] + [(t, t + 100 * ms, 90.0) for t in (1.0, 3.07, 5.0, 6.0)]
    host = ([("forward", 0.0, 0.01, 9.0), ("backward", 0.02, 0.03, 9.0)]    # the first step, skipped
            + [("forward", 1.0, 1.1, 60.0),                                   # covered: share 1
               ("backward", 2.0, 2.1, 95.0),                                  # untouched: share 0
               ("forward", 3.0, 3.1, 10.0)])                                  # covered 30 %: neither
    side = measure_data_side(host, produced)
    assert side.where == "thread" and side.batches == 4
    assert side.share_with == pytest.approx(0.6) and side.share_without == pytest.approx(0.95)


def test_two_batches_past_the_first_measure_the_data_side_in_the_step():
    from hfstream.report.advice import measure_data_side
    host = [("data", 0.0, 0.5, 0.4), ("forward", 0.5, 0.6, 0.1), ("data", 1.0, 1.001, 0.2), ("data", 2.0, 2.002, 1.0)]
    assert measure_data_side(host[:3]) is None                     # one batch past the warm-up: too few
    side = measure_data_side(host)
    assert (side.where, side.batches) == ("step", 2)
    assert side.wall_ms == pytest.approx(1.5) and side.cpu_ms == pytest.approx(0.6)


def test_a_report_with_no_step_says_so_and_advises_nothing():
    why = []
    assert advise(dict(MEAN, step_ms=0.0), RunFacts(grad_sync="overlap", world_size=2, bucket_mb=25.0), why) == []
    assert why == ["no step was measured"]


def test_changes_that_keep_results_come_first_then_the_larger_saving():
    mean = dict(data_wait_ms=15, forward_ms=70, backward_ms=115, optimizer_ms=29, exposed_comm_ms=234,
                comm_busy_ms=234, step_ms=470)
    plan = lambda cap: [28_000_000] if cap >= 64 else [int(cap * 2**20)] * max(1, int(28_000_000 / (cap * 2**20)))  # noqa: E731
    advice = advise(mean, RunFacts(grad_sync="overlap", world_size=2, bucket_mb=64.0, plan=plan, samples_per_step=8,
                                   comm_scaling=BYTES_BOUND))
    # Generated as bucket cap, wire dtype, accumulation; the wire dtype saves less than accumulation.
    assert [a["setting"] for a in advice] == ["grad_bucket_mb", "gradient_accumulation_steps", "grad_comm_dtype"]
    assert [a["changes_results"] for a in advice] == [False, True, True]
    assert advice[1]["saving"] > advice[2]["saving"], advice


def test_waiting_producers_are_counted_against_a_step_rest_under_a_millisecond():
    # 2 ms a batch beside 0.5 ms of compute: four producers that wait side by side keep up.
    mean = dict(data_wait_ms=1.5, forward_ms=0.2, backward_ms=0.3, optimizer_ms=0.0, exposed_comm_ms=0,
                comm_busy_ms=float("nan"), step_ms=2.0)
    waits = DataSide("thread", wall_ms=2.0, cpu_ms=0.1, batches=6)
    advice = advise(mean, RunFacts(grad_sync=None, prefetch_depth=2, spare_cores=0, calibration={}, data=waits))
    assert [(a["setting"], a["value"]) for a in advice] == [("dataloader_num_workers", 4)], advice


def test_the_accumulation_advice_gives_the_time_per_sample_to_three_decimals_from_one_sample_a_step():
    mean = dict(data_wait_ms=0, forward_ms=1.0, backward_ms=2.0, optimizer_ms=0.5, exposed_comm_ms=3.0,
                comm_busy_ms=3.0, step_ms=6.6667)
    facts = RunFacts(grad_sync="overlap", world_size=2, bucket_mb=None, samples_per_step=1, calibration={})
    (acc,) = [a for a in advise(mean, facts) if a["setting"] == "gradient_accumulation_steps"]
    assert acc["ms_per_sample"] == 6.667 and acc["predicted_ms_per_sample"] == pytest.approx(4.833, abs=1e-9)


def test_the_facts_read_the_one_minute_load(monkeypatch):
    monkeypatch.setattr(os, "getloadavg", lambda: (1.25, 2.5, 5.0))
    assert facts_from_trainer(_trainer(types.SimpleNamespace(num_processes=2))).loadavg_1min == 1.25


def _saved(exposed_s, run_s, save_async=False, nbytes=600e6, spare_cores=1.0):
    from hfstream.report.advice import advise_report

    report = {"mean": {"step_ms": 100.0, "steps": 10}, "spans": [],
              "save": {"save_async": save_async, "saves": 3, "run_s": run_s, "exposed_s": exposed_s, "bytes": nbytes}}
    return advise_report(report, RunFacts(grad_sync=None, world_size=1, spare_cores=spare_cores))


def test_save_async_is_advised_where_blocking_saves_cost_the_run_more_than_five_percent():
    report = _saved(exposed_s=6.0, run_s=60.0)   # 10 % of the run in saves
    [save] = [a for a in report["advice"] if a["setting"] == "save_async"]
    assert save["value"] is True and not save["changes_results"]
    assert "10%" in save["premise"] and "saves" in save["premise"]
    # What stays exposed: the snapshot (600 MB at the floor's 2 GB/s, 0.3 s), at least a tenth of the save.
    assert save["saving"] == pytest.approx((6.0 - 0.6) / 60.0, abs=1e-3)
    assert save["predicted_run_s"] == pytest.approx(60.0 - 6.0 + 0.6, abs=0.01)
    big = _saved(exposed_s=6.0, run_s=60.0, nbytes=3e9)   # a 1.5 s snapshot
    assert [a["saving"] for a in big["advice"]] == [pytest.approx((6.0 - 1.5) / 60.0, abs=1e-3)]
    # No core free for the writer: half the blocking save stays exposed (docs/benchmarks.md's 2-core row).
    busy = _saved(exposed_s=6.0, run_s=60.0, spare_cores=0)
    assert [a["saving"] for a in busy["advice"]] == [pytest.approx(3.0 / 60.0, abs=1e-3)]
    assert "no core is free" in busy["advice"][0]["reason"]


def test_save_async_is_not_advised_under_five_percent_nor_when_already_on():
    cheap = _saved(exposed_s=2.0, run_s=60.0)   # 3 %
    assert not [a for a in cheap["advice"] if a["setting"] == "save_async"]
    assert any("save_async=True: the 3 save(s) took 3.3% of the run" in w for w in cheap["ruled_out"]), cheap["ruled_out"]
    already = _saved(exposed_s=6.0, run_s=60.0, save_async=True)
    assert not [a for a in already["advice"] if a["setting"] == "save_async"]
