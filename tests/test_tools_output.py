"""What the tools print for a person: tables that fit 100 columns, verdicts that say when the machine
spoilt the figures, a soak that ends with a verdict, a loss figure for a short run, an honest ETA."""

from __future__ import annotations

import argparse
import json
import os

import pytest

from hfstream.cli.bench import cli as bench_cli
from hfstream.cli.bench import prefetch as bench_prefetch
from hfstream.cli.bench import session, soak
from hfstream.cli.bench.summary import format_bench_table, summarize_results
from hfstream.plan import main as plan_main

WIDTH = 100


def _record(step, comm, exposed, **extra):
    return {"data_ms": 0.0, "forward_ms": 20.0, "backward_ms": 40.0, "comm_busy_ms": comm, "exposed_comm_ms": exposed,
            "sync_ms": exposed, "optimizer_ms": 5.0, "step_ms": step, "collectives": 4, "forward_cpu_share": 0.9,
            "backward_cpu_share": 0.9, "comm_threads_cpu_ms": 3.0, "loss": 5.0, **extra}


def _run(kind, bucket, step, comm, exposed, state_bytes, **extra):
    return {"kind": kind, "bucket_mb": bucket, "buckets": 3, "optimizer_state_bytes": state_bytes,
            "records": [_record(step + i, comm, exposed, **extra) for i in range(4)]}


def _bench_result(loadavg, monkeypatch, cores=2):
    """A `summarize_results` document from two ranks' made-up records: the modes a quick run has."""
    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    ns = argparse.Namespace(quick=True, world_size=2, steps=None, warmup=None, rounds=None, rate_mbit=None,
                            latency_ms=0.0, shaping="simulated", modes=("serial", "ddp-default", "ddp-best",
                                                                       "overlap", "sharded"),
                            ddp_buckets=None, sharded_buckets=None, n_layer=None, seed=0, timeout_s=None)
    cfg = bench_cli.config_from_args(ns)
    halves = dict(reduce_scatter_busy_ms=10.0, reduce_scatter_exposed_ms=2.0, all_gather_busy_ms=8.0,
                  all_gather_exposed_ms=1.0)
    runs = {"serial": _run("serial", 25.0, 95.0, 30.0, 30.0, 4 << 20),
            "ddp-default": _run("ddp", None, 80.0, 30.0, 15.0, 4 << 20),
            "ddp-best": _run("ddp", 1.0, 75.0, 30.0, 10.0, 4 << 20),
            "overlap": _run("overlap", 25.0, 90.0, 30.0, 25.0, 4 << 20),   # 1.5 x the ceiling: a MISSED target
            "sharded": _run("sharded", 1.0, 70.0, 18.0, 3.0, 2 << 20, **halves)}
    sweep = {"ddp@default": _run("ddp", None, 80.0, 30.0, 15.0, 4 << 20), "ddp@1": _run("ddp", 1.0, 75.0, 30.0, 10.0, 4 << 20)}
    rank = {"runs": runs, "sweep": sweep, "best_ddp_bucket_mb": 1.0, "best_of_sweep": {"ddp": 1.0},
            "calibration": {"effective_rate_mbit": 990.0}, "params": 400_000, "num_threads": 1,
            "loadavg_1min": loadavg}
    shaping = {"kind": "simulated", "rate_mbit": 1000.0, "latency_ms": 0.0}
    return summarize_results(cfg, shaping, [rank, rank], argv=["hfstream", "bench", "--quick"])


def test_bench_table_fits_100_columns_and_wide_shows_every_column(monkeypatch):
    result = _bench_result([0.5, 0.6, 0.4], monkeypatch)
    table = format_bench_table(result)
    assert max(len(line) for line in table.splitlines()) <= WIDTH, table
    header = next(line for line in table.splitlines() if line.startswith("mode"))
    assert header.split() == ["mode", "bucket", "MiB", "step", "forward", "backward", "comm", "busy", "exposed",
                              "optimizer", "vs", "DDP", "vs", "ceiling"]
    for mode in result["modes"]:
        assert any(line.startswith(mode) for line in table.splitlines()), mode
    wide = format_bench_table(result, wide=True)
    assert "cpu fwd/bwd" in wide and "x cross" in wide and max(len(line) for line in wide.splitlines()) > WIDTH


