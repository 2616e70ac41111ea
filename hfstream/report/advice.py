"""What to change, and what it will give: the step report's numbers turned into advice.

`advise` takes a run's measured step parts (the report's ``mean``) and what the run was set to
(`RunFacts`), and predicts the step under each candidate change with the planner's model
(`hfstream.report.schedule`, which the planner uses too: one reduction at a time on the link, each
bucket ready as backward produces it; the sharded schedule of docs/design.md section 7). The model is fed the
run's own parts, not a hardware table:

- forward, backward, optimizer and data wait are the measured means;
- the link is calibrated from the run: bandwidth = the bytes the collectives carried over the
  measured comm busy time, less a per-collective latency (`LATENCY_MS`, by backend);
- each bucket is ready when the run's own spans say it was: the launch of each of the run's
  buckets as a fraction of its backward (`measured_ready`), interpolated over the gradient bytes
  for a candidate cap's plan (GradSync's own planner, `RunFacts.plan`); bytes-proportional only
  where the run has no such spans (serial mode, no report spans);
- backward's slow-down while collectives are in flight is calibrated from the run's backward spans
  (`comm_slowdown`: backward time against the communication in flight in it) where they differ
  enough to tell; where nothing was in flight in backward (one bucket, serial) and no core is
  spare (CPU training), from the collectives' own threads' CPU per ms in flight (the report's
  ``comm_cpu_ms``: gloo's threads take it from the compute's cores); otherwise it is not modelled;
- what the model does not explain (the bookkeeping between the timeline's marks) is carried
  over unchanged: a candidate's prediction is the measured step plus the model's difference
  between the candidate and the run as it was.

- the data side is measured, not assumed (`DataSide`): the producer's CPU time against its wall
  time per batch (the prefetch thread's, or the step's own thread while it waited for data) tells
  a producer that waits (I/O, a sleep: a thread beside the step hides it with or without a spare
  core) from one that computes (it needs a core of its own); the step's own thread's CPU share in
  forward and backward, while a producer thread ran against while it did not, tells one that holds
  the GIL (worker processes, ``dataloader_num_workers``, are the fix).

A change is advised only where the run's own measurement shows the mechanism it relies on, and
each advice names that measurement (its ``premise``): prefetching or workers only where the step
waited for its batch; a bucket cap only where the step waited for communication after backward;
the bf16 wire only where the run's collectives took longer in proportion to their bytes
(`measure_comm_scaling`, a line through each bucket's time against its bytes; not measured, it is
not advised and the report says how to measure it); under ``grad_sync="serial"``, ``overlap``
first (it keeps the results), never a larger batch before it.

Candidates: ``prefetch_depth``, ``dataloader_num_workers``, ``grad_bucket_mb``, ``grad_sync``
(serial -> overlap, overlap <-> sharded), ``grad_comm_dtype`` and ``gradient_accumulation_steps``. Only a change
predicted to save at least `MIN_SAVING` is advised (of the step; of the time per sample for a
change of the effective batch, whose ``predicted_step_ms`` is the new, longer step). Changes that
keep the run's results come first (best first), then those that change them (a bf16 wire, a larger
effective batch), which say so in their reason. `advise_report` also records what was ruled out
and why (``report["ruled_out"]``), the machine's load (``report["load"]``) and what the data side
measured (``report["data_side"]``); each advice carries its ``expected_error`` (`EXPECTED_ERROR`).
"""

from __future__ import annotations

import math
import os
from statistics import median
from dataclasses import dataclass, field, replace
from typing import Callable

from .schedule import sharded_step

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
# A producer whose CPU time is under this share of its wall time per batch waits (storage, a remote
# read, a sleep): a thread beside the step hides it without a core of its own.
WAITING_CPU_SHARE = 0.5
# The step's own thread got at least this much less CPU per wall time in forward and backward while a
# producer thread ran than while none did: the producer takes the GIL (or, with no spare core, a core)
# from the step, and a thread beside it slows the step as much as it hides.
CONTENTION_LOSS = 0.15
# What the sweep (`dev.bench.sweep`, seed 0, 24 runs, 2026-12-03 06:18 UTC on the 2-core
# CPU runner at load 0.6-1.9; docs/benchmarks.md, the sweep section) measured of each kind of
# prediction, by `_kind`: (the median share of the predicted saving that the run applying it
# realised, the median |predicted - measured| / measured of the model's step). Each prediction keeps
# only that share of its saving before it is weighed against `MIN_SAVING`: a kind whose savings did
# not come (sharded's bucket caps on 2 cores: the gathers and reduce-scatters take the compute's
# time; stopping a GIL-holding prefetch: the load comes back into the step) is no longer advised.
# Kinds with fewer than two runs in the sweep are not corrected and say their error is not measured.
CALIBRATION: dict[str, tuple[float, float]] = {
    "grad_bucket_mb/overlap": (0.73, 0.03),     # 4 runs: 0.40-1.08 of the saving
    "grad_bucket_mb/sharded": (0.0, 0.12),      # 5 runs: -1.1-0.76; three made the run slower
    "grad_comm_dtype/overlap": (1.0, 0.055),    # 4 runs: 0.92-1.32
    "grad_comm_dtype/sharded": (0.19, 0.195),   # 2 runs: -0.14 and 0.52
    "prefetch_depth=2": (0.79, 0.16),           # 3 runs: 0.66-1.08
    # Four runs, re-predicted with the producer's time per micro-batch (the sweep ran before that
    # fix): 0.0-0.41 of the saving.
    "prefetch_depth=0": (0.03, 0.09),
}
# Each advice's expected prediction error (|predicted - measured| / measured) by `_kind`.
EXPECTED_ERROR: dict[str, float] = {kind: err for kind, (_, err) in CALIBRATION.items()}
# A mode switch is advised only once the sweep has checked its prediction against measured runs of
# both modes on the same kind of machine (an `EXPECTED_ERROR` entry): before that (issue 30) it made
# two runs of three slower. Until then its prediction is kept in the report as ``unchecked_advice``.
# Serial -> overlap is not such a switch: the same all-reduces, launched during backward.
CHECKED_BY_SWEEP = ("grad_sync",)
# The bf16 wire is advised only where at least this share of the collectives' time grew with their
# bytes (`CommScaling`): on a link that is the bottleneck nearly all of it; where the collectives'
# time is per-call overhead or waiting for a core, halving the bytes saves little.
BYTES_SHARE = 0.5


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
        data: what the data side measured (`DataSide`), or None (not measured).
        samples_per_step: samples of one optimizer step on this rank (batch x accumulation), or 0.
        bucket_ready: per bucket of ``plan(bucket_mb)``, the fraction of backward done when it
            launched in the run (`measured_ready`), or None: bytes-proportional.
        comm_slowdown: ms of backward per ms of communication in flight in it (`comm_slowdown`),
            or None where the run could not tell.
        comm_cpu_share: ms of CPU the process group's own threads used per ms of communication in
            flight (the report's ``comm_cpu_ms / comm_busy_ms``), or None where not measured. Where
            the slowdown was not measured (nothing was in flight in backward: one bucket, serial)
            and no core is spare, backward is taken to lose that much per ms in flight.
        comm_scaling: how the run's collectives' time grew with their bytes (`measure_comm_scaling`),
            or None where the run could not tell (then the bf16 wire is not advised);
            ``comm_scaling_unmeasured`` says why it could not.
        mode_switch_checked: advise a ``grad_sync`` switch (None: only once `EXPECTED_ERROR` has one,
            `CHECKED_BY_SWEEP`).
        calibration: each kind of prediction's measured (bias, |error|) (None: `CALIBRATION`, the
            sweep's; ``{}``: the model's own predictions, uncorrected, as its unit tests read them).
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
    data: "DataSide | None" = None
    samples_per_step: int = 0
    bucket_ready: list[float] | None = None
    comm_slowdown: float | None = None
    comm_cpu_share: float | None = None
    comm_scaling: "CommScaling | None" = None
    comm_scaling_unmeasured: str = ""
    mode_switch_checked: bool | None = None
    calibration: dict[str, tuple[float, float]] | None = None


