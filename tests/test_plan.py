"""The planner: hand-computed cases, the invariants a reader of its table relies on, model
parsing (presets, config.json, transformers' own parameter lists), the figure and the flags."""

from __future__ import annotations

import json
import math

import pytest

import hfstream.plan as P
from hfstream.plan.cli import _count

MiB = 2**20


def row_for(shape, world_size, **cfg):
    return P.predict_row(shape, P.PlanConfig(world_sizes=(world_size,), **cfg), world_size)


# ---------------------------------------------------------------------------------------------
# Known cases, computed by hand
# ---------------------------------------------------------------------------------------------

def test_one_device_has_no_communication():
    r = row_for(P.load_model("llama-8b"), 1)
    assert r["ring_factor"] == 0.0
    assert r["comm_busy_ms"] == r["exposed_serial_ms"] == r["exposed_overlap_ms"] == 0.0
    assert r["step_serial_ms"] == r["step_overlap_ms"] == r["ideal_ms"] == pytest.approx(
        r["forward_ms"] + r["backward_ms"] + r["optimizer_ms"])
    assert r["efficiency_serial"] == r["efficiency_overlap"] == 1.0
    assert r["overlap"] is None                       # nothing to overlap: not NaN in strict JSON


def test_two_devices_send_each_byte_once():
    assert P.ring_factor(2) == 1.0
    # One bucket of 1 GB over 10 GB/s with 7 us per ring step: 1e9/1e10 s + 2 steps x 7 us.
    r = row_for(P.shape_from_params(250_000_000), 2, grad_bytes=4, bucket_mb=math.inf, link_gbs=10.0, latency_us=7.0)
    assert r["comm_busy_ms"] == pytest.approx(100.0 + 0.014)


def test_compute_and_optimizer_by_hand():
    # 6 P T = 6e12 FLOPs at 250 TFLOP/s x 0.4 = 1e14 FLOP/s: 60 ms, forward 1/3, backward 2/3.
    # Optimizer: 1e9 params x 28 B at 2000 GB/s = 14 ms.
    r = row_for(P.shape_from_params(10**9), 8, tokens_per_device=1000, peak_tflops=250, mfu=0.4,
                mem_bandwidth_gbs=2000, optimizer_bytes_per_param=28)
    assert (r["forward_ms"], r["backward_ms"], r["optimizer_ms"]) == pytest.approx((20.0, 40.0, 14.0))


def test_comm_time_in_the_table_matches_the_hand_computation(capsys):
    # 1e9 fp32 gradients = 4e9 B in 25 MiB buckets: ceil(4e9 / 26214400) = 153 buckets.
    # N = 4: 2(N-1)/N = 1.5; 1.5 x 4e9 B / 10 GB/s = 600 ms, plus 153 buckets x 2(N-1) = 6
    # ring steps x 10 us = 9.18 ms: 609.18 ms.
    rc = P.main(["--params", "1e9", "--grad-bytes", "4", "--bucket-mb", "25", "--link-gbs", "10",
                 "--latency-us", "10", "--world-sizes", "1,4", "--wide"])
    out = capsys.readouterr().out
    assert rc == 0
    line = next(ln for ln in out.splitlines() if ln.split() and ln.split()[0] == "4")
    assert line.split()[1] == "1.500"
    assert line.split()[5] == "609.2"                  # the comm busy column
    doc = P.plan(P.shape_from_params(10**9), P.PlanConfig(grad_bytes=4, bucket_mb=25, link_gbs=10, latency_us=10,
                                                          world_sizes=(4,)))
    assert doc["buckets"]["count"] == 153
    assert doc["rows"][0]["comm_busy_ms"] == pytest.approx(600.0 + 153 * 6 * 0.010)


