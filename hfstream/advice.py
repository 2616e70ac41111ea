"""What to change, and what it will give: the step report's numbers turned into advice.

`advise` takes a run's measured step parts (the report's ``mean``) and what the run was set to
(`RunFacts`), and predicts the step under each candidate change with the planner's model
(`hfstream.schedule`, which the planner uses too: one reduction at a time on the link, each
bucket ready as backward produces it; the sharded schedule of docs/design.md section 7). The model is fed the
run's own parts, not a hardware table:

- forward, backward, optimizer and data wait are the measured means;
- the link is calibrated from the run: bandwidth = the bytes the collectives carried over the
  measured comm busy time, less a per-collective latency (`LATENCY_MS`, by backend);
- each bucket is ready when backward has produced its share of the gradient bytes, in
  GradSync's own plan for the candidate cap (`RunFacts.plan`);
- what the model does not explain (the bookkeeping between the timeline's marks) is carried
  over unchanged: a candidate's prediction is the measured step plus the model's difference
  between the candidate and the run as it was.

Candidates: ``prefetch_depth``, ``dataloader_num_workers``, ``grad_bucket_mb``, ``grad_sync``
(overlap <-> sharded), ``grad_comm_dtype`` and ``gradient_accumulation_steps``. Only a change
predicted to save at least `MIN_SAVING` of the step is advised. Changes that keep the run's
results come first (best first), then those that change them (a bf16 wire, a larger effective
batch), which say so in their reason.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Callable

from .schedule import overlap_exposed, sharded_step

MIN_SAVING = 0.05            # advise a change only if it saves at least 5 % of the step
# Above this 1-minute load average per core (a run's or a bench's own ranks included) the ranks did
# not get a core each: other work took compute time from them, and measured parts, predictions and
# benchmark ratios say more about that work than about the run. The bench reads it from here.
LOADED_PER_CORE = 1.25
BUCKET_CANDIDATES_MB = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 25.0, 64.0)
# One collective's fixed cost in ms, by backend: gloo on loopback (measured here, 2 ranks: 0.3-0.7
# ms, busy machine), NCCL within a node (tens of microseconds). Used to split the measured comm
# time into latency and bandwidth.
LATENCY_MS = {"gloo": 0.5, "nccl": 0.03}
DEFAULT_LATENCY_MS = 0.1


@dataclass
class RunFacts:
    """What a run was set to, beside its measured parts.

    Attributes:
        grad_sync: the mode in use: ``"overlap"``, ``"sharded"``, ``"serial"``, ``"native"``
            (DDP), or None (one process, nothing to sync).
        world_size: data-parallel ranks.
        prefetch_depth, dataloader_num_workers, gradient_accumulation_steps: as set.
        bucket_mb: the cap in use (the chosen one under ``"auto"``); None if unknown.
        auto_bucket: ``grad_bucket_mb="auto"`` chose ``bucket_mb``.
        wire_element_bytes / grad_element_bytes: bytes per element on the wire / in the gradient.
        backend: the process group's backend (``"gloo"``, ``"nccl"``), for `LATENCY_MS`.
        plan: bucket bytes in launch order for a cap in MiB (GradSync's own planner), or None.
        cores_per_rank: CPU cores this rank may use for data loader workers.
        spare_cores: cores per rank left beside the compute (CPU training: the cores less the
            compute threads of this node's ranks): a producer that needs a core of its own
            (prefetch thread, workers) gains nothing without one.
        loadavg_1min / cores: the machine's 1-minute load average when the run ended, and its
            cores; above the bench's `LOADED_PER_CORE` x cores every prediction is marked
            unreliable (other work took compute time from the measured parts).
    """

    grad_sync: str | None
    world_size: int = 1
    prefetch_depth: int = 0
    dataloader_num_workers: int = 0
    gradient_accumulation_steps: int = 1
    bucket_mb: float | None = None
    auto_bucket: bool = False
    wire_element_bytes: int = 4
    grad_element_bytes: int = 4
    backend: str = "gloo"
    plan: Callable[[float], list[int]] | None = field(default=None, repr=False)
    cores_per_rank: int = 1
    spare_cores: float = 1.0
    loadavg_1min: float = math.nan
    cores: int = 1


@dataclass
class _Parts:
    """The measured means the model works from (ms)."""

    data_wait: float
    forward: float
    backward: float
    optimizer: float
    exposed: float
    busy: float
    step: float

    @property
    def compute(self) -> float:
        """Everything but the data wait: what a prefetching producer runs beside."""
        return self.step - self.data_wait


def _num(mean: dict, key: str) -> float:
    v = mean.get(key)
    return float(v) if isinstance(v, (int, float)) and not math.isnan(v) else 0.0


class _Link:
    """The run's link: ``alpha`` ms per collective, ``ms_per_byte`` for the bytes each rank sends."""

    def __init__(self, facts: RunFacts, parts: _Parts, buckets: list[int]):
        n = facts.world_size
        self.world_size = n
        self.alpha = LATENCY_MS.get(facts.backend, DEFAULT_LATENCY_MS)
        wire = sum(buckets) * facts.wire_element_bytes / max(1, facts.grad_element_bytes)
        collectives = len(buckets) * (2 if facts.grad_sync == "sharded" else 1)
        per_byte_time = parts.busy - collectives * self.alpha
        sent = 2 * (n - 1) / n * wire   # an all-reduce, or a reduce-scatter + an all-gather
        if per_byte_time <= 0 or sent <= 0:   # all latency: keep a bandwidth that makes the bytes cheap
            per_byte_time = max(parts.busy * 0.1, 1e-3)
        self.ms_per_byte = per_byte_time / max(sent, 1.0)

    def allreduce(self, nbytes: float) -> float:
        n = self.world_size
        return self.alpha + 2 * (n - 1) / n * nbytes * self.ms_per_byte

    def half(self, nbytes: float) -> float:
        n = self.world_size
        return self.alpha + (n - 1) / n * nbytes * self.ms_per_byte


def _ready(buckets: list[float]) -> list[float]:
    """Each bucket ready when backward has produced its share of the bytes (launch order)."""
    total, done, out = sum(buckets) or 1.0, 0.0, []
    for b in buckets:
        done += b
        out.append(done / total)
    return out


def _comm_step(mode: str, buckets: list[float], link: _Link, parts: _Parts, facts: RunFacts,
               optimizer_ms: float) -> float:
    """The model's step without the data wait and the bookkeeping: forward, backward, exposed comm, optimizer.

    ``buckets`` in wire bytes. Reductions run in the last micro-step's backward only.
    """
    n = facts.world_size
    accum = max(1, facts.gradient_accumulation_steps)
    last_backward = parts.backward / accum
    ready = _ready(buckets)
    if mode == "sharded":
        fwd_last = parts.forward / accum
        row = sharded_step([link.half(b) for b in buckets], ready, n, fwd_last, last_backward, optimizer_ms * n)
        earlier = (parts.forward + parts.backward) * (accum - 1) / accum
        return earlier + row["step_sharded_ms"]
    if mode == "serial":
        exposed = sum(link.allreduce(b) for b in buckets)
    else:
        exposed = overlap_exposed([link.allreduce(b) for b in buckets], ready, last_backward)
    return parts.forward + parts.backward + exposed + optimizer_ms


def _say(ms: float) -> str:
    return f"{ms:.0f} ms" if ms >= 10 else f"{ms:.1f} ms"


def advise(mean: dict, facts: RunFacts) -> list[dict]:
    """Advice for the run whose measured means are ``mean`` (the report's ``mean``), best first.

    Returns:
        A list of ``{"setting", "value", "predicted_step_ms", "reason", "changes_results"}``,
        empty when no change is predicted to save at least `MIN_SAVING` of the step.
    """
    parts = _Parts(_num(mean, "data_wait_ms"), _num(mean, "forward_ms"), _num(mean, "backward_ms"),
                   _num(mean, "optimizer_ms"), _num(mean, "exposed_comm_ms"), _num(mean, "comm_busy_ms"),
                   _num(mean, "step_ms"))
    if parts.step <= 0:
        return []
    out = _data_advice(parts, facts) + _comm_advice(parts, facts) + _accumulation_advice(parts, facts)
    worth = [a for a in out if a["predicted_step_ms"] <= parts.step * (1 - MIN_SAVING)]
    worth.sort(key=lambda a: (a["changes_results"], a["predicted_step_ms"]))
    seen, best = set(), []
    for a in worth:   # one piece of advice per setting: its best value
        if a["setting"] not in seen:
            seen.add(a["setting"])
            best.append(a)
    load = _load(facts)
    for a in best:
        a["load"] = load
    return best


def _count(n: int, noun: str) -> str:
    """``1 bucket``, ``3 buckets``."""
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _load(facts: RunFacts) -> dict:
    """The machine's load when the run ended, and whether it makes the predictions unreliable."""

    limit = LOADED_PER_CORE * max(1, facts.cores)
    load = facts.loadavg_1min
    known = isinstance(load, (int, float)) and not math.isnan(load)
    return {"loadavg_1min": round(load, 2) if known else None, "cores": facts.cores, "limit": limit,
            "unreliable": bool(known and load > limit)}


def _advice(setting: str, value, predicted: float, reason: str, changes_results: bool = False) -> dict:
    return {"setting": setting, "value": value, "predicted_step_ms": round(predicted, 1), "reason": reason,
            "changes_results": changes_results}


def _data_advice(parts: _Parts, facts: RunFacts) -> list[dict]:
    """Hide the data wait: a producer beside the step (prefetch), or several (workers)."""
    out = []
    wait, rest = parts.data_wait, parts.compute
    if wait <= 0 or facts.spare_cores < 1:
        return out   # nothing to hide, or no core for a producer beside the compute
    if facts.prefetch_depth == 0:
        # A background producer runs beside the rest of the step: only what is longer stays exposed.
        left = max(0.0, wait - rest)
        out.append(_advice(
            "prefetch_depth", 2, rest + left,
            f"the step waited {_say(wait)} of {_say(parts.step)} for its batch, loaded in the step itself; "
            f"prefetched beside the other {_say(rest)} of the step (a background thread on a spare core), "
            f"{_say(left)} would be left"))
    else:
        # Already prefetching: the producer is slower than the step. Workers share its work.
        produce = wait + rest   # a producer that keeps the step waiting `wait` takes wait + rest per batch
        cores = max(1, min(facts.cores_per_rank, int(facts.spare_cores)))
        have = max(1, facts.dataloader_num_workers)
        workers = min(cores, max(have + 1, math.ceil(produce / max(rest, 1e-9))))
        if workers > facts.dataloader_num_workers and workers > 1:
            left = max(0.0, produce / workers - rest)
            out.append(_advice(
                "dataloader_num_workers", workers, rest + left,
                f"with prefetching the step still waited {_say(wait)} of {_say(parts.step)}: one producer takes "
                f"about {_say(produce)} per batch; {workers} workers ({cores} core(s) per rank) would leave "
                f"{_say(left)}"))
    return out


def _comm_advice(parts: _Parts, facts: RunFacts) -> list[dict]:
    mode = facts.grad_sync
    if mode not in ("overlap", "sharded", "serial") or facts.world_size < 2 or facts.plan is None:
        return []
    if facts.bucket_mb is None or parts.busy <= 0:
        return []
    scale = facts.wire_element_bytes / max(1, facts.grad_element_bytes)
    planned = facts.plan(facts.bucket_mb)
    current = [b * scale for b in planned]
    link = _Link(facts, parts, planned)
    base = _comm_step(mode, current, link, parts, facts, parts.optimizer)
    other = parts.step - parts.data_wait - base   # what the model does not explain, carried over

    def predicted(model_ms: float) -> float:
        return parts.data_wait + other + model_ms

    out = []
    exposed = parts.exposed
    def best_cap(in_mode, optimizer_ms, caps):
        """The largest cap within 2 % of the best prediction: fewer collectives, the same step."""
        scored = [(cap, _comm_step(in_mode, [b * scale for b in facts.plan(cap)], link, parts, facts, optimizer_ms))
                  for cap in caps]
        low = min(ms for _, ms in scored)
        return max((c for c in scored if c[1] <= low * 1.02), key=lambda c: c[0])

    # The bucket cap, in the mode the run has.
    if not facts.auto_bucket:
        best = best_cap(mode, parts.optimizer, [c for c in BUCKET_CANDIDATES_MB if c != facts.bucket_mb])
        out.append(_advice(
            "grad_bucket_mb", best[0], predicted(best[1]),
            f"{_say(exposed)} of the {_say(parts.step)} step waited for communication ({_say(parts.busy)} busy) "
            f"with {_count(len(current), 'bucket')} of at most {facts.bucket_mb:g} MiB; {best[0]:g} MiB buckets leave the "
            f"link less after backward (or 'auto' tunes it in the first steps)"))
    # The other mode: overlap <-> sharded (the optimizer then steps 1/N of the parameters, or all).
    if mode in ("overlap", "sharded"):
        other_mode = "sharded" if mode == "overlap" else "overlap"
        n = facts.world_size
        opt = parts.optimizer / n if other_mode == "sharded" else parts.optimizer * n
        # At the run's cap (the one change advised), or at the best one where "auto" tunes it again.
        caps = (facts.bucket_mb, *BUCKET_CANDIDATES_MB) if facts.auto_bucket else (facts.bucket_mb,)
        plan_cap, model_ms = best_cap(other_mode, opt, caps)
        what = ("reduce-scatter in backward, each rank steps 1/N of the optimizer "
                f"({_say(parts.optimizer)} -> {_say(opt)}), the all-gathers hidden in the next forward"
                if other_mode == "sharded" else
                f"one all-reduce per bucket; each rank steps the whole optimizer ({_say(parts.optimizer)} -> {_say(opt)})")
        out.append(_advice(
            "grad_sync", other_mode, predicted(model_ms),
            f"{_say(exposed)} exposed comm and {_say(parts.optimizer)} optimizer of a {_say(parts.step)} step; "
            f"{other_mode} at {plan_cap:g} MiB buckets: {what}"))
    # A narrower wire: half the bytes, results change.
    if facts.wire_element_bytes > 2:
        half = [b / 2 for b in current]
        model_ms = _comm_step(mode, half, link, parts, facts, parts.optimizer)
        out.append(_advice(
            "grad_comm_dtype", "bf16", predicted(model_ms),
            f"{_say(parts.busy)} of communication carries {facts.wire_element_bytes}-byte gradients; bf16 halves "
            f"the bytes. Changes the results slightly: each rank's gradient is rounded to bf16 before the sum",
            changes_results=True))
    return out


def _accumulation_advice(parts: _Parts, facts: RunFacts) -> list[dict]:
    """Twice the micro-batches per step: the sync and the optimizer are paid once per twice the samples."""
    if parts.exposed < MIN_SAVING * parts.step:
        return []   # what accumulating amortises is the sync; without exposed comm it only changes the run
    fixed = parts.step - parts.data_wait - parts.forward - parts.backward   # exposed comm, optimizer, bookkeeping
    a = max(1, facts.gradient_accumulation_steps)
    per_samples = parts.step - fixed / 2   # ms per the current step's samples
    return [_advice(
        "gradient_accumulation_steps", 2 * a, per_samples,
        f"{_say(fixed)} of each {_say(parts.step)} step is paid once per step (exposed comm "
        f"{_say(parts.exposed)}, optimizer {_say(parts.optimizer)}); with {2 * a} micro-batches it is paid once "
        f"per twice the samples ({_say(per_samples)} per the current step's samples). Changes the results: twice "
        f"the effective batch, half the optimizer steps (adjust learning rate and max_steps)",
        changes_results=True)]


def facts_from_trainer(trainer) -> RunFacts:
    """`RunFacts` of a `StreamTrainer` whose `train()` just ended."""
    args = trainer.args
    sync = getattr(trainer, "grad_sync", None)
    world = int(getattr(trainer.accelerator, "num_processes", 1) or 1)
    mode = trainer.grad_sync_mode if world > 1 else None
    plan = bucket_mb = None
    wire, elem, backend = 4, 4, "gloo"
    if sync is not None and sync.world_size > 1:
        hooked = sync.hooked_parameters
        elem = hooked[0][1].element_size() if hooked else 4
        wire = sync.comm_dtype.itemsize if sync.comm_dtype is not None else elem
        bucket_mb = sync.bucket_mb if isinstance(sync.bucket_mb, float) else None
        plan = lambda cap: [b.nbytes for b in sync.plan_for(cap)]   # noqa: E731
        try:
            import torch.distributed as dist
            backend = str(dist.get_backend(sync.process_group))
        except Exception:   # noqa: BLE001  a group already destroyed: the default guess
            backend = "gloo"
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world) or 1)
    import torch

    on_cpu = torch.device(args.device).type == "cpu"
    # CPU training: each rank's compute threads hold cores; an accelerator leaves the host's cores to the data.
    threads = torch.get_num_threads() if on_cpu else 1
    spare = ((os.cpu_count() or 1) - local * threads) / local
    return RunFacts(
        grad_sync=mode, world_size=world, prefetch_depth=int(args.prefetch_depth),
        dataloader_num_workers=int(args.dataloader_num_workers),
        gradient_accumulation_steps=int(args.gradient_accumulation_steps),
        bucket_mb=bucket_mb, auto_bucket=getattr(args, "grad_bucket_mb", None) == "auto",
        wire_element_bytes=wire, grad_element_bytes=elem, backend=backend, plan=plan,
        cores_per_rank=max(1, (os.cpu_count() or 1) // max(1, local)), spare_cores=spare,
        loadavg_1min=os.getloadavg()[0] if hasattr(os, "getloadavg") else math.nan, cores=os.cpu_count() or 1)
