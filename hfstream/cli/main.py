"""The `hfstream` command.

    hfstream demo [-- TRAIN_CLM_ARGS...]   train the demo under accelerate launch (2 CPU ranks, or every GPU)
    hfstream bench [--quick] [--json F]    gradient sync side by side on a shaped link: serial, DDP, overlap, ceiling
    hfstream bench-prefetch [--json F]     stock Trainer vs prefetching with a collate as costly as a step
    hfstream plan [--model M] [--plot F]   predict compute, communication and the ceiling for 1..1024 devices
    hfstream doctor PATH                   a run's step report (its output_dir, or stream_report.json) and its advice
    hfstream corpus OUT_DIR                write the standard-library demo corpus
    hfstream env                           versions, devices and backends this machine offers
"""

from __future__ import annotations

import argparse
import functools
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]   # the folder that holds the package: a clone's root, or site-packages
DEMO = Path(__file__).resolve().parent / "demo"   # the demo's script and configs, shipped with the package


def _accelerator_count() -> int:
    import torch

    acc = getattr(torch, "accelerator", None)
    if acc is not None and hasattr(acc, "device_count"):
        return int(acc.device_count()) if acc.is_available() else 0
    return torch.cuda.device_count()


def demo_command(extra: list[str], num_devices: int | None = None) -> list[str]:
    """The `accelerate launch` command line the demo runs on this machine."""
    from hfstream.testing import free_port

    n = _accelerator_count() if num_devices is None else num_devices
    configs = DEMO / "accelerate"
    script = DEMO / "train_clm.py"
    threads: list[str] = []
    if n == 0:
        config, procs = configs / "cpu_2proc.yaml", 2
        threads = ["--num_cpu_threads_per_process", "1"]   # 2 ranks on 2 cores: one thread each
    elif n == 1:
        config, procs = configs / "1gpu.yaml", 1
    else:
        config, procs = configs / "8gpu.yaml", n
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
            "--num_processes", str(procs), *threads, "--main_process_port", str(free_port()), str(script), *extra]


def _cmd_demo(ns) -> int:
    from .extras import require

    try:   # before the launch: one line, not a traceback per rank
        require("datasets", "demo")
        require("matplotlib", "demo")
    except ModuleNotFoundError as exc:
        print(f"hfstream demo: {exc}", file=sys.stderr)
        return 2
    extra = list(ns.train_args)
    if extra and extra[0] == "--":
        extra = extra[1:]
    cmd = demo_command(extra)
    print("hfstream demo:", " ".join(cmd), flush=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return subprocess.call(cmd, env=env)


def _run_with_parser(run, parser, ns) -> int:
    return run(ns, parser)


def _cmd_doctor(ns) -> int:
    from hfstream.cli.doctor import doctor

    return doctor(ns.path)


def _cmd_corpus(ns) -> int:
    from .data import build_stdlib_corpus

    path = build_stdlib_corpus(ns.out_dir, max_bytes=ns.max_bytes)
    print(f"{path} ({path.stat().st_size:,} bytes)")
    return 0


def _cmd_env(ns) -> int:
    import torch
    import torch.distributed as dist

    import accelerate
    import transformers

    from hfstream import __version__

    acc = getattr(torch, "accelerator", None)
    current = acc.current_accelerator() if acc is not None and acc.is_available() else None
    rows = [
        ("hfstream", __version__), ("python", sys.version.split()[0]), ("torch", torch.__version__),
        ("transformers", transformers.__version__), ("accelerate", accelerate.__version__),
        ("accelerator", f"{current} x{_accelerator_count()}" if current is not None else "none (CPU)"),
        ("gloo", dist.is_available() and dist.is_gloo_available()),
        ("nccl", dist.is_available() and dist.is_nccl_available()),
        ("cpu threads", torch.get_num_threads()),
    ]
    for k, v in rows:
        print(f"{k:<14}{v}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hfstream", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("demo", help="train the demo under accelerate launch and print the step report")
    p.add_argument("train_args", nargs=argparse.REMAINDER,
                   help="arguments for the demo's train_clm.py, after --, e.g. -- --max_steps 50")
    p.set_defaults(func=_cmd_demo)

    from .bench import cli as bench

    p = sub.add_parser("bench", help="gradient sync side by side on a bandwidth-limited link, against the ceiling")
    bench.add_arguments(p)
    p.set_defaults(func=bench.run_from_args)

    from .bench import prefetch as bench_prefetch

    p = sub.add_parser("bench-prefetch", help="stock Trainer vs StreamTrainer with a costly collate (CPU)")
    bench_prefetch.add_arguments(p)
    p.set_defaults(func=functools.partial(_run_with_parser, bench_prefetch.run_from_args, p))

    # Parsed by bench_soak itself (see main()); listed here so `hfstream --help` shows it.
    sub.add_parser("soak", help="2 ranks for 2000 steps: do resident memory, threads and open files stay flat?")

    from ..plan import cli as plan

    p = sub.add_parser("plan", help="predict step time, exposed communication and the ceiling for 1..1024 devices")
    plan.add_arguments(p)
    p.set_defaults(func=plan.run_from_args)

    p = sub.add_parser("doctor", help="print a run's step report and what to change (advice)")
    p.add_argument("path", help="the run's output_dir, or its stream_report.json")
    p.set_defaults(func=_cmd_doctor)

    p = sub.add_parser("corpus", help="write the standard-library demo corpus")
    p.add_argument("out_dir", help="directory to write stdlib_corpus.txt into")
    p.add_argument("--max-bytes", type=int, default=2_000_000, help="corpus size (default 2,000,000)")
    p.set_defaults(func=_cmd_corpus)

    p = sub.add_parser("env", help="versions, devices and communication backends on this machine")
    p.set_defaults(func=_cmd_env)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["soak"]:
        from .bench.soak import main as soak_main

        return soak_main(argv[1:])
    ns = build_parser().parse_args(argv)
    try:
        return int(ns.func(ns) or 0)
    except ModuleNotFoundError as exc:   # an optional package (`extras.require`): one line, not a traceback
        if "pip install 'hfstream[" not in str(exc):
            raise
        print(f"hfstream: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
