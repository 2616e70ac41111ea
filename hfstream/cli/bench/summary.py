"""From the ranks' raw step records to the benchmark's JSON document and its table.

Per step, each part is the mean over ranks and the step time the slowest rank's; each number
reported is then the median over the timed steps. The ceiling, forward + max(backward, comm
busy) + optimizer (docs/design.md section 4), is taken from the serial mode, where compute runs
undisturbed by communication and the reductions run alone on the link; so is the cross-step
limit of the sharded modes, max(forward + backward + optimizer / N, comm busy) (section 7). On
CPU only the ratios mean something: step time over DDP-default's, DDP-best's, the ceiling and
the cross-step limit; and each mode's optimizer state per rank over the unsharded optimizer's.
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

from hfstream.report.advice import LOADED_PER_CORE   # above it per core the ranks did not get a core each
from hfstream.gradsync import DDP_BUCKET_MB
from hfstream.report.table import row, wrap
from hfstream.report.timeline import cross_step_limit

from .config import MEMORY_TARGET, MODES, SHARDED_MODES, TARGETS, BenchConfig
from .over_limit import format_over_limit, over_limit


def _aggregate(per_rank_runs: list[dict]) -> dict:
    """One run on every rank -> per step, the mean over ranks of each part and the slowest
    rank's step time; then the median over steps of each."""
    steps = []
    for recs in zip(*(run["records"] for run in per_rank_runs)):
        s = {k: statistics.fmean(r[k] for r in recs) for k in recs[0]}
        s["step_ms"] = max(r["step_ms"] for r in recs)
        steps.append(s)
    out = {k: _median(s[k] for s in steps) for k in steps[0]}
    out["ideal_ms"] = statistics.median(s["forward_ms"] + max(s["backward_ms"], s["comm_busy_ms"]) + s["optimizer_ms"]
                                        for s in steps)
    out["step_ms_all"] = [round(s["step_ms"], 3) for s in steps]
    first = per_rank_runs[0]
    out.update(kind=first["kind"], bucket_mb=first["bucket_mb"], buckets=first["buckets"],
               tuning=first.get("tuning"),   # bucket_mb="auto": its scores, default and reason (every rank's alike)
               optimizer_state_bytes=max(r.get("optimizer_state_bytes", 0) for r in per_rank_runs))
    return out


def _median(values) -> float:
    """Median that is NaN for values that were not measured (FSDP2's comm), instead of a sorting accident."""
    values = list(values)
    return math.nan if any(isinstance(v, float) and math.isnan(v) for v in values) else statistics.median(values)


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
    cross_step = _cross_step(modes, cfg.world_size)
    base = modes.get("ddp-default", {}).get("step_ms")
    best = modes.get("ddp-best", {}).get("step_ms")
    ratios = {m: {"to_ddp_default": (v["step_ms"] / base) if base else None,
                  "to_ddp_best": (v["step_ms"] / best) if best else None,
                  "to_ceiling": v["step_ms"] / ceiling["step_ms"],
                  "to_cross_step": (v["step_ms"] / cross_step["step_ms"]) if cross_step else None}
              for m, v in modes.items()}
    steps_of = {**{m: v["step_ms"] for m, v in modes.items()}, "ceiling": ceiling["step_ms"]}
    if cross_step:
        steps_of["cross-step"] = cross_step["step_ms"]
    targets = {}
    for name, (a, b, limit) in TARGETS.items():
        if a in steps_of and b in steps_of:
            ratio = steps_of[a] / steps_of[b]
            targets[name] = {"ratio": ratio, "limit": limit, "met": ratio <= limit, "timing": True}
    unsharded = next((modes[m]["optimizer_state_bytes"] for m in ("ddp-best", "ddp-default", "overlap-auto", "serial")
                      if m in modes), None)
    for m in SHARDED_MODES:
        if m in modes and unsharded:
            ratio = modes[m]["optimizer_state_bytes"] / unsharded
            targets[f"{m} optimizer state <= {MEMORY_TARGET:.2f} x unsharded"] = {
                "ratio": ratio, "limit": MEMORY_TARGET, "met": ratio <= MEMORY_TARGET, "timing": False}
    sweep = []
    for label in r0["sweep"]:
        agg = _aggregate([r["sweep"][label] for r in per_rank])
        sweep.append({"run": label, "kind": agg["kind"], "bucket_mb": agg["bucket_mb"], "step_ms": agg["step_ms"],
                      "exposed_comm_ms": agg["exposed_comm_ms"], "collectives": agg["collectives"]})
    grad_bytes = r0["params"] * 4
    loaded = machine_loaded(r0["loadavg_1min"], os.cpu_count() or 1)
    for t in targets.values():   # a loaded machine spoils the times, not the optimizer state's bytes
        t["judged"] = loaded is None or not t["timing"]
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
        "cross_step": cross_step,
        "ratios": ratios,
        "ddp_sweep": sweep,
        "best_ddp_bucket_mb": r0["best_ddp_bucket_mb"],
        "best_of_sweep": r0.get("best_of_sweep", {}),
        "unshaped_modes": [m for m in modes if m in SHARDED_MODES] if shaping["kind"] == "simulated" else [],
        "targets": targets,
        "loaded": loaded,
    }



