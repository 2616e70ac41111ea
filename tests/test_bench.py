"""The communication benchmark and its links: the simulated link really delays and never blocks
compute, the shaped namespace is created, limits the rate and always disappears, the quick
benchmark produces a complete and consistent JSON, and bad flags fail with their name."""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hfstream.gradsync import DDP_BUCKET_MB
from hfstream.cli.bench import cli as bench
from hfstream.cli.bench import config, netns
from hfstream.cli.bench.link import SimulatedLink, ring_allreduce_bytes

REPO = Path(__file__).resolve().parents[1]
MiB = 2**20


# -- the simulated link ---------------------------------------------------------------------------

def test_ring_allreduce_moves_2_n_minus_1_over_n_bytes():
    assert ring_allreduce_bytes(100, 1) == 0
    assert ring_allreduce_bytes(100, 2) == 100
    assert ring_allreduce_bytes(100, 4) == 150


def test_simulated_link_carries_one_transfer_at_a_time():
    link = SimulatedLink(rate_mbit=8.0, latency_ms=5.0)      # 1 MB/s
    assert link.transfer_s(10_000, 2) == pytest.approx(0.005 + 0.010)
    t0 = time.perf_counter()
    first = link.reserve(10_000, 2)
    second = link.reserve(10_000, 2)                          # queued behind the first
    assert first >= t0 + 0.015
    assert second == pytest.approx(first + 0.015)


