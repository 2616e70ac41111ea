"""Step timeline and the ceiling: where each training step's time goes, and how far it is from
the best achievable step.

A data-parallel step is data wait + forward + backward + exposed communication + optimizer.
Only backward can hide communication, so the per-step ceiling (docs/design.md section 4) is

    ideal = forward + max(backward, comm_busy) + optimizer          (data fully hidden)

Under ``grad_sync="sharded"`` the all-gather of the parameters runs behind the next forward,
so the step's limit crosses the step boundary (docs/design.md section 7):

    cross_step_limit = max(forward + backward + optimizer / N, comm_busy)   (`cross_step_limit`)

There communication is two parts, each busy and exposed: the reduce-scatters in backward (waited
in ``finish()``) and the previous step's all-gathers (waited by the forward's pre-hooks: that
wait is taken out of forward and counted as exposed communication).

Times come from `time.perf_counter` on CPU and from timing events on the compute stream of an
accelerator (resolved lazily, when a report is asked for, so measuring never forces a sync).
Data wait is always a host time: it is the time the host could not launch work.
"""

from __future__ import annotations

import json
import math
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable


def cross_step_limit(forward_ms: float, backward_ms: float, optimizer_per_rank_ms: float, comm_ms: float) -> float:
    """The sharded mode's best step: ``max(forward + backward + optimizer / N, comm)`` (docs/design.md section 4).

    The one definition the report, the benchmark, the planner and the course use. Args:
    ``optimizer_per_rank_ms``, the time to step this rank's 1/N of the parameters (a sharded run's
    measured optimizer time, or an unsharded one's divided by N); ``comm_ms``, the link's time for
    the whole ring all-reduce (a sharded run's reduce-scatter plus all-gather busy time).
    """
    return max(forward_ms + backward_ms + optimizer_per_rank_ms, comm_ms)

import torch

FIELDS = (
    "data_wait_ms", "forward_ms", "backward_ms", "comm_busy_ms", "exposed_comm_ms",
    "reduce_scatter_busy_ms", "reduce_scatter_exposed_ms", "all_gather_busy_ms", "all_gather_exposed_ms",
    "optimizer_ms", "step_ms", "ideal_ms", "cross_step_limit_ms", "efficiency", "overlap",
)
SHARDED_FIELDS = ("reduce_scatter_busy_ms", "reduce_scatter_exposed_ms", "all_gather_busy_ms",
                  "all_gather_exposed_ms", "cross_step_limit_ms")   # NaN outside grad_sync="sharded"


@dataclass
class StepRecord:
    """One optimizer step, in milliseconds. ``comm_busy_ms`` is NaN where it is not measured
    (native DDP hides its reductions from us), and then so is ``overlap``.

    ``all_gather_busy_ms``/``all_gather_exposed_ms`` are measured under ``grad_sync="sharded"``
    only (NaN otherwise); there ``comm_busy_ms`` and ``exposed_comm_ms`` are the sums of both
    halves, the reduce-scatter's being the rest, and the ceiling of the mode is
    ``cross_step_limit_ms`` (``efficiency`` is taken against it).
    """

    step: int
    data_wait_ms: float
    forward_ms: float
    backward_ms: float
    comm_busy_ms: float
    exposed_comm_ms: float
    optimizer_ms: float
    step_ms: float
    all_gather_busy_ms: float = math.nan
    all_gather_exposed_ms: float = math.nan

    @property
    def sharded(self) -> bool:
        return not math.isnan(self.all_gather_busy_ms)

    @property
    def ideal_ms(self) -> float:
        comm = 0.0 if math.isnan(self.comm_busy_ms) else self.comm_busy_ms
        return self.forward_ms + max(self.backward_ms, comm) + self.optimizer_ms

    @property
    def cross_step_limit_ms(self) -> float:
        if not self.sharded:
            return math.nan
        return cross_step_limit(self.forward_ms, self.backward_ms, self.optimizer_ms, self.comm_busy_ms)

    @property
    def reduce_scatter_busy_ms(self) -> float:
        return self.comm_busy_ms - self.all_gather_busy_ms if self.sharded else math.nan

    @property
    def reduce_scatter_exposed_ms(self) -> float:
        return self.exposed_comm_ms - self.all_gather_exposed_ms if self.sharded else math.nan

    @property
    def efficiency(self) -> float:
        ceiling = self.cross_step_limit_ms if self.sharded else self.ideal_ms
        return ceiling / self.step_ms if self.step_ms > 0 else math.nan

    @property
    def overlap(self) -> float:
        if math.isnan(self.comm_busy_ms) or self.comm_busy_ms <= 0:
            return math.nan
        return 1.0 - min(self.exposed_comm_ms, self.comm_busy_ms) / self.comm_busy_ms

    def as_dict(self) -> dict[str, float]:
        d = asdict(self)
        d.update(ideal_ms=self.ideal_ms, cross_step_limit_ms=self.cross_step_limit_ms,
                 reduce_scatter_busy_ms=self.reduce_scatter_busy_ms,
                 reduce_scatter_exposed_ms=self.reduce_scatter_exposed_ms,
                 efficiency=self.efficiency, overlap=self.overlap)
        return d


