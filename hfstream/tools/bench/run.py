"""Side-by-side gradient-communication benchmark on CPU, over a slow (shaped) link.

One run trains the same small GPT-2-style model (built from a config, no hub) on the same
random tokens, with the same number of gloo ranks and the same link, once per mode:

    serial        GradSync(mode="serial"): backward, then every bucket's all-reduce (baseline)
    ddp-default   torch DistributedDataParallel as users get it: bucket_cap_mb=None, which is
                  25 MiB buckets after a 1 MiB first bucket
    ddp-best      the fastest DDP of a bucket sweep (--ddp-buckets; the sweep is reported too)
    overlap       GradSync(mode="overlap") at its default bucket, 25 MiB
    overlap-best  GradSync overlap at ddp-best's bucket size
    overlap-auto  GradSync overlap with bucket_mb="auto" (tuned in its warm-up steps, then timed)

and the ceiling, forward + max(backward, comm busy) + optimizer (DESIGN.md section 4), taken
from the serial mode, where compute runs undisturbed by communication and the reductions run
alone on the link. On CPU only the ratios mean something: step time over DDP-default's and
over the ceiling.

The link (see `hfstream.tools.bench.link`): as root, the ranks run inside a private network namespace
whose loopback has a ``tc tbf`` rate limit of world_size x --rate-mbit (the ranks share that
loopback, so each gets --rate-mbit); otherwise a simulated link delays each all-reduce's
completion to latency + 2(N-1)/N x bytes / rate after its launch. The parent process stays
outside the namespace and re-executes ``python -m hfstream.tools.bench.run --_worker`` inside it; the
worker runs the ranks with `hfstream.testing.run_on_ranks` and returns its results as JSON.

How the parts of a step are measured (``time.perf_counter`` on every rank; per step the mean
over ranks, the step itself the slowest rank; then the median over the timed steps):

    GradSync modes   forward | loss.backward() | sync.finish() | optimizer.step + zero_grad;
                     comm busy and exposed comm from ``sync.stats``
    DDP modes        a comm hook (the default all-reduce hook plus timestamps) records when each
                     bucket is launched and completed; backward ends at the last launch, and the
                     rest of ``loss.backward()`` (DDP waits for its buckets there) is exposed comm

Commands (``hfstream bench ...`` takes the same flags):

    python -m hfstream.tools.bench.run --quick                               # < 2 min, simulated link (CI)
    sudo python -m hfstream.tools.bench.run --json bench.json                # shaped loopback, 2 ranks
    python -m hfstream.tools.bench.run --shaping simulated --rate-mbit 500 --modes serial,overlap

Run it on an otherwise idle machine: with one core per rank, any other job takes compute time
from a rank. The ``cpu fwd/bwd`` column (the share of a core each rank's compute thread got)
says whether that happened; ``gloo cpu`` is what the rank's communication threads used.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

MODES = ("serial", "ddp-default", "ddp-best", "overlap", "overlap-best", "overlap-auto")
SHAPINGS = ("auto", "netns", "simulated")
OVERLAP_DEFAULT_MB = 25.0   # GradSync's default bucket_mb
# What the project aims for (measurements, not tests), for overlap at its default bucket and
# at DDP's best bucket.
TARGETS = {
    f"{mode} <= {limit:.2f} x {ref}": (mode, ref, limit)
    for mode in ("overlap", "overlap-best", "overlap-auto")
    for ref, limit in (("ddp-default", 0.85), ("ddp-best", 1.00), ("ceiling", 1.15))
}
AUTO_TUNING_MAX_STEPS = 60   # bound on the extra warm-up an "auto" session takes to finish tuning
REPO = Path(__file__).resolve().parents[3]


@dataclass
class ModelSpec:
    """The GPT-2-style model and batch each rank trains on (tokens are random ids)."""

    n_layer: int
    n_embd: int
    n_head: int
    vocab_size: int
    seq_len: int
    batch_size: int


# ~10.9M parameters (41.6 MiB of fp32 gradients): on 2 cores, one thread per rank, backward
# takes about as long as all-reducing the gradients over a 1 Gbit/s link (~0.3 s each).
FULL_MODEL = ModelSpec(n_layer=6, n_embd=384, n_head=6, vocab_size=512, seq_len=128, batch_size=4)
# ~0.4M parameters: a smoke test of every mode in seconds.
QUICK_MODEL = ModelSpec(n_layer=2, n_embd=128, n_head=2, vocab_size=256, seq_len=64, batch_size=2)


@dataclass
class BenchConfig:
    """One benchmark run; `add_arguments` documents each field as a flag."""

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


# =============================================================================================
# Inside each rank
# =============================================================================================

def _build_model(spec: ModelSpec, seed: int):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=spec.n_layer, n_embd=spec.n_embd, n_head=spec.n_head, vocab_size=spec.vocab_size,
        n_positions=spec.seq_len, bos_token_id=spec.vocab_size - 1, eos_token_id=spec.vocab_size - 1,
    )
    torch.manual_seed(seed)   # every mode starts from the same weights
    return GPT2LMHeadModel(config)


class _CommTimer:
    """State of `_timed_allreduce_hook`: launch/complete times of DDP's bucket reductions."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.spans: list[tuple[float, float]] = []
        self._lock = threading.Lock()

    def take(self) -> list[tuple[float, float]]:
        with self._lock:
            spans, self.spans = self.spans, []
        return spans


