"""The planner against a measurement: predict a `hfstream bench --json` document and compare.

`predict_bench` calibrates compute and memory bandwidth from the run's serial mode and predicts
every mode at its own bucket size on the same link; `compare_with_measurement` gives the relative
error of each quantity, `format_comparison` the table ``hfstream plan --compare`` prints.
"""

from __future__ import annotations

import dataclasses
import math

from hfstream.gradsync import DDP_BUCKET_MB
from hfstream.gradsync.buckets import MiB
from hfstream.report.table import row

from .predict import (DDP_FIRST_BUCKET_MB, PlanConfig, calibrated_mem_bandwidth_gbs, calibrated_tflops,
                      predict_buckets, predict_row)
from .shapes import _count_str, shape_from_config, shape_from_params


def _bench_buckets(mode: dict) -> tuple[float, float | None]:
    """(bucket_mb, first_bucket_mb) a bench mode ran with."""
    if mode["kind"] == "ddp" and mode["bucket_mb"] is None:
        return DDP_BUCKET_MB, DDP_FIRST_BUCKET_MB   # DDP without bucket_cap_mb: 25 MiB after a 1 MiB first bucket
    return float(mode["bucket_mb"]), None


CALIBRATIONS = ("parts", "backward", "compute")


def predict_bench(bench: dict, calibrate_from: str = "parts", use_measured_rate: bool = False) -> dict:
    """Predict every mode of a `hfstream.cli.bench.run` JSON document with the same model, tokens, link
    and world size.

    Calibrated from the serial mode (whose compute runs undisturbed and whose reductions run
    alone): the achieved FLOP/s from its forward and backward, each its own
    (``calibrate_from="parts"``: the measured split replaces the 1/3 : 2/3 of FLOPs), from its
    backward alone or from its forward + backward (``"backward"``, ``"compute"``: FLOPs split
    1/3 : 2/3); the memory bandwidth from its optimizer step; and, where the ranks' compute
    threads hold every core (CPU training), the host time communication takes from the backward
    it overlaps, from the serial run's communication threads (``comm_threads_cpu_ms`` per MiB
    sent). Forward, backward, communication, exposure and step time are then predicted, per mode
    at that mode's bucket size; the link is the configured rate (or the one the bench measured,
    with ``use_measured_rate``).

    Returns:
        ``{"modes": {mode: plan row}, "calibration": {...}}``.
    """
    spec, sh = bench["model"], bench["shaping"]
    world_size = int(bench["config"]["world_size"])
    shape = shape_from_config({"model_type": "gpt2", "vocab_size": spec["vocab_size"], "n_positions": spec["seq_len"],
                               "n_embd": spec["n_embd"], "n_layer": spec["n_layer"], "n_head": spec["n_head"]},
                              name=f"bench GPT-2 {spec['n_layer']}x{spec['n_embd']}")
    if "params" in spec and shape.params != spec["params"]:
        shape = shape_from_params(spec["params"])     # not the GPT-2 the planner knows: count only
    if calibrate_from not in CALIBRATIONS:
        raise ValueError(f"calibrate_from={calibrate_from!r} is not valid; expected one of {', '.join(CALIBRATIONS)}")
    ref = bench["modes"].get("serial") or bench["ceiling"]
    rate = sh.get("measured", {}).get("effective_rate_mbit") if use_measured_rate else None
    rate = rate or sh["rate_mbit"]
    # Latency: the simulated link adds it once per all-reduce, i.e. per 2(N-1) ring steps; netem
    # adds it per packet, so roughly once per ring step.
    lat_ms = float(sh.get("latency_ms") or 0.0)
    latency_us = lat_ms * 1e3 / (2 * (world_size - 1)) if sh["kind"] == "simulated" else lat_ms * 1e3
    base = PlanConfig(tokens_per_device=spec["batch_size"] * spec["seq_len"], grad_bytes=4, link_gbs=rate / 8000,
                      latency_us=latency_us, world_sizes=(world_size,))
    if calibrate_from == "parts":
        base.forward_share = ref["forward_ms"] / (ref["forward_ms"] + ref["backward_ms"])
    measured_ms = ref["backward_ms"] + (ref["forward_ms"] if calibrate_from != "backward" else 0.0)
    base.compute_tflops = calibrated_tflops(shape, base, measured_ms, "backward" if calibrate_from == "backward"
                                            else "compute")
    base.mem_bandwidth_gbs = calibrated_mem_bandwidth_gbs(shape, base, ref["optimizer_ms"])
    base.comm_host_ms_per_mib = _comm_host_ms_per_mib(bench, ref, shape.params * base.grad_bytes)
    modes = {}
    for name, mode in bench["modes"].items():
        if mode["kind"] == "fsdp2":
            continue   # FSDP2's own schedule (per-block units, prefetching) is not what the planner models
        bucket_mb, first = _bench_buckets(mode)
        cfg = dataclasses.replace(base, bucket_mb=bucket_mb, first_bucket_mb=first)
        modes[name] = {**predict_row(shape, cfg, world_size), "kind": mode["kind"], "bucket_mb": bucket_mb,
                       "first_bucket_mb": first,
                       "buckets": len(predict_buckets(shape, 4, bucket_mb, first))}
    return {"modes": modes, "calibration": {
        "source": "serial" if "serial" in bench["modes"] else "ceiling", "calibrate_from": calibrate_from,
        "forward_share": base.forward_share, "comm_host_ms_per_mib": base.comm_host_ms_per_mib,
        "params": shape.params,
        "tokens_per_device": base.tokens_per_device, "compute_tflops": base.compute_tflops,
        "mem_bandwidth_gbs": base.mem_bandwidth_gbs, "link_gbs": base.link_gbs, "latency_us": latency_us,
        "world_size": world_size}}