def test_overlap_schedule_by_hand():
    # Two buckets of 1 MiB (2 MiB of 1-byte gradients), each 80 ms on the link at N = 2;
    # backward 100 ms. Bucket 1 is ready at 50 ms and ends at 130; bucket 2 is ready at 100,
    # waits for the link until 130 and ends at 210: 110 ms exposed, not 160 - 100 = 60.
    params, tokens = 2 * MiB, 1000
    cfg = dict(grad_bytes=1, bucket_mb=1.0, link_gbs=MiB / 0.080 / 1e9, latency_us=0.0, tokens_per_device=tokens,
               compute_tflops=4 * params * tokens / 0.100 / 1e12)
    r = row_for(P.shape_from_params(params), 2, **cfg)
    assert r["backward_ms"] == pytest.approx(100.0)
    assert r["comm_busy_ms"] == pytest.approx(160.0)
    assert r["last_bucket_ms"] == pytest.approx(80.0)
    assert r["exposed_overlap_ms"] == pytest.approx(110.0)
    assert r["ideal_ms"] == pytest.approx(r["forward_ms"] + 160.0 + r["optimizer_ms"])
    assert not r["overlap_complete"]


# ---------------------------------------------------------------------------------------------
# Invariants over many settings
# ---------------------------------------------------------------------------------------------

SETTINGS = [
    ("gpt2-124m", dict(bucket_mb=25.0)),
    ("gpt2-124m", dict(bucket_mb=0.0, latency_us=50.0)),
    ("llama-1b", dict(bucket_mb=math.inf, grad_bytes=2)),
    ("llama-8b", dict(bucket_mb=25.0, first_bucket_mb=1.0)),
    ("llama-70b", dict(bucket_mb=100.0, link_gbs=400.0)),
    (3_000_000_000, dict(bucket_mb=4.0, link_gbs=2.0, latency_us=20.0)),
]


@pytest.mark.parametrize("model,cfg", SETTINGS, ids=[str(m) for m, _ in SETTINGS])
def test_overlap_never_hurts_and_the_ceiling_is_a_lower_bound(model, cfg):
    shape = P.load_model(model) if isinstance(model, str) else P.shape_from_params(model)
    doc = P.plan(shape, P.PlanConfig(**cfg))
    assert [r["world_size"] for r in doc["rows"]] == list(P.DEFAULT_WORLD_SIZES)
    for r in doc["rows"]:
        assert 0.0 <= r["exposed_overlap_ms"] <= r["exposed_serial_ms"] + 1e-9
        assert r["ideal_ms"] <= r["step_overlap_ms"] + 1e-9
        assert r["step_overlap_ms"] <= r["step_serial_ms"] + 1e-9
        assert 0.0 < r["efficiency_serial"] <= r["efficiency_overlap"] + 1e-12
        assert r["efficiency_overlap"] <= 1.0 + 1e-12
        if r["world_size"] > 1:
            # The last bucket is ready only when backward ends: it can never be hidden.
            assert r["exposed_overlap_ms"] >= r["last_bucket_ms"] - 1e-9 > 0
            assert r["exposed_overlap_ms"] >= r["comm_busy_ms"] - r["backward_ms"] - 1e-9


def test_ring_factor_and_comm_grow_with_world_size():
    sizes = [1, 2, 3, 4, 8, 100, 1024, 10**6]
    factors = [P.ring_factor(n) for n in sizes]
    assert factors == sorted(factors) and factors[-1] < 2.0
    doc = P.plan(P.load_model("gpt2-124m"), P.PlanConfig(world_sizes=tuple(sizes)))
    busy = [r["comm_busy_ms"] for r in doc["rows"]]
    assert busy == sorted(busy)
    # Without latency, comm busy tends to 2 x bytes / bandwidth and never exceeds it.
    cfg = P.PlanConfig(latency_us=0, link_gbs=10, grad_bytes=4, world_sizes=(10**6,))
    doc = P.plan(P.shape_from_params(10**9), cfg)
    assert doc["rows"][0]["comm_busy_ms"] < 2 * 4e9 / 1e10 * 1e3


def test_overlap_limit_is_where_comm_busy_first_exceeds_backward():
    shape = P.load_model("llama-8b")
    cfg = P.PlanConfig(link_gbs=25.0, latency_us=5.0)
    limit = P.overlap_limit(shape, cfg)
    assert limit is not None and limit >= 2
    before = row_for(shape, limit - 1, link_gbs=25.0, latency_us=5.0)
    at = row_for(shape, limit, link_gbs=25.0, latency_us=5.0)
    assert before["overlap_complete"] and not at["overlap_complete"]
    assert P.plan(shape, cfg)["overlap_incomplete_from"] == limit
    # A fast link without latency: comm busy stays below backward for every N.
    assert P.overlap_limit(shape, P.PlanConfig(link_gbs=1000.0, latency_us=0.0)) is None