def _timed_allreduce_hook(state: _CommTimer, bucket):
    """DDP's default all-reduce hook (divide, then sum over ranks) plus timestamps.

    It calls ``torch.distributed.all_reduce`` by attribute, so under the simulated link the
    future DDP waits on completes when the link says (see `netshape.SimulatedLink`).
    """
    import torch.distributed as dist

    buf = bucket.buffer()
    buf.div_(state.world_size)
    launched = time.perf_counter()
    fut = dist.all_reduce(buf, async_op=True).get_future()

    def done(f):
        with state._lock:
            state.spans.append((launched, time.perf_counter()))
        return f.value()[0]

    return fut.then(done)


def _union_ms(spans: list[tuple[float, float]]) -> float:
    from hfstream.gradsync.sync import union_length   # the same "in flight" measure GradSync reports

    return union_length(spans) * 1e3


class _Progress:
    """Progress with an ETA on stderr, from rank 0, at most every couple of seconds."""

    def __init__(self, total_steps: int, enabled: bool):
        self.total, self.done, self.enabled = total_steps, 0, enabled
        self.t0 = self.last = time.perf_counter()

    def step(self, label: str, i: int, n: int, phase: str) -> None:
        self.done += 1
        now = time.perf_counter()
        if not self.enabled or (now - self.last < 2.0 and self.done < self.total):
            return
        self.last = now
        elapsed = now - self.t0
        eta = elapsed / self.done * (self.total - self.done)
        print(f"[hfstream bench] {label:<13} {phase:<10} step {i:>3}/{n:<3} | {self.done}/{self.total} steps "
              f"({100 * self.done / self.total:3.0f} %) | elapsed {_fmt_s(elapsed)} | ETA {_fmt_s(eta)}",
              file=sys.stderr, flush=True)


def _fmt_s(s: float) -> str:
    return f"{int(s // 60)}m{int(s % 60):02d}s" if s >= 60 else f"{s:.0f}s"


