"""Step timeline and the ceiling: where each training step's time goes, and how far it is from
the best achievable step.

A data-parallel step is data wait + forward + backward + exposed communication + optimizer.
Only backward can hide communication, so the per-step ceiling (DESIGN.md section 4) is

    ideal = forward + max(backward, comm_busy) + optimizer          (data fully hidden)

Times come from `time.perf_counter` on CPU and from timing events on the compute stream of an
accelerator (resolved lazily, when a report is asked for, so measuring never forces a sync).
Data wait is always a host time: it is the time the host could not launch work.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

import torch

FIELDS = (
    "data_wait_ms", "forward_ms", "backward_ms", "comm_busy_ms", "exposed_comm_ms",
    "optimizer_ms", "step_ms", "ideal_ms", "efficiency", "overlap",
)


@dataclass
class StepRecord:
    """One optimizer step, in milliseconds. ``comm_busy_ms`` is NaN where it is not measured
    (native DDP hides its reductions from us), and then so is ``overlap``."""

    step: int
    data_wait_ms: float
    forward_ms: float
    backward_ms: float
    comm_busy_ms: float
    exposed_comm_ms: float
    optimizer_ms: float
    step_ms: float

    @property
    def ideal_ms(self) -> float:
        comm = 0.0 if math.isnan(self.comm_busy_ms) else self.comm_busy_ms
        return self.forward_ms + max(self.backward_ms, comm) + self.optimizer_ms

    @property
    def efficiency(self) -> float:
        return self.ideal_ms / self.step_ms if self.step_ms > 0 else math.nan

    @property
    def overlap(self) -> float:
        if math.isnan(self.comm_busy_ms) or self.comm_busy_ms <= 0:
            return math.nan
        return 1.0 - min(self.exposed_comm_ms, self.comm_busy_ms) / self.comm_busy_ms

    def as_dict(self) -> dict[str, float]:
        d = asdict(self)
        d.update(ideal_ms=self.ideal_ms, efficiency=self.efficiency, overlap=self.overlap)
        return d


def _nanmean(values: Iterable[float]) -> float:
    vals = [v for v in values if not math.isnan(v)]
    return sum(vals) / len(vals) if vals else math.nan


def summarize(records: list[StepRecord], warmup: int = 1) -> dict[str, float]:
    """Average the breakdown over steps after ``warmup`` (all steps if there are no more).

    Ratios (efficiency, overlap) are recomputed from the averaged times, not averaged
    themselves, so that ``ideal_ms / step_ms == efficiency`` holds in the summary too.
    """
    kept = records[warmup:] if len(records) > warmup else records
    if not kept:
        return {}
    avg = StepRecord(
        step=len(kept),
        **{f: _nanmean(getattr(r, f) for r in kept) for f in
           ("data_wait_ms", "forward_ms", "backward_ms", "comm_busy_ms", "exposed_comm_ms", "optimizer_ms", "step_ms")},
    )
    out = avg.as_dict()
    out["steps"] = float(len(kept))
    out.pop("step")
    return out


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
            ("comm exposed", "exposed_comm_ms", "ms"), ("optimizer", "optimizer_ms", "ms"),
            ("step", "step_ms", "ms"), ("ceiling", "ideal_ms", "ms"),
            ("efficiency", "efficiency", "%"), ("overlap", "overlap", "%")]
    for label, key, unit in rows:
        cells = [fmt(mean.get(key, math.nan), unit)]
        if per_rank:
            cells += [fmt(r.get(key, math.nan), unit) for r in per_rank]
        lines.append(f"  {label:<13}" + "".join(f"{c:>12}" for c in cells))
    if per_rank:
        lines.insert(1, f"  {'':<13}{'mean':>12}" + "".join(f"{'rank ' + str(i):>12}" for i in range(len(per_rank))))
    lines.append("  ceiling = forward + max(backward, comm busy) + optimizer; efficiency = ceiling / step")
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


class StepTimeline:
    """Collects the marks of each optimizer step and turns them into `StepRecord`s.

    The trainer calls, in order: `begin_step` (before fetching data), `data_ready`, then per
    micro-step `forward_start`, `forward_end`, `backward_end`, then `optimizer_start` and
    `end_step`. Records are kept in a ring of ``capacity`` steps: memory stays bounded.

    Args:
        device: where compute runs; accelerators are timed with events.
        capacity: how many resolved steps to keep.
    """

    def __init__(self, device: torch.device | None = None, capacity: int = 4096):
        self._clock = _Clock(device)
        self.records: deque[StepRecord] = deque(maxlen=capacity)
        self._pending: list[_PendingStep] = []
        self._cur: _PendingStep | None = None
        self._data_t0 = 0.0
        self._fwd: Any = None
        self._micro_start: Any = None

    # -- marks, in step order ------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        self._cur = _PendingStep(step=step)
        self._data_t0 = time.perf_counter()
        self._cur.start = self._clock.mark()

    def data_ready(self) -> None:
        if self._cur is not None:
            self._cur.data_wait_ms += (time.perf_counter() - self._data_t0) * 1e3

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

    def add_comm(self, comm_busy_ms: float, exposed_comm_ms: float) -> None:
        """Communication measured by `GradSync` for this step (its own clock)."""
        if self._cur is not None:
            busy = self._cur.comm_busy_ms
            self._cur.comm_busy_ms = comm_busy_ms if math.isnan(busy) else busy + comm_busy_ms
            self._cur.exposed_comm_ms += exposed_comm_ms

    def optimizer_start(self) -> None:
        if self._cur is not None:
            self._cur.optimizer_start = self._clock.mark()

    def end_step(self) -> None:
        cur, self._cur = self._cur, None
        if cur is None or not cur.micro:
            return
        cur.end = self._clock.mark()
        self._pending.append(cur)
        if not self._clock.device_events:
            self.resolve()

    # -- results ---------------------------------------------------------------------------
    def resolve(self) -> None:
        """Turn finished steps into records (waits for their events on an accelerator)."""
        ms = self._clock.ms
        for p in self._pending:
            fwd = sum(ms(f0, f1) for f0, f1, _ in p.micro)
            bwd = sum(ms(f1, b1) for _, f1, b1 in p.micro)
            opt_start = p.optimizer_start if p.optimizer_start is not None else p.micro[-1][2]
            # On an accelerator this is the stream's time from the step's first mark to its
            # last: a host wait for data shows up in it only if the stream ran dry meanwhile.
            step_ms = ms(p.start, p.end)
            self.records.append(StepRecord(
                step=p.step, data_wait_ms=p.data_wait_ms, forward_ms=fwd, backward_ms=bwd,
                comm_busy_ms=p.comm_busy_ms, exposed_comm_ms=p.exposed_comm_ms,
                optimizer_ms=ms(opt_start, p.end), step_ms=step_ms,
            ))
        self._pending.clear()

    def summary(self, warmup: int = 1, since_step: int | None = None) -> dict[str, float]:
        self.resolve()
        recs = [r for r in self.records if since_step is None or r.step > since_step]
        return summarize(recs, warmup=warmup if since_step is None else 0)
