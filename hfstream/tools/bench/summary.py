"""From the ranks' raw step records to the benchmark's JSON document and its table.

Per step, each part is the mean over ranks and the step time the slowest rank's; each number
reported is then the median over the timed steps. The ceiling, forward + max(backward, comm
busy) + optimizer (docs/design.md section 4), is taken from the serial mode, where compute runs
undisturbed by communication and the reductions run alone on the link. On CPU only the ratios
mean something: step time over DDP-default's and over the ceiling.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import math
import os
import platform
import statistics
from typing import Sequence

from hfstream.gradsync import DDP_BUCKET_MB

from .config import MODES, TARGETS, BenchConfig


def _aggregate(per_rank_runs: list[dict]) -> dict:
    """One run on every rank -> per step, the mean over ranks of each part and the slowest
    rank's step time; then the median over steps of each."""
    steps = []
    for recs in zip(*(run["records"] for run in per_rank_runs)):
        s = {k: statistics.fmean(r[k] for r in recs) for k in recs[0]}
        s["step_ms"] = max(r["step_ms"] for r in recs)
        steps.append(s)
    out = {k: statistics.median(s[k] for s in steps) for k in steps[0]}
    out["ideal_ms"] = statistics.median(s["forward_ms"] + max(s["backward_ms"], s["comm_busy_ms"]) + s["optimizer_ms"]
                                        for s in steps)
    out["step_ms_all"] = [round(s["step_ms"], 3) for s in steps]
    first = per_rank_runs[0]
    out.update(kind=first["kind"], bucket_mb=first["bucket_mb"], buckets=first["buckets"])
    return out