class _Session:
    """One mode on its own copy of the model: built once, then stepped in rounds.

    Args:
        kind: ``"ddp"``, ``"serial"`` or ``"overlap"``.
        bucket_mb: bucket cap in MiB; None = DDP's own default; "auto" = GradSync tunes it.
        label: the run's name in the results, e.g. ``"ddp@4"``.
    """

    def __init__(self, kind: str, bucket_mb: float | str | None, cfg: BenchConfig, label: str):
        import torch
        import torch.distributed as dist

        self.kind, self.bucket_mb, self.label = kind, bucket_mb, label
        self.model = _build_model(cfg.model, cfg.seed)
        self.sync = self.timer = None
        if kind == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            self.forward = DistributedDataParallel(self.model, bucket_cap_mb=bucket_mb)
            self.timer = _CommTimer(dist.get_world_size())
            self.forward.register_comm_hook(self.timer, _timed_allreduce_hook)
        else:
            from hfstream.gradsync import GradSync

            self.sync = GradSync(self.model, bucket_mb=bucket_mb, mode=kind)
            self.forward = self.model
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.records: list[dict] = []
        self.steps = 0

    def step(self, x, keep: bool) -> None:
        """One training step on batch ``x``; its record is kept when ``keep``."""
        t0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
        batch = x                      # the data is already in memory: data wait is ~0 by design
        t1, c1 = time.perf_counter(), time.thread_time()
        loss = self.forward(input_ids=batch, labels=batch).loss
        t2, c2 = time.perf_counter(), time.thread_time()
        loss.backward()
        t3, c3 = time.perf_counter(), time.thread_time()
        if self.sync is not None:
            self.sync.finish()
        t4 = time.perf_counter()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        t5, c5, p5 = time.perf_counter(), time.thread_time(), time.process_time()
        self.steps += 1
        if self.sync is not None:
            st = self.sync.stats
            backward, busy, exposed, collectives = t3 - t2, st.comm_busy_ms, st.exposed_comm_ms, st.num_collectives
        else:
            spans = self.timer.take()
            # The last bucket is launched when backward has produced its last gradient; what
            # loss.backward() spends after that is DDP waiting for its reductions.
            last = max((a for a, _ in spans), default=t3)
            backward = min(max(last - t2, 0.0), t3 - t2)
            busy, exposed, collectives = _union_ms(spans), (t3 - t2 - backward) * 1e3, len(spans)
        if keep:
            self.records.append({
                "data_ms": (t1 - t0) * 1e3, "forward_ms": (t2 - t1) * 1e3, "backward_ms": backward * 1e3,
                "comm_busy_ms": busy, "exposed_comm_ms": exposed, "sync_ms": (t4 - t3) * 1e3,
                "optimizer_ms": (t5 - t4) * 1e3, "step_ms": (t5 - t0) * 1e3, "collectives": collectives,
                # Share of a core this rank's compute thread got: well below 1 means another
                # process (or gloo's threads) took the core. DDP's backward also waits for its
                # buckets, which costs no CPU, so its share is taken over the compute part.
                "forward_cpu_share": (c2 - c1) / (t2 - t1), "backward_cpu_share": (c3 - c2) / max(backward, 1e-9),
                # CPU time of this process's other threads (gloo's send/receive/reduce threads):
                # on a machine with a core per rank, that is time taken from compute.
                "comm_threads_cpu_ms": ((p5 - p0) - (c5 - c0)) * 1e3,
                "loss": float(loss.detach()),
            })

    def result(self) -> dict:
        tuned = self.sync.bucket_mb if self.sync is not None and self.bucket_mb == "auto" else self.bucket_mb
        tuning = getattr(self.sync, "tuning_result", None)
        return {"kind": self.kind, "bucket_mb": tuned, "tuning": dataclasses.asdict(tuning) if tuning else None,
                "buckets": len(self.sync.buckets) if self.sync is not None else None, "records": self.records}

    def close(self) -> None:
        if self.sync is not None:
            self.sync.close()
        self.model = self.forward = self.sync = self.opt = None


