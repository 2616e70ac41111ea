"""Side-by-side gradient-communication benchmark on CPU, over a slow (shaped) link.

The command line of `hfstream bench` (``python -m hfstream.cli.bench`` takes the same flags):

    python -m hfstream.cli.bench --quick                               # < 2 min, simulated link (CI)
    sudo python -m hfstream.cli.bench --json bench.json                # shaped loopback, 2 ranks
    python -m hfstream.cli.bench --shaping simulated --rate-mbit 500 --modes serial,overlap
    sudo python -m hfstream.cli.bench --n-layer 4 --modes serial,ddp-best,overlap-auto,fsdp2-best,sharded,sharded-best

Run it on an otherwise idle machine: with one core per rank, any other job takes compute time
from a rank. When the load average during the run exceeds 1.25 per core the targets say
"unreliable: the machine is loaded" instead of met or MISSED. With ``--wide`` the ``cpu fwd/bwd``
column (the share of a core each rank's compute thread got) says how much was taken; ``gloo
cpu`` is what the rank's communication threads used.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Sequence

from .config import FULL_MODEL, MODES, QUICK_MODEL, SHAPINGS, BenchConfig, BenchError
from .run import run_benchmark, worker_main
from .summary import format_bench_table


def _bounded(kind, ok, rule: str):
    """An argparse type: ``kind(text)`` that must satisfy ``ok``, else an error saying ``rule``."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {kind.__name__}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {rule}, got {text}")
        return value
    parse.__name__ = kind.__name__
    return parse


def _positive(kind):
    return _bounded(kind, lambda v: v > 0, "> 0")


def _non_negative(kind):
    return _bounded(kind, lambda v: v >= 0, ">= 0")


def _world_size(text: str) -> int:
    value = _positive(int)(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"must be >= 2 (gradient communication needs two ranks), got {text}")
    return value


def _modes(text: str) -> tuple[str, ...]:
    if text == "all":
        return MODES
    modes = tuple(m.strip() for m in text.split(",") if m.strip())
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise argparse.ArgumentTypeError(f"unknown mode(s) {bad or [text]}; accepted: all, or a comma-separated "
                                         f"list of {', '.join(MODES)}")
    return tuple(m for m in MODES if m in modes)


def _buckets(text: str) -> tuple[float, ...]:
    parse = _positive(float)
    sizes = tuple(parse(t.strip()) for t in text.split(",") if t.strip())
    if not sizes:
        raise argparse.ArgumentTypeError("expected a comma-separated list of bucket sizes in MiB, e.g. 1,2,4,8,16")
    return sizes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the benchmark's flags to ``parser`` (``hfstream bench`` and ``python -m hfstream.cli.bench``)."""
    parser.add_argument("--quick", action="store_true",
                        help="small model, few steps, simulated link unless --shaping netns: under 2 minutes")
    parser.add_argument("--world-size", type=_world_size, default=2, help="number of ranks (default 2)")
    parser.add_argument("--steps", type=_positive(int), default=None, help="timed steps per mode (default 12, quick 4)")
    parser.add_argument("--warmup", type=_non_negative(int), default=None,
                        help="untimed steps per mode before timing (default 3, quick 2)")
    parser.add_argument("--rounds", type=_positive(int), default=None,
                        help="interleave the modes in this many rounds of timed steps (default 3, quick 2)")
    parser.add_argument("--rate-mbit", type=_positive(float), default=None,
                        help="link bandwidth per rank in Mbit/s (default 1000)")
    parser.add_argument("--latency-ms", type=_non_negative(float), default=0.0,
                        help="added latency: per all-reduce when simulated, per packet (netem) in a namespace (default 0)")
    parser.add_argument("--shaping", choices=SHAPINGS, default="auto",
                        help="auto = a tbf-shaped namespace when root and tc allow, else simulated")
    parser.add_argument("--modes", type=_modes, default=MODES,
                        help=f"comma-separated subset of {','.join(MODES)} (default all)")
    parser.add_argument("--ddp-buckets", type=_buckets, default=None,
                        help="DDP bucket sweep in MiB for ddp-best (default 1,2,4,8,16; quick 0.25,1)")
    parser.add_argument("--sharded-buckets", type=_buckets, default=None,
                        help="sharded bucket sweep in MiB for sharded-best (default 1,2,4,8,16; quick 0.25,1)")
    parser.add_argument("--n-layer", type=_positive(int), default=None,
                        help="transformer blocks of the GPT-2 model (default 6, quick 2)")
    parser.add_argument("--seed", type=int, default=0, help="model and data seed (default 0)")
    parser.add_argument("--timeout-s", type=_positive(float), default=None,
                        help="hard limit for the ranks (default 1800, quick 110)")
    parser.add_argument("--json", metavar="FILE", default=None, help="also write the results as JSON to FILE")
    parser.add_argument("--wide", action="store_true",
                        help="every column (CPU shares, ratios to ddp-best and cross-step, optimizer state): "
                             "about 140 columns instead of 100")


