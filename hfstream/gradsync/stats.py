"""What one synchronised step's communication cost: busy time, exposed time, per-bucket spans.

The step report and the timeline read `SyncStats` (docs/design.md section 4). On CPU the
spans are host times (``time.perf_counter``). On an accelerator they come from timing events,
resolved only when ``GradSync.stats`` is read or a step's `StepTimes` is called (the timeline
calls it once ``ready()`` says its events have completed), so recording never forces the host
to wait, and the timeline never does either.

Under ``mode="sharded"`` a step's stats also carry the all-gathers that the *previous*
optimizer step launched: those are the ones this step's forward waited for, so their exposed
time lies inside this step. Every one of them has been waited for by the end of this step's
``finish()`` (the forward's pre-hooks, or the launch of the bucket that reuses the buffer).
"""

from __future__ import annotations

import math
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
            seconds, in launch order. On an accelerator a span is a device time placed from one
            reference: the step's start event at the host time the step began, where the
            timeline gave one (``stats_deferred().place_from``), else the first launch's event
            at the host time of that launch.
        finish_span: ``(start, end)`` of the exposed wait in ``finish()``, placed like the spans
            (CPU: host times from entering it to the last completion; accelerator: the compute
            stream's stall); None where not measured.
        all_gather_busy_ms: ``mode="sharded"``: time at least one of the previous step's parameter
            all-gathers was in flight (from ``optimizer.step()`` to each one's completion); NaN
            in the other modes, 0 before the first optimizer step.
        all_gather_exposed_ms: ``mode="sharded"``: time the forward pre-hooks waited for those
            all-gathers (on an accelerator: the compute stream's stall, from events); NaN otherwise.
        num_all_gathers, all_gather_spans: those all-gathers, as ``num_collectives``/``bucket_spans``.

    ``comm_busy_ms`` and ``exposed_comm_ms`` here are the backward's collectives only (under
    sharded: the reduce-scatters); the step report's fields of those names add the all-gathers.
    """

    comm_busy_ms: float
    exposed_comm_ms: float
    num_collectives: int
    launched_in_backward: int
    bucket_spans: list[tuple[int, float, float]]
    finish_span: tuple[float, float] | None
    all_gather_busy_ms: float = math.nan
    all_gather_exposed_ms: float = math.nan
    num_all_gathers: int = 0
    all_gather_spans: list[tuple[int, float, float]] = field(default_factory=list)


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
    `deferred` hands out *that* step, to resolve later (`StepTimes`: callable, with ``ready()``
    and ``place_from()``), so a reader that can wait a step (the Trainer's report) never makes
    the host wait for the device.
    """

    def __init__(self):
        self._last = StepTimes([], (0.0, 0.0), {}, 0, None)
        # mode="sharded": the all-gathers launched since the last finish() and the forward's waits for them.
        self._gathers: list[_Gather] | None = None
        self._gather_waits: list = []

    def record_gathers(self) -> None:
        """From now on each step's stats carry the parameter all-gathers (``mode="sharded"``)."""
        if self._gathers is None:
            self._gathers = []

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
        gathers = None
        if self._gathers is not None:
            # Every gather launched since the last finish() has been waited for by now (forward
            # pre-hooks, or the launch of its bucket): its completion callback is due at once.
            done = [g for g in self._gathers if g.waited]
            for g in done:
                g.done.wait()
            gathers = (done, self._gather_waits)
            self._gathers, self._gather_waits = [g for g in self._gathers if not g.waited], []
        self._last = StepTimes(launches, (t_enter, t_done), waits, early, gathers)
        on_device = gathers is not None and any(g.start_event is not None for g in gathers[0])
        if not waits and not on_device:
            self._last.resolve()   # host times only: nothing to wait for

    # -- mode="sharded": the all-gathers after the step, and the forward's waits for them ----------
    @staticmethod
    def gather_launching(index: int, device, events: bool) -> "_Gather":
        """An all-gather is about to be issued (after ``optimizer.step()``): note when (host) and, with ``events``, an event."""
        g = _Gather(index, device)
        if events:
            g.start_event = streams.new_event(device, enable_timing=True)
            g.start_event.record(streams.current_stream(device))
        g.launch_time = time.perf_counter()
        return g

    def gather_launched(self, g: "_Gather", work) -> None:
        g.done = work.get_future().then(g.completed)
        self._gathers.append(g)

    @staticmethod
    def wait_entered(device, events: bool):
        """Before a forward pre-hook waits for a gather: host time, or (``events``) an event on the compute stream."""
        if events:
            ev = streams.new_event(device, enable_timing=True)
            ev.record(streams.current_stream(device))
            return ev
        return time.perf_counter()

    def wait_left(self, device, entered) -> None:
        """After that wait: the host's wait (CPU), or the compute stream's stall (events, resolved later)."""
        if isinstance(entered, float):
            self._gather_waits.append((time.perf_counter() - entered) * 1e3)
        else:
            after = streams.new_event(device, enable_timing=True)
            after.record(streams.current_stream(device))
            self._gather_waits.append((entered, after))

    @property
    def stats(self) -> SyncStats:
        return self._last.resolve()

    @property
    def launched_in_backward(self) -> int:
        """The last step's count of buckets launched by the hooks (a host count: never waits)."""
        return self._last.launched_in_backward

    def deferred(self) -> "StepTimes":
        """The last step's timings: call it for its `SyncStats`, once ``ready()`` says its events are done."""
        return self._last


class _Gather:
    """One parameter all-gather: launch and completion (host times, or device events)."""

    def __init__(self, index: int, device):
        self.index, self.device = index, device
        self.launch_time = self.end_time = self.start_event = self.end_event = self.done = None
        self.waited = False   # its work was waited for (set by `sharded`)

    def completed(self, _future=None) -> None:
        # As StatsRecorder.completed: on an accelerator the current stream here follows the collective.
        if self.start_event is not None:
            self.end_event = streams.new_event(self.device, enable_timing=True)
            self.end_event.record(streams.current_stream(self.device))
        else:
            self.end_time = time.perf_counter()


def _offset_s(reference, event) -> float | None:
    """Seconds from ``reference`` to ``event`` (negative when earlier); None when they cannot be compared."""
    try:
        return reference.elapsed_time(event) / 1e3
    except (RuntimeError, ValueError):   # another device's event
        return None


def _device_spans(rows, reference=None) -> list[tuple[int, float, float]]:
    """``(index, device, launch, end, start_event, end_event)`` -> ``(index, start, end)`` host seconds.

    Host-timed rows are kept as they are. Device rows are placed from ``reference`` (``(host
    time, event)``: the step's start event at the host time the step began) where it is given and
    on their device; otherwise from the device's first start event at the host time of that first
    launch (lengths and gaps are device times either way; only the anchor differs).
    """
    anchors: dict = {}
    spans = []
    for index, device, launched, ended, start, end in rows:
        if start is None:
            spans.append((index, launched, ended))
            continue
        end.synchronize()   # elapsed_time needs both events completed (a no-op once ready())
        if device not in anchors:
            offset = _offset_s(reference[1], start) if reference is not None else None
            anchors[device] = (launched, start) if offset is None else (reference[0], reference[1])
        t0, ref = anchors[device]
        spans.append((index, t0 + ref.elapsed_time(start) / 1e3, t0 + ref.elapsed_time(end) / 1e3))
    return spans


def _events(launches, waits, gathers) -> list:
    """Every event a step's stats read (None: one that is not recorded yet)."""
    out = [ev for row in launches for ev in row[4:6] if row[4] is not None]
    out += [ev for pair in waits.values() for ev in pair]
    if gathers is not None:
        launched, gather_waits = gathers
        out += [ev for g in launched if g.start_event is not None for ev in (g.start_event, g.end_event)]
        out += [ev for w in gather_waits if isinstance(w, tuple) for ev in w]
    return out


class StepTimes:
    """One step's raw timings; calling it resolves them into `SyncStats` once (then cached).

    ``ready()`` says, without waiting, whether every event it reads has completed; a reader that
    calls it only then never stalls the host. ``place_from(host_time, event)`` sets the reference
    its device spans are placed from (the timeline's step start), before it is resolved.
    """

    def __init__(self, launches: list, finish_window: tuple[float, float], waits: dict, launched_in_backward: int,
                 gathers: tuple[list, list] | None):
        self._raw = (launches, finish_window, waits, gathers)
        self.launched_in_backward = launched_in_backward
        self._reference: tuple[float, object] | None = None
        self._stats: SyncStats | None = None

    def ready(self) -> bool:
        if self._raw is None:
            return True
        return all(ev is not None and ev.query() for ev in _events(self._raw[0], self._raw[2], self._raw[3]))

    def place_from(self, host_time: float, event) -> None:
        if self._stats is None:
            self._reference = (host_time, event)

    def __call__(self) -> SyncStats:
        return self.resolve()

    def resolve(self) -> SyncStats:
        if self._stats is not None:
            return self._stats
        launches, (t_enter, t_done), waits, gathers = self._raw
        reference = self._reference
        spans = _device_spans(launches, reference)
        exposed, finish_span = (t_done - t_enter) * 1e3, (t_enter, t_done)
        if waits:   # what the compute stream(s) spent waiting, not what the host spent queueing
            for _, after in waits.values():
                after.synchronize()
            stalls = [(before.elapsed_time(after), before, after) for before, after in waits.values()]
            exposed, before, after = max(stalls, key=lambda s: s[0])
            offset = _offset_s(reference[1], before) if reference is not None else None
            finish_span = None if offset is None else (reference[0] + offset, reference[0] + offset + exposed / 1e3)
        self._stats = SyncStats(
            comm_busy_ms=union_length([(a, b) for _, a, b in spans]) * 1e3,
            exposed_comm_ms=exposed,
            num_collectives=len(spans),
            launched_in_backward=self.launched_in_backward,
            bucket_spans=spans,
            finish_span=finish_span,
        )
        if gathers is not None:
            launched, gather_waits = gathers
            gspans = _device_spans([(g.index, g.device, g.launch_time, g.end_time, g.start_event, g.end_event)
                                    for g in launched], reference)
            waited = 0.0
            for w in gather_waits:
                if isinstance(w, tuple):
                    w[1].synchronize()
                    w = w[0].elapsed_time(w[1])
                waited += w
            self._stats.all_gather_busy_ms = union_length([(a, b) for _, a, b in gspans]) * 1e3
            self._stats.all_gather_exposed_ms = waited
            self._stats.num_all_gathers = len(gspans)
            self._stats.all_gather_spans = gspans
        self._raw = None   # the events are no longer needed
        return self._stats
