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

Steps that ran while ``grad_bucket_mb="auto"`` was still trying caps (tuning steps: each on a
candidate cap, not the one kept) stay out of the mean; the report gives their count and mean step
apart (``tuning_steps``, ``tuning_step_ms``), so a short A/B comparison is not blurred by them.

The report's quantities, their names, units and modes are one table, `hfstream.report.fields`;
the printed table is `hfstream.report.format`. Times come from `time.perf_counter` on CPU and
from timing events on the compute stream of an accelerator, read only once they have completed
(`StepTimeline.resolve`), so measuring never makes the host wait. Data wait is always a host
time: it is the time the host could not launch work.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Collection, Iterable

import torch

from .. import streams
from .fields import FIELDS, MEASURED, SHARDED_ONLY
from .format import format_report


def cross_step_limit(forward_ms: float, backward_ms: float, optimizer_per_rank_ms: float, comm_ms: float) -> float:
    """The sharded mode's best step: ``max(forward + backward + optimizer / N, comm)`` (docs/design.md section 4).

    The one definition the report, the benchmark, the planner and the course use. Args:
    ``optimizer_per_rank_ms``, the time to step this rank's 1/N of the parameters (a sharded run's
    measured optimizer time, or an unsharded one's divided by N); ``comm_ms``, the link's time for
    the whole ring all-reduce (a sharded run's reduce-scatter plus all-gather busy time).
    """
    return max(forward_ms + backward_ms + optimizer_per_rank_ms, comm_ms)


@dataclass
class StepRecord:
    """One optimizer step's measured parts, in milliseconds; the derived fields are properties.

    The fields are the ``measured`` rows of `hfstream.report.fields.FIELDS`. ``comm_busy_ms`` is
    NaN where it is not measured (native DDP hides its reductions from us), and then so is
    ``overlap``. ``all_gather_busy_ms``/``all_gather_exposed_ms`` are measured under
    ``grad_sync="sharded"`` only (NaN otherwise); there ``comm_busy_ms`` and ``exposed_comm_ms``
    are the sums of both halves, the reduce-scatter's being the rest, and the ceiling of the mode
    is ``cross_step_limit_ms`` (``efficiency`` is taken against it).
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
    comm_cpu_ms: float = math.nan

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
        """``step`` and every field of the report, measured and derived."""
        d = asdict(self)
        d.update({f.key: getattr(self, f.key) for f in FIELDS if f.source == "derived"})
        return d


def _nanmean(values: Iterable[float]) -> float:
    vals = [v for v in values if not math.isnan(v)]
    return sum(vals) / len(vals) if vals else math.nan


def _mean_breakdown(rows: list[dict[str, float]], steps: float) -> dict[str, Any]:
    """Average the measured fields of ``rows``; the derived ones (ceiling, efficiency, overlap) are
    recomputed from the averaged times, not averaged themselves, so ``ideal_ms / step_ms ==
    efficiency`` holds."""
    avg = StepRecord(step=0, **{key: _nanmean(r.get(key, math.nan) for r in rows) for key in MEASURED})
    out = avg.as_dict()
    out.pop("step")
    if not avg.sharded:   # not grad_sync="sharded": those fields do not exist
        for key in SHARDED_ONLY:
            out.pop(key, None)
    out["steps"] = steps
    return out


def summarize(records: list[StepRecord], warmup: int = 1, tuning: Collection[int] = ()) -> dict[str, Any]:
    """Average the breakdown over steps after ``warmup`` (all steps if there are no more).

    Args:
        tuning: the steps that ran while ``grad_bucket_mb="auto"`` was tuning. They stay out of
            the mean; ``tuning_steps`` and ``tuning_step_ms`` give their count and mean step. Where
            every step was one, the mean is theirs and says so (``tuning_in_mean``).
    """
    after = records[warmup:] if len(records) > warmup else records
    if not after:
        return {}
    kept = [r for r in after if r.step not in tuning]
    tuned = [r for r in after if r.step in tuning]
    out = _mean_breakdown([{key: getattr(r, key) for key in MEASURED} for r in kept or tuned],
                          float(len(kept or tuned)))
    if tuned:
        out.update(tuning_steps=float(len(tuned)), tuning_step_ms=_nanmean(r.step_ms for r in tuned),
                   tuning_in_mean=not kept)
    return out


def combine_ranks(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """One breakdown for several ranks' `summarize` results (empty ones skipped)."""
    rows = [s for s in summaries if s]
    if not rows:
        return {}
    out = _mean_breakdown(rows, _nanmean(r["steps"] for r in rows))
    if any("tuning_steps" in r for r in rows):   # every rank tunes alike (the choice is agreed)
        out.update(tuning_steps=_nanmean(r.get("tuning_steps", 0.0) for r in rows),
                   tuning_step_ms=_nanmean(r.get("tuning_step_ms", math.nan) for r in rows),
                   tuning_in_mean=any(r.get("tuning_in_mean", False) for r in rows))
    return out


