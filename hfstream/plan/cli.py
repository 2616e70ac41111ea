"""The planner's command line, ``hfstream plan`` (and ``python -m hfstream.plan``).

    python -m hfstream.plan --model llama-8b                       # presets need no hub access
    python -m hfstream.plan --model path/to/config.json --seq-len 4096 --plot plan.png
    python -m hfstream.plan --params 1.3B --peak-tflops 989 --link-gbs 50 --json plan.json
    python -m hfstream.plan --compare bench.json        # predicted vs `hfstream bench --json`
    hfstream plan --model llama-8b --devices 8 --device h100-80gb   # will it fit, and what does
    hfstream plan --model llama-8b --devices 64 --device-memory 80GB --seq-len 4096 --micro-batch-size 2

Every flag is checked as it is parsed, and a refused value names its flag.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Sequence

from ..cli.plot import plot_plan
from . import predict as _predict
from .compare import CALIBRATIONS, compare_with_measurement, format_comparison, predict_bench
from .predict import (DDP_FIRST_BUCKET_MB, DEFAULT_WORLD_SIZES, PlanConfig, calibrated_mem_bandwidth_gbs,
                      calibrated_tflops, plan)
from .devices import DEVICES, parse_bytes
from .memory import OPTIMIZERS, format_memory, memory_report
from .shapes import PRESETS, ModelShape, load_model, shape_from_params
from .tables import format_plan_table



def _number(kind, low: float, inclusive: bool, what: str, allow_inf: bool = False):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if isinstance(value, float) and (math.isnan(value) or (math.isinf(value) and not allow_inf)):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        if not (value >= low if inclusive else value > low):
            raise argparse.ArgumentTypeError(f"must be {'>=' if inclusive else '>'} {low:g}, got {text}")
        return value
    parse.__name__ = kind.__name__
    return parse


def _count(text: str) -> int:
    """``7e9``, ``124M``, ``1.3B``, ``70b`` -> an integer > 0."""
    t = text.strip().replace("_", "").replace(",", "")
    scale = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}.get(t[-1:].lower(), 1) if t else 1
    if scale != 1:
        t = t[:-1]
    try:
        value = float(t) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a parameter count such as 124M, 1.3B or 7e9, "
                                         f"got {text!r}") from None
    if not (math.isfinite(value) and value >= 1):
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text!r}")
    return int(round(value))


def _mfu(text: str) -> float:
    value = _number(float, 0.0, False, "a fraction in (0, 1]")(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1] (a share of the peak), got {text}")
    return value


def _world_sizes(text: str) -> tuple[int, ...]:
    parse = _number(int, 1, True, "an integer >= 1")
    sizes = tuple(sorted({parse(t.strip()) for t in text.split(",") if t.strip()}))
    if not sizes:
        raise argparse.ArgumentTypeError("expected a comma-separated list of world sizes, e.g. 1,8,64,512")
    return sizes


def _size(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _model(text: str) -> ModelShape:
    try:
        return load_model(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the planner's flags to ``parser`` (``hfstream plan`` and ``python -m hfstream.plan``)."""
    d = PlanConfig()
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--model", type=_model, default=None, metavar="PRESET|config.json",
                      help=f"a preset ({', '.join(PRESETS)}) or a transformers config.json (default llama-8b)")
    what.add_argument("--params", type=_count, default=None, metavar="COUNT",
                      help="parameter count instead of a model, e.g. 1.3B or 7e9 (equal-sized buckets)")
    what.add_argument("--compare", metavar="BENCH_JSON", default=None,
                      help="predict the run of `hfstream bench --json BENCH_JSON` and compare (other flags ignored)")
    parser.add_argument("--tokens-per-device", type=_number(int, 1, True, "an integer >= 1"),
                        default=d.tokens_per_device, help=f"tokens per device per step (default {d.tokens_per_device})")
    parser.add_argument("--seq-len", type=_number(int, 1, True, "an integer >= 1"), default=None,
                        help="sequence length: adds attention FLOPs 12 L d s per token (needs --model)")
    # --peak-tflops, --mem-bandwidth-gbs, --link-gbs: None = the --device preset's, else PlanConfig's default.
    parser.add_argument("--peak-tflops", type=_number(float, 0, False, "a number"), default=None,
                        help=f"peak TFLOP/s of one device (default: --device's, else {d.peak_tflops:g}, A100 bf16 dense)")
    parser.add_argument("--mfu", type=_mfu, default=d.mfu, help=f"model-FLOPs utilisation (default {d.mfu:g})")
    parser.add_argument("--calibrate-backward-ms", type=_number(float, 0, False, "a time in ms"), default=None,
                        help="a measured backward time: sets the achieved FLOP/s instead of --peak-tflops x --mfu")
    parser.add_argument("--calibrate-compute-ms", type=_number(float, 0, False, "a time in ms"), default=None,
                        help="a measured forward + backward time: sets the achieved FLOP/s "
                             "(not with --calibrate-backward-ms)")
    parser.add_argument("--calibrate-from", choices=CALIBRATIONS, default="parts",
                        help="with --compare: calibrate forward and backward each from the serial run's own "
                             "(parts, the default), or the FLOP/s from its backward or its forward + backward "
                             "with FLOPs split 1/3 : 2/3")
    parser.add_argument("--calibrate-optimizer-ms", type=_number(float, 0, False, "a time in ms"), default=None,
                        help="a measured optimizer step: sets the memory bandwidth instead of --mem-bandwidth-gbs")
    parser.add_argument("--grad-bytes", type=_number(int, 1, True, "an integer >= 1"), default=d.grad_bytes,
                        help="bytes per gradient element on the wire (default 4 = fp32; 2 = bf16)")
    parser.add_argument("--link-gbs", type=_number(float, 0, False, "a bandwidth in GB/s"), default=None,
                        help=f"link bandwidth per device in GB/s; with --devices-per-node, across nodes "
                             f"(default: --device's, else {d.link_gbs:g})")
    parser.add_argument("--devices-per-node", type=_number(int, 1, True, "an integer >= 1"), default=None,
                        help="devices on one node's fast links: collectives run a ring inside each node and one "
                             "across nodes (default: --device's, else one flat ring)")
    parser.add_argument("--intra-node-gbs", type=_number(float, 0, False, "a bandwidth in GB/s"), default=None,
                        help="bus bandwidth of a ring inside a node in GB/s (default: --device's NVLink, else --link-gbs)")
    parser.add_argument("--latency-us", type=_number(float, 0, True, "a latency in microseconds"),
                        default=d.latency_us, help=f"latency per ring step in us (default {d.latency_us:g})")
    parser.add_argument("--mem-bandwidth-gbs", type=_number(float, 0, False, "a bandwidth in GB/s"),
                        default=None,
                        help=f"memory bandwidth in GB/s for the optimizer (default: --device's, else "
                             f"{d.mem_bandwidth_gbs:g})")
    parser.add_argument("--optimizer-bytes-per-param", type=_number(float, 0, True, "a number of bytes"),
                        default=d.optimizer_bytes_per_param,
                        help=f"bytes the optimizer moves per parameter "
                             f"(default {d.optimizer_bytes_per_param:g}, fp32 AdamW)")
    parser.add_argument("--bucket-mb", type=_number(float, 0, True, "MiB (or inf)", allow_inf=True),
                        default=d.bucket_mb, help=f"gradient bucket cap in MiB (default {d.bucket_mb:g}; 0 = per tensor; inf = one)")
    parser.add_argument("--first-bucket-mb", type=_number(float, 0, False, "MiB"), default=None,
                        help=f"a smaller first bucket in MiB (DDP's default is {DDP_FIRST_BUCKET_MB:g})")
    # Memory (memory.py): shown with --device, --device-memory or --devices.
    parser.add_argument("--device", choices=DEVICES, default=None,
                        help="a device preset: its memory, FLOP/s, memory bandwidth and node links; says what fits")
    parser.add_argument("--device-memory", type=_size, default=None, metavar="SIZE",
                        help="device memory instead of --device's, e.g. 80GB (10**9), 80GiB or bytes")
    parser.add_argument("--devices", type=_number(int, 1, True, "an integer >= 1"), default=None,
                        help="the world size the memory is given for, added to the table (default: one node "
                             "of --device, else the largest of --world-sizes)")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw",
                        help="optimizer and precision for the memory (default adamw: mixed precision, 16 B/param)")
    parser.add_argument("--micro-batch-size", type=_number(int, 1, True, "an integer >= 1"), default=None,
                        help="sequences per forward for the activations (default: --tokens-per-device / --seq-len)")
    parser.add_argument("--gradient-checkpointing", action="store_true",
                        help="activations with every layer recomputed in backward")
    parser.add_argument("--attention", choices=("sdpa", "eager"), default="sdpa",
                        help="attention kernel for the activations: sdpa (fused, no s^2 term; the default) or eager")
    parser.add_argument("--world-sizes", type=_world_sizes, default=DEFAULT_WORLD_SIZES,
                        help="comma-separated world sizes (default 1,2,4,...,1024)")
    parser.add_argument("--plot", metavar="FILE", default=None, help="draw step times and the ceiling vs N to FILE")
    parser.add_argument("--json", metavar="FILE", default=None, help="also write the prediction as JSON to FILE")
    parser.add_argument("--wide", action="store_true",
                        help="every column (ring factor, last bucket, both exposures and efficiencies, the sharded "
                             "parts): about 160 columns instead of 100")