def _run_interleaved(sessions: list[_Session], cfg: BenchConfig, batches: list, progress: _Progress) -> None:
    """Warm every session up, then time them in rounds, round-robin.

    Interleaving spreads slow phases of a shared machine (another job, frequency changes) over
    all modes instead of charging them to whichever mode ran at that moment.
    """
    import torch.distributed as dist

    for s in sessions:
        dist.barrier()   # start together: a step's time should not include a peer's setup
        for i in range(cfg.warmup):
            s.step(batches[s.steps % len(batches)], keep=False)
            progress.step(s.label, i + 1, cfg.warmup, "warm-up")
        # bucket_mb="auto" tries caps in its first steps; time it only once it has chosen. The
        # choice is collective, so every rank leaves this loop at the same step.
        extra = 0
        while s.sync is not None and s.sync.tuning is not None and extra < AUTO_TUNING_MAX_STEPS:
            s.step(batches[s.steps % len(batches)], keep=False)
            extra += 1
    rounds = max(1, min(cfg.rounds, cfg.steps))
    for r in range(rounds):
        for s in sessions:
            n = cfg.steps // rounds + (r < cfg.steps % rounds)
            dist.barrier()
            for i in range(n):
                s.step(batches[s.steps % len(batches)], keep=True)
                progress.step(s.label, len(s.records), cfg.steps, f"round {r + 1}/{rounds}")


def _rank_main(rank: int, world_size: int, cfg_dict: dict, shaping: dict) -> dict:
    """One rank of the benchmark: the same sessions, in the same order, on every rank.

    Phase 1 sweeps DDP's bucket size (when ddp-best or overlap-best is asked for) and agrees
    on the best; phase 2 runs the compared modes side by side, interleaved.
    """
    import torch
    import torch.distributed as dist
    import transformers

    from .link import SimulatedLink, measure_allreduce

    transformers.logging.set_verbosity_error()
    cfg = BenchConfig.from_dict(cfg_dict)
    spec = cfg.model
    gen = torch.Generator().manual_seed(cfg.seed * 1000 + rank)   # each rank its own shard
    batches = [torch.randint(0, spec.vocab_size, (spec.batch_size, spec.seq_len), generator=gen) for _ in range(4)]
    params = sum(p.numel() for p in _build_model(spec, cfg.seed).parameters())

    sweep = "ddp-best" in cfg.modes or "overlap-best" in cfg.modes
    sweep_runs = [None, *cfg.ddp_buckets] if sweep else []
    main_runs = (["serial"] * ("serial" in cfg.modes) + ["ddp-default"] * ("ddp-default" in cfg.modes)
                 + ["ddp-best"] * ("ddp-best" in cfg.modes) + ["overlap"] * ("overlap" in cfg.modes)
                 + ["overlap-best"] * ("overlap-best" in cfg.modes) + ["overlap-auto"] * ("overlap-auto" in cfg.modes))
    total = (len(sweep_runs) + len(main_runs)) * (cfg.warmup + cfg.steps)
    progress = _Progress(total, enabled=rank == 0)

    link = SimulatedLink(shaping["rate_mbit"], shaping["latency_ms"]) if shaping["kind"] == "simulated" else None
    sweep_results: dict[str, dict] = {}
    runs: dict[str, dict] = {}
    best_mb, load = None, [os.getloadavg()[0]]
    with link.installed() if link is not None else contextlib.nullcontext():
        calibration = measure_allreduce(min(8 * 2**20, params * 4))
        if sweep:
            sessions = [_Session("ddp", mb, cfg, "ddp@default" if mb is None else f"ddp@{mb:g}") for mb in sweep_runs]
            _run_interleaved(sessions, cfg, batches, progress)
            for s in sessions:
                sweep_results[s.label] = s.result()
                s.close()
            del sessions
            gc.collect()
            # Every rank must pick the same best bucket, by the statistic the report shows: per
            # step the slowest rank, then the median over steps.
            steps = torch.tensor([[r["step_ms"] for r in res["records"]] for res in sweep_results.values()],
                                 dtype=torch.float64)
            dist.all_reduce(steps, op=dist.ReduceOp.MAX)
            medians = [statistics.median(row) for row in steps.tolist()]
            best_mb = sweep_runs[medians.index(min(medians))]
        load.append(os.getloadavg()[0])
        specs = {"serial": ("serial", OVERLAP_DEFAULT_MB), "ddp-default": ("ddp", None), "ddp-best": ("ddp", best_mb),
                 "overlap": ("overlap", OVERLAP_DEFAULT_MB),
                 "overlap-best": ("overlap", OVERLAP_DEFAULT_MB if best_mb is None else best_mb),
                 "overlap-auto": ("overlap", "auto")}
        sessions = [_Session(*specs[m], cfg, m) for m in main_runs]
        _run_interleaved(sessions, cfg, batches, progress)
        for s in sessions:
            runs[s.label] = s.result()
            s.close()
        load.append(os.getloadavg()[0])
    return {"runs": runs, "sweep": sweep_results, "best_ddp_bucket_mb": best_mb,
            "calibration": calibration, "params": params, "num_threads": torch.get_num_threads(),
            "loadavg_1min": load}