def _comm_host_ms_per_mib(bench: dict, ref: dict, grad_bytes: float) -> float:
    """The serial run's communication-thread CPU per MiB each rank sent, where compute holds every
    core (ranks x threads >= cores); 0 otherwise, or when the run did not measure it."""
    n = int(bench["config"]["world_size"])
    cores, threads = bench.get("machine", {}).get("nproc"), bench.get("threads_per_rank")
    cpu_ms = ref.get("comm_threads_cpu_ms")
    if n <= 1 or not cores or not threads or cpu_ms is None or n * threads < cores:
        return 0.0
    sent_mib = 2 * (n - 1) / n * grad_bytes / MiB
    return max(0.0, cpu_ms) / sent_mib


def _rel(pred: float, meas: float | None) -> float | None:
    if meas is None or not isinstance(meas, (int, float)) or math.isnan(meas) or meas == 0:
        return None
    return (pred - meas) / meas


def compare_with_measurement(pred: dict, measured: dict, tolerance: float = 0.25) -> dict:
    """Relative errors (predicted - measured) / measured of comm busy, backward, exposed and step.

    Args:
        pred: `predict_bench`'s result (``{"modes": {mode: row}}``), or one `predict_row` /
            `plan` row (then ``measured`` is one mode's dict from the bench JSON).
        measured: a `hfstream.cli.bench.run` JSON document, or one of its ``modes`` entries.
        tolerance: the relative error on comm busy and step that still counts as agreement.

    A serial measurement is compared with the predicted serial step, a sharded one with the
    predicted sharded step, every other mode (GradSync overlap, DDP) with the predicted overlapped step.
    """
    if "modes" in pred and "modes" in measured:
        pairs = [(name, pred["modes"][name], measured["modes"][name]) for name in pred["modes"]
                 if name in measured["modes"]]
    else:
        pairs = [(measured.get("kind", "measured"), pred, measured)]
    out: dict = {"modes": {}, "tolerance": tolerance}
    for name, p, m in pairs:
        kind = m.get("kind")
        predicted = {"forward_ms": p["forward_ms"],
                     "backward_ms": p["backward_ms"] if kind == "serial" else p["backward_overlap_ms"],
                     "comm_busy_ms": p["comm_busy_ms"],
                     "exposed_comm_ms": p["exposed_serial_ms"] if kind == "serial" else p["exposed_overlap_ms"],
                     "step_ms": p["step_serial_ms"] if kind == "serial" else p["step_overlap_ms"]}
        if kind == "sharded":
            predicted.update(exposed_comm_ms=p["reduce_scatter_exposed_ms"] + p["all_gather_exposed_ms"],
                             comm_busy_ms=p["reduce_scatter_busy_ms"] + p["all_gather_busy_ms"],
                             step_ms=p["step_sharded_ms"], forward_ms=p["forward_sharded_ms"],
                             backward_ms=p["backward_sharded_ms"])
        meas = {k: m.get(k) for k in predicted}
        out["modes"][name] = {"predicted": predicted, "measured": meas,
                              "rel_error": {k: _rel(predicted[k], meas[k]) for k in predicted}}
    errs = {k: [abs(v["rel_error"][k]) for v in out["modes"].values() if v["rel_error"][k] is not None]
            for k in ("comm_busy_ms", "backward_ms", "step_ms")}
    out["max_abs_rel_error"] = {k: max(v) if v else None for k, v in errs.items()}
    out["agree"] = all(v is not None and v <= tolerance for k, v in out["max_abs_rel_error"].items()
                       if k in ("comm_busy_ms", "step_ms"))
    return out


def format_comparison(comp: dict, calibration: dict | None = None) -> str:
    """The human-readable table of `compare_with_measurement`'s result."""
    lines = []
    if calibration:
        lines.append(f"calibrated from the {calibration['source']} run: {calibration['compute_tflops'] * 1e3:.3g} "
                     f"GFLOP/s ({calibration['calibrate_from']}: forward "
                     f"{100 * calibration.get('forward_share', 1 / 3):.0f}% of it), "
                     f"{calibration['mem_bandwidth_gbs']:.3g} GB/s (optimizer),"
                     f"\n  {calibration.get('comm_host_ms_per_mib', 0.0):.2g} ms of backward per MiB sent; link "
                     f"{calibration['link_gbs'] * 8000:g} Mbit/s, {calibration['world_size']} ranks, "
                     f"{_count_str(calibration['params'])} params, {calibration['tokens_per_device']} tokens/rank")
    keys = ("forward_ms", "backward_ms", "comm_busy_ms", "exposed_comm_ms", "step_ms")
    widths = (-13, 4, 7, 7, 10, 9, 7)
    lines.append(row(["mode", "", "fwd", "bwd", "comm busy", "exposed", "step"], (-13, 3, *widths[2:])))

    def cell(v, pct=False):
        if v is None:
            return "-"
        return f"{100 * v:+.0f}%" if pct else f"{v:.0f}"

    for name, v in comp["modes"].items():
        for i, (label, src, pct) in enumerate((("pred", "predicted", False), ("meas", "measured", False),
                                               ("err", "rel_error", True))):
            lines.append(row([name if i == 0 else "", label, *(cell(v[src][k], pct) for k in keys)], widths))
    mx = comp["max_abs_rel_error"]
    fmt = lambda x: "-" if x is None else f"{100 * x:.0f}%"  # noqa: E731
    lines.append(f"largest |error|: comm busy {fmt(mx['comm_busy_ms'])}, backward {fmt(mx['backward_ms'])}, "
                 f"step {fmt(mx['step_ms'])} -> {'within' if comp['agree'] else 'NOT within'} "
                 f"{100 * comp['tolerance']:.0f}% on comm busy and step")
    return "\n".join(lines)