def _nanmean(values: Iterable[float]) -> float:
    vals = [v for v in values if not math.isnan(v)]
    return sum(vals) / len(vals) if vals else math.nan


# The measured parts (StepRecord's fields); the rest of FIELDS is derived from them.
TIMES = ("data_wait_ms", "forward_ms", "backward_ms", "comm_busy_ms", "exposed_comm_ms", "optimizer_ms", "step_ms",
         "all_gather_busy_ms", "all_gather_exposed_ms")


def _mean_breakdown(rows: list[dict[str, float]], steps: float) -> dict[str, float]:
    """Average the times of ``rows``; the ratios (ceiling, efficiency, overlap) are recomputed from
    the averaged times, not averaged themselves, so ``ideal_ms / step_ms == efficiency`` holds."""
    avg = StepRecord(step=0, **{f: _nanmean(r.get(f, math.nan) for r in rows) for f in TIMES})
    out = avg.as_dict()
    out.pop("step")
    if math.isnan(out["all_gather_busy_ms"]):   # not grad_sync="sharded": those fields do not exist
        for key in SHARDED_FIELDS:
            out.pop(key, None)
    out["steps"] = steps
    return out


def summarize(records: list[StepRecord], warmup: int = 1) -> dict[str, float]:
    """Average the breakdown over steps after ``warmup`` (all steps if there are no more)."""
    kept = records[warmup:] if len(records) > warmup else records
    if not kept:
        return {}
    return _mean_breakdown([{f: getattr(r, f) for f in TIMES} for r in kept], float(len(kept)))


def combine_ranks(summaries: list[dict[str, float]]) -> dict[str, float]:
    """One breakdown for several ranks' `summarize` results (empty ones skipped)."""
    rows = [s for s in summaries if s]
    if not rows:
        return {}
    return _mean_breakdown(rows, _nanmean(r["steps"] for r in rows))


def format_report(summary: dict[str, Any], title: str = "hfstream step report") -> str:
    """A short, aligned text table of a `summarize` result (or of a per-rank dict of them)."""
    if not summary:
        return f"{title}: no steps measured"
    per_rank = summary.get("per_rank") if isinstance(summary.get("per_rank"), list) else None
    mean = summary.get("mean", summary)
    lines = [f"{title} (mean of {int(mean.get('steps', 0))} steps after warm-up"
             + (f", {len(per_rank)} ranks)" if per_rank else ")")]

    def fmt(v: float, unit: str) -> str:
        if v is None or (isinstance(v, float) and math.isnan(v)):
            return "n/a"
        return f"{100 * v:.1f} %" if unit == "%" else f"{v:.2f} ms"

    rows = [("data wait", "data_wait_ms", "ms"), ("forward", "forward_ms", "ms"),
            ("backward", "backward_ms", "ms"), ("comm busy", "comm_busy_ms", "ms"),
            ("comm exposed", "exposed_comm_ms", "ms"),
            ("  RS busy", "reduce_scatter_busy_ms", "ms"), ("  RS exposed", "reduce_scatter_exposed_ms", "ms"),
            ("  AG busy", "all_gather_busy_ms", "ms"), ("  AG exposed", "all_gather_exposed_ms", "ms"),
            ("optimizer", "optimizer_ms", "ms"),
            ("step", "step_ms", "ms"), ("ceiling", "ideal_ms", "ms"), ("cross-step", "cross_step_limit_ms", "ms"),
            ("efficiency", "efficiency", "%"), ("overlap", "overlap", "%")]
    everywhere = [mean, *(per_rank or ())]
    sharded = any(not math.isnan(r.get("all_gather_busy_ms", math.nan)) for r in everywhere)
    for label, key, unit in rows:
        if key in SHARDED_FIELDS and not sharded:
            continue   # other modes have no all-gather: the rows are not shown
        cells = [fmt(mean.get(key, math.nan), unit)]
        if per_rank:
            cells += [fmt(r.get(key, math.nan), unit) for r in per_rank]
        lines.append(f"  {label:<13}" + "".join(f"{c:>12}" for c in cells))
    if per_rank:
        lines.insert(1, f"  {'':<13}{'mean':>12}" + "".join(f"{'rank ' + str(i):>12}" for i in range(len(per_rank))))
    if sharded:
        lines.append("  RS = reduce-scatter (in backward), AG = all-gather (the previous step's, behind the forward)")
        lines.append("  ceiling = forward + max(backward, comm busy) + optimizer (DDP's); cross-step = max(forward + "
                     "backward + optimizer, comm busy); efficiency = cross-step / step")
    else:
        lines.append("  ceiling = forward + max(backward, comm busy) + optimizer; efficiency = ceiling / step")
    for note in summary.get("notes") or ():
        lines.append(f"  note: {note}")
    return "\n".join(lines)


