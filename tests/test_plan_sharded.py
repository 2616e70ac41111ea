"""The planner's sharded step (docs/design.md section 7): a case computed by hand, the bounds a
reader of its table relies on, where it says sharded beats overlap, and a bench comparison."""

from __future__ import annotations

import math

import pytest

import hfstream.plan as P
from test_plan import SETTINGS, _bench_doc

MiB = 2**20


def test_sharded_schedule_by_hand(capsys):
    # Two buckets of 1 MiB (1-byte gradients): 80 ms each as an all-reduce at N = 2, so 40 ms per
    # half. Forward 50 ms, backward 100 ms, optimizer 10 ms (5 ms on half the parameters).
    params, tokens = 2 * MiB, 1000
    cfg = P.PlanConfig(grad_bytes=1, bucket_mb=1.0, link_gbs=MiB / 0.080 / 1e9, latency_us=0.0,
                       tokens_per_device=tokens, compute_tflops=6 * params * tokens / 0.150 / 1e12,
                       optimizer_bytes_per_param=1.0, mem_bandwidth_gbs=params / 0.010 / 1e9, world_sizes=(2,))
    r = P.predict_row(P.shape_from_params(params), cfg, 2)
    assert (r["forward_ms"], r["backward_ms"], r["optimizer_ms"]) == pytest.approx((50.0, 100.0, 10.0))
    assert r["reduce_scatter_busy_ms"] == r["all_gather_busy_ms"] == pytest.approx(80.0)
    # The step goes bucket by bucket in forward order (the bucket backward made last comes first),
    # 2.5 ms each, and launches each gather once its bucket is stepped: the first completes at
    # 2.5 + 40 = 42.5 ms, the second at 82.5. The forward starts at 5, waits for the first to 42.5,
    # computes its half (25 ms) to 67.5, waits for the second to 82.5 and finishes at 107.5:
    # 52.5 ms exposed.
    assert r["all_gather_exposed_ms"] == pytest.approx(52.5)
    # Backward 107.5-207.5; the reduce-scatters are ready at 157.5 and 207.5 and end at 197.5 and 247.5.
    assert r["reduce_scatter_exposed_ms"] == pytest.approx(40.0)
    assert r["optimizer_sharded_ms"] == pytest.approx(5.0)
    assert r["step_sharded_ms"] == pytest.approx(50 + 52.5 + 100 + 40 + 5)
    assert r["cross_step_limit_ms"] == pytest.approx(max(50 + 100 + 5, 160))
    # Overlap: 50 + 100 + 110 exposed (the by-hand case of test_plan) + 10 = 270 ms.
    assert r["step_overlap_ms"] == pytest.approx(270.0) and r["sharded_beats_overlap"]


@pytest.mark.parametrize("model,cfg", SETTINGS, ids=[str(m) for m, _ in SETTINGS])
def test_sharded_step_is_bounded_by_its_limit_and_carries_the_all_reduce_bytes(model, cfg):
    shape = P.load_model(model) if isinstance(model, str) else P.shape_from_params(model)
    # The same buckets in both modes (no last bucket of sharded's own), to compare them.
    doc = P.plan(shape, P.PlanConfig(**cfg, sharded_last_bucket_mb=None))
    for r in doc["rows"]:
        n = r["world_size"]
        # The two halves carry what the ring all-reduce carries, latency included.
        assert r["reduce_scatter_busy_ms"] + r["all_gather_busy_ms"] == pytest.approx(r["comm_busy_ms"])
        assert r["cross_step_limit_ms"] == pytest.approx(
            max(r["forward_ms"] + r["backward_ms"] + r["optimizer_ms"] / n, r["comm_busy_ms"]))
        assert r["cross_step_limit_ms"] <= r["step_sharded_ms"] + 1e-9
        assert r["cross_step_limit_ms"] <= r["ideal_ms"] + 1e-9        # never above DDP's ceiling
        assert 0 < r["efficiency_sharded"] <= 1.0 + 1e-12
        assert min(r["reduce_scatter_exposed_ms"], r["all_gather_exposed_ms"]) >= 0
        if n == 1:
            assert r["step_sharded_ms"] == pytest.approx(r["step_overlap_ms"])
    assert doc["sharded_beats_overlap_at"] == [r["world_size"] for r in doc["rows"] if r["sharded_beats_overlap"]]