def machine_loaded(loadavg: Sequence[float], cores: int) -> dict | None:
    """``{"loadavg", "cores", "limit"}`` when the highest load sampled during the run makes the figures
    meaningless (above `LOADED_PER_CORE` x cores), else None."""
    peak = max(loadavg, default=0.0)
    limit = LOADED_PER_CORE * cores
    return {"loadavg": peak, "cores": cores, "limit": limit} if peak > limit else None


def loaded_line(loaded: dict) -> str:
    """The sentence a loaded run's verdicts give instead of met/MISSED."""
    return (f"unreliable: the machine is loaded (load average {loaded['loadavg']:.1f} on {loaded['cores']} cores, "
            f"above {loaded['limit']:g}): other work took compute time from the ranks; rerun on an idle machine")


def _cross_step(modes: dict, world_size: int) -> dict | None:
    """The sharded modes' limit, max(forward + backward + optimizer / N, comm busy), from the serial
    run's parts (compute undisturbed, the all-reduce alone on the link); None without one."""
    s = modes.get("serial")
    if s is None:
        return None
    compute = s["forward_ms"] + s["backward_ms"] + s["optimizer_ms"] / world_size
    limit = cross_step_limit(s["forward_ms"], s["backward_ms"], s["optimizer_ms"] / world_size, s["comm_busy_ms"])
    return {"step_ms": limit, "source": "serial", "compute_ms": compute,
            "comm_busy_ms": s["comm_busy_ms"], "optimizer_ms": s["optimizer_ms"] / world_size}


def _bucket_cell(v: dict) -> str:
    if v["kind"] == "fsdp2":
        return f"reshard={'T' if v['bucket_mb'] else 'F'}"
    if v["kind"] == "ddp" and v["bucket_mb"] is None:
        return f"{DDP_BUCKET_MB:g} (1st 1)"   # bucket_cap_mb=None: DDP's default cap after its 1 MiB first bucket
    return f"{v['bucket_mb']:g}"


WIDTH = 100   # the table and its notes fit a terminal this wide (--wide: every column)
COLUMNS = (("mode", -13), ("bucket MiB", 11), ("step", 7), ("forward", 8), ("backward", 9), ("comm busy", 10),
           ("exposed", 8), ("optimizer", 10), ("vs DDP", 7), ("vs ceiling", 11))
WIDE_COLUMNS = (("mode", -13), ("bucket MiB", 11), ("step", 7), ("fwd", 6), ("bwd", 6), ("comm busy", 10),
                ("exposed", 8), ("opt", 5), ("cpu fwd/bwd", 12), ("gloo cpu", 9), ("x ddp-default", 14),
                ("x ddp-best", 11), ("x ceiling", 10), ("x cross", 8), ("opt MiB", 8))


def _wrap(line: str) -> list[str]:
    """A note line cut to `WIDTH`, continuation lines indented under it."""
    indent = " " * (len(line) - len(line.lstrip()))
    return wrap([line], WIDTH, indent=indent + "  ", break_on_hyphens=False)