def _error(msg: str) -> int:
    print(f"hfstream plan: error: {msg}", file=sys.stderr)
    return 2


def run_from_args(ns: argparse.Namespace) -> int:
    """Plan (or compare) from parsed flags: table on stdout, files to --plot / --json."""
    for flag in ("plot", "json"):
        target = getattr(ns, flag)
        if target and not Path(target).resolve().parent.is_dir():
            return _error(f"--{flag}: directory {Path(target).resolve().parent} does not exist")
    if ns.compare:
        try:
            bench = json.loads(Path(ns.compare).read_text())
            prediction = predict_bench(bench, calibrate_from=ns.calibrate_from)
        except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            return _error(f"--compare: cannot use {ns.compare} as `hfstream bench --json` output: {exc!r}")
        comp = compare_with_measurement(prediction, bench)
        print(format_comparison(comp, prediction["calibration"]))
        if ns.json:
            Path(ns.json).write_text(json.dumps({"prediction": prediction, "comparison": comp}, indent=1))
        return 0
    if ns.model is not None:
        shape = ns.model
    else:
        shape = shape_from_params(ns.params) if ns.params else load_model("llama-8b")
    if ns.seq_len is not None and shape.n_layer is None:
        return _error("--seq-len needs the architecture: give --model (a preset or config.json), not --params")
    if ns.bucket_mb == 0 and not shape.tensors:
        return _error("--bucket-mb 0 (one tensor per bucket) needs the tensors: give --model, not --params")
    d, dev = PlanConfig(), DEVICES.get(ns.device)

    def pick(given, preset_field, default):   # a flag given wins, then the --device preset, then the default
        return given if given is not None else getattr(dev, preset_field) if dev else default

    world_sizes = ns.world_sizes if ns.devices is None else tuple(sorted({*ns.world_sizes, ns.devices}))
    cfg = PlanConfig(tokens_per_device=ns.tokens_per_device, seq_len=ns.seq_len,
                     peak_tflops=pick(ns.peak_tflops, "peak_tflops", d.peak_tflops), mfu=ns.mfu,
                     grad_bytes=ns.grad_bytes, link_gbs=pick(ns.link_gbs, "inter_node_gbs", d.link_gbs),
                     latency_us=ns.latency_us,
                     devices_per_node=pick(ns.devices_per_node, "devices_per_node", None),
                     intra_node_gbs=pick(ns.intra_node_gbs, "intra_node_gbs", None),
                     mem_bandwidth_gbs=pick(ns.mem_bandwidth_gbs, "mem_bandwidth_gbs", d.mem_bandwidth_gbs),
                     optimizer_bytes_per_param=ns.optimizer_bytes_per_param,
                     bucket_mb=ns.bucket_mb, first_bucket_mb=ns.first_bucket_mb, world_sizes=world_sizes)
    if ns.calibrate_backward_ms is not None and ns.calibrate_compute_ms is not None:
        return _error("--calibrate-backward-ms and --calibrate-compute-ms both set the FLOP/s: give one")
    if ns.calibrate_backward_ms is not None:
        cfg.compute_tflops = calibrated_tflops(shape, cfg, ns.calibrate_backward_ms, "backward")
    if ns.calibrate_compute_ms is not None:
        cfg.compute_tflops = calibrated_tflops(shape, cfg, ns.calibrate_compute_ms, "compute")
    if ns.calibrate_optimizer_ms is not None:
        if cfg.optimizer_bytes_per_param == 0:
            return _error("--calibrate-optimizer-ms needs --optimizer-bytes-per-param > 0")
        cfg.mem_bandwidth_gbs = calibrated_mem_bandwidth_gbs(shape, cfg, ns.calibrate_optimizer_ms)
    doc = plan(shape, cfg)
    print(format_plan_table(doc, wide=bool(getattr(ns, "wide", False))))
    if ns.device or ns.device_memory or ns.devices:
        try:
            doc["memory"] = _memory(ns, shape, cfg, dev)
        except ValueError as exc:
            return _error(str(exc))
        name = ns.device or "the device"
        print("\n".join([""] + format_memory(doc["memory"], name)))
    if ns.plot:
        print(f"[hfstream plan] wrote {plot_plan(doc, ns.plot)}", file=sys.stderr)
    if ns.json:
        Path(ns.json).write_text(json.dumps(doc, indent=1))
        print(f"[hfstream plan] wrote {ns.json}", file=sys.stderr)
    return 0