class _Clock:
    """perf_counter on CPU; timing events on ``device``'s current stream on an accelerator.

    The events are recorded on the stream of the model's own device (not the current device's,
    which a script that never calls ``set_device`` leaves at device 0): GradSync's events for
    ``finish()`` are recorded there too, so a step's windows and its exposed time share one stream.
    """

    def __init__(self, device: torch.device | None):
        self.device = device
        self.device_events = device is not None and device.type not in ("cpu", "meta") and hasattr(torch, "Event")

    def mark(self):
        if self.device_events:
            ev = streams.new_event(self.device, enable_timing=True)
            ev.record(streams.current_stream(self.device))
            return ev
        return time.perf_counter()

    def done(self, mark) -> bool:
        """Whether ``mark`` has been reached (never waits)."""
        return not self.device_events or mark.query()

    def ms(self, a, b) -> float:
        """Milliseconds from ``a`` to ``b``; on an accelerator both must have completed (`done`)."""
        if self.device_events:
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
    comm_later: list = field(default_factory=list)   # `GradSync.stats_deferred()` results, read at resolve()
    tuning: bool = False                              # ran while grad_bucket_mb="auto" was trying caps
    all_gather_busy_ms: float = math.nan     # grad_sync="sharded": the previous step's all-gathers
    all_gather_exposed_ms: float = math.nan
    comm_cpu_ms: float = math.nan            # the process group's threads' CPU, from the last step's end to this one's
    items_span: tuple | None = None          # (start, end): the Trainer's count of the step's items across ranks


class Span(tuple):
    """``(rank, lane, name, start, end)``: one interval of the timeline, host seconds."""

    __slots__ = ()

    def __new__(cls, rank: int, lane: str, name: str, start: float, end: float):
        return super().__new__(cls, (rank, lane, name, start, end))