def test_a_loaded_machine_makes_the_timing_targets_unreliable_not_missed(monkeypatch):
    idle = format_bench_table(_bench_result([0.5, 0.6, 0.4], monkeypatch))
    assert "MISSED" in idle and "unreliable" not in idle   # overlap is 1.5 x the ceiling: a real miss
    result = _bench_result([1.1, 6.5, 4.0], monkeypatch)   # 6.5 on 2 cores
    assert result["loaded"] == {"loadavg": 6.5, "cores": 2, "limit": 2.5}
    table = format_bench_table(result)
    assert "MISSED" not in table, table
    assert "unreliable: the machine is loaded (load average 6.5 on 2 cores" in table
    targets = [line for line in table.splitlines() if line.startswith("target ")]
    timing = [t for t in targets if "optimizer state" not in t]
    assert timing and all(t.endswith("unreliable") for t in timing), targets
    # The optimizer state's bytes do not depend on the load: still judged.
    assert any("optimizer state" in t and t.endswith("met") for t in targets), targets
    assert all(not t["judged"] for t in result["targets"].values() if t["timing"])


def test_bench_prefetch_says_when_the_load_makes_it_unreliable(monkeypatch, capsys):
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(os, "getloadavg", lambda: (7.0, 5.0, 3.0))

    def fake_run(**kw):
        return {"compute_ms": 10.0, "collate_ms": 10.0, "collate_rounds": 3, "stock_step_ms": 20.0,
                "prefetch_step_ms": 11.0, "stock_over_sum": 1.0, "prefetch_over_max": 1.1, "speedup": 1.8,
                **bench_prefetch._load_fields([os.getloadavg()[0]] * 2)}

    monkeypatch.setattr(bench_prefetch, "run", fake_run)
    assert bench_prefetch.main(["--steps", "8", "--warmup", "2"]) == 0
    out = capsys.readouterr().out
    assert "unreliable: the machine is loaded (load average 7.0 on 2 cores" in out, out
    monkeypatch.setattr(os, "getloadavg", lambda: (0.4, 0.5, 0.5))
    assert bench_prefetch.main(["--steps", "8", "--warmup", "2"]) == 0
    assert "unreliable" not in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["--model", "llama-8b"], ["--params", "1.3B", "--world-sizes", "1,8,1024"],
                                  ["--model", "gpt2-124m", "--seq-len", "1024"]])
def test_plan_table_fits_100_columns_with_plain_headers(argv, capsys):
    assert plan_main(argv) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= WIDTH, out
    header = next(line for line in out.splitlines() if line.split()[:2] == ["N", "forward"])
    assert header.split() == ["N", "forward", "backward", "optimizer", "comm", "busy", "exposed", "serial",
                              "overlap", "sharded", "ceiling", "fastest"]
    assert plan_main(argv + ["--wide"]) == 0
    assert "2(N-1)/N" in capsys.readouterr().out


def _soak_rows(rss_last, threads_last=9, samples=5, slope=0.5):
    return {"rss_mib": {"after_warmup": 450.0, "last": rss_last, "slope_per_1000_steps": slope},
            "threads": {"after_warmup": 9, "last": threads_last, "slope_per_1000_steps": 0.0},
            "open_files": {"after_warmup": 27, "last": 27, "slope_per_1000_steps": 0.0},
            "judged_samples": samples}


def test_soak_verdict_is_flat_growing_or_unknown_with_its_thresholds():
    flat = soak.verdict({0: _soak_rows(452.0), 1: _soak_rows(451.0)})
    assert flat["verdict"] == "flat" and flat["thresholds"]["rss_mib_per_1000_steps"] == soak.RSS_SLOPE_LIMIT_MIB
    line = soak.format_verdict(flat)
    assert line.startswith("verdict: flat") and f"{soak.RSS_SLOPE_LIMIT_MIB:g} MiB per 1000 steps" in line
    leak = soak.verdict({0: _soak_rows(452.0), 1: _soak_rows(480.0, slope=16.0)})
    assert leak["verdict"] == "growing" and leak["why"] == [
        "rank 1: resident set 450.0 -> 480.0 MiB, +16.0 MiB per 1000 steps"]
    threads = soak.verdict({0: _soak_rows(450.0, threads_last=10)})
    assert threads["verdict"] == "growing" and "threads 9 -> 10" in threads["why"][0]
    # A short run's noisy slope with a small rise is not growth.
    assert soak.verdict({0: _soak_rows(451.0, slope=25.0)})["verdict"] == "flat"
    short = soak.verdict({0: _soak_rows(450.0, samples=2)})
    assert short["verdict"] == "unknown" and "fewer than" in soak.format_verdict(short)
    assert soak.verdict({})["verdict"] == "unknown"