@dataclass
class DataSide:
    """How the run's batches were produced, measured per batch (the first, warm-up, left out).

    Attributes:
        where: ``"thread"`` (the prefetch thread beside the step) or ``"step"`` (the step's own
            thread, inside its data wait: ``prefetch_depth=0``, or a source read on that thread).
        wall_ms, cpu_ms: the producer's wall time and CPU time per batch.
        batches: how many batches the means cover.
        share_with / share_without: the step's own thread's CPU time over wall time in forward and
            backward while a producer thread ran (at least half the interval) / while none did;
            NaN where no interval was of that kind.
    """

    where: str
    wall_ms: float
    cpu_ms: float
    batches: int
    share_with: float = math.nan
    share_without: float = math.nan

    @property
    def cpu_share(self) -> float:
        return self.cpu_ms / self.wall_ms if self.wall_ms > 0 else math.nan

    @property
    def loss(self) -> float:
        """How much CPU per wall time the step's own thread lost while a producer thread ran (0 if unknown)."""
        if self.where != "thread" or math.isnan(self.share_with):
            return 0.0
        ref = self.share_without if not math.isnan(self.share_without) else 1.0
        return max(0.0, 1.0 - self.share_with / ref) if ref > 0 else 0.0

    def kind(self, spare_cores: float) -> str:
        """``"waits"``, ``"computes"``, ``"holds_gil"`` (a spare core, yet the step lost CPU to it) or
        ``"contends"`` (no spare core: the GIL or the core, either way taken from the step)."""
        if self.loss >= CONTENTION_LOSS:
            return "holds_gil" if spare_cores >= 1 else "contends"
        return "waits" if self.cpu_share < WAITING_CPU_SHARE else "computes"

    def evidence(self) -> str:
        said = f"the producer used {_say(self.cpu_ms)} of CPU in {_say(self.wall_ms)} per batch"
        if self.where == "thread" and not math.isnan(self.share_with):
            ref = (f"{self.share_without:.0%} while it did not" if not math.isnan(self.share_without)
                   else "against a whole core")
            said += f"; the step's own thread got {self.share_with:.0%} CPU while it ran, {ref}"
        return said


def _union(intervals) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _overlap(t0: float, t1: float, intervals) -> float:
    return sum(max(0.0, min(t1, b) - max(t0, a)) for a, b in intervals)


def measure_data_side(host_intervals, produced=()) -> DataSide | None:
    """A `DataSide` from the timeline's ``host_intervals`` (``(kind, start, end, cpu_ms)``) and the
    prefetch thread's ``produced`` (``(start, end, cpu_ms)`` per batch), or None with too few batches."""
    produced = list(produced)[1:]
    intervals = list(host_intervals)
    compute = [iv for iv in intervals if iv[0] in ("forward", "backward")][2:]   # past the first step
    if len(produced) >= 2:
        busy = [(a, b) for a, b, _ in produced]
        wall = sum(b - a for a, b, _ in produced) * 1e3
        side = DataSide("thread", wall / len(produced), sum(c for *_, c in produced) / len(produced), len(produced))
        groups: dict[bool, list] = {True: [], False: []}
        for _, t0, t1, cpu in compute:
            share = _overlap(t0, t1, busy) / max(t1 - t0, 1e-9)
            if share >= 0.5 or share <= 0.1:
                groups[share >= 0.5].append(((t1 - t0) * 1e3, cpu))
        for key, name in ((True, "share_with"), (False, "share_without")):
            w = sum(x for x, _ in groups[key])
            if groups[key] and w > 0:
                setattr(side, name, sum(c for _, c in groups[key]) / w)
        return side
    data = [iv for iv in intervals if iv[0] == "data"][1:]
    if len(data) < 2:
        return None
    wall = sum((t1 - t0) * 1e3 for _, t0, t1, _ in data)
    return DataSide("step", wall / len(data), sum(c for *_, c in data) / len(data), len(data))


