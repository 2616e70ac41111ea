"""What one benchmark run is: the compared modes, the link choices, the model, the targets.

Pure data, no torch: the parent process, the namespace worker and every rank share it, and a
`BenchConfig` travels between them as a dict (`dataclasses.asdict` / `BenchConfig.from_dict`).

The modes, each on its own copy of the same model, data and link:

    serial        GradSync(mode="serial"): backward, then every bucket's all-reduce (baseline)
    ddp-default   torch DistributedDataParallel as users get it: bucket_cap_mb=None, which is
                  25 MiB buckets after a 1 MiB first bucket
    ddp-best      the fastest DDP of a bucket sweep (--ddp-buckets; the sweep is reported too)
    overlap       GradSync(mode="overlap") at DDP's default cap, 25 MiB
    overlap-best  GradSync overlap at ddp-best's bucket size
    overlap-auto  GradSync overlap with bucket_mb="auto" (tuned in its warm-up steps, then timed)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

MODES = ("serial", "ddp-default", "ddp-best", "overlap", "overlap-best", "overlap-auto")
SHAPINGS = ("auto", "netns", "simulated")
# What the project aims for (measurements, not tests), for overlap at its default bucket and
# at DDP's best bucket.
TARGETS = {
    f"{mode} <= {limit:.2f} x {ref}": (mode, ref, limit)
    for mode in ("overlap", "overlap-best", "overlap-auto")
    for ref, limit in (("ddp-default", 0.85), ("ddp-best", 1.00), ("ceiling", 1.15))
}


@dataclass
class ModelSpec:
    """The GPT-2-style model and batch each rank trains on (tokens are random ids)."""

    n_layer: int
    n_embd: int
    n_head: int
    vocab_size: int
    seq_len: int
    batch_size: int


# ~10.9M parameters, 41.6 MiB of fp32 gradients (0.35 s for 2 ranks on a 1 Gbit/s link): sized
# so that on a 2-core machine, one thread per rank, backward and the all-reduce of its
# gradients take about as long, where hiding communication matters most.
FULL_MODEL = ModelSpec(n_layer=6, n_embd=384, n_head=6, vocab_size=512, seq_len=128, batch_size=4)
# ~0.4M parameters: a smoke test of every mode in seconds.
QUICK_MODEL = ModelSpec(n_layer=2, n_embd=128, n_head=2, vocab_size=256, seq_len=64, batch_size=2)


@dataclass
class BenchConfig:
    """One benchmark run; `hfstream.tools.bench.cli.add_arguments` documents each field as a flag."""

    world_size: int = 2
    steps: int = 12
    warmup: int = 3
    rounds: int = 3
    rate_mbit: float = 1000.0
    latency_ms: float = 0.0
    shaping: str = "auto"
    modes: tuple[str, ...] = MODES
    ddp_buckets: tuple[float, ...] = (1.0, 2.0, 4.0, 8.0, 16.0)
    seed: int = 0
    timeout_s: float = 1800.0
    quick: bool = False
    model: ModelSpec = field(default_factory=lambda: dataclasses.replace(FULL_MODEL))

    @classmethod
    def from_dict(cls, d: dict) -> "BenchConfig":
        d = dict(d)
        d["model"] = ModelSpec(**d["model"])
        d["modes"], d["ddp_buckets"] = tuple(d["modes"]), tuple(d["ddp_buckets"])
        return cls(**d)


class BenchError(RuntimeError):
    """The benchmark could not run as asked; the message says why and what to do instead."""
