"""Benchmarks on CPU: does hfstream hide gradient communication and data movement behind compute?

`hfstream bench` trains the same small GPT-2-style model on the same random tokens, with the
same gloo ranks over the same slow link (a ``tc tbf``-shaped loopback as root, else a simulated
link), once per mode: GradSync serial, overlap and sharded, DDP at its default and best bucket
sizes, FSDP2, the ceiling, forward + max(backward, comm busy) + optimizer (docs/design.md
section 4), and the sharded modes' cross-step limit (section 7), with each mode's optimizer
state per rank.
On CPU only the ratios mean something. `hfstream bench-prefetch` and `hfstream soak` measure
the data side and long-run stability.

Modules:
    config    the modes, link choices, model presets and targets (`BenchConfig`, `ModelSpec`)
    session   what runs inside one rank: the timed sessions, interleaved
    link      the simulated link (`SimulatedLink`, `ring_allreduce_bytes`, `measure_allreduce`)
    netns     the shaped network namespace, and its ``check``/``probe`` command line
    run       choosing the link and running the ranks under it (`run_benchmark`)
    summary   the JSON document and the table (`summarize_results`, `format_bench_table`)
    cli       the flags of `hfstream bench` and ``python -m hfstream.cli.bench``
    prefetch  `hfstream bench-prefetch`: stock Trainer vs prefetching with a costly collate
    soak      `hfstream soak`: resident memory, threads and open files over a long run

The advice check and sweep, an unused parameter's cost and the collectives probe are development
measurements, in the repository's ``dev/bench/`` (not installed).
"""

from __future__ import annotations

import importlib

# Imported on first use: were they imported here, ``python -m hfstream.cli.bench.<module>``
# would find its own module already imported (runpy warns, and the module would exist twice).
_EXPORTS = {
    "BenchConfig": "config", "BenchError": "config", "ModelSpec": "config", "MODES": "config",
    "SHAPINGS": "config", "TARGETS": "config", "FULL_MODEL": "config", "QUICK_MODEL": "config",
    "SimulatedLink": "link", "ring_allreduce_bytes": "link", "measure_allreduce": "link",
    "can_shape": "netns", "shaped_namespace": "netns", "run_in_namespace": "netns",
    "resolve_shaping": "run", "run_benchmark": "run",
    "summarize_results": "summary", "format_bench_table": "summary",
    "add_arguments": "cli", "config_from_args": "cli", "run_from_args": "cli", "main": "cli",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