def measured_ready(spans, n_buckets: int) -> list[float] | None:
    """Per bucket of the run's plan, the median fraction of its backward done when it launched.

    ``spans``: the report's ``(rank, lane, name, start, end)``; a bucket ``"bucket i"`` of the comm
    lane belongs to the latest backward of its rank that started before it. None unless every
    bucket was seen. Monotone (a later bucket is never ready before an earlier one).
    """
    backward: dict[int, list] = {}
    launches: dict[int, list] = {}
    for rank, lane, name, t0, t1 in (tuple(s) for s in spans or ()):
        if lane == "compute" and name == "backward" and t1 > t0:
            backward.setdefault(rank, []).append((t0, t1))
        elif lane == "comm" and str(name).startswith("bucket "):
            launches.setdefault(int(str(name).split()[1]), []).append((rank, t0))
    fractions: dict[int, list] = {}
    for i, seen in launches.items():
        for rank, t0 in seen:
            before = [b for b in backward.get(rank, ()) if b[0] <= t0]
            if before:
                b0, b1 = max(before)
                fractions.setdefault(i, []).append(min(1.0, max(0.0, (t0 - b0) / (b1 - b0))))
    if n_buckets <= 0 or any(i not in fractions for i in range(n_buckets)):
        return None
    out, top = [], 0.0
    for i in range(n_buckets):
        vals = sorted(fractions[i])
        top = max(top, vals[len(vals) // 2])
        out.append(top)
    return out


def comm_slowdown(spans) -> float | None:
    """ms of backward per ms of communication in flight in it, fitted over the report's backward spans.

    A fit that one slow step cannot carry: the backwards are split by their in-flight time into a
    lower and an upper half, and the slope is the difference of the halves' medians (a least-squares
    line through nine quiet steps and one that a loaded machine stretched to 8x said over 20 ms of backward
    per ms in flight, and ruled every bucket cap out). At most 1: a collective sharing the cores
    can at worst stop backward for as long as it runs. None where the halves' in-flight times do not
    differ by a tenth of a backward (nothing to fit from).
    """
    by_rank: dict[int, dict[str, list]] = {}
    for rank, lane, name, t0, t1 in (tuple(s) for s in spans or ()):
        lanes = by_rank.setdefault(rank, {"backward": [], "comm": []})
        if lane == "compute" and name == "backward":
            lanes["backward"].append((t0, t1))
        elif lane == "comm":
            lanes["comm"].append((t0, t1))
    points = []
    for lanes in by_rank.values():
        comm = _union(lanes["comm"])
        for b0, b1 in lanes["backward"]:
            points.append((_overlap(b0, b1, comm) * 1e3, (b1 - b0) * 1e3))
    if len(points) < 3:
        return None
    points.sort()
    half = len(points) // 2
    low, high = points[:half], points[-half:]
    dx = median([x for x, _ in high]) - median([x for x, _ in low])
    if dx < 0.1 * median([y for _, y in points]):
        return None
    dy = median([y for _, y in high]) - median([y for _, y in low])
    return min(1.0, max(0.0, dy / dx))


@dataclass
class CommScaling:
    """How the run's collectives' time grew with their bytes: a line through each bucket's median time.

    Attributes:
        ms_per_mib: the line's slope, ms per MiB of gradient (as planned, before any wire dtype).
        fixed_ms: its intercept, ms per collective whatever its bytes.
        bytes_share: of the buckets' time in one step, the share the slope explains (``ms_per_mib``
            x their MiB over their time): the part fewer bytes would shorten.
        buckets: how many buckets the line is fitted through; smallest_mib, largest_mib: their range.
    """

    ms_per_mib: float
    fixed_ms: float
    bytes_share: float
    buckets: int
    smallest_mib: float
    largest_mib: float

    @property
    def holds(self) -> bool:
        """The premise of the bf16 wire: at least `BYTES_SHARE` of the collectives' time is per byte."""
        return self.ms_per_mib > 0 and self.bytes_share >= BYTES_SHARE

    def evidence(self) -> str:
        return (f"the run's collectives took {self.ms_per_mib:.2f} ms more per MiB (a line through {self.buckets} "
                f"buckets of {self.smallest_mib:.2g}-{self.largest_mib:.2g} MiB): their bytes are "
                f"{max(0.0, self.bytes_share):.0%} of their time")


def measure_comm_scaling(spans, bucket_bytes: list[int]) -> tuple[CommScaling | None, str]:
    """How the run's collectives' time grew with their bytes, from the report's spans; or None and why not.

    A bucket's time is from its launch, or from the end of the bucket before it on the same rank if
    that was later (collectives run one after another on the link), to its end: each bucket's median
    over the ranks and steps the spans cover. A least-squares line through (bytes, time) of the
    buckets needs at least 3 of them whose sizes differ by 1.5x or more (one size tells nothing).

    Args:
        spans: the report's ``(rank, lane, name, start, end)``; ``"bucket i"`` of the comm lane.
        bucket_bytes: the bytes of each bucket of the run's plan, in launch order.
    """
    by_rank: dict[int, list] = {}
    for rank, lane, name, t0, t1 in (tuple(s) for s in spans or ()):
        if lane == "comm" and str(name).startswith("bucket ") and t1 >= t0:
            by_rank.setdefault(rank, []).append((t0, t1, int(str(name).split()[1])))
    times: dict[int, list[float]] = {}
    for seen in by_rank.values():
        free = -math.inf
        for t0, t1, i in sorted(seen):
            times.setdefault(i, []).append(max(0.0, t1 - max(t0, free)) * 1e3)
            free = max(free, t1)
    n = len(bucket_bytes)
    if n < 3:
        return None, f"{_count(n, 'bucket')}: a line needs at least 3"
    if any(i not in times for i in range(n)) or any(i >= n for i in times):
        return None, "the report's spans do not show every bucket of the run's plan"
    mib = [b / 2**20 for b in bucket_bytes]
    if max(mib) < 1.5 * min(mib):
        return None, f"its buckets were all about one size ({min(mib):.2g}-{max(mib):.2g} MiB)"
    ys = [median(times[i]) for i in range(n)]
    mx, my = sum(mib) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in mib)
    slope = sum((x - mx) * (y - my) for x, y in zip(mib, ys)) / var
    total = sum(ys)
    share = slope * sum(mib) / total if total > 0 else 0.0
    return CommScaling(slope, my - slope * mx, min(1.0, share), n, min(mib), max(mib)), ""


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


def _ready(buckets: list[float], curve: list[tuple[float, float]] | None = None) -> list[float]:
    """Each bucket's ready time as a fraction of backward (launch order).

    ``curve``: the run's measured ``(share of the gradient bytes, fraction of backward)`` points
    (`_ready_curve`), interpolated at each bucket's last byte; without it, bytes-proportional.
    """
    total, done, out = sum(buckets) or 1.0, 0.0, []
    for b in buckets:
        done += b
        x = done / total
        if not curve:
            out.append(x)
            continue
        (x0, y0) = (0.0, 0.0)
        for x1, y1 in curve:
            if x <= x1 + 1e-12:
                out.append(y0 + (y1 - y0) * (x - x0) / (x1 - x0) if x1 > x0 else y1)
                break
            x0, y0 = x1, y1
        else:
            out.append(curve[-1][1])
    return out


def _ready_curve(facts: RunFacts) -> list[tuple[float, float]] | None:
    """The measured readiness of the run's buckets, against the share of the gradient bytes before them."""
    if facts.bucket_ready is None or facts.plan is None or facts.bucket_mb is None:
        return None
    planned = facts.plan(facts.bucket_mb)
    if len(planned) != len(facts.bucket_ready):
        return None
    total, done, out = sum(planned) or 1.0, 0.0, []
    for b, r in zip(planned, facts.bucket_ready):
        done += b
        out.append((done / total, r))
    return out


def _overlap_schedule(times: list[float], ready: list[float], bwd: float) -> tuple[float, float]:
    """Overlap on one link: (exposed after backward, time a collective was in flight within backward).

    Each all-reduce starts once its bucket is ready and the link is free, so what is hidden never
    exceeds the backward after the first bucket is ready (``bwd x (1 - ready[0])``).
    """
    end, inside = 0.0, 0.0
    for t, r in zip(times, ready):
        start = max(r * bwd, end)
        end = start + t
        inside += max(0.0, min(end, bwd) - min(start, bwd))
    return max(0.0, end - bwd), inside


def _comm_step(mode: str, buckets: list[float], link: _Link, parts: _Parts, facts: RunFacts,
               optimizer_ms: float) -> float:
    """The model's step without the data wait and the bookkeeping: forward, backward, exposed comm, optimizer.

    ``buckets`` in wire bytes. Reductions run in the last micro-step's backward only.
    """
    n = facts.world_size
    accum = max(1, facts.gradient_accumulation_steps)
    last_backward = parts.backward / accum
    ready = _ready(buckets, _ready_curve(facts))
    k = _slowdown(facts) or 0.0
    if k and mode != "serial":
        # Backward as it would run with no collective in flight, then with the candidate's in flight.
        base = max(last_backward - k * max(0.0, parts.busy - parts.exposed), 0.5 * last_backward)
        one = link.half if mode == "sharded" else link.allreduce
        _, inside = _overlap_schedule([one(b) for b in buckets], ready, base)
        last_backward = base + k * inside
    if mode == "sharded":
        fwd_last = parts.forward / accum
        row = sharded_step([link.half(b) for b in buckets], ready, n, fwd_last, last_backward, optimizer_ms * n)
        earlier = (parts.forward + parts.backward) * (accum - 1) / accum
        return earlier + row["step_sharded_ms"]
    if mode == "serial":
        exposed = sum(link.allreduce(b) for b in buckets)
    else:
        exposed, _ = _overlap_schedule([link.allreduce(b) for b in buckets], ready, last_backward)
    return parts.forward + parts.backward * (accum - 1) / accum + last_backward + exposed + optimizer_ms


def _slowdown(facts: RunFacts) -> float | None:
    """ms of backward lost per ms of communication in flight in it: measured in backward where the run
    had some there, else the collectives' own CPU per ms where no core is spare for them (None: unknown)."""
    if facts.comm_slowdown is not None:
        return facts.comm_slowdown
    if facts.comm_cpu_share is not None and facts.spare_cores < 1:
        return min(1.0, facts.comm_cpu_share)
    return None


def _cpu_share(mean: dict) -> float | None:
    cpu, busy = mean.get("comm_cpu_ms"), mean.get("comm_busy_ms")
    if not all(isinstance(v, (int, float)) and not math.isnan(v) for v in (cpu, busy)) or busy <= 0:
        return None
    return cpu / busy


def _say(ms: float) -> str:
    return f"{ms:.0f} ms" if ms >= 10 else f"{ms:.1f} ms"


def advise(mean: dict, facts: RunFacts, ruled_out: list[str] | None = None,
           unchecked: list[dict] | None = None) -> list[dict]:
    """Advice for the run whose measured means are ``mean`` (the report's ``mean``), best first.

    Args:
        ruled_out: if given, gets one sentence per candidate not advised and why (no spare core,
            predicted to save too little, nothing to hide, ...).
        unchecked: if given, gets the advice held back because its kind of prediction has not been
            checked by the sweep yet (`CHECKED_BY_SWEEP`), with its prediction.

    Returns:
        A list of ``{"setting", "value", "predicted_step_ms", "reason", "changes_results", "saving",
        "expected_error", "load"}``, empty when no change is predicted to save at least `MIN_SAVING`
        (``saving``: of the step; of the time per sample where the change makes the effective batch
        larger, which also has ``predicted_ms_per_sample``).
    """
    why = ruled_out if ruled_out is not None else []
    parts = _Parts(_num(mean, "data_wait_ms"), _num(mean, "forward_ms"), _num(mean, "backward_ms"),
                   _num(mean, "optimizer_ms"), _num(mean, "exposed_comm_ms"), _num(mean, "comm_busy_ms"),
                   _num(mean, "step_ms"))
    if parts.step <= 0:
        why.append("no step was measured")
        return []
    if facts.comm_cpu_share is None:
        facts = replace(facts, comm_cpu_share=_cpu_share(mean))
    out = _data_advice(parts, facts, why) + _comm_advice(parts, facts, why) + _accumulation_advice(parts, facts, why)
    worth = []
    checked = facts.mode_switch_checked
    for a in out:
        a = _calibrate(a, facts, parts.step)
        held = (a["setting"] in CHECKED_BY_SWEEP and facts.grad_sync != "serial"
                and not (checked if checked is not None else _kind(a, facts) in EXPECTED_ERROR))
        if a["saving"] >= MIN_SAVING and held:
            why.append(f"{a['setting']}={a['value']}: predicted {a['predicted_step_ms']:g} ms, but a mode switch is "
                       f"advised only once the sweep has checked such predictions against measured runs of both "
                       f"modes on this kind of machine (not yet)")
            if unchecked is not None:
                unchecked.append(a)
        elif a["saving"] >= MIN_SAVING:
            worth.append(a)
        else:
            unit = "per sample" if "predicted_ms_per_sample" in a else "of the step"
            share = (f" (the sweep saw {a['realised_share']:.0%} of such predicted savings realised on this kind "
                     f"of machine)" if a.get("realised_share", 1.0) < 1.0 else "")
            why.append(f"{a['setting']}={a['value']}: predicted to save {a['saving']:.0%} {unit}{share}, under "
                       f"{MIN_SAVING:.0%}")
    # Results-keeping changes first, best first; a change of results never before one that keeps them.
    # Under serial, overlap first: the mode a run that waits for its communication should be in, whatever
    # else it waits for; a larger batch only after it.
    first = lambda a: facts.grad_sync == "serial" and a["setting"] == "grad_sync"  # noqa: E731
    worth.sort(key=lambda a: (a["changes_results"], not first(a), -a["saving"]))
    if facts.grad_sync == "serial" and not any(first(a) for a in worth):
        for a in [a for a in worth if a["setting"] == "gradient_accumulation_steps"]:
            worth.remove(a)
            why.append("gradient_accumulation_steps: under grad_sync='serial', grad_sync='overlap' comes first (it "
                       "keeps the results); it is not predicted to save enough here, and a larger batch is not "
                       "advised before it")
    seen, best = set(), []
    for a in worth:   # one piece of advice per setting: its best value
        if a["setting"] not in seen:
            seen.add(a["setting"])
            best.append(a)
    load = _load(facts)
    for a in best:
        a["load"] = load
    return best


def advise_report(report: dict, facts: RunFacts) -> dict:
    """Fill a report's ``advice``, ``ruled_out``, ``load`` and ``data_side`` from its ``mean`` and ``spans``.

    The run's own spans calibrate the model where ``facts`` does not say already: each bucket's
    measured readiness (`measured_ready`) and backward's slow-down under communication
    (`comm_slowdown`). Returns ``report``.
    """
    spans = report.get("spans") or ()
    if facts.bucket_ready is None and facts.plan is not None and facts.bucket_mb is not None \
            and facts.grad_sync in ("overlap", "sharded"):
        facts.bucket_ready = measured_ready(spans, len(facts.plan(facts.bucket_mb)))
    if facts.comm_slowdown is None and facts.grad_sync in ("overlap", "sharded"):
        facts.comm_slowdown = comm_slowdown(spans)
    if facts.comm_scaling is None and facts.plan is not None and facts.bucket_mb is not None \
            and facts.grad_sync in ("overlap", "sharded", "serial"):
        facts.comm_scaling, facts.comm_scaling_unmeasured = measure_comm_scaling(spans, facts.plan(facts.bucket_mb))
    mean = report.get("mean") or {}
    why: list[str] = []
    held: list[dict] = []
    report["advice"] = advise(mean, facts, why, held) + _save_advice(report.get("save"), facts, why)
    report["unchecked_advice"] = held
    efficiency = mean.get("efficiency")
    if isinstance(efficiency, (int, float)) and not math.isnan(efficiency) and efficiency >= 1 - MIN_SAVING:
        why.insert(0, f"at the ceiling: the step is within {1 - efficiency:.0%} of its ceiling "
                      f"(efficiency {efficiency:.0%}), less than the {MIN_SAVING:.0%} any change must save")
    report["load"] = _load(facts)
    if report["load"]["unreliable"]:
        why.append(_loaded_sentence(report["load"]))
    report["ruled_out"] = why
    report["data_side"] = None if facts.data is None else {
        **{k: getattr(facts.data, k) for k in ("where", "wall_ms", "cpu_ms", "batches", "share_with", "share_without")},
        "kind": facts.data.kind(facts.spare_cores)}
    report["model"] = {"bucket_ready": "measured" if facts.bucket_ready is not None else "bytes-proportional",
                       "comm_slowdown": facts.comm_slowdown,
                       "comm_scaling": None if facts.comm_scaling is None else vars(facts.comm_scaling)}
    return report


SAVE_SHARE = 0.05          # saves costing the run more than this are worth moving behind training
SNAPSHOT_BYTES_PER_S = 2e9   # host copy of the checkpoint into the snapshot: slower than this machines' memcpy


def _save_advice(save: dict | None, facts: RunFacts, why: list[str]) -> list[dict]:
    """``save_async=True`` where blocking saves cost the run more than `SAVE_SHARE` of its time.

    Premise: the run's own saves (the training thread's time in them against the run's). The
    prediction: with a core free for the writer, what stays exposed is the snapshot, a host copy of
    the checkpoint (its bytes at `SNAPSHOT_BYTES_PER_S`, a floor well under a memcpy's bandwidth) and
    at least a tenth of the blocking save; with none free, half the blocking save (docs/benchmarks.md,
    2 loaded cores: the snapshot alone 0.11x the blocking save, 0.50x exposed with the writer's wait).
    """
    if not save or not save.get("saves") or save.get("save_async") or not save.get("run_s"):
        return []
    share = save["exposed_s"] / save["run_s"]
    if share <= SAVE_SHARE:
        why.append(f"save_async=True: the {save['saves']} save(s) took {share:.1%} of the run "
                   f"({save['exposed_s']:.2f} s of {save['run_s']:.1f} s), at most {SAVE_SHARE:.0%}")
        return []
    snapshot = save.get("bytes", 0) / SNAPSHOT_BYTES_PER_S
    free = facts.spare_cores is None or facts.spare_cores >= 1
    after = min(save["exposed_s"], max(snapshot, 0.10 * save["exposed_s"]) if free else 0.5 * save["exposed_s"])
    saving = (save["exposed_s"] - after) / save["run_s"]
    return [{"setting": "save_async", "value": True, "predicted_step_ms": None, "changes_results": False,
             "saving": round(saving, 4), "predicted_run_s": round(save["run_s"] - save["exposed_s"] + after, 2),
             "reason": f"the {save['saves']} blocking save(s) held training {save['exposed_s']:.2f} s, "
                       f"{share:.0%} of the run; written behind training, about {after:.2f} s stays exposed ("
                       + ("the snapshot into host memory" if free else "no core is free for the writer: it shares "
                          "training's") + f"), {saving:.0%} of the run saved",
             "premise": f"measured: the training thread spent {share:.0%} of the run in saves (more than "
                        f"{SAVE_SHARE:.0%})"}]


def _loaded_sentence(load: dict) -> str:
    return (f"the machine was loaded (1-minute load {load.get('loadavg_1min')} on {load.get('cores')} cores, above "
            f"{load.get('limit'):g}): other work took time from the measured parts, so every prediction here is "
            f"unreliable; rerun on a quiet machine")


def _count(n: int, noun: str) -> str:
    """``1 bucket``, ``3 buckets``."""
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _load(facts: RunFacts) -> dict:
    """The machine's load when the run ended, and whether it makes the predictions unreliable."""

    limit = LOADED_PER_CORE * max(1, facts.cores)
    load = facts.loadavg_1min
    known = isinstance(load, (int, float)) and not math.isnan(load)
    return {"loadavg_1min": round(load, 2) if known else None, "cores": facts.cores, "limit": limit,
            "per_core": round(load / max(1, facts.cores), 2) if known else None,
            "limit_per_core": LOADED_PER_CORE, "unreliable": bool(known and load > limit)}


def _advice(setting: str, value, predicted: float, reason: str, step: float, premise: str,
            changes_results: bool = False, saving: float | None = None) -> dict:
    """One advice; ``premise``: the run's measurement that shows the mechanism it relies on.
    ``saving`` defaults to the share of ``step`` the prediction saves."""
    return {"setting": setting, "value": value, "predicted_step_ms": round(predicted, 1), "reason": reason,
            "premise": premise, "changes_results": changes_results,
            "saving": round(saving if saving is not None else 1 - predicted / step, 4),
            "expected_error": None}


def _kind(a: dict, facts: RunFacts) -> str:
    """The kind of prediction ``a`` is, as the sweep's calibration tells them apart."""
    if a["setting"] in ("grad_bucket_mb", "grad_comm_dtype"):
        return f"{a['setting']}/{'sharded' if facts.grad_sync == 'sharded' else 'overlap'}"
    if a["setting"] == "prefetch_depth":
        return f"prefetch_depth={0 if a['value'] == 0 else 2}"
    if a["setting"] == "grad_sync" and facts.grad_sync == "serial":
        return "grad_sync=overlap/serial"
    return a["setting"]


def _calibrate(a: dict, facts: RunFacts, step: float) -> dict:
    """``a`` with only its kind's measured share of its saving (`CALIBRATION`) and its expected error."""
    kind, table = _kind(a, facts), CALIBRATION if facts.calibration is None else facts.calibration
    a["expected_error"] = table[kind][1] if kind in table else None
    a["model_step_ms"] = a["predicted_step_ms"]   # the model's own figure, before the correction
    if kind in table and "predicted_ms_per_sample" not in a:
        realised = table[kind][0]
        a["realised_share"] = realised
        a["predicted_step_ms"] = round(step - realised * (step - a["predicted_step_ms"]), 1)
        a["saving"] = round(1 - a["predicted_step_ms"] / step, 4)
    return a


def _data_advice(parts: _Parts, facts: RunFacts, why: list[str]) -> list[dict]:
    """Hide the data wait: a producer beside the step (prefetch), or several (workers), by what it measured.

    A producer that waits needs no core of its own; one that computes does; one that holds the GIL
    (or, with no spare core, takes the step's core) slows the step's own thread and needs processes.
    """
    out = []
    wait, rest, step = parts.data_wait, parts.compute, parts.step
    data = facts.data
    kind = data.kind(facts.spare_cores) if data is not None else None
    seen = f" ({data.evidence()})" if data is not None else ""
    spare = f"{facts.spare_cores:g} spare core(s) per rank beside the compute"
    if kind in ("holds_gil", "contends") and facts.prefetch_depth > 0:
        # The step's own compute ran slower while the producer thread ran: what it lost comes back
        # once the producer is out of this process.
        premise = (f"the step's own thread got {data.share_with:.0%} CPU in forward and backward while the "
                   f"producer thread ran, " + (f"{data.share_without:.0%} while it did not" if not
                                                math.isnan(data.share_without) else "against a whole core"))
        lost = (parts.forward + parts.backward) * data.loss
        calm = rest - lost
        produce = data.cpu_ms
        micro = max(1, facts.gradient_accumulation_steps)   # batches a step loads
        if kind == "holds_gil":
            cores = max(1, min(facts.cores_per_rank, int(facts.spare_cores)))
            workers = max(facts.dataloader_num_workers + 1, min(cores, math.ceil(produce * micro / max(calm, 1e-9))))
            left = max(0.0, produce * micro / workers - calm)
            out.append(_advice(
                "dataloader_num_workers", workers, calm + left,
                f"the producer thread holds the GIL{seen}: the step's forward and backward lost about {_say(lost)}; "
                f"{workers} worker process(es) have their own interpreter and core, leaving {_say(left)} of data wait",
                step, premise))
        else:
            why.append(f"dataloader_num_workers: the producer thread takes the GIL or a core from the step{seen}, "
                       f"and there is no core for worker processes ({spare})")
        out.append(_advice(
            "prefetch_depth", 0, calm + produce * micro,
            f"the producer thread slows the step's own compute{seen}: in the step itself it would take "
            f"{_say(produce)} a batch ({micro} a step) but no longer slow forward and backward (about "
            f"{_say(lost)} lost now)", step, premise))
        return out
    if wait <= MIN_SAVING * step:
        if wait > 0 or data is not None:
            why.append(f"data: the step waited {_say(wait)} of {_say(step)} for its batches: little to hide")
        return out
    if facts.prefetch_depth == 0:
        if kind == "computes" and facts.spare_cores < 1:
            why.append(f"prefetch_depth, dataloader_num_workers: the loader computes{seen} and there is no "
                       f"spare core ({spare}): a producer beside the step would take its core from the compute")
            return out
        if kind is None and facts.spare_cores < 1:
            why.append(f"prefetch_depth: the loader's CPU time was not measured and there is no spare core "
                       f"({spare}): a producer that computes would take its core from the compute")
            return out
        # A background producer runs beside the rest of the step: only what is longer stays exposed.
        left = max(0.0, wait - rest)
        how = ("it waits, so a thread beside the step hides it without a core of its own" if kind == "waits" else
               "a background thread on a spare core; a producer that holds the GIL would then show in the "
               "next report")
        out.append(_advice(
            "prefetch_depth", 2, rest + left,
            f"the step waited {_say(wait)} of {_say(step)} for its batch, loaded in the step itself{seen}; "
            f"prefetched beside the other {_say(rest)} of the step ({how}), {_say(left)} would be left", step,
            f"the step waited for its batch: {_say(wait)} of {_say(step)} (the data wait, measured)"))
        return out
    # Already prefetching: the producer is slower than the step. Workers share its work.
    produce = data.wall_ms if data is not None and data.where == "thread" else wait + rest
    have = max(1, facts.dataloader_num_workers)
    if produce <= rest:
        why.append(f"dataloader_num_workers: the producer takes {_say(produce)} per batch, less than the "
                   f"{_say(rest)} of the step beside it: the {_say(wait)} wait is the hand-over, not the "
                   f"producer, and more producers would not shorten it")
        return out
    if kind == "waits":
        # Waiting producers wait side by side: no core each.
        workers = max(have + 1, math.ceil(produce / max(rest, 1e-9)))
        cores_said = "they wait, so they need no core each"
    elif facts.spare_cores < 1:
        why.append(f"dataloader_num_workers: the producer computes{seen} and there is no spare core ({spare})")
        return out
    else:
        cores = max(1, min(facts.cores_per_rank, int(facts.spare_cores)))
        workers = min(cores, max(have + 1, math.ceil(produce / max(rest, 1e-9))))
        cores_said = f"{cores} core(s) per rank"
    if workers > facts.dataloader_num_workers and workers > 1:
        left = max(0.0, produce / workers - rest)
        out.append(_advice(
            "dataloader_num_workers", workers, rest + left,
            f"with prefetching the step still waited {_say(wait)} of {_say(step)}{seen}: one producer takes about "
            f"{_say(produce)} per batch; {workers} workers ({cores_said}) would leave {_say(left)}", step,
            f"with prefetching the step still waited for its batch ({_say(wait)} of {_say(step)}), and one "
            f"producer took {_say(produce)} per batch, more than the {_say(rest)} of the step beside it"))
    else:
        why.append(f"dataloader_num_workers: {have} producer(s) already use the {cores} core(s) per rank there "
                   f"are for them ({spare}; {facts.cores_per_rank} per rank in all)" if kind != "waits" else
                   f"dataloader_num_workers: {have} worker(s) already keep up with the step")
    return out


def _comm_advice(parts: _Parts, facts: RunFacts, why: list[str]) -> list[dict]:
    mode = facts.grad_sync
    if facts.world_size < 2:
        why.append("communication: one process, nothing to synchronise")
        return []
    if mode not in ("overlap", "sharded", "serial") or facts.plan is None:
        why.append(f"communication: grad_sync={mode!r} hides its reductions from the report (not modelled)")
        return []
    if facts.bucket_mb is None or parts.busy <= 0:
        why.append("communication: no bucket cap or no communication time measured")
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

    waited = exposed >= MIN_SAVING * parts.step   # the premise of every change on the link
    assumed = _slowdown(facts) if facts.comm_slowdown is None else None   # from the collectives' CPU
    cpu = (f"; backward taken to lose {assumed:.2f} ms per ms of communication in flight in it (the collectives' "
           f"threads used that much CPU per ms, and no core is spare)" if assumed is not None else "")
    waited_said = (f"the step waited for communication after backward: {_say(exposed)} of {_say(parts.step)} "
                   f"(exposed comm, measured; {_say(parts.busy)} busy)")
    if not waited:
        why.append(f"communication: the step waited {_say(exposed)} of {_say(parts.step)} for it after backward: "
                   f"little for a bucket cap, the bf16 wire or a mode switch to hide")
    # Serial -> overlap: the same all-reduces, launched as backward produces their buckets; with the
    # cap too where the run's own cap leaves too few buckets for backward to hide (one: none of it).
    if mode == "serial" and waited:
        if facts.auto_bucket:   # the tuner chooses the cap
            cap, model_ms = facts.bucket_mb, _comm_step("overlap", current, link, parts, facts, parts.optimizer)
        else:
            cap, model_ms = best_cap("overlap", parts.optimizer, (facts.bucket_mb, *BUCKET_CANDIDATES_MB))
        also = {"grad_bucket_mb": cap} if cap != facts.bucket_mb else {}
        at = (f" at {cap:g} MiB buckets (now {_count(len(current), 'bucket')} of at most {facts.bucket_mb:g} MiB, "
              f"{'none of which backward can hide' if len(current) == 1 else 'fewer than backward can hide'})"
              if also else "")
        entry = _advice(
            "grad_sync", "overlap", predicted(model_ms),
            f"under serial every bucket's all-reduce waits for the end of backward; overlap launches each as "
            f"backward produces it, behind the rest of the {_say(parts.backward)} backward{at}, and keeps the "
            f"results (the same all-reduces, the same sums){cpu}", parts.step,
            f"under serial all {_say(parts.busy)} of communication ran after backward ({_say(exposed)} exposed), "
            f"beside a {_say(parts.backward)} backward that overlap runs it in")
        if also:
            entry["also"] = also
        out.append(entry)
    # The bucket cap, in the mode the run has.
    ready_said = (f"buckets ready as the run's spans show (the first at {facts.bucket_ready[0]:.0%} of backward)"
                  if _ready_curve(facts) else "buckets assumed ready in proportion to their bytes (no spans measured)")
    if not facts.auto_bucket and waited:
        best = best_cap(mode, parts.optimizer, [c for c in BUCKET_CANDIDATES_MB if c != facts.bucket_mb])
        out.append(_advice(
            "grad_bucket_mb", best[0], predicted(best[1]),
            f"{_say(exposed)} of the {_say(parts.step)} step waited for communication ({_say(parts.busy)} busy) "
            f"with {_count(len(current), 'bucket')} of at most {facts.bucket_mb:g} MiB; {best[0]:g} MiB buckets leave the "
            f"link less after backward (or 'auto' tunes it in the first steps); {ready_said}{cpu}", parts.step,
            waited_said))
    # The other mode: overlap <-> sharded (the optimizer then steps 1/N of the parameters, or all).
    if mode in ("overlap", "sharded") and exposed + parts.optimizer >= MIN_SAVING * parts.step:
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
            f"{other_mode} at {plan_cap:g} MiB buckets: {what}", parts.step,
            f"the step waited {_say(exposed)} for communication after backward and took {_say(parts.optimizer)} "
            f"in the optimizer, of {_say(parts.step)} (measured)"))
    # A narrower wire: half the bytes, results change. Only where fewer bytes are measured to take less time.
    scaling = facts.comm_scaling
    if facts.wire_element_bytes > 2 and waited:
        if scaling is None:
            why.append(f"grad_comm_dtype=bf16: not advised: whether this run's communication takes less time with "
                       f"fewer bytes was not measured ({facts.comm_scaling_unmeasured or 'no per-bucket spans'}); to "
                       f"measure it, run a few steps with grad_comm_dtype='bf16' and compare the exposed comm")
        elif not scaling.holds:
            why.append(f"grad_comm_dtype=bf16: {scaling.evidence()}, under {BYTES_SHARE:.0%}: the collectives' "
                       f"time is per call or waiting, and half the bytes would not shorten it")
        else:
            half = [b / 2 for b in current]
            model_ms = _comm_step(mode, half, link, parts, facts, parts.optimizer)
            out.append(_advice(
                "grad_comm_dtype", "bf16", predicted(model_ms),
                f"{_say(parts.busy)} of communication carries {facts.wire_element_bytes}-byte gradients; bf16 halves "
                f"the bytes. Changes the results slightly: each rank's gradient is rounded to bf16 before the sum",
                parts.step, f"{waited_said}; {scaling.evidence()}", changes_results=True))
    return out