def config_from_args(ns: argparse.Namespace) -> BenchConfig:
    """A `BenchConfig` from parsed flags, with the --quick defaults where a flag was not given."""
    quick = bool(ns.quick)

    def pick(value, full, small):
        return value if value is not None else (small if quick else full)

    return BenchConfig(
        world_size=ns.world_size, steps=pick(ns.steps, 12, 4), warmup=pick(ns.warmup, 3, 2),
        rounds=pick(ns.rounds, 3, 2),
        rate_mbit=pick(ns.rate_mbit, 1000.0, 1000.0), latency_ms=ns.latency_ms, shaping=ns.shaping,
        modes=tuple(ns.modes), ddp_buckets=tuple(pick(ns.ddp_buckets, (1.0, 2.0, 4.0, 8.0, 16.0), (0.25, 1.0))),
        sharded_buckets=tuple(pick(ns.sharded_buckets, (1.0, 2.0, 4.0, 8.0, 16.0), (0.25, 1.0))),
        seed=ns.seed, timeout_s=pick(ns.timeout_s, 1800.0, 110.0), quick=quick,
        model=dataclasses.replace(QUICK_MODEL if quick else FULL_MODEL,
                                  **({"n_layer": ns.n_layer} if ns.n_layer is not None else {})),
    )


def run_from_args(ns: argparse.Namespace, argv: Sequence[str] | None = None) -> int:
    """Run the benchmark from parsed flags: table on stdout, progress on stderr, JSON to --json."""
    cfg = config_from_args(ns)
    if cfg.world_size > (os.cpu_count() or 1):
        print(f"[hfstream bench] warning: {cfg.world_size} ranks on {os.cpu_count()} cores; ranks will share cores",
              file=sys.stderr)
    if ns.json:
        parent = Path(ns.json).resolve().parent
        if not parent.is_dir():
            print(f"hfstream bench: error: --json: directory {parent} does not exist", file=sys.stderr)
            return 2
    try:
        result = run_benchmark(cfg, argv=argv if argv is not None else sys.argv)
    except BenchError as exc:
        print(f"hfstream bench: error: {exc}", file=sys.stderr)
        return 2
    print(format_bench_table(result, wide=bool(getattr(ns, "wide", False))))
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"[hfstream bench] wrote {ns.json}", file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m hfstream.cli.bench``; the hidden ``--_worker``/``--_out`` are how
    `hfstream.cli.bench.run` starts its worker inside the shaped namespace."""
    parser = argparse.ArgumentParser(prog="python -m hfstream.cli.bench", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.add_argument("--_worker", default=None, help=argparse.SUPPRESS)   # job file, inside the namespace
    parser.add_argument("--_out", default=None, help=argparse.SUPPRESS)
    ns = parser.parse_args(argv)
    if ns._worker:
        if not ns._out:
            parser.error("--_worker needs --_out")
        return worker_main(ns._worker, ns._out)
    return run_from_args(ns, argv=list(argv) if argv is not None else sys.argv)