def test_soak_output_ends_with_the_verdict(monkeypatch, capsys):
    rows = {0: _soak_rows(452.0), 1: _soak_rows(452.0)}
    monkeypatch.setattr(soak, "soak", lambda *a, **k: {"per_rank": rows, "verdict": soak.verdict(rows)})
    assert soak.main(["--steps", "10", "--every", "2", "--warmup", "2"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("verdict: flat (")


def _blue_pixels(path) -> int:
    import matplotlib.image

    img = matplotlib.image.imread(str(path))[..., :3]
    target = (0x4C / 255, 0x72 / 255, 0xB0 / 255)   # the train curve's colour
    close = (abs(img[..., 0] - target[0]) < 0.03) & (abs(img[..., 1] - target[1]) < 0.03) & \
        (abs(img[..., 2] - target[2]) < 0.03)
    return int(close.sum())


def test_loss_figure_of_a_run_shorter_than_logging_steps_still_shows_its_loss(tmp_path):
    from hfstream.cli.plot import plot_loss

    # What Trainer.log_history holds after 3 steps with logging_steps=10: the end-of-train summary only.
    history = [{"train_runtime": 1.0, "train_samples_per_second": 12.0, "train_loss": 4.1, "epoch": 0.1, "step": 3}]
    short = plot_loss(history, tmp_path / "short.png")
    empty = plot_loss([], tmp_path / "empty.png")
    assert _blue_pixels(short) > 20 and _blue_pixels(empty) == 0
    curve = plot_loss([{"step": 1, "loss": 4.0}, {"step": 2, "loss": 3.5}], tmp_path / "two.png")
    assert _blue_pixels(curve) > _blue_pixels(short)


class _Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_bench_eta_is_unknown_at_first_then_steps_left_times_measured_step_time(capsys):
    clock = _Clock()
    progress = session._Progress(10, enabled=True, clock=clock)
    clock.t += 30.0                      # model building before the first step: not a step's cost
    progress.step("serial", 1, 10, "warm-up")
    assert progress.eta().startswith("ETA unknown")
    for i in range(2, 6):                # 4 more steps of 2 s each
        clock.t += 2.0
        progress.step("serial", i, 10, "warm-up")
    assert progress.eta() == "ETA 10s (2.00 s/step)"   # 5 steps left x 2 s
    lines = capsys.readouterr().err.strip().splitlines()
    assert "ETA unknown" in lines[0] and "ETA 10s" in lines[-1], lines


def test_bench_eta_is_a_lower_bound_while_auto_tuning_is_pending():
    clock = _Clock()
    progress = session._Progress(10, enabled=False, tuning_sessions=1, clock=clock)
    for i in range(1, 5):
        clock.t += 1.0
        progress.step("overlap-auto", i, 10, "warm-up")
    assert progress.eta().startswith("ETA at least 6s") and "auto-tuning" in progress.eta()
    progress.tuned()
    assert progress.eta() == "ETA 6s (1.00 s/step)"


class _Bucket:
    names = ["h.0.weight", "h.0.bias"]


def _lost_note(mode, monkeypatch, compiled):
    from hfstream.gradsync import overlap_check

    monkeypatch.setattr(overlap_check, "anything_compiled", lambda: compiled)
    check = overlap_check.OverlapCheck(mode)
    for step in range(1, 4):             # every gradient within 0.1 ms of a 100 ms step, three times
        check.reset()
        check.forward_time = 10.0
        check.first_hook, check.last_hook = 10.0999, 10.1
        note = check.step_done(step, [_Bucket(), _Bucket()], launched_in_backward=1, t_enter=10.1)
    return note


def test_overlap_lost_names_the_mode_and_blames_torch_compile_only_when_something_compiled(monkeypatch):
    eager = _lost_note("sharded", monkeypatch, compiled=False)
    assert eager.startswith("GradSync(mode='sharded'): overlap lost") and "at once" in eager
    assert "torch.compile" not in eager and "nothing is compiled" in eager
    compiled = _lost_note("overlap", monkeypatch, compiled=True)
    assert compiled.startswith("GradSync(mode='overlap')") and "torch.compile" in compiled


def test_plan_compare_fits_100_columns(tmp_path, capsys):
    from test_plan import _bench_doc
    doc = _bench_doc()
    doc["modes"]["sharded-best"] = {**doc["modes"]["overlap"], "kind": "sharded", "bucket_mb": 1.0}
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(doc))
    plan_main(["--compare", str(path)])
    out = capsys.readouterr().out
    assert "sharded-best" in out and "per MiB sent" in out, out
    assert max(len(line) for line in out.splitlines()) <= WIDTH, out