def _run_ranks(cfg: BenchConfig, shaping: dict) -> list[dict]:
    from hfstream.testing import run_on_ranks

    # GLOO_SOCKET_IFNAME=lo: gloo would otherwise pick the interface of the hostname; the ranks
    # talk over 127.0.0.1 only (inside the namespace: the shaped loopback).
    return run_on_ranks(_rank_main, cfg.world_size, dataclasses.asdict(cfg), shaping,
                        timeout=cfg.timeout_s, pg_timeout_s=max(60.0, cfg.timeout_s / 4),
                        env={"GLOO_SOCKET_IFNAME": "lo"})


def _worker_main(cfg_path: str, out_path: str) -> int:
    """Entry point inside the namespace: run the ranks, write their results as JSON."""
    with open(cfg_path) as f:
        job = json.load(f)
    per_rank = _run_ranks(BenchConfig.from_dict(job["config"]), job["shaping"])
    with open(out_path, "w") as f:
        json.dump(per_rank, f)
    return 0


# =============================================================================================
# The parent: choose the link, run the worker, summarise
# =============================================================================================

def resolve_shaping(cfg: BenchConfig) -> dict:
    """Which link this run uses, as the JSON records it. Raises `BenchError` for --shaping netns
    where namespaces cannot be made."""
    from .link import can_shape

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


def _run_in_namespace(cfg: BenchConfig, shaping: dict) -> list[dict]:
    from .link import run_in_namespace, shaped_namespace

    with tempfile.TemporaryDirectory(prefix="hfstream-bench-") as tmp:
        cfg_path, out_path = os.path.join(tmp, "job.json"), os.path.join(tmp, "result.json")
        with open(cfg_path, "w") as f:
            json.dump({"config": dataclasses.asdict(cfg), "shaping": shaping}, f)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")   # no DNS in the namespace: c10d warns about hostnames
        cmd = [sys.executable, "-m", "hfstream.tools.bench.run", "--_worker", cfg_path, "--_out", out_path]
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


def format_table(result: dict) -> str:
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
        bucket = "25 (1st 1)" if v["kind"] == "ddp" and v["bucket_mb"] is None else f"{v['bucket_mb']:g}"
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


# =============================================================================================
# Command line
# =============================================================================================

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
    """Add the benchmark's flags to ``parser`` (``hfstream bench`` and ``python -m hfstream.tools.bench.run``)."""
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
    parser.add_argument("--seed", type=int, default=0, help="model and data seed (default 0)")
    parser.add_argument("--timeout-s", type=_positive(float), default=None,
                        help="hard limit for the ranks (default 1800, quick 110)")
    parser.add_argument("--json", metavar="FILE", default=None, help="also write the results as JSON to FILE")


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
        seed=ns.seed, timeout_s=pick(ns.timeout_s, 1800.0, 110.0), quick=quick,
        model=dataclasses.replace(QUICK_MODEL if quick else FULL_MODEL),
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
    print(format_table(result))
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"[hfstream bench] wrote {ns.json}", file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hfstream.tools.bench.run", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.add_argument("--_worker", default=None, help=argparse.SUPPRESS)   # job file, inside the namespace
    parser.add_argument("--_out", default=None, help=argparse.SUPPRESS)
    ns = parser.parse_args(argv)
    if ns._worker:
        if not ns._out:
            parser.error("--_worker needs --_out")
        return _worker_main(ns._worker, ns._out)
    return run_from_args(ns, argv=list(argv) if argv is not None else sys.argv)


if __name__ == "__main__":
    sys.exit(main())