def _simulated_allreduce_rank(rank, world_size, rate_mbit):
    import torch.distributed as dist

    def compute():
        a = torch.randn(96, 96)
        for _ in range(40):
            a = torch.tanh(a @ a)
        return a

    t_compute_alone = min(_timed(compute) for _ in range(3))
    link = SimulatedLink(rate_mbit=rate_mbit)
    expected = link.transfer_s(MiB, world_size)
    original = dist.all_reduce
    out = {"expected": expected, "compute_alone": t_compute_alone}
    with link.installed():
        # wait(): what GradSync calls; compute launched meanwhile must run at full speed.
        x = torch.full((MiB // 4,), float(rank + 1))
        dist.barrier()
        t0 = time.perf_counter()
        work = dist.all_reduce(x, async_op=True)
        out["launch"] = time.perf_counter() - t0
        out["compute_in_flight"] = _timed(compute)
        out["completed_after_compute"] = work.is_completed()
        work.wait()
        out["wait_total"] = time.perf_counter() - t0
        out["value"] = float(x[0])
        # get_future(): what a DDP comm hook returns and GradSync chains its bookkeeping on.
        y = torch.ones(MiB // 4)
        dist.barrier()
        t0 = time.perf_counter()
        value = dist.all_reduce(y, async_op=True).get_future().wait()
        out["future_total"] = time.perf_counter() - t0
        out["future_value"] = float(value[0][0])
        # async_op=False blocks for the simulated time too.
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(torch.ones(MiB // 4))
        out["sync_total"] = time.perf_counter() - t0
    out["restored"] = dist.all_reduce is original
    return out


def _timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


@pytest.mark.multiprocess
def test_simulated_allreduce_takes_bytes_over_bandwidth_and_never_blocks_compute(run_distributed):
    # 1 MiB on 2 ranks over 16 Mbit/s: 2 x 1/2 x 1 MiB x 8 / 16e6 = 0.52 s on the link.
    results = run_distributed(_simulated_allreduce_rank, 2, 16.0, timeout=120)
    for r in results:
        assert r["expected"] == pytest.approx(MiB * 8 / 16e6)
        assert r["wait_total"] >= r["expected"]
        assert r["future_total"] >= r["expected"]
        assert r["sync_total"] >= r["expected"]
        assert r["value"] == 3.0 and r["future_value"] == 2.0          # the real sum came back
        # Launching returns at once, and the compute after it finished long before the link did.
        assert r["launch"] < 0.25 * r["expected"]
        assert r["launch"] + r["compute_in_flight"] < r["expected"]
        assert not r["completed_after_compute"]
        assert r["restored"]


# -- the shaped namespace ---------------------------------------------------------------------------

def _require_netns():
    ok, reason = netns.can_shape()
    if not ok:
        pytest.skip(f"no shaped namespace here: {reason}")


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["TORCH_CPP_LOG_LEVEL"] = "ERROR"
    return env


def _tbf_line(name: str) -> str:
    return subprocess.run(["ip", "netns", "exec", name, "tc", "qdisc", "show", "dev", "lo"],
                          capture_output=True, text=True, timeout=10).stdout


@pytest.mark.multiprocess
def test_shaped_namespace_limits_an_allreduce_and_is_removed():
    _require_netns()
    # 2 ranks share the loopback: 160 Mbit/s on lo = 80 Mbit/s per rank; 2 MiB then needs 0.21 s.
    with netns.shaped_namespace(rate_mbit=160) as name:
        assert netns.namespace_exists(name)
        assert "tbf" in _tbf_line(name)
        cmd = [sys.executable, "-m", "hfstream.cli.bench.netns", "probe", "--inside", "--mb", "2", "--world-size", "2"]
        proc = netns.run_in_namespace(name, cmd, timeout_s=120, env=_env(), capture_output=True)
        assert proc.returncode == 0, proc.stderr
    assert not netns.namespace_exists(name)
    measured = json.loads(proc.stdout.strip().splitlines()[-1])
    expected = ring_allreduce_bytes(2 * MiB, 2) * 8 / 80e6
    # tbf lets its 256 KiB burst through at line rate and TCP timing varies run to run (0.167 s
    # was seen once against 0.21 s): the bound is loose, yet far from the unshaped loopback,
    # which moves the same bytes in a few milliseconds.
    assert measured["seconds"] >= 0.5 * expected
    assert measured["effective_rate_mbit"] < 2 * 80


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_shaped_namespace_is_removed_on_error_and_interrupt(exc):
    _require_netns()
    with pytest.raises(exc):
        with netns.shaped_namespace(rate_mbit=100) as name:
            raise exc("boom")
    assert not netns.namespace_exists(name)


def test_run_in_namespace_kills_a_command_that_overruns():
    _require_netns()
    with netns.shaped_namespace(rate_mbit=100) as name:
        t0 = time.perf_counter()
        with pytest.raises(subprocess.TimeoutExpired):
            netns.run_in_namespace(name, ["sleep", "30"], timeout_s=1)
        assert time.perf_counter() - t0 < 15
    assert not netns.namespace_exists(name)


# -- the benchmark ----------------------------------------------------------------------------------

@pytest.mark.multiprocess
def test_quick_bench_writes_every_mode_with_consistent_ratios(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert bench.main(["--quick", "--shaping", "simulated", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    result = json.loads(out.read_text())

    assert result["shaping"]["kind"] == "simulated"
    assert result["shaping"]["rate_mbit"] > 0 and "latency_ms" in result["shaping"]
    assert list(result["modes"]) == list(config.MODES)
    base = result["modes"]["ddp-default"]["step_ms"]
    ceiling = result["ceiling"]["step_ms"]
    assert ceiling > 0
    for mode, m in result["modes"].items():
        assert m["step_ms"] > 0 and len(m["step_ms_all"]) == result["config"]["steps"]
        assert math.isfinite(m["loss"])
        assert result["ratios"][mode]["to_ddp_default"] == pytest.approx(m["step_ms"] / base)
        assert result["ratios"][mode]["to_ceiling"] == pytest.approx(m["step_ms"] / ceiling)
        assert mode in table
    # Communication was measured in every mode the simulated link shapes, and it really slowed it
    # down; the sharded modes' collectives it does not delay, and the table says so.
    link_ms = result["model"]["link_time_ms"]
    assert result["unshaped_modes"] == list(config.SHARDED_MODES) and "warning: the simulated link" in table
    for name, m in result["modes"].items():
        if name not in config.SHARDED_MODES:
            assert m["comm_busy_ms"] >= 0.9 * link_ms
    assert math.isnan(result["modes"]["fsdp2-best"]["comm_busy_ms"])   # FSDP2 hides its collectives
    sharded = result["modes"]["sharded"]
    assert sharded["all_gather_busy_ms"] > 0 and sharded["reduce_scatter_busy_ms"] > 0
    # comm busy is the median of per-step sums of both halves: never below either half's median
    # (each step's sum is at least that half), whatever the load does to the medians.
    assert sharded["comm_busy_ms"] >= max(sharded["all_gather_busy_ms"], sharded["reduce_scatter_busy_ms"]) - 1e-6
    # ddp-best is the fastest of the DDP sweep it reports, and overlap-best uses its bucket; so for
    # sharded-best and fsdp2-best among theirs.
    for kind, mode in (("ddp", "ddp-best"), ("sharded", "sharded-best"), ("fsdp2", "fsdp2-best")):
        sweep = {s["bucket_mb"]: s["step_ms"] for s in result["ddp_sweep"] if s["kind"] == kind}
        best = result["modes"][mode]["bucket_mb"]
        assert best in sweep and sweep[best] == min(sweep.values()), kind
    assert result["modes"]["overlap-best"]["bucket_mb"] == (result["best_ddp_bucket_mb"] or DDP_BUCKET_MB)
    # The cross-step limit comes from the serial run's parts; every mode is set against it.
    s, x = result["modes"]["serial"], result["cross_step"]
    n = result["config"]["world_size"]
    assert x["step_ms"] == pytest.approx(max(s["forward_ms"] + s["backward_ms"] + s["optimizer_ms"] / n,
                                             s["comm_busy_ms"]))
    assert result["ratios"]["sharded"]["to_cross_step"] == pytest.approx(sharded["step_ms"] / x["step_ms"])
    # Optimizer state per rank, measured: the sharded modes hold about 1/N of it.
    full = result["modes"]["ddp-best"]["optimizer_state_bytes"]
    assert full > 8 * result["model"]["params"]   # AdamW: two fp32 moments per parameter
    for mode in config.SHARDED_MODES:
        assert result["modes"][mode]["optimizer_state_bytes"] <= 0.55 * full, mode
    assert set(config.TARGETS) <= set(result["targets"])
    assert sum("optimizer state" in name for name in result["targets"]) == len(config.SHARDED_MODES)


@pytest.mark.parametrize("argv, flag", [
    (["--world-size", "1"], "--world-size"),
    (["--modes", "serial,warp"], "--modes"),
    (["--rate-mbit", "-5"], "--rate-mbit"),
    (["--steps", "0"], "--steps"),
    (["--shaping", "wifi"], "--shaping"),
    (["--ddp-buckets", "1,x"], "--ddp-buckets"),
])
def test_bad_flags_fail_naming_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as err:
        bench.main(argv)
    assert err.value.code == 2
    assert flag in capsys.readouterr().err


def test_netns_shaping_without_namespaces_says_why(monkeypatch, capsys):
    monkeypatch.setattr(netns, "can_shape", lambda latency=False: (False, "network namespaces need root"))
    assert bench.main(["--quick", "--shaping", "netns"]) == 2
    err = capsys.readouterr().err
    assert "--shaping netns" in err and "need root" in err and "simulated" in err


def test_arguments_plug_into_another_parser():
    # The `hfstream bench` subcommand adds the same flags to its own subparser.
    parser = argparse.ArgumentParser(prog="hfstream")
    bench.add_arguments(parser.add_subparsers().add_parser("bench"))
    ns = parser.parse_args(["bench", "--quick", "--modes", "overlap,serial", "--steps", "5"])
    cfg = bench.config_from_args(ns)
    assert cfg.quick and cfg.steps == 5 and cfg.modes == ("serial", "overlap")
    assert cfg.model == config.QUICK_MODEL and cfg.timeout_s < 120


def test_gloo_uses_lo_only_where_it_exists(monkeypatch):
    # Inside the namespace lo is the only interface; elsewhere `lo` is Linux's name, not everyone's.
    assert netns.gloo_loopback_env(inside_namespace=True) == {"GLOO_SOCKET_IFNAME": "lo"}
    monkeypatch.setattr(netns.socket, "if_nameindex", lambda: [(1, "lo0"), (2, "en0")])
    assert netns.gloo_loopback_env(inside_namespace=False) == {}
    monkeypatch.setattr(netns.socket, "if_nameindex", lambda: [(1, "lo"), (2, "eth0")])
    assert netns.gloo_loopback_env(inside_namespace=False) == {"GLOO_SOCKET_IFNAME": "lo"}


def test_old_entry_point_still_runs_the_command_line(capsys):
    # `python -m hfstream.cli.bench.run` and `run.main` are the same command as `python -m hfstream.cli.bench`.
    from hfstream.cli.bench import run

    with pytest.raises(SystemExit) as err:
        run.main(["--world-size", "1"])
    assert err.value.code == 2 and "--world-size" in capsys.readouterr().err


def test_a_sharded_session_takes_an_untimed_lead_in_each_round(monkeypatch):
    # Interleaved rounds: a sharded session's gathers, launched in its last step, would finish
    # during the other modes' steps and its next timed forward would find them done for free.
    from hfstream.cli.bench import session

    calls = []

    class Fake:
        def __init__(self, kind):
            self.kind, self.label, self.steps, self.records = kind, kind, 0, []
            self.carries_over, self.sync, self.bucket_mb = kind == "sharded", None, 1.0

        def step(self, batch, keep):
            calls.append((self.kind, keep))
            self.steps += 1
            if keep:
                self.records.append({})

        def settle(self):
            if self.carries_over:
                calls.append((self.kind, "settled"))

    monkeypatch.setattr(torch.distributed, "barrier", lambda: None)
    cfg = config.BenchConfig(steps=4, rounds=2, warmup=1)
    sessions = [Fake("serial"), Fake("sharded")]
    session._run_interleaved(sessions, cfg, [None], session._Progress(0, enabled=False))
    after_warmup = calls[2:]
    # ... and its gathers are waited for before the next mode's turn, so they do not slow it.
    turn = [("serial", True), ("serial", True), ("sharded", False), ("sharded", True), ("sharded", True),
            ("sharded", "settled")]
    assert after_warmup == turn + turn
    assert [len(s.records) for s in sessions] == [4, 4]