def _machine() -> dict:
    import torch
    import transformers

    cpu = platform.processor()
    with contextlib.suppress(OSError):
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {"nproc": os.cpu_count(), "cpu": cpu, "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__}


def summarize_results(cfg: BenchConfig, shaping: dict, per_rank: list[dict], argv: Sequence[str] | None = None) -> dict:
    """The benchmark's JSON document: every mode, the DDP sweep, the ceiling, ratios, targets."""
    r0 = per_rank[0]
    modes = {m: _aggregate([r["runs"][m] for r in per_rank]) for m in MODES if m in r0["runs"]}

    # The ceiling: serial's compute (undisturbed) and its reductions alone on the link; without
    # a serial run, the lowest of the modes' own ceilings.
    if "serial" in modes:
        s = modes["serial"]
        ceiling = {"step_ms": s["forward_ms"] + max(s["backward_ms"], s["comm_busy_ms"]) + s["optimizer_ms"],
                   "source": "serial", "forward_ms": s["forward_ms"], "backward_ms": s["backward_ms"],
                   "comm_busy_ms": s["comm_busy_ms"], "optimizer_ms": s["optimizer_ms"]}
    else:
        m = min(modes, key=lambda k: modes[k]["ideal_ms"])
        ceiling = {"step_ms": modes[m]["ideal_ms"], "source": m}
    base = modes.get("ddp-default", {}).get("step_ms")
    ratios = {m: {"to_ddp_default": (v["step_ms"] / base) if base else None,
                  "to_ceiling": v["step_ms"] / ceiling["step_ms"]} for m, v in modes.items()}
    steps_of = {**{m: v["step_ms"] for m, v in modes.items()}, "ceiling": ceiling["step_ms"]}
    targets = {}
    for name, (a, b, limit) in TARGETS.items():
        if a in steps_of and b in steps_of:
            ratio = steps_of[a] / steps_of[b]
            targets[name] = {"ratio": ratio, "limit": limit, "met": ratio <= limit}
    sweep = []
    for label in r0["sweep"]:
        agg = _aggregate([r["sweep"][label] for r in per_rank])
        sweep.append({"run": label, "bucket_mb": agg["bucket_mb"], "step_ms": agg["step_ms"],
                      "exposed_comm_ms": agg["exposed_comm_ms"], "collectives": agg["collectives"]})
    grad_bytes = r0["params"] * 4
    return {
        "hfstream_bench": 1,
        "command": list(argv) if argv is not None else None,
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": {**_machine(), "loadavg_1min": r0["loadavg_1min"]},
        "config": dataclasses.asdict(cfg),
        "shaping": {**shaping, "measured": r0["calibration"]},
        "model": {**dataclasses.asdict(cfg.model), "params": r0["params"], "grad_bytes": grad_bytes,
                  "link_time_ms": grad_bytes * 8 * 2 * (cfg.world_size - 1) / cfg.world_size / (cfg.rate_mbit * 1e3)},
        "threads_per_rank": r0["num_threads"],
        "modes": modes,
        "ceiling": ceiling,
        "ratios": ratios,
        "ddp_sweep": sweep,
        "best_ddp_bucket_mb": r0["best_ddp_bucket_mb"],
        "targets": targets,
    }


def format_bench_table(result: dict) -> str:
    """The human-readable table of a `summarize_results` document."""
    sh, model, cfg = result["shaping"], result["model"], result["config"]
    measured = sh.get("measured", {}).get("effective_rate_mbit")
    load = result["machine"].get("loadavg_1min") or []
    lines = [
        f"hfstream bench | {cfg['world_size']} ranks x {result['threads_per_rank']} thread on "
        f"{result['machine']['nproc']} cores | link {sh['kind']} {sh['rate_mbit']:g} Mbit/s per rank"
        + (f" (measured {measured:.0f})" if measured else "")
        + (f", latency {sh['latency_ms']:g} ms" if sh["latency_ms"] else ""),
        f"GPT-2 {model['n_layer']}x{model['n_embd']}, {model['params'] / 1e6:.1f}M params "
        f"({model['grad_bytes'] / 2**20:.1f} MiB grads, {model['link_time_ms']:.0f} ms on the link), "
        f"{model['batch_size']}x{model['seq_len']} tokens per rank per step",
        f"median of {cfg['steps']} steps after {cfg['warmup']} warm-up, modes interleaved in {cfg['rounds']} "
        f"rounds; ms (CPU: read the ratios); load avg {', '.join(f'{x:.1f}' for x in load)}",
        "",
        f"{'mode':<13}{'bucket MiB':>11}{'step':>7}{'fwd':>6}{'bwd':>6}{'comm busy':>10}{'exposed':>8}"
        f"{'opt':>5}{'cpu fwd/bwd':>12}{'gloo cpu':>9}{'x ddp-default':>14}{'x ceiling':>10}",
    ]

    def num(v, w, d=0):
        return f"{'-':>{w}}" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:>{w}.{d}f}"

    for m, v in result["modes"].items():
        r = result["ratios"][m]
        # bucket_cap_mb=None: DDP's default cap after its 1 MiB first bucket
        ddp_default = v["kind"] == "ddp" and v["bucket_mb"] is None
        bucket = f"{DDP_BUCKET_MB:g} (1st 1)" if ddp_default else f"{v['bucket_mb']:g}"
        cpu = f"{100 * v['forward_cpu_share']:.0f}/{100 * v['backward_cpu_share']:.0f}%"
        lines.append(f"{m:<13}{bucket:>11}{num(v['step_ms'], 7)}{num(v['forward_ms'], 6)}{num(v['backward_ms'], 6)}"
                     f"{num(v['comm_busy_ms'], 10)}{num(v['exposed_comm_ms'], 8)}{num(v['optimizer_ms'], 5)}"
                     f"{cpu:>12}{num(v['comm_threads_cpu_ms'], 9)}{num(r['to_ddp_default'], 14, 2)}"
                     f"{num(r['to_ceiling'], 10, 2)}")
    c = result["ceiling"]
    base = result["modes"].get("ddp-default", {}).get("step_ms")
    lines.append(f"{'ceiling':<13}{'':>11}{num(c['step_ms'], 7)}{num(c.get('forward_ms'), 6)}"
                 f"{num(c.get('backward_ms'), 6)}{num(c.get('comm_busy_ms'), 10)}{'':>8}{num(c.get('optimizer_ms'), 5)}"
                 f"{'':>21}{num(c['step_ms'] / base if base else None, 14, 2)}{num(1.0, 10, 2)}")
    lines.append(f"  ceiling = forward + max(backward, comm busy) + optimizer, from the {c['source']} run")
    lines.append("  cpu fwd/bwd = share of a core the rank's compute thread got; gloo cpu = ms of CPU per step "
                 "used by the rank's other (communication) threads")
    if result["ddp_sweep"]:
        cells = [f"{'default' if s['bucket_mb'] is None else format(s['bucket_mb'], 'g')}: {s['step_ms']:.0f}"
                 for s in result["ddp_sweep"]]
        lines.append("DDP bucket sweep (MiB: step ms): " + " | ".join(cells))
    for name, t in result["targets"].items():
        lines.append(f"target {name:<37} {t['ratio']:.3f}  {'met' if t['met'] else 'MISSED'}")
    return "\n".join(lines)
