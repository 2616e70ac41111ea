"""Running the benchmark: choose the link, run the ranks under it, summarise what they measured.

With a shaped namespace (root) the parent process stays outside it and re-executes
``python -m hfstream.cli.bench --_worker JOB --_out RESULT`` inside; that worker runs the
ranks with `hfstream.testing.run_on_ranks` and hands their results back as JSON. With the
simulated link the parent runs the ranks itself. Either way every rank runs
`hfstream.cli.bench.session.rank_main`.

``python -m hfstream.cli.bench.run`` still runs the benchmark (`main` is the command line's).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Sequence

from .config import BenchConfig, BenchError
from .session import rank_main
from .summary import summarize_results

REPO = Path(__file__).resolve().parents[3]   # hfstream/cli/bench/run.py -> the repository root


def resolve_shaping(cfg: BenchConfig) -> dict:
    """Which link this run uses, as the JSON records it. Raises `BenchError` for --shaping netns
    where namespaces cannot be made."""
    from .netns import can_shape

    want = cfg.shaping
    if want == "auto" and cfg.quick:
        want = "simulated"
    if want in ("auto", "netns"):
        ok, reason = can_shape(latency=cfg.latency_ms > 0)
        if ok:
            return {"kind": "netns-tbf", "rate_mbit": cfg.rate_mbit, "latency_ms": cfg.latency_ms,
                    "tbf_rate_mbit": cfg.rate_mbit * cfg.world_size, "burst_kb": 256, "queue_ms": 50.0,
                    "note": f"the {cfg.world_size} ranks share one loopback limited to "
                            f"{cfg.world_size} x rate_mbit, so each gets rate_mbit"}
        if want == "netns":
            raise BenchError(f"--shaping netns: {reason}; use --shaping simulated (or auto) instead")
        print(f"[hfstream bench] shaped namespace not available ({reason}); using the simulated link",
              file=sys.stderr)
    return {"kind": "simulated", "rate_mbit": cfg.rate_mbit, "latency_ms": cfg.latency_ms,
            "note": "each all-reduce completes no earlier than latency + 2(N-1)/N x bytes / rate after "
                    "its launch, and after the previous one"}


def _run_ranks(cfg: BenchConfig, shaping: dict) -> list[dict]:
    from hfstream.testing import run_on_ranks

    from .netns import gloo_loopback_env

    # The ranks talk over 127.0.0.1 only (inside the namespace: the shaped loopback).
    env = gloo_loopback_env(inside_namespace=shaping["kind"] == "netns-tbf")
    return run_on_ranks(rank_main, cfg.world_size, dataclasses.asdict(cfg), shaping,
                        timeout=cfg.timeout_s, pg_timeout_s=max(60.0, cfg.timeout_s / 4), env=env)


def worker_main(cfg_path: str, out_path: str) -> int:
    """Entry point inside the namespace: run the ranks, write their results as JSON."""
    with open(cfg_path) as f:
        job = json.load(f)
    per_rank = _run_ranks(BenchConfig.from_dict(job["config"]), job["shaping"])
    with open(out_path, "w") as f:
        json.dump(per_rank, f)
    return 0


def _run_in_namespace(cfg: BenchConfig, shaping: dict) -> list[dict]:
    from .netns import run_in_namespace, shaped_namespace

    with tempfile.TemporaryDirectory(prefix="hfstream-bench-") as tmp:
        cfg_path, out_path = os.path.join(tmp, "job.json"), os.path.join(tmp, "result.json")
        with open(cfg_path, "w") as f:
            json.dump({"config": dataclasses.asdict(cfg), "shaping": shaping}, f)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")   # no DNS in the namespace: c10d warns about hostnames
        cmd = [sys.executable, "-m", "hfstream.cli.bench", "--_worker", cfg_path, "--_out", out_path]
        with shaped_namespace(shaping["tbf_rate_mbit"], latency_ms=shaping["latency_ms"],
                              burst_kb=shaping["burst_kb"], queue_ms=shaping["queue_ms"]) as name:
            shaping["namespace"] = name
            try:
                proc = run_in_namespace(name, cmd, timeout_s=cfg.timeout_s + 60, env=env)
            except subprocess.TimeoutExpired:
                raise BenchError(f"the benchmark worker did not finish within {cfg.timeout_s + 60:.0f} s and was "
                                 f"killed; raise --timeout-s or lower --steps") from None
        if proc.returncode != 0 or not os.path.exists(out_path):
            raise BenchError(f"the benchmark worker inside namespace {name} failed (exit {proc.returncode}); "
                             f"its error is printed above")
        with open(out_path) as f:
            return json.load(f)


def run_benchmark(cfg: BenchConfig, argv: Sequence[str] | None = None) -> dict:
    """Run every requested mode under one link; returns the `summarize_results` document."""
    shaping = resolve_shaping(cfg)
    print(f"[hfstream bench] link: {shaping['kind']}, {cfg.rate_mbit:g} Mbit/s per rank; modes: "
          f"{', '.join(cfg.modes)}; {cfg.world_size} ranks", file=sys.stderr, flush=True)
    if shaping["kind"] == "netns-tbf":
        per_rank = _run_in_namespace(cfg, shaping)
    else:
        per_rank = _run_ranks(cfg, shaping)
    return summarize_results(cfg, shaping, per_rank, argv)


def main(argv: Sequence[str] | None = None) -> int:
    """The benchmark's command line (`hfstream.cli.bench.cli.main`)."""
    from .cli import main as cli_main   # here, not at the top: cli imports this module

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