class _Clock:
    """perf_counter on CPU; timing events on the current stream of an accelerator."""

    def __init__(self, device: torch.device | None):
        self.device_events = device is not None and device.type not in ("cpu", "meta") and hasattr(torch, "Event")

    def mark(self):
        if self.device_events:
            ev = torch.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def ms(self, a, b) -> float:
        if self.device_events:
            b.synchronize()
            return a.elapsed_time(b)
        return (b - a) * 1e3


@dataclass
class _PendingStep:
    step: int
    data_wait_ms: float = 0.0
    start: Any = None
    micro: list = field(default_factory=list)      # (forward_start, forward_end, backward_end)
    optimizer_start: Any = None
    end: Any = None
    comm_busy_ms: float = math.nan
    exposed_comm_ms: float = 0.0
    host_start: float = 0.0
    data_end: float = 0.0
    comm_spans: list = field(default_factory=list)   # (name, start, end) host seconds
    exposed_spans: list = field(default_factory=list)
    comm_later: list = field(default_factory=list)   # functions returning SyncStats, called at resolve()
    gather_busy_ms: float = math.nan     # grad_sync="sharded": the previous step's all-gathers
    gather_exposed_ms: float = math.nan


class Span(tuple):
    """``(rank, lane, name, start, end)``: one interval of the timeline, host seconds."""

    __slots__ = ()

    def __new__(cls, rank: int, lane: str, name: str, start: float, end: float):
        return super().__new__(cls, (rank, lane, name, start, end))