def test_seq_len_adds_attention_flops_and_calibration_hits_the_measured_backward():
    shape = P.load_model("llama-8b")            # 32 layers, 32 heads x 128 = 4096 attention width
    plain, attn = P.PlanConfig(tokens_per_device=4096), P.PlanConfig(tokens_per_device=4096, seq_len=4096)
    extra = P.step_flops(shape, attn) - P.step_flops(shape, plain)
    assert extra == pytest.approx(12 * 32 * 4096 * 4096 * 4096)
    cfg = P.PlanConfig(tokens_per_device=4096)
    cfg.compute_tflops = P.calibrated_tflops(shape, cfg, 123.0, "backward")
    r = row_for(shape, 8, tokens_per_device=4096, compute_tflops=cfg.compute_tflops)
    assert r["backward_ms"] == pytest.approx(123.0)
    cfg.compute_tflops = P.calibrated_tflops(shape, cfg, 300.0, "compute")
    r = row_for(shape, 8, tokens_per_device=4096, compute_tflops=cfg.compute_tflops)
    assert r["forward_ms"] + r["backward_ms"] == pytest.approx(300.0)


# ---------------------------------------------------------------------------------------------
# Models: presets, config.json, agreement with transformers and with GradSync's buckets
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,params", [("gpt2-124m", 124_439_808), ("llama-1b", 1_235_814_400),
                                         ("llama-8b", 8_030_261_248), ("llama-70b", 70_553_706_496)])
def test_presets_have_the_published_parameter_counts(name, params):
    assert P.load_model(name).params == params


TINY = [
    {"model_type": "gpt2", "vocab_size": 97, "n_positions": 16, "n_embd": 24, "n_layer": 2, "n_head": 2},
    {"model_type": "gpt2", "vocab_size": 97, "n_positions": 16, "n_embd": 24, "n_layer": 1, "n_head": 2,
     "n_inner": 40, "tie_word_embeddings": False},
    {"model_type": "llama", "vocab_size": 97, "hidden_size": 32, "intermediate_size": 56, "num_hidden_layers": 2,
     "num_attention_heads": 4, "num_key_value_heads": 2},
    {"model_type": "llama", "vocab_size": 97, "hidden_size": 32, "intermediate_size": 56, "num_hidden_layers": 1,
     "num_attention_heads": 4, "head_dim": 16, "tie_word_embeddings": True, "attention_bias": True, "mlp_bias": True},
    {"model_type": "qwen2", "vocab_size": 97, "hidden_size": 32, "intermediate_size": 56, "num_hidden_layers": 2,
     "num_attention_heads": 4, "num_key_value_heads": 1, "tie_word_embeddings": True},
]


def _transformers_params(config: dict) -> list[tuple[str, int]]:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(config["model_type"], **{k: v for k, v in config.items() if k != "model_type"})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    return [(n, p.numel()) for n, p in model.named_parameters()]


@pytest.mark.parametrize("config", TINY, ids=lambda c: f"{c['model_type']}-{c.get('tie_word_embeddings', 'default')}")
def test_architecture_counts_match_transformers_tensor_by_tensor(config):
    shape = P.shape_from_config(config)
    assert [(n, k) for n, k, _ in shape.tensors] == _transformers_params(config)


def test_unknown_model_types_are_built_on_the_meta_device():
    config = {"model_type": "gpt_neox", "vocab_size": 50, "hidden_size": 16, "num_hidden_layers": 2,
              "num_attention_heads": 2, "intermediate_size": 32}
    shape = P.shape_from_config(config)
    assert shape.params == sum(k for _, k in _transformers_params(config))
    assert shape.tensors[0][2] == "lookup"           # untied input embedding: no FLOPs
    assert shape.flop_params == shape.params - 50 * 16
    with pytest.raises(ValueError, match="nonsense.*--params"):
        P.shape_from_config({"model_type": "nonsense"})