class StepTimeline:
    """Collects the marks of each optimizer step and turns them into `StepRecord`s.

    The trainer calls, in order: `begin_step` (before fetching data; ``tuning=True`` for a step
    that runs while ``grad_bucket_mb="auto"`` tries caps), `data_ready`, then per micro-step
    `forward_start`, `forward_end`, `backward_end`, then `optimizer_start` and `end_step`.
    Records and spans are kept in rings (``capacity`` steps, ``span_capacity`` spans): memory
    stays bounded however long the run.

    Spans ``(rank, lane, name, start, end)`` in seconds, grouped per step, draw the timeline
    figure: lane ``data`` (waiting for a batch), ``compute`` (forward, backward, exposed comm,
    optimizer) and ``comm`` (each bucket's reduction, from `GradSync`; under ``mode="sharded"``
    also the previous step's all-gathers, ``gather i``). One reference per step places them: the
    step's first mark, at the host time ``begin_step`` was called. On CPU every span is a host
    time. On an accelerator every compute and comm span is a device time, its offset from the
    step's start event added to that host time (the comm spans too, through
    ``stats_deferred().place_from``), so compute and communication are drawn on one clock; the
    data wait alone is a host time, as it is measured.

    Args:
        device: where compute runs; accelerators are timed with events.
        capacity: how many resolved steps to keep.
        span_capacity: how many steps' spans to keep.
        rank: this process's rank, written into every span.
    """

    # On an accelerator, end_step resolves the completed steps once this many are pending.
    _MAX_PENDING = 32

    def __init__(self, device: torch.device | None = None, capacity: int = 4096, span_capacity: int = 256,
                 rank: int = 0):
        self._clock = _Clock(device)
        self.rank = rank
        self.records: deque[StepRecord] = deque(maxlen=capacity)
        self.spans: deque[tuple[int, list[Span]]] = deque(maxlen=span_capacity)
        self._pending: list[_PendingStep] = []
        self.tuning_steps: set[int] = set()   # steps begun with tuning=True (at most `max_auto_steps` per GradSync)
        self._cur: _PendingStep | None = None
        self._data_t0 = 0.0
        self._fwd: Any = None
        # The training thread's host intervals, ``(kind, start, end, cpu_ms)`` for kind "data",
        # "forward" and "backward": perf_counter and that thread's CPU clock (`_ThreadCPU`) around
        # them, so the advice can tell a data wait spent computing from one spent waiting, and see
        # the step's own thread lose CPU time to a producer beside it (`hfstream.report.advice`). Host
        # times, also on an accelerator.
        self.host_intervals: deque[tuple[str, float, float, float]] = deque(maxlen=8 * span_capacity)
        self._host_mark = (0.0, 0.0)
        self._cpu = _ThreadCPU()   # the training thread's CPU clock: the one that calls begin_step
        self._comm_cpu = _CollectiveCPU()
        self._comm_cpu_mark = math.nan   # its seconds at the last step's end (at the first step's beginning)

    # -- marks, in step order ------------------------------------------------------------
    def begin_step(self, step: int, tuning: bool = False) -> None:
        # The step's mark first, then the data wait's start: the wait lies inside the step even
        # when the thread is preempted between the two (under load it was, by 0.3 ms, and the
        # step's parts summed past the step).
        start = self._clock.mark()
        self._data_t0 = time.perf_counter()
        if self._cpu.ident != threading.get_ident():
            self._cpu = _ThreadCPU()
        self._host_mark = (self._data_t0, self._cpu.seconds())
        self._cur = _PendingStep(step=step, host_start=self._data_t0, tuning=tuning)
        self._cur.start = start
        if math.isnan(self._comm_cpu_mark):
            self._comm_cpu_mark = self._comm_cpu.seconds()

    def data_ready(self) -> None:
        """The step's batches are loaded (the first call of a step counts; a later one is a no-op)."""
        if self._cur is not None and not self._cur.data_end:
            self._cur.data_end = time.perf_counter()
            self._cur.data_wait_ms += (self._cur.data_end - self._data_t0) * 1e3
            self._host_interval("data", self._cur.data_end)

    def items_counted(self, start: float, end: float) -> None:
        """Under ``grad_sync="sharded"``: the Trainer counted the step's items across ranks from ``start`` to
        ``end`` (perf_counter), after `data_ready`. A collective, which waits behind the previous step's
        all-gathers still on the link: exposed communication (all-gather), as far as they were in flight;
        the rest, a wait for another rank's batch, stays data wait."""
        if self._cur is not None:
            self._cur.items_span = (start, end)

    def forward_start(self) -> None:
        if self._cur is not None:
            self._fwd = [self._clock.mark(), None, None]
            self._host_mark = (_host(self._fwd[0]), self._cpu.seconds())

    def forward_end(self) -> None:
        if self._cur is not None and self._fwd is not None:
            self._fwd[1] = self._clock.mark()
            self._host_interval("forward", _host(self._fwd[1]))

    def backward_end(self) -> None:
        if self._cur is not None and self._fwd is not None and self._fwd[1] is not None:
            self._fwd[2] = self._clock.mark()
            self._cur.micro.append(tuple(self._fwd))
            self._host_interval("backward", _host(self._fwd[2]))
        self._fwd = None

    def _host_interval(self, kind: str, end: float) -> None:
        """Close the host interval opened at the last mark, and open the next one at ``end``."""
        start, cpu = self._host_mark
        now_cpu = self._cpu.seconds()
        self.host_intervals.append((kind, start, end, (now_cpu - cpu) * 1e3))
        self._host_mark = (end, now_cpu)

    def add_comm(self, comm_busy_ms: float, exposed_comm_ms: float, bucket_spans=(),
                 exposed_span: tuple[float, float] | None = None, all_gather_busy_ms: float = math.nan,
                 all_gather_exposed_ms: float = math.nan, all_gather_spans=()) -> None:
        """Communication measured by `GradSync` for this step.

        Args:
            comm_busy_ms, exposed_comm_ms: from ``GradSync.stats`` (the backward reductions).
            bucket_spans: ``(bucket index, launch, finish)`` in perf_counter seconds.
            exposed_span: the host interval the step spent waiting in ``finish()``.
            all_gather_busy_ms, all_gather_exposed_ms, all_gather_spans: ``mode="sharded"``: the
                previous step's parameter all-gathers, and what this step's forward waited for them.
        """
        if self._cur is not None:
            _add_comm(self._cur, comm_busy_ms, exposed_comm_ms, bucket_spans, all_gather_busy_ms,
                      all_gather_exposed_ms, all_gather_spans)
            if exposed_span is not None:
                self._cur.exposed_spans.append(exposed_span)

    def add_comm_later(self, resolve, exposed_span: tuple[float, float] | None = None) -> None:
        """Communication for this step whose numbers are read only when the step is resolved.

        ``resolve()`` returns the step's `SyncStats` (``GradSync.stats_deferred()``). Where it also
        has ``ready()`` (its events have completed, never waits) and ``place_from(host_time,
        event)`` (device spans measured from this step's start event), the step is resolved only
        once ready, and its comm spans share the compute spans' reference. ``exposed_span``: the
        host interval around ``finish()``, drawn where the stats carry no ``finish_span``.
        """
        if self._cur is not None:
            if self._clock.device_events and hasattr(resolve, "place_from"):
                resolve.place_from(self._cur.host_start, self._cur.start)
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
        now = self._comm_cpu.seconds()
        used = now - self._comm_cpu_mark   # NaN where there is no collectives' thread to read
        cur.comm_cpu_ms, self._comm_cpu_mark = (used if math.isnan(used) else max(0.0, used) * 1e3), now
        if cur.tuning:
            self.tuning_steps.add(cur.step)
        self._pending.append(cur)
        if not self._clock.device_events or len(self._pending) > self._MAX_PENDING:
            self.resolve()

    # -- results ---------------------------------------------------------------------------
    def _completed(self, p: _PendingStep) -> bool:
        """Whether every event of step ``p`` (its end mark, GradSync's events) has completed; never waits."""
        return self._clock.done(p.end) and all(getattr(later, "ready", lambda: True)() for later in p.comm_later)

    def resolve(self, wait: bool = False) -> int:
        """Turn finished steps into records, oldest first; returns how many.

        Never waits for the device: a step whose events have not all completed stays pending (and
        so do the steps after it, to keep the records in step order), unless ``wait`` (the end of
        training, when a report is made) says to wait for them.
        """
        done = 0
        for p in self._pending:
            if not wait and not self._completed(p):
                break
            if wait and self._clock.device_events:
                p.end.synchronize()
            self._resolve_one(p)
            done += 1
        del self._pending[:done]
        return done

    def _resolve_one(self, p: _PendingStep) -> None:
        ms = self._clock.ms
        finish_spans = []
        for later in p.comm_later:
            stats = later()
            _add_comm(p, stats.comm_busy_ms, stats.exposed_comm_ms, stats.bucket_spans,
                      getattr(stats, "all_gather_busy_ms", math.nan), getattr(stats, "all_gather_exposed_ms", math.nan),
                      getattr(stats, "all_gather_spans", ()))
            if getattr(stats, "finish_span", None) is not None:
                finish_spans.append(stats.finish_span)
        if finish_spans:   # the stall GradSync measured, on the step's reference: drawn instead of the host's
            p.exposed_spans = finish_spans
        p.comm_later.clear()
        fwd = sum(ms(f0, f1) for f0, f1, _ in p.micro)
        bwd = sum(ms(f1, b1) for _, f1, b1 in p.micro)
        opt_start = p.optimizer_start if p.optimizer_start is not None else p.micro[-1][2]
        # On an accelerator this is the stream's time from the step's first mark to its
        # last: a host wait for data shows up in it only if the stream ran dry meanwhile.
        step_ms = ms(p.start, p.end)
        # The windows finish() can run in: from each backward's end to the next forward, the last
        # to the optimizer. The exposed time GradSync measured lies inside them; whatever a clock
        # on another stream or device puts outside them would be counted twice, so it is cut.
        ends = [b1 for _, _, b1 in p.micro]
        starts = [f0 for f0, _, _ in p.micro[1:]] + [opt_start]
        window = sum(max(ms(b1, nxt), 0.0) for b1, nxt in zip(ends, starts))
        exposed, busy = min(p.exposed_comm_ms, window), p.comm_busy_ms
        # The wait in finish() also packs buckets launched late and copies results back:
        # sync work, not communication. Whatever of it exceeds the reductions' own busy time
        # is counted with backward, so that exposed <= busy holds and the parts still sum up.
        if not math.isnan(busy) and exposed > busy:
            bwd, exposed = bwd + exposed - busy, busy
        gather_busy, gather_exposed = p.all_gather_busy_ms, p.all_gather_exposed_ms
        if not math.isnan(gather_busy):
            # The pre-hooks' waits ran inside the forward: communication, not forward compute.
            gather_exposed = min(gather_exposed, fwd)
            fwd -= gather_exposed
            busy, exposed = busy + gather_busy, exposed + gather_exposed
        data_wait = p.data_wait_ms
        if p.items_span is not None and not math.isnan(gather_busy):   # the items count, behind the gathers
            items = (p.items_span[1] - p.items_span[0]) * 1e3
            behind = min(items, max(0.0, gather_busy - gather_exposed))
            exposed, gather_exposed, data_wait = exposed + behind, gather_exposed + behind, data_wait + items - behind
        self.records.append(StepRecord(
            step=p.step, data_wait_ms=data_wait, forward_ms=fwd, backward_ms=bwd,
            comm_busy_ms=busy, exposed_comm_ms=exposed,
            optimizer_ms=ms(opt_start, p.end), step_ms=step_ms,
            all_gather_busy_ms=gather_busy, all_gather_exposed_ms=gather_exposed, comm_cpu_ms=p.comm_cpu_ms,
        ))
        self._add_spans(p, opt_start)

    def _add_spans(self, p: _PendingStep, opt_start) -> None:
        # One reference per step: its first mark, at host time p.host_start; device marks sit at
        # their offsets from it (and so do GradSync's spans, placed from the same event).
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
        if p.items_span is not None:
            add(Span(r, "compute", "items count", *p.items_span))
        add(Span(r, "compute", "optimizer", at(opt_start), at(p.end)))
        for name, t0, t1 in p.comm_spans:
            add(Span(r, "comm", name, t0, t1))
        self.spans.append((p.step, spans))

    @property
    def last_step(self) -> int | None:
        """The step of the newest record (None before the first): what a summary so far covers."""
        return self.records[-1].step if self.records else None

    def last_spans(self, steps: int = 4, wait: bool = True) -> list[Span]:
        """The spans of the last ``steps`` resolved steps, in time order (``wait``: of every step ended)."""
        self.resolve(wait=wait)
        return [span for _, spans in list(self.spans)[-steps:] for span in spans]

    def summary(self, warmup: int = 1, since_step: int | None = None, wait: bool = True) -> dict[str, Any]:
        """The mean breakdown of the resolved steps (after ``warmup``, or after step ``since_step``),
        tuning steps apart (`summarize`).

        ``wait=False`` leaves out the steps the device has not finished (they come in a later
        summary): the Trainer's periodic log never drains the device's queue.
        """
        self.resolve(wait=wait)
        recs = [r for r in self.records if since_step is None or r.step > since_step]
        return summarize(recs, warmup=warmup if since_step is None else 0, tuning=self.tuning_steps)