def _memory(ns: argparse.Namespace, shape: ModelShape, cfg: PlanConfig, dev) -> dict:
    """`memory.memory_report` from the flags; ValueError names the flag to change."""
    if shape.layer is None:
        raise ValueError("--device/--devices (memory) need the model's layers for the activations: give --model "
                         "(a GPT-2 or Llama-style preset or config.json), not --params")
    seq_len = ns.seq_len or cfg.tokens_per_device
    if ns.micro_batch_size is not None:
        micro_batch = ns.micro_batch_size
    else:
        micro_batch = max(1, cfg.tokens_per_device // seq_len)
    if micro_batch * seq_len > cfg.tokens_per_device:
        raise ValueError(f"--micro-batch-size {micro_batch} x --seq-len {seq_len} is more than --tokens-per-device "
                         f"{cfg.tokens_per_device}: lower --micro-batch-size or raise --tokens-per-device")
    device_bytes = ns.device_memory if ns.device_memory is not None else dev.memory_bytes if dev else None
    world_size = ns.devices or cfg.devices_per_node or max(cfg.world_sizes)
    return memory_report(shape, world_size, ns.optimizer, seq_len, micro_batch, device_bytes,
                         checkpointing=ns.gradient_checkpointing, attention=ns.attention)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m hfstream.plan``: parse ``argv`` (default ``sys.argv[1:]``), plan, return the exit status."""
    usage = __doc__.split("\n\n")[1]
    parser = argparse.ArgumentParser(prog="python -m hfstream.plan",
                                     description=_predict.__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=f"{_predict.__doc__}\n{usage}\n")
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))
