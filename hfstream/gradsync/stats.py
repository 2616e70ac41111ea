"""What one synchronised step's communication cost: busy time, exposed time, per-bucket spans.

The step report and the timeline read `SyncStats` (docs/design.md section 4). On CPU the
spans are host times (``time.perf_counter``). On an accelerator they come from timing events,
resolved only when ``GradSync.stats`` is read, so recording never forces the host to wait.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from .. import streams


@dataclass
class SyncStats:
    """The last synchronised step's communication, as the step report and the timeline read it.

    Args:
        comm_busy_ms: time at least one reduction was in flight (union of the bucket spans).
        exposed_comm_ms: time ``finish()`` kept the caller waiting, from entering it until every
            reduction had completed (leftover launches included). On an accelerator: the time
            the compute stream stalled waiting, from events.
        num_collectives: collectives launched in that step (one per bucket).
        launched_in_backward: of those, how many the gradient hooks launched while backward ran
            (the rest were launched by ``finish()``: their communication could not overlap).
        bucket_spans: ``(bucket index, launch time, finish time)`` in ``time.perf_counter()``
            seconds, in launch order. On an accelerator a span's length comes from device
            events and is placed at the host time the first bucket was launched.
    """

    comm_busy_ms: float = 0.0
    exposed_comm_ms: float = 0.0
    num_collectives: int = 0
    launched_in_backward: int = 0
    bucket_spans: list[tuple[int, float, float]] = field(default_factory=list)


def union_length(spans: list[tuple[float, float]]) -> float:
    """Length of the union of ``[start, end]`` intervals.

    >>> union_length([(0, 2), (1, 3), (5, 6)])
    4.0
    """
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


class StatsRecorder:
    """Collects one step's timings from GradSync and turns them into `SyncStats` when asked.

    GradSync calls `launched` and `completed` per bucket, `finish_entered`/`finish_left` around
    its wait. `stats` resolves the last step (on an accelerator: waits for its events);
    `deferred` hands out a function that resolves *that* step later, so a reader that can wait a
    step (the Trainer's report) never makes the host wait for the device.
    """

    def __init__(self):
        self._last = _StepTimes([], 0.0, {}, 0)

    @staticmethod
    def launched(st, stream) -> None:
        """A bucket's collective is being issued: note when (host) and, on a side stream, an event."""
        if stream is not None:
            st.start_event = streams.new_event(st.plan.device, enable_timing=True)
            st.start_event.record(stream)
        st.launch_time = time.perf_counter()

    @staticmethod
    def completed(st, _future=None) -> None:
        # Runs when the work completes (gloo: on its thread). On an accelerator the current
        # stream here is synchronised with the collective, so an event recorded on it marks its end.
        if st.start_event is not None:
            st.end_event = streams.new_event(st.plan.device, enable_timing=True)
            st.end_event.record(streams.current_stream(st.plan.device))
        else:
            st.end_time = time.perf_counter()

    @staticmethod
    def finish_entered(devices) -> tuple[float, dict]:
        """Host time and, per accelerator, an event on the compute stream as ``finish()`` starts waiting."""
        waits = {}
        for d in devices:
            waits[d] = (streams.new_event(d, enable_timing=True), streams.new_event(d, enable_timing=True))
            waits[d][0].record(streams.current_stream(d))
        return time.perf_counter(), waits

    def finish_left(self, launched_states, t_enter: float, t_done: float, waits: dict) -> None:
        """Record the step: the buckets in launch order, the host's wait, the compute streams' waits."""
        for d, (_, after) in waits.items():
            after.record(streams.current_stream(d))
        launches = [(st.plan.index, st.plan.device, st.launch_time, st.end_time, st.start_event, st.end_event)
                    for st in launched_states]
        early = sum(1 for st in launched_states if st.launch_time is not None and st.launch_time < t_enter)
        self._last = _StepTimes(launches, (t_done - t_enter) * 1e3, waits, early)
        if not waits:
            self._last.resolve()   # host times only: nothing to wait for

    @property
    def stats(self) -> SyncStats:
        return self._last.resolve()

    @property
    def launched_in_backward(self) -> int:
        """The last step's count of buckets launched by the hooks (a host count: never waits)."""
        return self._last.launched_in_backward

    def deferred(self):
        """A function returning the last step's `SyncStats`, to call once its events are long done."""
        return self._last.resolve


class _StepTimes:
    """One step's raw timings; `resolve` turns them into `SyncStats` once (then cached)."""

    def __init__(self, launches: list, host_exposed_ms: float, waits: dict, launched_in_backward: int):
        self._raw = (launches, host_exposed_ms, waits)
        self.launched_in_backward = launched_in_backward
        self._stats: SyncStats | None = None

    def resolve(self) -> SyncStats:
        if self._stats is not None:
            return self._stats
        launches, host_exposed_ms, waits = self._raw
        # Device spans are measured from the device's first start event and placed at the host
        # time of that first launch: lengths and gaps are device times, the anchor is the host's.
        anchors: dict = {}
        spans = []
        for index, device, launched, ended, start, end in launches:
            if start is None:
                spans.append((index, launched, ended))
                continue
            end.synchronize()   # elapsed_time needs both events completed
            t0, ref = anchors.setdefault(device, (launched, start))
            spans.append((index, t0 + ref.elapsed_time(start) / 1e3, t0 + ref.elapsed_time(end) / 1e3))
        exposed = host_exposed_ms
        if waits:   # what the compute stream(s) spent waiting, not what the host spent queueing
            for _, after in waits.values():
                after.synchronize()
            exposed = max(before.elapsed_time(after) for before, after in waits.values())
        self._stats = SyncStats(
            comm_busy_ms=union_length([(a, b) for _, a, b in spans]) * 1e3,
            exposed_comm_ms=exposed,
            num_collectives=len(spans),
            launched_in_backward=self.launched_in_backward,
            bucket_spans=spans,
        )
        self._raw = None   # the events are no longer needed
        return self._stats