def test_table_says_where_sharded_beats_overlap(capsys):
    assert P.main(["--model", "gpt2-124m", "--world-sizes", "1,2,8,64", "--wide"]) == 0
    out = capsys.readouterr().out
    assert "step shard" in out and "limit" in out
    doc = P.plan(P.load_model("gpt2-124m"), P.PlanConfig(world_sizes=(1, 2, 8, 64)))
    wins = doc["sharded_beats_overlap_at"]
    assert 1 not in wins   # one device: nothing to shard, nothing gained
    line = next(ln for ln in out.splitlines() if ln.startswith("grad_sync='sharded'"))
    assert ("beats overlap at none" in line) == (not wins)
    # One bucket: nothing overlaps in either mode (the gather before the forward, the reduce-scatter
    # after backward), so sharded gains exactly the optimizer's (N-1)/N, and nothing without one.
    one = dict(bucket_mb=math.inf, sharded_last_bucket_mb=None, world_sizes=(2, 8))
    doc = P.plan(P.load_model("gpt2-124m"), P.PlanConfig(**one))
    for r in doc["rows"]:
        n = r["world_size"]
        assert r["step_overlap_ms"] - r["step_sharded_ms"] == pytest.approx(r["optimizer_ms"] * (n - 1) / n)
    free = P.plan(P.load_model("gpt2-124m"), P.PlanConfig(optimizer_bytes_per_param=0, **one))
    assert free["sharded_beats_overlap_at"] == []
    assert "beats overlap at none" in P.format_plan_table(free)


def test_the_end_of_backward_cut_finer_shortens_what_is_left_after_backward():
    from transformers import GPT2Config, GPT2LMHeadModel

    from hfstream.gradsync import plan_buckets
    # GPT-2 4x384 with a small vocabulary (the bench's): at 8 MiB, block 0 is one 9 MiB bucket
    # that becomes ready at the very end of backward; cut at 1 MiB, only the embeddings are left.
    config = GPT2Config(vocab_size=512, n_positions=128, n_embd=384, n_layer=4, n_head=6)
    shape = P.shape_from_config(config.to_dict())
    base = dict(bucket_mb=8.0, world_sizes=(2,), link_gbs=0.125, compute_tflops=0.02, tokens_per_device=512)
    cut = P.plan(shape, P.PlanConfig(**base))["rows"][0]
    uncut = P.plan(shape, P.PlanConfig(**base, sharded_last_bucket_mb=None))["rows"][0]
    assert cut["reduce_scatter_exposed_ms"] < 0.5 * uncut["reduce_scatter_exposed_ms"]
    assert cut["step_sharded_ms"] < uncut["step_sharded_ms"]
    # The planner cuts from counts what plan_buckets cuts from the model's tensors.
    named = list(GPT2LMHeadModel(config).named_parameters())
    for cap in (1.0, 2.0, 8.0):
        planned = [b.nbytes for b in plan_buckets(named, cap, None, 1.0)]
        predicted = [b for b, _ in P.predict_buckets(shape, 4, cap, None, 1.0)]
        assert predicted == pytest.approx(planned), cap
        assert planned[-1] <= MiB
    assert len(plan_buckets(named, 8.0, None, 1.0)) > len(plan_buckets(named, 8.0))
    assert len(plan_buckets(named, math.inf, None, 1.0)) == 1   # one bucket stays one


def test_compare_predicts_a_sharded_run_and_leaves_fsdp2_out():
    bench = _bench_doc()
    bench["modes"]["sharded"] = {**bench["modes"]["overlap"], "kind": "sharded", "bucket_mb": 1.0}
    bench["modes"]["fsdp2-best"] = {**bench["modes"]["overlap"], "kind": "fsdp2", "bucket_mb": True}
    pred = P.predict_bench(bench)
    assert "fsdp2-best" not in pred["modes"]
    comp = P.compare_with_measurement(pred, bench)
    p = pred["modes"]["sharded"]
    assert comp["modes"]["sharded"]["predicted"]["step_ms"] == pytest.approx(p["step_sharded_ms"])
    assert comp["modes"]["sharded"]["predicted"]["exposed_comm_ms"] == pytest.approx(
        p["reduce_scatter_exposed_ms"] + p["all_gather_exposed_ms"])
    assert not math.isnan(comp["max_abs_rel_error"]["step_ms"])