class _ThreadCPU:
    """One thread's CPU time in seconds, read from any thread.

    A mark may be taken on another thread than the step's: on an accelerator the autograd engine
    runs backward's final callback (GradSync's, which marks the backward's end and may open the
    next forward) on its device thread. ``time.thread_time()`` there reads that thread's clock,
    and an interval opened on one clock and closed on the other is no time at all (it came out
    negative, or longer than its wall time). Here the training thread's clock is read by its id
    (``time.pthread_getcpuclockid``); where there is none (not Unix), such an interval is NaN.
    """

    def __init__(self):
        self.ident = threading.get_ident()
        getclock = getattr(time, "pthread_getcpuclockid", None)
        self._clock = getclock(self.ident) if getclock is not None else None

    def seconds(self) -> float:
        if threading.get_ident() == self.ident:
            return time.thread_time()
        return time.clock_gettime(self._clock) if self._clock is not None else math.nan


class _CollectiveCPU:
    """The CPU seconds of the process group's own threads, from ``/proc/self/task`` (Linux).

    Gloo runs its collectives on threads of its own (``pt_gloo_runloop``, ``gloo_tcp_loop``): the
    training thread only waits for them. On CPU training that work comes out of the same cores as
    the compute, which is what the advice needs to know before it moves communication into
    backward. NaN where there is no such thread (one process, NCCL) or no ``/proc``. A thread that
    exits takes its time with it (the step's difference is then floored at 0).
    """

    PREFIXES = ("gloo", "pt_gloo")

    def __init__(self):
        self._tasks: list[str] | None = None   # the task ids at the last scan
        self._tids: list[str] = []             # those of the collectives' threads
        self._tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    def seconds(self) -> float:
        try:
            tasks = os.listdir("/proc/self/task")
        except OSError:
            return math.nan
        if tasks != self._tasks:   # threads came or went: find gloo's again by name
            self._tasks, self._tids = tasks, [t for t in tasks if self._name(t).startswith(self.PREFIXES)]
        total = 0
        for tid in self._tids:
            try:
                with open(f"/proc/self/task/{tid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            total += int(fields[11]) + int(fields[12])   # utime, stime: fields 14 and 15 of stat(5)
        return total / self._tick if self._tids else math.nan

    @staticmethod
    def _name(tid: str) -> str:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                return f.read().strip()
        except OSError:
            return ""


def _host(mark) -> float:
    """A mark's host time: the mark itself on CPU (no second clock read), perf_counter for an event."""
    return mark if isinstance(mark, float) else time.perf_counter()


def _add_comm(p: _PendingStep, busy_ms, exposed_ms, bucket_spans, all_gather_busy_ms, all_gather_exposed_ms,
              all_gather_spans) -> None:
    """Add one `SyncStats`' numbers to a step (NaN, where not measured, stays NaN until a number comes)."""
    plus = lambda a, b: b if math.isnan(a) else (a if math.isnan(b) else a + b)  # noqa: E731
    p.comm_busy_ms = plus(p.comm_busy_ms, busy_ms)
    p.exposed_comm_ms += exposed_ms
    p.comm_spans.extend((f"bucket {i}", t0, t1) for i, t0, t1 in bucket_spans)
    p.all_gather_busy_ms = plus(p.all_gather_busy_ms, all_gather_busy_ms)
    p.all_gather_exposed_ms = plus(p.all_gather_exposed_ms, all_gather_exposed_ms)
    p.comm_spans.extend((f"gather {i}", t0, t1) for i, t0, t1 in all_gather_spans)


@dataclasses.dataclass(eq=False)
class StreamReport(Mapping):
    """The step breakdown against the ceiling, and what to change: prints as a table.

    Typed: its fields are fixed (a field no module declared here cannot be added), and it reads
    as a mapping of the fields that are set (``report["mean"]``, ``dict(report)``, JSON), so a
    script reads it as the stock Trainer's metrics dicts. The Trainer fills the measured part
    when training ends; `hfstream.report.advice.advise_report` the advice part.

    Args:
        mean: each field of docs/design.md section 4, averaged over ranks (`combine_ranks`).
        per_rank: each rank's mean over its steps after the first.
        grad_sync: the mode that ran; prefetch_depth: the prefetch depth.
        spans: every rank's timeline of its last few steps (`hfstream.cli.plot.plot_timeline`).
        notes: what hfstream said once during the run (a lost overlap, a refusal's reason).
        save: the saves' exposed time (`save_async`).
        advice, unchecked_advice, load, ruled_out, data_side, model: the advice and what it rests
            on (`advice.advise_report`).
    """

    mean: dict | None = None
    per_rank: list | None = None
    grad_sync: str | None = None
    prefetch_depth: int | None = None
    spans: list | None = None
    notes: list | None = None
    save: dict | None = None
    advice: list | None = None
    unchecked_advice: list | None = None
    load: dict | None = None
    ruled_out: list | None = None
    data_side: dict | None = None
    model: dict | None = None

    @classmethod
    def from_dict(cls, data: Mapping) -> "StreamReport":
        """A report from its JSON form; keys it does not know (another version's) are left out."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def __getitem__(self, key: str):
        value = getattr(self, key, None) if key in _REPORT_FIELDS else None
        if value is None:
            raise KeyError(key)
        return value

    def __setitem__(self, key: str, value) -> None:
        if key not in _REPORT_FIELDS:
            raise KeyError(f"StreamReport has no field {key!r}; its fields: {', '.join(_REPORT_FIELDS)}")
        setattr(self, key, value)

    def __iter__(self):
        return (k for k in _REPORT_FIELDS if getattr(self, k) is not None)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __str__(self) -> str:
        return format_report(self)

    def to_json(self) -> str:
        """Strict JSON of the fields that are set: unmeasured values (NaN) become null."""
        def clean(x):
            if isinstance(x, dict):
                return {k: clean(v) for k, v in x.items()}
            if isinstance(x, list):
                return [clean(v) for v in x]
            return None if isinstance(x, float) and math.isnan(x) else x

        return json.dumps(clean(dict(self)), indent=2, allow_nan=False)


_REPORT_FIELDS = tuple(f.name for f in dataclasses.fields(StreamReport))