class StepTimeline:
    """Collects the marks of each optimizer step and turns them into `StepRecord`s.

    The trainer calls, in order: `begin_step` (before fetching data), `data_ready`, then per
    micro-step `forward_start`, `forward_end`, `backward_end`, then `optimizer_start` and
    `end_step`. Records and spans are kept in rings (``capacity`` steps, ``span_capacity``
    spans): memory stays bounded however long the run.

    Spans ``(rank, lane, name, start, end)`` in host seconds, grouped per step, draw the
    timeline figure: lane
    ``data`` (waiting for a batch), ``compute`` (forward, backward, exposed comm, optimizer) and
    ``comm`` (each bucket's reduction, from `GradSync`; under ``mode="sharded"`` also the previous
    step's all-gathers, ``gather i``). On an accelerator, compute spans are
    placed by their event offsets from the step's first mark.

    Args:
        device: where compute runs; accelerators are timed with events.
        capacity: how many resolved steps to keep.
        span_capacity: how many steps' spans to keep.
        rank: this process's rank, written into every span.
    """

    # Unresolved steps kept before the oldest are resolved (their events are long complete).
    _MAX_PENDING = 32

    def __init__(self, device: torch.device | None = None, capacity: int = 4096, span_capacity: int = 256,
                 rank: int = 0):
        self._clock = _Clock(device)
        self.rank = rank
        self.records: deque[StepRecord] = deque(maxlen=capacity)
        self.spans: deque[tuple[int, list[Span]]] = deque(maxlen=span_capacity)
        self._pending: list[_PendingStep] = []
        self._cur: _PendingStep | None = None
        self._data_t0 = 0.0
        self._fwd: Any = None

    # -- marks, in step order ------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        # The step's mark first, then the data wait's start: the wait lies inside the step even
        # when the thread is preempted between the two (under load it was, by 0.3 ms, and the
        # step's parts summed past the step).
        start = self._clock.mark()
        self._data_t0 = time.perf_counter()
        self._cur = _PendingStep(step=step, host_start=self._data_t0)
        self._cur.start = start

    def data_ready(self) -> None:
        if self._cur is not None:
            self._cur.data_end = time.perf_counter()
            self._cur.data_wait_ms += (self._cur.data_end - self._data_t0) * 1e3

    def forward_start(self) -> None:
        if self._cur is not None:
            self._fwd = [self._clock.mark(), None, None]

    def forward_end(self) -> None:
        if self._cur is not None and self._fwd is not None:
            self._fwd[1] = self._clock.mark()

    def backward_end(self) -> None:
        if self._cur is not None and self._fwd is not None and self._fwd[1] is not None:
            self._fwd[2] = self._clock.mark()
            self._cur.micro.append(tuple(self._fwd))
        self._fwd = None

    def add_comm(self, comm_busy_ms: float, exposed_comm_ms: float, bucket_spans=(),
                 exposed_span: tuple[float, float] | None = None, gather_busy_ms: float = math.nan,
                 gather_exposed_ms: float = math.nan, gather_spans=()) -> None:
        """Communication measured by `GradSync` for this step.

        Args:
            comm_busy_ms, exposed_comm_ms: from ``GradSync.stats`` (the backward reductions).
            bucket_spans: ``(bucket index, launch, finish)`` in perf_counter seconds.
            exposed_span: the host interval the step spent waiting in ``finish()``.
            gather_busy_ms, gather_exposed_ms, gather_spans: ``mode="sharded"``: the previous
                step's parameter all-gathers, and what this step's forward waited for them.
        """
        if self._cur is not None:
            _add_comm(self._cur, comm_busy_ms, exposed_comm_ms, bucket_spans, gather_busy_ms, gather_exposed_ms,
                      gather_spans)
            if exposed_span is not None:
                self._cur.exposed_spans.append(exposed_span)

    def add_comm_later(self, resolve, exposed_span: tuple[float, float] | None = None) -> None:
        """Communication for this step whose numbers are read only when the step is resolved.

        ``resolve()`` returns the step's `SyncStats` (``GradSync.stats_deferred()``): on an
        accelerator reading them waits for the reductions' events, which by then have long
        completed, so the host never stalls to measure a step.
        """
        if self._cur is not None:
            self._cur.comm_later.append(resolve)
            if exposed_span is not None:
                self._cur.exposed_spans.append(exposed_span)

    def optimizer_start(self) -> None:
        if self._cur is not None:
            self._cur.optimizer_start = self._clock.mark()

    def end_step(self) -> None:
        cur, self._cur = self._cur, None
        if cur is None or not cur.micro:
            return
        cur.end = self._clock.mark()
        self._pending.append(cur)
        if not self._clock.device_events or len(self._pending) > self._MAX_PENDING:
            self.resolve()

    # -- results ---------------------------------------------------------------------------
    def resolve(self) -> None:
        """Turn finished steps into records (waits for their events on an accelerator)."""
        ms = self._clock.ms
        for p in self._pending:
            for resolve in p.comm_later:
                stats = resolve()
                _add_comm(p, stats.comm_busy_ms, stats.exposed_comm_ms, stats.bucket_spans,
                          getattr(stats, "gather_busy_ms", math.nan), getattr(stats, "gather_exposed_ms", math.nan),
                          getattr(stats, "gather_spans", ()))
            p.comm_later.clear()
            fwd = sum(ms(f0, f1) for f0, f1, _ in p.micro)
            bwd = sum(ms(f1, b1) for _, f1, b1 in p.micro)
            opt_start = p.optimizer_start if p.optimizer_start is not None else p.micro[-1][2]
            # On an accelerator this is the stream's time from the step's first mark to its
            # last: a host wait for data shows up in it only if the stream ran dry meanwhile.
            step_ms = ms(p.start, p.end)
            # The wait in finish() also packs buckets launched late and copies results back:
            # sync work, not communication. Whatever of it exceeds the reductions' own busy time
            # is counted with backward, so that exposed <= busy holds and the parts still sum up.
            exposed, busy = p.exposed_comm_ms, p.comm_busy_ms
            if not math.isnan(busy) and exposed > busy:
                bwd, exposed = bwd + exposed - busy, busy
            gather_busy, gather_exposed = p.gather_busy_ms, p.gather_exposed_ms
            if not math.isnan(gather_busy):
                # The pre-hooks' waits ran inside the forward: communication, not forward compute.
                gather_exposed = min(gather_exposed, fwd)
                fwd -= gather_exposed
                busy, exposed = busy + gather_busy, exposed + gather_exposed
            self.records.append(StepRecord(
                step=p.step, data_wait_ms=p.data_wait_ms, forward_ms=fwd, backward_ms=bwd,
                comm_busy_ms=busy, exposed_comm_ms=exposed,
                optimizer_ms=ms(opt_start, p.end), step_ms=step_ms,
                all_gather_busy_ms=gather_busy, all_gather_exposed_ms=gather_exposed,
            ))
            self._add_spans(p, opt_start)
        self._pending.clear()

    def _add_spans(self, p: _PendingStep, opt_start) -> None:
        # Host seconds: the step's first mark is p.host_start; device marks sit at their offsets.
        at = lambda mark: p.host_start + self._clock.ms(p.start, mark) / 1e3  # noqa: E731
        r, spans = self.rank, []
        add = spans.append
        if p.data_wait_ms > 0:
            add(Span(r, "data", "data wait", p.host_start, p.data_end))
        for f0, f1, b1 in p.micro:
            add(Span(r, "compute", "forward", at(f0), at(f1)))
            add(Span(r, "compute", "backward", at(f1), at(b1)))
        for t0, t1 in p.exposed_spans:
            add(Span(r, "compute", "exposed comm", t0, t1))
        add(Span(r, "compute", "optimizer", at(opt_start), at(p.end)))
        for name, t0, t1 in p.comm_spans:
            add(Span(r, "comm", name, t0, t1))
        self.spans.append((p.step, spans))

    def last_spans(self, steps: int = 4) -> list[Span]:
        """The spans of the last ``steps`` resolved steps, in time order."""
        self.resolve()
        return [span for _, spans in list(self.spans)[-steps:] for span in spans]

    def summary(self, warmup: int = 1, since_step: int | None = None) -> dict[str, float]:
        self.resolve()
        recs = [r for r in self.records if since_step is None or r.step > since_step]
        return summarize(recs, warmup=warmup if since_step is None else 0)