def test_buckets_are_gradsync_buckets():
    """With the tensors known, the planner cuts the gradient exactly as GradSync does."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from hfstream.gradsync.buckets import plan_buckets as gradsync_plan

    config = TINY[0]
    with torch.device("meta"):
        model = GPT2LMHeadModel(GPT2Config(**{k: v for k, v in config.items() if k != "model_type"}))
    shape = P.shape_from_config(config)
    for mb, first in ((0.0, None), (0.01, None), (0.05, None), (0.05, 0.01), (math.inf, None)):
        mine = P.predict_buckets(shape, 4, mb, first)
        theirs = gradsync_plan(list(model.named_parameters()), mb, first_bucket_mb=first)
        assert [b for b, _ in mine] == [b.nbytes for b in theirs]
        ready = [r for _, r in mine]
        assert ready == sorted(ready) and ready[-1] == 1.0     # the tied embedding's bucket comes last


def test_config_json_file_and_directory(tmp_path, capsys):
    config = dict(TINY[2], architectures=["LlamaForCausalLM"], torch_dtype="bfloat16")
    (tmp_path / "config.json").write_text(json.dumps(config))
    expected = sum(k for _, k in _transformers_params(TINY[2]))
    assert P.load_model(str(tmp_path / "config.json")).params == expected
    assert P.load_model(str(tmp_path)).params == expected
    assert P.main(["--model", str(tmp_path / "config.json"), "--seq-len", "16", "--world-sizes", "1,2"]) == 0
    assert "config.json" in capsys.readouterr().out


def test_bad_model_argument_says_what_it_accepts(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        P.main(["--model", str(tmp_path / "missing.json")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--model" in err and "llama-8b" in err
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(SystemExit):
        P.main(["--model", str(tmp_path / "config.json")])
    assert "model_type" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# Outputs and flags
# ---------------------------------------------------------------------------------------------

def test_plot_and_strict_json(tmp_path, capsys):
    png, out = tmp_path / "plan.png", tmp_path / "plan.json"
    assert P.main(["--model", "gpt2-124m", "--bucket-mb", "inf", "--plot", str(png), "--json", str(out)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000

    def no_constants(name):
        raise AssertionError(f"{name} in the JSON")

    doc = json.loads(out.read_text(), parse_constant=no_constants)
    assert doc["inputs"]["bucket_mb"] == "inf" and doc["buckets"]["count"] == 1
    assert [r["world_size"] for r in doc["rows"]] == list(P.DEFAULT_WORLD_SIZES)
    assert "comm busy" in capsys.readouterr().out


def test_plot_plan_leaves_the_backend_alone(tmp_path):
    """The planner figure never switches matplotlib's backend (a notebook's inline one stays)."""
    import matplotlib

    from hfstream.cli.plot import plot_plan

    before = matplotlib.get_backend()
    matplotlib.use("svg")          # not Agg, so a switch to Agg would show
    try:
        doc = P.plan(P.load_model("gpt2-124m"), P.PlanConfig(world_sizes=(1, 8, 64)))
        png = plot_plan(doc, tmp_path / "sub" / "plan.png")
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert matplotlib.get_backend() == "svg"
    finally:
        matplotlib.use(before)


@pytest.mark.parametrize("flag,value", [
    ("--link-gbs", "0"), ("--link-gbs", "-3"), ("--latency-us", "-1"), ("--mfu", "1.5"), ("--mfu", "0"),
    ("--peak-tflops", "nan"), ("--tokens-per-device", "0"), ("--world-sizes", "0,2"), ("--world-sizes", "a"),
    ("--bucket-mb", "-1"), ("--params", "lots"), ("--params", "0"), ("--grad-bytes", "0"),
    ("--mem-bandwidth-gbs", "0"), ("--calibrate-backward-ms", "0"), ("--first-bucket-mb", "0"),
    ("--calibrate-from", "flops"),
])
def test_bad_values_fail_naming_the_flag(flag, value, capsys):
    with pytest.raises(SystemExit) as exc:
        P.main([flag, value])
    assert exc.value.code == 2
    assert f"argument {flag}" in capsys.readouterr().err


@pytest.mark.parametrize("argv,flag", [
    (["--params", "1B", "--seq-len", "2048"], "--seq-len"),
    (["--params", "1B", "--bucket-mb", "0"], "--bucket-mb"),
    (["--calibrate-backward-ms", "10", "--calibrate-compute-ms", "30"], "--calibrate-compute-ms"),
    (["--json", "/nonexistent-dir/x.json"], "--json"),
])
def test_inconsistent_flags_fail_naming_the_flag(argv, flag, capsys):
    assert P.main(argv) == 2
    assert flag in capsys.readouterr().err


def test_parameter_counts_and_config_errors():
    assert _count("124M") == 124_000_000 and _count("1.3B") == 1_300_000_000 and _count("7e9") == 7 * 10**9
    with pytest.raises(ValueError, match="link_gbs"):
        P.PlanConfig(link_gbs=0)
    with pytest.raises(ValueError, match="mfu"):
        P.PlanConfig(mfu=2)


# ---------------------------------------------------------------------------------------------
# Against a benchmark document (the shape `hfstream bench --json` writes)
# ---------------------------------------------------------------------------------------------

def _bench_doc() -> dict:
    model = {"n_layer": 2, "n_embd": 256, "n_head": 2, "vocab_size": 128, "seq_len": 32, "batch_size": 2}
    params = P.shape_from_config({"model_type": "gpt2", **{k: model[k] for k in ("vocab_size", "n_embd", "n_layer",
                                                                                 "n_head")}, "n_positions": 32}).params

    def mode(kind, bucket, **ms):
        return {"kind": kind, "bucket_mb": bucket, "forward_ms": 10.0, "backward_ms": 20.0, "optimizer_ms": 2.0, **ms}

    return {
        "config": {"world_size": 2},
        "shaping": {"kind": "simulated", "rate_mbit": 100.0, "latency_ms": 0.0},
        "model": {**model, "params": params},
        "modes": {"serial": mode("serial", 25.0, comm_busy_ms=30.0, exposed_comm_ms=30.0, step_ms=62.0),
                  "overlap": mode("overlap", 25.0, comm_busy_ms=30.0, exposed_comm_ms=30.0, step_ms=62.0),
                  "ddp-default": mode("ddp", None, comm_busy_ms=30.0, exposed_comm_ms=15.0, step_ms=47.0)},
        "ceiling": {"step_ms": 62.0},
    }


def test_compare_with_a_bench_document(tmp_path, capsys):
    bench = _bench_doc()
    pred = P.predict_bench(bench)
    grad_bytes = bench["model"]["params"] * 4
    link_ms = grad_bytes * 8 / (100.0 * 1e6) * 1e3                   # N = 2: each byte once at 100 Mbit/s
    for name, p in pred["modes"].items():
        assert p["backward_ms"] == pytest.approx(20.0)                # calibrated from serial's backward
        assert p["forward_ms"] == pytest.approx(10.0)                 # the 1/3 : 2/3 convention
        assert p["optimizer_ms"] == pytest.approx(2.0)                # calibrated memory bandwidth
        assert p["comm_busy_ms"] == pytest.approx(link_ms)
    assert pred["modes"]["ddp-default"]["buckets"] == 2               # DDP's 1 MiB first bucket, then the rest

    comp = P.compare_with_measurement(pred, bench)
    serial = comp["modes"]["serial"]
    assert serial["rel_error"]["backward_ms"] == pytest.approx(0.0)
    assert serial["rel_error"]["comm_busy_ms"] == pytest.approx((link_ms - 30.0) / 30.0)
    assert serial["predicted"]["step_ms"] == pytest.approx(10 + 20 + link_ms + 2)
    assert serial["rel_error"]["step_ms"] == pytest.approx((32 + link_ms - 62.0) / 62.0)
    # A non-serial mode is compared with the overlapped prediction.
    overlap = comp["modes"]["overlap"]["predicted"]["step_ms"]
    assert overlap == pytest.approx(pred["modes"]["overlap"]["step_overlap_ms"])
    assert set(comp["max_abs_rel_error"]) == {"comm_busy_ms", "backward_ms", "step_ms"}

    one = P.compare_with_measurement(pred["modes"]["serial"], bench["modes"]["serial"])
    assert one["modes"]["serial"]["rel_error"] == serial["rel_error"]

    path = tmp_path / "bench.json"
    path.write_text(json.dumps(bench))
    assert P.main(["--compare", str(path), "--json", str(tmp_path / "cmp.json")]) == 0
    out = capsys.readouterr().out
    assert "serial" in out and "ddp-default" in out and "largest |error|" in out
    written = json.loads((tmp_path / "cmp.json").read_text())
    assert written["comparison"]["modes"]["serial"]["measured"]["step_ms"] == 62.0
    path.write_text("{}")
    assert P.main(["--compare", str(path)]) == 2
    assert "--compare" in capsys.readouterr().err
