"""The planner's links by level (hfstream/plan/links.py): a ring inside each node, one across
nodes on 1/g of the bytes, worked by hand; 8 GPUs of one NVLink node are not communication-bound."""

from __future__ import annotations

import math

import pytest

import hfstream.plan as P
from hfstream.plan.links import Links

GB = 1e9


def test_one_node_is_one_ring_at_the_node_bandwidth():
    # 8 GPUs, 1 GB at a bus bandwidth of 450 GB/s: 2 x 7/8 x 1e9 / 450e9 s = 3.889 ms.
    links = Links(inter_gbs=50, devices_per_node=8, intra_gbs=450)
    assert links.all_reduce_s(1 * GB, 8) * 1e3 == pytest.approx(2 * 7 / 8 * 1e9 / 450e9 * 1e3)
    assert links.all_reduce_s(1 * GB, 8) * 1e3 == pytest.approx(3.8889, abs=1e-4)
    # Four of them in the node: 2 x 3/4 x 1e9 / 450e9 = 3.333 ms.
    assert links.all_reduce_s(1 * GB, 4) * 1e3 == pytest.approx(3.3333, abs=1e-4)


def test_two_nodes_reduce_scatter_inside_all_reduce_an_eighth_across_all_gather_inside():
    # 16 GPUs = 2 nodes x 8, 1 GB, NVLink 450 GB/s, 50 GB/s per GPU across nodes:
    #   reduce-scatter inside:  7/8 x 1e9 / 450e9           = 1.9444 ms
    #   all-reduce across 2:    2 x 1/2 x (1e9 / 8) / 50e9  = 2.5    ms
    #   all-gather inside:      7/8 x 1e9 / 450e9           = 1.9444 ms
    #                                                         6.3889 ms
    # A flat ring at 50 GB/s: 2 x 15/16 x 1e9 / 50e9 = 37.5 ms.
    links = Links(inter_gbs=50, devices_per_node=8, intra_gbs=450)
    assert links.all_reduce_s(1 * GB, 16) * 1e3 == pytest.approx(1.9444 + 2.5 + 1.9444, abs=1e-3)
    assert Links(inter_gbs=50).all_reduce_s(1 * GB, 16) * 1e3 == pytest.approx(37.5)
    # 64 GPUs = 8 nodes: 2 x 1.9444 + 2 x 7/8 x 125e6 / 50e9 (4.375 ms) = 8.264 ms.
    assert links.all_reduce_s(1 * GB, 64) * 1e3 == pytest.approx(2 * 1.94444 + 4.375, abs=1e-3)


def test_latency_counts_the_steps_of_both_rings_and_a_reduce_scatter_is_half():
    # 16 = 2 x 8 with 10 us a step and no bandwidth term (0 bytes): 2 x (7 + 1) steps = 160 us.
    links = Links(inter_gbs=50, latency_us=10, devices_per_node=8, intra_gbs=450)
    assert links.all_reduce_s(0, 16) * 1e6 == pytest.approx(160.0)
    assert links.reduce_scatter_s(3 * GB, 16) == pytest.approx(links.all_reduce_s(3 * GB, 16) / 2)
    assert links.all_reduce_s(1 * GB, 1) == 0.0


def test_without_a_node_size_it_is_the_flat_ring():
    # 2(N-1)/N x 7e8 B / 25 GB/s + 2(N-1) x 5 us, whatever the node bandwidth when a node holds one device.
    for n in (2, 3, 8, 1024):
        flat = 2 * (n - 1) / n * 7e8 / 25e9 + 2 * (n - 1) * 5e-6
        assert Links(25, 5, None).all_reduce_s(7e8, n) == pytest.approx(flat)
        assert Links(25, 5, 1, 900).all_reduce_s(7e8, n) == pytest.approx(flat)
        assert P.allreduce_s(7e8, n, 25, 5) == pytest.approx(flat)


def test_a_part_filled_node_is_priced_as_a_full_one():
    # 12 GPUs at 8 a node: 2 nodes of 8 (the slowest node sets the pace), as 16.
    links = Links(inter_gbs=50, devices_per_node=8, intra_gbs=450)
    assert links.levels(12) == (8, 2)
    assert links.all_reduce_s(1 * GB, 12) == pytest.approx(links.all_reduce_s(1 * GB, 16))