def test_a_step_as_long_as_the_gathers_hides_all_but_the_first():
    # Four buckets of 1 MiB (1-byte gradients), 40 ms per half at N = 2; the optimizer step on half
    # the parameters takes 80 ms, 20 per bucket. Each gather is launched as its bucket is stepped:
    # they end at 60, 100, 140 and 180 ms. The forward (100 ms, 25 per bucket) starts at 80: its
    # first bucket is there (to 105), the second too (to 130); it waits
    # for the third to 140 (to 165) and the fourth to 180: it ends at 205, 25 ms exposed.
    params, tokens = 4 * MiB, 1000
    cfg = P.PlanConfig(grad_bytes=1, bucket_mb=1.0, link_gbs=MiB / 0.080 / 1e9, latency_us=0.0,
                       tokens_per_device=tokens, compute_tflops=6 * params * tokens / 0.300 / 1e12,
                       optimizer_bytes_per_param=1.0, mem_bandwidth_gbs=params / 0.160 / 1e9, world_sizes=(2,),
                       sharded_last_bucket_mb=None)
    r = P.predict_row(P.shape_from_params(params), cfg, 2)
    assert (r["forward_ms"], r["optimizer_sharded_ms"]) == pytest.approx((100.0, 80.0))
    assert r["all_gather_exposed_ms"] == pytest.approx(25.0)
    # Gathers launched only after a one-call step would end at 40, 80, 120, 160 ms of the forward:
    # 85 ms exposed. The pipelined step hides 60 of them.
    assert r["step_sharded_ms"] == pytest.approx(100 + 25 + 200 + r["reduce_scatter_exposed_ms"] + 80)


def test_compare_calibrates_forward_and_backward_each_and_the_host_cost_of_comm():
    bench = _bench_doc()
    for m in bench["modes"].values():
        m["forward_ms"] = 15.0                                    # forward 0.75x backward, as on this CPU
    bench["modes"]["serial"]["comm_threads_cpu_ms"] = 6.0
    bench["modes"]["sharded"] = {**bench["modes"]["overlap"], "kind": "sharded", "bucket_mb": 1.0}
    bench.update(machine={"nproc": 2}, threads_per_rank=1)      # 2 ranks x 1 thread hold both cores
    pred = P.predict_bench(bench)
    assert pred["calibration"]["forward_share"] == pytest.approx(15 / 35)
    for p in pred["modes"].values():
        assert (p["forward_ms"], p["backward_ms"]) == pytest.approx((15.0, 20.0))
        # The all-reduce sends what serial's sent: its threads' CPU; a reduce-scatter half of it.
        assert p["backward_overlap_ms"] == pytest.approx(26.0)
        assert p["backward_sharded_ms"] == pytest.approx(23.0)
        assert p["forward_sharded_ms"] == pytest.approx(18.0)   # the all-gathers overlap the forward
        # Contention is a cost, not a new limit: the limit is the undisturbed compute's.
        assert p["cross_step_limit_ms"] == pytest.approx(max(15 + 20 + p["optimizer_sharded_ms"], p["comm_busy_ms"]))
    comp = P.compare_with_measurement(pred, bench)
    assert comp["modes"]["serial"]["predicted"]["backward_ms"] == pytest.approx(20.0)
    assert comp["modes"]["overlap"]["predicted"]["backward_ms"] == pytest.approx(26.0)
    assert comp["modes"]["sharded"]["predicted"]["backward_ms"] == pytest.approx(23.0)
    assert comp["modes"]["sharded"]["predicted"]["forward_ms"] == pytest.approx(18.0)
    # With a spare core the threads take nothing from compute; the FLOP-split calibrations keep 1/3.
    bench["machine"]["nproc"] = 16
    spare = P.predict_bench(bench)
    assert spare["modes"]["overlap"]["backward_overlap_ms"] == pytest.approx(20.0)
    assert P.predict_bench(bench, calibrate_from="compute")["modes"]["serial"]["forward_ms"] == pytest.approx(35 / 3)
    assert P.predict_bench(bench, calibrate_from="backward")["modes"]["serial"]["forward_ms"] == pytest.approx(10.0)
    with pytest.raises(ValueError, match="calibrate_from='flops'.*parts, backward, compute"):
        P.predict_bench(bench, calibrate_from="flops")
    for bad in (0, 1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="forward_share"):
            P.PlanConfig(forward_share=bad)
    with pytest.raises(ValueError, match="comm_host_ms_per_mib"):
        P.PlanConfig(comm_host_ms_per_mib=-1)