def format_bench_table(result: dict, wide: bool = False) -> str:
    """The human-readable table of a `summarize_results` document: 100 columns, or every column with ``wide``."""
    sh, model, cfg = result["shaping"], result["model"], result["config"]
    measured = sh.get("measured", {}).get("effective_rate_mbit")
    load = result["machine"].get("loadavg_1min") or []
    loaded = result.get("loaded")
    notes = [
        f"hfstream bench | {cfg['world_size']} ranks x {result['threads_per_rank']} thread on "
        f"{result['machine']['nproc']} cores | link {sh['kind']} {sh['rate_mbit']:g} Mbit/s per rank"
        + (f" (measured {measured:.0f})" if measured else "")
        + (f", latency {sh['latency_ms']:g} ms" if sh["latency_ms"] else ""),
        f"GPT-2 {model['n_layer']}x{model['n_embd']}, {model['params'] / 1e6:.1f}M params "
        f"({model['grad_bytes'] / 2**20:.1f} MiB grads, {model['link_time_ms']:.0f} ms on the link), "
        f"{model['batch_size']}x{model['seq_len']} tokens per rank per step",
        f"median of {cfg['steps']} steps after {cfg['warmup']} warm-up, modes interleaved in {cfg['rounds']} "
        f"round(s); ms per step (on CPU read the ratios); load average {', '.join(f'{x:.1f}' for x in load)}",
    ]
    lines = [w for line in notes for w in _wrap(line)] + [""]

    def num(v, d=0):
        return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{d}f}"

    c, x = result["ceiling"], result.get("cross_step")
    base = result["modes"].get("ddp-default", {}).get("step_ms")
    best = result["modes"].get("ddp-best", {}).get("step_ms")
    columns = WIDE_COLUMNS if wide else COLUMNS
    widths = [w for _, w in columns]
    lines.append(row([name for name, _ in columns], widths))

    for m, v in result["modes"].items():
        r = result["ratios"][m]
        cells = [m, _bucket_cell(v), num(v["step_ms"]), num(v["forward_ms"]), num(v["backward_ms"]),
                 num(v["comm_busy_ms"]), num(v["exposed_comm_ms"]), num(v["optimizer_ms"])]
        if wide:
            cpu = f"{100 * v['forward_cpu_share']:.0f}/{100 * v['backward_cpu_share']:.0f}%"
            cells += [cpu, num(v["comm_threads_cpu_ms"]), num(r["to_ddp_default"], 2), num(r.get("to_ddp_best"), 2),
                      num(r["to_ceiling"], 2), num(r.get("to_cross_step"), 2),
                      num(v.get("optimizer_state_bytes", 0) / 2**20, 1)]
        else:
            cells += [num(r["to_ddp_default"], 2), num(r["to_ceiling"], 2)]
        lines.append(row(cells, widths))

    def limit_row(label, step, fwd, bwd, comm, opt):
        vs_ddp = step / base if base else None
        cells = [label, "", num(step), num(fwd), num(bwd), num(comm), "", num(opt)]
        if not wide:
            return row(cells + [num(vs_ddp, 2), num(step / c["step_ms"], 2)], widths)
        return row(cells + ["", "", num(vs_ddp, 2), num(step / best if best else None, 2), num(step / c["step_ms"], 2),
                            num(step / x["step_ms"] if x else None, 2)], widths[:-1])

    lines.append(limit_row("ceiling", c["step_ms"], c.get("forward_ms"), c.get("backward_ms"), c.get("comm_busy_ms"),
                           c.get("optimizer_ms")))
    if x:
        lines.append(limit_row("cross-step", x["step_ms"], None, None, x["comm_busy_ms"], x["optimizer_ms"]))
    notes = [f"  ceiling = forward + max(backward, comm busy) + optimizer, from the {c['source']} run"]
    if x:
        notes.append(f"  cross-step = max(forward + backward + optimizer / {result['config']['world_size']}, comm busy), "
                     f"from the {x['source']} run (the sharded modes' limit)")
    if not wide:
        notes.append("  vs DDP = step / ddp-default's step; vs ceiling = step / ceiling; --wide adds the CPU shares, "
                     "ratios to ddp-best and cross-step, and the optimizer state per rank")
    sharded = [m for m in result["modes"] if result["modes"][m]["kind"] == "sharded"]
    for m in sharded:
        v = result["modes"][m]
        notes.append(f"  {m}: " + ("" if wide else f"vs cross-step {num(result['ratios'][m].get('to_cross_step'), 2)}; ")
                     + f"reduce-scatter busy {num(v.get('reduce_scatter_busy_ms'))} exposed "
                     f"{num(v.get('reduce_scatter_exposed_ms'))} | all-gather busy {num(v.get('all_gather_busy_ms'))} "
                     f"exposed {num(v.get('all_gather_exposed_ms'))} ms")
        if x and "serial" in result["modes"]:
            notes.append(format_over_limit(m, over_limit(v, result["modes"]["serial"], result["config"]["world_size"],
                                                         x["step_ms"])))
    if result.get("unshaped_modes"):
        notes.append(f"  warning: the simulated link does not delay {', '.join(result['unshaped_modes'])}'s "
                     f"reduce-scatters and all-gathers: compare them on the shaped namespace (--shaping netns)")
    if wide:
        notes.append("  cpu fwd/bwd = share of a core the rank's compute thread got; gloo cpu = ms of CPU per step "
                     "used by the rank's other (communication) threads")
    if result["ddp_sweep"]:
        cells = [f"{s['run']}: {s['step_ms']:.0f}" for s in result["ddp_sweep"]]
        notes.append("sweep (run: step ms): " + " | ".join(cells))
    if loaded and any(t.get("timing", True) for t in result["targets"].values()):
        notes.append(loaded_line(loaded))
    lines += [w for line in notes for w in _wrap(line)]
    for name, t in result["targets"].items():
        verdict = "unreliable" if loaded and t.get("timing", True) else ("met" if t["met"] else "MISSED")
        lines.append(f"target {name:<44} {t['ratio']:.3f}  {verdict}")
    return "\n".join(lines)