def test_llama_8b_on_one_h100_node_is_not_communication_bound(capsys):
    # 8.03e9 fp32 gradients = 32.12e9 B; on one node at 450 GB/s: 2 x 7/8 x 32.12e9 / 450e9 = 124.9 ms,
    # plus 194 buckets x 14 ring steps x 5 us = 13.6 ms: 138.5 ms against a 621.6 ms backward
    # (6 x 8.03e9 x 8192 x 2/3 FLOP at 989 TFLOP/s x 0.4). A flat ring at 50 GB/s: 1,124 ms, comm-bound.
    shape = P.load_model("llama-8b")
    node = P.PlanConfig(peak_tflops=989, link_gbs=50, devices_per_node=8, intra_node_gbs=450, world_sizes=(8,))
    r = P.predict_row(shape, node, 8)
    grad = 8_030_261_248 * 4
    assert r["comm_busy_ms"] == pytest.approx(2 * 7 / 8 * grad / 450e9 * 1e3 + 194 * 14 * 5e-3, rel=1e-6)
    assert r["comm_busy_ms"] == pytest.approx(138.5, abs=0.1)
    assert r["backward_ms"] == pytest.approx(621.6, abs=0.1) and r["overlap_complete"]
    flat = P.predict_row(shape, P.PlanConfig(peak_tflops=989, link_gbs=50, world_sizes=(8,)), 8)
    assert not flat["overlap_complete"] and flat["comm_busy_ms"] > 1100
    # The --device preset brings the node: the table calls 8 complete, and says from where it is not.
    assert P.main(["--model", "llama-8b", "--device", "h100-80gb", "--world-sizes", "8,16"]) == 0
    out = capsys.readouterr().out
    assert "8 devices per node at 450 GB/s, 50 GB/s per device across nodes" in " ".join(out.split())
    row8 = next(ln.split() for ln in out.splitlines() if ln.split()[:1] == ["8"] and len(ln.split()) == 11)
    assert float(row8[4]) == pytest.approx(138.5, abs=0.1)      # comm busy, below the 621.6 backward


def test_overlap_limit_and_sharded_halves_use_the_levels():
    shape = P.shape_from_params(10**9)
    # Backward 6 x 1e9 x 512 x 2/3 / 124.8e12 = 16.4 ms; 4 GB of gradients take 2 x 7/8 x 4e9 / 450e9
    # = 15.6 ms in one node, + 2 x 1/2 x 5e8 / 50e9 = 10 ms across 2 nodes: complete up to 8, not from 9.
    cfg = P.PlanConfig(tokens_per_device=512, link_gbs=50, devices_per_node=8, intra_node_gbs=450, latency_us=0,
                       bucket_mb=math.inf)
    limit = P.overlap_limit(shape, cfg)
    assert limit == 9
    busy = [P.predict_row(shape, cfg, n)["comm_busy_ms"] for n in (limit - 1, limit)]
    bwd = P.predict_row(shape, cfg, 8)["backward_ms"]
    assert busy[0] <= bwd < busy[1]
    r = P.predict_row(shape, cfg, 16)
    assert r["reduce_scatter_busy_ms"] == pytest.approx(r["comm_busy_ms"] / 2)


def test_explicit_link_flags_win_over_the_device_preset(tmp_path, capsys):
    out_json = tmp_path / "p.json"
    assert P.main(["--model", "llama-8b", "--device", "a100-80gb", "--link-gbs", "12.5", "--intra-node-gbs", "200",
                   "--world-sizes", "8", "--json", str(out_json)]) == 0
    import json
    inputs = json.loads(out_json.read_text())["inputs"]
    assert (inputs["link_gbs"], inputs["intra_node_gbs"], inputs["devices_per_node"]) == (12.5, 200, 8)
    assert inputs["peak_tflops"] == 312.0


@pytest.mark.parametrize("flag,value", [("--devices-per-node", "0"), ("--intra-node-gbs", "0"),
                                        ("--intra-node-gbs", "fast")])
def test_bad_link_values_fail_naming_the_flag(flag, value, capsys):
    with pytest.raises(SystemExit) as exc:
        P.main([flag, value])
    assert exc.value.code == 2
    assert f"argument {flag}" in capsys.readouterr().err


def test_node_presets_are_within_10_percent_of_published_nccl_tests_bus_bandwidths():
    # all_reduce_perf -g 8, busbw at large sizes (Alaya NeW, "NCCL-tests in practice", 2026-05-06):
    # 8x H100 SXM5 460-480 GB/s, 8x A100 SXM4 230-250 GB/s (hfstream/plan/devices.py).
    from hfstream.plan.devices import DEVICES

    for name, (low, high) in {"h100-80gb": (460, 480), "h200-141gb": (460, 480), "a100-40gb": (230, 250),
                              "a100-80gb": (230, 250)}.items():
        assert DEVICES[name].intra_node_gbs == pytest.approx((low + high) / 2, rel=0.10), name