def _add_comm(p: _PendingStep, busy_ms, exposed_ms, bucket_spans, gather_busy_ms, gather_exposed_ms,
              gather_spans) -> None:
    """Add one `SyncStats`' numbers to a step (NaN, where not measured, stays NaN until a number comes)."""
    plus = lambda a, b: b if math.isnan(a) else (a if math.isnan(b) else a + b)  # noqa: E731
    p.comm_busy_ms = plus(p.comm_busy_ms, busy_ms)
    p.exposed_comm_ms += exposed_ms
    p.comm_spans.extend((f"bucket {i}", t0, t1) for i, t0, t1 in bucket_spans)
    p.gather_busy_ms = plus(p.gather_busy_ms, gather_busy_ms)
    p.gather_exposed_ms = plus(p.gather_exposed_ms, gather_exposed_ms)
    p.comm_spans.extend((f"gather {i}", t0, t1) for i, t0, t1 in gather_spans)


class StreamReport(dict):
    """The step breakdown against the ceiling: a dict (``mean``, ``per_rank``) that prints as a table."""

    def __str__(self) -> str:
        return format_report(self)

    def to_json(self) -> str:
        """Strict JSON: unmeasured values (NaN) become null."""
        def clean(x):
            if isinstance(x, dict):
                return {k: clean(v) for k, v in x.items()}
            if isinstance(x, list):
                return [clean(v) for v in x]
            return None if isinstance(x, float) and math.isnan(x) else x

        return json.dumps(clean(dict(self)), indent=2, allow_nan=False)