def _accumulation_advice(parts: _Parts, facts: RunFacts, why: list[str]) -> list[dict]:
    """Twice the micro-batches per step: the sync and the optimizer are paid once per twice the samples.

    A change of the effective batch: predicted as its new (longer) step and as time per sample,
    never as a step time it would not produce.
    """
    if parts.exposed < MIN_SAVING * parts.step:
        why.append(f"gradient_accumulation_steps: exposed comm is {_say(parts.exposed)} of {_say(parts.step)}: "
                   f"nothing for a larger batch to amortise")
        return []
    fixed = parts.step - parts.data_wait - parts.forward - parts.backward   # exposed comm, optimizer, bookkeeping
    a = max(1, facts.gradient_accumulation_steps)
    new_step = 2 * (parts.step - fixed) + fixed
    saving = 1 - new_step / (2 * parts.step)
    samples = facts.samples_per_step
    if samples > 0:
        now_ms, new_ms = parts.step / samples, new_step / (2 * samples)
        per = f"{now_ms:.2f} -> {new_ms:.2f} ms per sample"
    else:
        now_ms = new_ms = None
        per = f"{saving:.0%} less time per sample"
    entry = _advice(
        "gradient_accumulation_steps", 2 * a, new_step,
        f"{_say(fixed)} of each {_say(parts.step)} step is paid once per step (exposed comm "
        f"{_say(parts.exposed)}, optimizer {_say(parts.optimizer)}); with {2 * a} micro-batches a step takes about "
        f"{_say(new_step)} for twice the samples ({per}). Changes the results: twice the effective batch, half "
        f"the optimizer steps (adjust learning rate and max_steps)",
        parts.step, f"paid once per step: exposed comm {_say(parts.exposed)} and optimizer {_say(parts.optimizer)} "
                    f"of {_say(parts.step)} (measured)", changes_results=True, saving=saving)
    entry["ms_per_sample"] = None if now_ms is None else round(now_ms, 3)
    entry["predicted_ms_per_sample"] = None if new_ms is None else round(new_ms, 3)
    return [entry]


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
        bucket_mb = sync.cap_mb if sync.tuning is None else None
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
    timeline = getattr(trainer, "_timeline", None)
    prefetcher = getattr(trainer, "_prefetcher", None)
    produced = prefetcher.stats.produced if prefetcher is not None else ()
    data = measure_data_side(timeline.host_intervals, produced) if timeline is not None else None
    batch = int(getattr(args, "per_device_train_batch_size", 0) or 0)
    return RunFacts(
        grad_sync=mode, world_size=world, prefetch_depth=int(args.prefetch_depth),
        dataloader_num_workers=int(args.dataloader_num_workers),
        gradient_accumulation_steps=int(args.gradient_accumulation_steps),
        bucket_mb=bucket_mb, auto_bucket=getattr(args, "grad_bucket_mb", None) == "auto",
        wire_element_bytes=wire, grad_element_bytes=elem, backend=backend, plan=plan,
        cores_per_rank=max(1, (os.cpu_count() or 1) // max(1, local)), spare_cores=spare,
        loadavg_1min=os.getloadavg()[0] if hasattr(os, "getloadavg") else math.nan, cores=os.cpu_count() or 1,
        data=data, samples_per_step=batch * int(args.gradient_accumulation_steps))
