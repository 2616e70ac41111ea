"""Lesson 02 checks, and the pretend accelerator the lesson grades on: `SimDevice`.

`SimDevice` models what PyTorch's CUDA notes ("CUDA semantics: asynchronous execution, CUDA
streams, memory management") say about streams, events and the caching allocator, with the
same method names as ``torch.Stream``, ``torch.Event`` and ``torch.Tensor``:

- the host only *queues* work; a stream runs its work in order; two streams run independently;
- ``event.record(stream)`` marks the point the stream has reached; ``event.wait(stream)`` /
  ``stream.wait_event(event)`` holds the stream (not the host) until that point has run;
  ``stream.wait_stream(other)`` is a record on ``other`` plus a wait, i.e. *everything* queued
  on ``other`` so far; an event never recorded is already complete;
- a tensor's memory comes from a pool per stream (the stream it was allocated on); when its last
  reference dies (here: ``tensor.free()``) the block goes back to that pool at once, unless
  ``tensor.record_stream(other)`` said that another stream uses it: then the block waits for the
  work ``other`` had queued up to the free;
- ``pin_memory()`` host batches are copied by DMA and the host goes on; a copy from pageable
  memory holds the host until the copy is done.

Every access is checked against a happens-before relation (vector clocks, one component per
stream and one for the host): two accesses to the same memory, at least one a write, with no
chain of stream order, event waits or host synchronization between them, are a race, whatever
the timings happen to be. Times (milliseconds) are simulated from fixed durations, so the
timeline is the same on every machine.
"""

from __future__ import annotations

import contextlib
import itertools
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from course.checks.drawn import falsify
from course.grading import Exercise, Wrong

DURATIONS_MS = {"copy": 2.0, "step": 3.0, "pack": 0.5, "all-reduce": 3.0, "unpack": 0.5,
                "backward": 1.0, "optimizer": 1.0}
LANES = {"compute": "compute", "copy": "data", "comm": "comm"}
POLL_MS = 0.05          # host time that passes per query() that answers False


# --------------------------------------------------------------------------- the simulator
def _join(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        if v > out.get(k, 0):
            out[k] = v
    return out


@dataclass
class Op:
    """One piece of queued work: a copy or a kernel."""

    seq: int
    stream: "SimStream"
    name: str
    label: str
    start: float
    end: float
    vc: dict
    reads: list = field(default_factory=list)
    writes: list = field(default_factory=list)

    def happens_before(self, other: "Op") -> bool:
        own = self.vc[self.stream.id]
        return own <= other.vc.get(self.stream.id, 0)

    def __repr__(self) -> str:
        return f"{self.label} on '{self.stream.name}' [{self.start:.1f}-{self.end:.1f} ms]"


@dataclass
class Race:
    kind: str          # "read before write", "write while in use", "two unordered writes"
    first: Op
    second: Op
    tensor: str        # what `second` touched
    other: str         # what `first` touched (another tensor when memory was reused)

    def __str__(self) -> str:
        if self.kind == "read before write":
            return (f"{self.second.label} on '{self.second.stream.name}' may read {self.tensor} before "
                    f"{self.first.label} on '{self.first.stream.name}' has finished writing it")
        reuse = f" (the memory of {self.other}, reused for {self.tensor})" if self.other != self.tensor else ""
        return (f"{self.second.label} on '{self.second.stream.name}' may write{reuse} while "
                f"{self.first.label} on '{self.first.stream.name}' still uses it")


class SimStream:
    """A stream of the pretend device: ``wait_stream``, ``wait_event``, ``record_event``, ``with``."""

    def __init__(self, device: "SimDevice", name: str, sid: int):
        self.device, self.name, self.id = device, name, sid
        self.lane = LANES.get(name, name)
        self.tail = 0.0            # when the work queued so far ends
        self.vc: dict = {}         # what the next op on this stream is ordered after
        self.count = 0             # ops queued so far

    def wait_event(self, event: "SimEvent") -> None:
        """Work queued on this stream from now on waits for ``event`` (the host does not)."""
        self.device._log("wait", stream=self, event=event)
        if event.recorded:
            self.tail = max(self.tail, event.time)
            self.vc = _join(self.vc, event.vc)

    def wait_stream(self, other: "SimStream") -> None:
        """Work queued on this stream from now on waits for *everything* queued on ``other`` so far."""
        self.device._log("wait_stream", stream=self, other=other)
        if other is not self:
            self.tail = max(self.tail, other.tail)
            self.vc = _join(self.vc, other.vc)

    def record_event(self, event: "SimEvent | None" = None) -> "SimEvent":
        event = event if event is not None else self.device.Event()
        event.record(self)
        return event

    def synchronize(self) -> None:
        """The host waits until this stream's queued work has run."""
        self.device._host_waits(self.tail, self.vc, what=f"stream '{self.name}'")

    def __enter__(self):
        self.device._stack.append(self)
        return self

    def __exit__(self, *exc):
        self.device._stack.pop()
        return False

    def __repr__(self) -> str:
        return f"SimStream({self.name!r})"


class SimEvent:
    """``record(stream=None)``, ``wait(stream=None)``, ``query()``, ``synchronize()``, as ``torch.Event``."""

    _ids = itertools.count()

    def __init__(self, device: "SimDevice"):
        self.device = device
        self.id = next(SimEvent._ids)
        self.recorded = False
        self.stream: SimStream | None = None
        self.time = 0.0
        self.vc: dict = {}
        self.after = 0            # how many ops of its stream it follows

    def record(self, stream: SimStream | None = None) -> None:
        """Mark the point ``stream`` (default: the current stream) has reached in its queue."""
        stream = stream if stream is not None else self.device.current_stream()
        self.recorded, self.stream = True, stream
        self.time, self.vc, self.after = stream.tail, dict(stream.vc), stream.count
        self.device._log("record", stream=stream, event=self)

    def wait(self, stream: SimStream | None = None) -> None:
        """Make ``stream`` (default: the current stream) wait for this event; the host goes on."""
        (stream if stream is not None else self.device.current_stream()).wait_event(self)

    def query(self) -> bool:
        """Has the recorded work run? The host spins while it asks: each answer False lets a little host time pass
        (POLL_MS), so a loop of query() is a host wait, which ends once the event's work has run."""
        done = self._done()
        if not done:
            self.device._log("poll", event=self, what=f"an event on '{self.stream.name}'")
            self.device.host_time = min(self.time, self.device.host_time + POLL_MS)
        return done

    def _done(self) -> bool:
        """Has the host already passed the recorded work? (The allocator's own question: no time passes.)"""
        done = not self.recorded or self.time <= self.device.host_time
        if done:
            self.device._host_vc = _join(self.device._host_vc, self.vc)
        return done

    def synchronize(self) -> None:
        """The host waits for this event."""
        if self.recorded:
            self.device._host_waits(self.time, self.vc, what=f"an event on '{self.stream.name}'")


class SimHost:
    """A batch in host memory; ``pin_memory()`` returns a page-locked copy, as ``Tensor.pin_memory``."""

    def __init__(self, name: str, pinned: bool = False):
        self.name, self.pinned = name, pinned

    def pin_memory(self) -> "SimHost":
        return SimHost(self.name, pinned=True)

    def is_pinned(self) -> bool:
        return self.pinned

    def __repr__(self) -> str:
        return f"SimHost({self.name!r}, pinned={self.pinned})"


class SimTensor:
    """Device memory: ``record_stream(stream)`` and ``free()`` (in PyTorch: the last reference dies)."""

    def __init__(self, device: "SimDevice", name: str, block: int, stream: SimStream):
        self.device, self.name, self.block, self.stream = device, name, block, stream
        self.recorded: list[SimStream] = []
        self.freed = False

    def record_stream(self, stream: SimStream) -> None:
        """Tell the allocator ``stream`` uses this tensor: on free, its block waits for that stream."""
        self._alive("record_stream")
        self.device._log("record_stream", stream=stream, tensor=self)
        if stream is not self.stream and stream not in self.recorded:
            self.recorded.append(stream)

    def free(self) -> None:
        """Drop the last reference: the block goes back to its stream's pool (see record_stream)."""
        self._alive("free")
        self.freed = True
        self.device._free(self)

    def _alive(self, what: str) -> None:
        if self.freed:
            raise RuntimeError(f"{what}() on {self.name} after free(): in PyTorch the tensor no longer exists")

    def __repr__(self) -> str:
        return f"SimTensor({self.name!r}, block {self.block}, allocated on '{self.stream.name}')"


class SimDevice:
    """A pretend accelerator with streams, events and a caching allocator (see the module docstring).

    >>> sim = SimDevice()
    >>> side = sim.Stream("copy")
    >>> with side:
    ...     x = sim.copy_in(SimHost("batch 0", pinned=True))
    >>> sim.current_stream().wait_stream(side)
    >>> y = sim.compute("step", x)
    >>> sim.races
    []
    """

    def __init__(self, durations: dict[str, float] | None = None):
        self.durations = {**DURATIONS_MS, **(durations or {})}
        self._streams: list[SimStream] = []
        self.default_stream = self._new_stream("compute")
        self._stack: list[SimStream] = []
        self.host_time = 0.0
        self._host_vc: dict = {}
        self.ops: list[Op] = []
        self.races: list[Race] = []
        self.calls: list[dict] = []          # every API call, in order (what the checks diagnose)
        self._blocks = itertools.count()
        self._pool: dict[int, list[tuple[int, list[SimEvent]]]] = {}
        self._accesses: dict[int, list[tuple[Op, str, str]]] = {}
        self.tensors: list[SimTensor] = []
        self.peak_blocks = 0               # blocks held by live tensors, at most
        self.reserved_blocks = 0           # blocks the allocator ever had to create
        self._live_blocks: set[int] = set()

    # -- streams and events -------------------------------------------------------------------------
    def _new_stream(self, name: str) -> SimStream:
        s = SimStream(self, name, len(self._streams))
        self._streams.append(s)
        return s

    def Stream(self, name: str = "side") -> SimStream:  # noqa: N802 - mirrors torch.Stream
        """A new stream; name it "copy" or "comm" to put it in that lane of the timeline."""
        return self._new_stream(name)

    def Event(self) -> SimEvent:  # noqa: N802 - mirrors torch.Event
        return SimEvent(self)

    def current_stream(self) -> SimStream:
        return self._stack[-1] if self._stack else self.default_stream

    @contextlib.contextmanager
    def stream(self, s: SimStream):
        """``with sim.stream(s):`` queues work on ``s`` (same as ``with s:``)."""
        with s:
            yield s

    def synchronize(self) -> None:
        """The host waits for every stream (``torch.accelerator.synchronize()``)."""
        for s in self._streams:
            self._host_waits(s.tail, s.vc, what="the device", log=False)
        self._log("synchronize", what="the device")

    def _host_waits(self, time: float, vc: dict, what: str, log: bool = True) -> None:
        self.host_time = max(self.host_time, time)
        self._host_vc = _join(self._host_vc, vc)
        if log:
            self._log("synchronize", what=what)

    def _log(self, kind: str, **info: Any) -> None:
        self.calls.append({"kind": kind, "seq": len(self.ops), **info})

    # -- memory ---------------------------------------------------------------------------------------
    def _alloc(self, name: str, stream: SimStream) -> SimTensor:
        pool = self._pool.setdefault(stream.id, [])
        block = None
        for i in range(len(pool) - 1, -1, -1):          # most recently freed first, as the allocator
            blk, events = pool[i]
            if all(e._done() for e in events):
                block = blk
                del pool[i]
                break
        if block is None:
            block = next(self._blocks)
            self.reserved_blocks += 1
        t = SimTensor(self, name, block, stream)
        self.tensors.append(t)
        self._live_blocks.add(block)
        self.peak_blocks = max(self.peak_blocks, len(self._live_blocks))
        return t

    def _free(self, t: SimTensor) -> None:
        events = []
        for s in t.recorded:               # the allocator's own events: not the learner's calls
            e = SimEvent(self)
            e.recorded, e.stream, e.time, e.vc, e.after = True, s, s.tail, dict(s.vc), s.count
            events.append(e)
        self._log("free", tensor=t)
        self._live_blocks.discard(t.block)
        self._pool.setdefault(t.stream.id, []).append((t.block, events))

    # -- work ---------------------------------------------------------------------------------------------
    def copy_in(self, host: SimHost, ms: float | None = None) -> SimTensor:
        """``host.to(device, non_blocking=True)`` on the current stream: a new device tensor.

        From pinned memory the host goes on at once; from pageable memory the host is held until
        the copy has run (the driver stages it through a pinned buffer of its own).
        """
        if not isinstance(host, SimHost):
            raise TypeError(f"copy_in takes a SimHost batch, got {type(host).__name__}")
        stream = self.current_stream()
        x = self._alloc(host.name, stream)
        op = self._queue(stream, "copy", f"copy({host.name})", [], [x], ms)
        if not host.pinned:
            self.host_time = max(self.host_time, op.end)
        return x

    def compute(self, name: str, *inputs: SimTensor, ms: float | None = None) -> SimTensor:
        """A kernel on the current stream that reads ``inputs`` into a new tensor (its output)."""
        stream = self.current_stream()
        label = f"{name}({', '.join(t.name for t in inputs)})"
        out = self._alloc(label, stream)
        self._queue(stream, name, label, list(inputs), [out], ms)
        return out

    def kernel(self, name: str, reads=(), writes=(), ms: float | None = None) -> Op:
        """A kernel on the current stream that reads and writes existing tensors."""
        stream = self.current_stream()
        touched = [*reads, *[w for w in writes if w not in reads]]
        label = f"{name}({', '.join(t.name for t in touched)})"
        return self._queue(stream, name, label, list(reads), list(writes), ms)

    def _queue(self, stream: SimStream, name: str, label: str, reads, writes, ms) -> Op:
        for t in [*reads, *writes]:
            if not isinstance(t, SimTensor):
                raise TypeError(f"{label}: expected SimTensors, got {type(t).__name__}")
            t._alive(f"using it in {label}")
        ms = self.durations.get(name, 1.0) if ms is None else ms
        start = max(stream.tail, self.host_time)
        vc = _join(stream.vc, self._host_vc)
        stream.count += 1
        vc[stream.id] = stream.count
        op = Op(len(self.ops), stream, name, label, start, start + ms, vc, list(reads), list(writes))
        stream.tail, stream.vc = op.end, vc
        self.ops.append(op)
        for mode, tensors in (("r", reads), ("w", writes)):
            for t in tensors:
                self._check(op, mode, t)
        return op

    def _check(self, op: Op, mode: str, t: SimTensor) -> None:
        seen = self._accesses.setdefault(t.block, [])
        for prev, pmode, pname in seen:
            if prev is op or (mode == "r" and pmode == "r") or prev.happens_before(op):
                continue
            kind = ("read before write" if mode == "r" else
                    "two unordered writes" if pmode == "w" and pname == t.name else "write while in use")
            self.races.append(Race(kind, prev, op, t.name, pname))
        seen.append((op, mode, t.name))

    # -- results ------------------------------------------------------------------------------------------
    def elapsed_ms(self) -> float:
        return max((op.end for op in self.ops), default=0.0)

    def spans(self) -> list[tuple]:
        """``(rank, lane, name, start, end)`` in seconds, like `hfstream.report.timeline` spans."""
        return [(0, op.stream.lane, op.name, op.start / 1e3, op.end / 1e3) for op in self.ops]

    def raced_ops(self) -> set[int]:
        return {r.second.seq for r in self.races} | {r.first.seq for r in self.races}

    def first_race(self) -> str:
        return str(self.races[0]) if self.races else "no race"

    def find(self, label: str) -> Op:
        return next(op for op in self.ops if op.label == label)


# --------------------------------------------------------------------------- the figure
COLORS = {"copy": "#dd8452", "step": "#4c72b0", "pack": "#55a868", "unpack": "#55a868",
          "all-reduce": "#c44e52", "backward": "#8172b2", "optimizer": "#937860", "compute": "#4c72b0"}


def draw_timelines(panels: dict[str, Any], path, title: str, unit: str = "ms") -> Path:
    """One panel per entry, one row per lane; a value is a `SimDevice` or a list of spans.

    Spans are ``(rank, lane, name, start, end)`` in seconds; ops of a `SimDevice` caught in a
    race are outlined in red and hatched.
    """
    from matplotlib.figure import Figure   # no pyplot: leaves the notebook's backend alone

    fig = Figure(figsize=(8.5, 1.0 + 1.25 * len(panels)))
    axes = fig.subplots(len(panels), 1, squeeze=False)[:, 0]
    seen = set()
    for ax, (name, value) in zip(axes, panels.items()):
        raced = set()
        if isinstance(value, SimDevice):
            spans, raced = value.spans(), value.raced_ops()
        else:
            spans = list(value)
        lanes = []
        for s in spans:
            if s[1] not in lanes:
                lanes.append(s[1])
        origin = min((s[3] for s in spans), default=0.0)
        for i, (_, lane, op_name, t0, t1) in enumerate(spans):
            y = len(lanes) - 1 - lanes.index(lane)
            bad = i in raced
            ax.barh(y, (t1 - t0) * 1e3, left=(t0 - origin) * 1e3, height=0.6,
                    color=COLORS.get(op_name, "#999999"), edgecolor="#d62728" if bad else "white",
                    linewidth=1.6 if bad else 0.5, hatch="//" if bad else None,
                    label=op_name if op_name not in seen else None)
            seen.add(op_name)
        ax.set_yticks(range(len(lanes)), list(reversed(lanes)), fontsize=8)
        ax.set_title(name, fontsize=9, loc="left")
        ax.tick_params(axis="x", labelsize=8)
    axes[-1].set_xlabel(f"{unit} since the first span")
    fig.suptitle(title, fontsize=10)
    fig.legend(fontsize=8, loc="upper right")
    fig.tight_layout(rect=(0, 0, 0.86, 1))
    fig.savefig(path, dpi=110)
    return Path(path)


# --------------------------------------------------------------------------- helpers for the checks
def _batches(n: int, pinned: bool = True) -> list[SimHost]:
    return [SimHost(f"batch {i}", pinned=pinned) for i in range(n)]


def _calls(sim: SimDevice, kind: str) -> list[dict]:
    return [c for c in sim.calls if c["kind"] == kind]


def _step_ops(sim: SimDevice) -> list[Op]:
    return [op for op in sim.ops if op.name == "step"]


def _copy_ops(sim: SimDevice) -> list[Op]:
    return [op for op in sim.ops if op.name == "copy"]


# --------------------------------------------------------------------------- 02.order
order = Exercise("02.order", uses=["start_copy", "consume", "prefetch_loop"],
                 title="a prefetch loop whose compute never reads a batch early")


def _run_order(learner, n: int = 6, pinned: bool = True, copy_ms: float | None = None,
               step_ms: float | None = None) -> SimDevice:
    durations = {k: v for k, v in (("copy", copy_ms), ("step", step_ms)) if v is not None}
    sim = SimDevice(durations)
    outs = learner.prefetch_loop(sim, _batches(n, pinned))
    if not isinstance(outs, list) or len(outs) != n:
        raise Wrong(f"prefetch_loop should return one output per batch ({n}), got {outs!r:.80}")
    return sim


def _diagnose_order_race(sim: SimDevice) -> None:
    race = sim.races[0]
    side_names = {op.stream.name for op in _copy_ops(sim)}
    records = _calls(sim, "record")
    waits = _calls(sim, "wait")
    if not records and not _calls(sim, "wait_stream"):
        raise Wrong(f"{race}. Nothing orders the compute stream after the copy: in start_copy record an "
                    "Event on the side stream right after the copy, and in consume make the compute stream "
                    "wait on it (ready.wait(compute))")
    if records and all(c["stream"].name not in side_names for c in records):
        raise Wrong(f"{race}. You recorded the event on the compute stream: an event marks a point in the "
                    "queue of the stream it is recorded on, and the copy is queued on the side stream",
                    reveal="ready.record(side) right after the copy, in start_copy")
    if waits and all(c["stream"].name in side_names for c in waits):
        raise Wrong(f"{race}. The side stream waits on its own event, which orders nothing: the stream that "
                    "*reads* the batch must wait, i.e. ready.wait(compute) in consume")
    first_copy = _copy_ops(sim)[0]
    if any(c["stream"].name in side_names and c["seq"] <= first_copy.seq for c in records):
        raise Wrong(f"{race}. Your event was recorded before the copy was queued, so it marks a point "
                    "before the copy: record it after sim.copy_in(...)")
    if not waits and not _calls(sim, "wait_stream"):
        raise Wrong(f"{race}. You recorded an event but nobody waits on it: in consume, "
                    "ready.wait(compute) before the compute")
    step = race.second
    if waits and not any(c["seq"] <= step.seq and c["stream"] is step.stream for c in waits):
        raise Wrong(f"{race}. Your compute stream waits on the event only after the step was queued: a wait "
                    "orders the work queued *after* it on that stream, so make compute wait first, then queue the "
                    "step")
    raise Wrong(f"{race}. The compute on each batch must be ordered after that batch's copy: "
                "record an Event after the copy on the side stream and wait on it from the compute stream")


def _pipeline_ms(n: int, copy_ms: float, step_ms: float) -> float:
    """The end of n steps when every copy runs on one side stream under the steps: copy i+1 right after copy i,
    step i once copy i and step i-1 are done."""
    copy_end, step_end = copy_ms, 0.0
    for _ in range(n):
        step_end = max(copy_end, step_end) + step_ms
        copy_end += copy_ms
    return step_end


# The lesson's loop (6 batches, a copy shorter than a step), then drawn ones: 1 to 7 batches, copies shorter
# and longer than the steps.
def _order_cases(seed: int = 21, count: int = 6) -> list[tuple]:
    rng = random.Random(seed)
    cases = [(6, None, None)]
    for k in range(count):
        copy_ms, step_ms = float(rng.randint(1, 6)), float(rng.randint(1, 6))
        if k % 2:
            copy_ms, step_ms = max(copy_ms, step_ms) + 1.0, min(copy_ms, step_ms)     # copies outlast steps
        cases.append((rng.randint(1, 7), copy_ms, step_ms))
    return cases


def _smaller_order(case):
    n, c, t = case
    for m in range(1, n):
        yield (m, c, t)


def _describe_order(case) -> str:
    n, c, t = case
    return (f"{n} batch{'es' if n > 1 else ''}, copies of {c if c is not None else DURATIONS_MS['copy']:g} ms, "
            f"steps of {t if t is not None else DURATIONS_MS['step']:g} ms")


def _order_falsify(learner, prop, reveal: str) -> None:
    reveals = {}

    def check_one(case):
        try:
            prop(_run_order(learner, case[0], copy_ms=case[1], step_ms=case[2]), case)
        except Wrong as exc:
            message = f"{_describe_order(case)}: {exc}"
            reveals[message] = exc.reveal
            return message
        return None

    found = falsify(_order_cases(), check_one, smaller=_smaller_order, kind=lambda m: m.split(": ", 1)[-1][:50])
    if found is not None:
        raise Wrong(str(found), reveal=reveals.get(found.message) or reveal)


@order.case("no compute reads a batch before its copy has landed",
            hint="the compute stream may read a batch only once its copy on the side stream has finished, and "
                 "nothing ordered the two",
            reveal="record an Event on the side stream after the copy; make the compute stream wait on it")
def _(learner):
    """Property: on the lesson's loop and on drawn ones (1 to 7 batches, copies shorter and longer than the
    steps), every step's read of its batch happens after that batch's copy, whatever the timings."""
    def prop(sim, case):
        n = case[0]
        if len(_copy_ops(sim)) != n or len(_step_ops(sim)) != n:
            raise Wrong(f"expected {n} copies and {n} steps, the loop queued {len(_copy_ops(sim))} copies and "
                        f"{len(_step_ops(sim))} steps: keep start_copy to one sim.copy_in and consume to one "
                        f"sim.compute")
        if sim.races:
            _diagnose_order_race(sim)

    _order_falsify(learner, prop, "record an Event on the side stream after the copy; make the compute stream wait "
                                  "on it")
    return f"{len(_order_cases())} loops, every read ordered after its copy"


@order.case("the host never waits, and each step waits only for its own batch",
            hint="the ordering must be between the streams, not done by the host; and each step must wait for its "
                 "own batch only",
            reveal="use event.wait(stream), not event.synchronize() or sim.synchronize(); and an Event per batch, "
                   "not wait_stream, since the next copy is already queued")
def _(learner):
    """Property: on the same loops, the host never waits (no synchronize, no polling), each copy runs on the side
    stream, step i waits for copy i and not for copy i + 1, so the loop ends when the pipelined schedule does."""
    def prop(sim, case):
        if sim.races:
            raise Wrong(f"fix the race first: {sim.first_race()}")
        if _calls(sim, "synchronize"):
            what = _calls(sim, "synchronize")[0]["what"]
            raise Wrong(f"the host waited for {what}: that orders the read, but the host stops queuing work, so the "
                        "next copy can no longer run under this step. Let the compute *stream* wait: "
                        "ready.wait(compute)")
        if _calls(sim, "poll"):
            raise Wrong("the host polled the event (query() in a loop) until the copy had run: that is a host wait "
                        "too, and the host queues nothing meanwhile. Let the compute *stream* wait: "
                        "ready.wait(compute)")
        steps, copies = _step_ops(sim), _copy_ops(sim)
        if any(op.stream is sim.default_stream for op in copies):
            raise Wrong("your copies ran on the compute stream, in line with the steps: no race, and nothing "
                        "overlaps either. Queue each copy on the side stream (inside `with side:`)")
        for i in range(len(steps) - 1):
            if copies[i + 1].happens_before(steps[i]):
                how = ("compute.wait_stream(side) waits for everything queued on the side stream so far, "
                       "and the copy of the next batch is already queued"
                       if _calls(sim, "wait_stream") else "the step waited for a later copy")
                raise Wrong(f"step on batch {i} waited for the copy of batch {i + 1}: {how}. Record an Event right "
                            f"after each batch's copy and wait on exactly that event")
        ideal = _pipeline_ms(len(steps), sim.durations["copy"], sim.durations["step"])
        assert sim.elapsed_ms() <= ideal + 1e-6, (
            f"the loop took {sim.elapsed_ms():.1f} simulated ms; with copies hidden it takes {ideal:.1f}")

    _order_falsify(learner, prop, "use event.wait(stream), not event.synchronize() or sim.synchronize(); and an Event "
                                  "per batch, not wait_stream, since the next copy is already queued")
    sim = _run_order(learner)
    serial = len(_step_ops(sim)) * (sim.durations["copy"] + sim.durations["step"])
    return f"{sim.elapsed_ms():.0f} simulated ms vs {serial:.0f} ms one stream, and {len(_order_cases()) - 1} drawn loops"


# --------------------------------------------------------------------------- 02.lifetime
lifetime = Exercise("02.lifetime", uses=["reduce_buckets"],
                    title="buckets reduced on a side stream: ordering and memory lifetime")


def _run_lifetime(learner, n: int = 4, durations: dict | None = None) -> tuple[SimDevice, list[Op]]:
    sim = SimDevice(durations)
    comm = sim.Stream("comm")
    grads = [sim.compute("backward", ms=1.0) for _ in range(n)]
    for i, g in enumerate(grads):
        g.name = f"grad {i}"
    done = learner.reduce_buckets(sim, comm, grads)
    if not isinstance(done, SimEvent):
        raise Wrong(f"reduce_buckets should return the Event recorded on comm after the last unpack, "
                    f"got {done!r:.60}")
    if sim.current_stream() is not sim.default_stream:
        raise Wrong("after reduce_buckets the current stream is still a side stream: leave every `with comm:` block")
    compute = sim.default_stream
    done.wait(compute)
    sim.kernel("optimizer", reads=grads, writes=[])
    return sim, grads


def _lifetime_ops(sim: SimDevice, name: str) -> list[Op]:
    return [op for op in sim.ops if op.name == name]


@lifetime.case("every bucket, unpack and optimizer read is ordered after its producer",
               hint="each stream must wait for what the other produced before it reads it: the comm stream for "
                    "the packed bucket, the optimizer for the last unpack",
               reveal="comm.wait_stream(compute) before the all-reduce; return an Event recorded on comm "
                      "after the last unpack")
def _(learner):
    """Property: for the lesson's 4 gradients and drawn runs (1 to 6 gradients, packs shorter and longer than the
    reductions), every all-reduce reads its bucket after its pack, every unpack after its all-reduce, and the
    optimizer after the last unpack."""
    _lifetime_falsify(learner, _lifetime_order)
    return f"{len(_lifetime_cases())} runs, every read after its writer"


def _lifetime_cases(seed: int = 22, count: int = 5) -> list[tuple]:
    """The lesson's 4 gradients, then drawn runs: 1 to 6 gradients, pack, all-reduce and unpack durations."""
    rng = random.Random(seed)
    cases = [(4, None)]
    for _ in range(count):
        cases.append((rng.randint(1, 6), {"pack": float(rng.randint(1, 4)), "all-reduce": float(rng.randint(1, 6)),
                                          "unpack": float(rng.randint(1, 3))}))
    return cases


def _lifetime_falsify(learner, prop) -> None:
    reveals = {}

    def check_one(case):
        n, durations = case
        try:
            sim, grads = _run_lifetime(learner, n, durations)
            prop(sim, grads)
        except Wrong as exc:
            parts = "" if durations is None else ", " + ", ".join(f"{k} {v:g} ms" for k, v in durations.items())
            message = f"{n} gradient{'s' if n > 1 else ''}{parts}: {exc}"
            reveals[message] = exc.reveal
            return message
        return None

    found = falsify(_lifetime_cases(), check_one, kind=lambda m: m.split(": ", 1)[-1][:50],
                    smaller=lambda case: ((m, case[1]) for m in range(1, case[0])))
    if found is not None:
        raise Wrong(str(found), reveal=reveals.get(found.message))


def _lifetime_order(sim: SimDevice, grads) -> None:
    packs, reduces, unpacks = (_lifetime_ops(sim, k) for k in ("pack", "all-reduce", "unpack"))
    if not (len(packs) == len(reduces) == len(unpacks) == len(grads)):
        raise Wrong(f"expected one pack, all-reduce and unpack per gradient ({len(grads)}), got "
                    f"{len(packs)}, {len(reduces)}, {len(unpacks)}")
    if any(op.stream.name != "comm" for op in reduces + unpacks):
        raise Wrong("queue the all-reduce and the unpack on the comm stream (inside `with comm:`), so the "
                    "compute stream goes on packing the next bucket")
    if any(op.stream is not sim.default_stream for op in packs):
        raise Wrong("pack on the compute stream (outside `with comm:`): the gradients are produced there")
    reads = [r for r in sim.races if r.kind == "read before write"]
    comm_waits = [c for c in _calls(sim, "wait_stream") + _calls(sim, "wait") if c["stream"].name == "comm"]
    for r in reads:
        if r.second.name == "all-reduce":
            b = reduces.index(r.second)
            before = [c for c in comm_waits if c["seq"] > packs[b].seq and c["seq"] <= r.second.seq]
            if not before and any(c["seq"] > r.second.seq for c in comm_waits) and len(comm_waits) >= len(packs):
                raise Wrong(f"{r}. The comm stream waits for compute, but only after the all-reduce of bucket {b} was "
                            f"queued: a wait orders the work queued *after* it on that stream. Wait first, then "
                            f"queue the all-reduce")
            if comm_waits and len(comm_waits) < len(packs):
                raise Wrong(f"{r}. The comm stream waited for compute {len(comm_waits)} time(s) for {len(packs)} "
                            f"buckets: a wait orders only what compute had queued before it, so the pack of bucket "
                            f"{b}, queued later, is not covered. Each bucket needs its own wait, after its pack")
            raise Wrong(f"{r}. The all-reduce on the comm stream read the bucket before the pack queued on the "
                        "compute stream had written it: nothing made the comm stream wait",
                        reveal="comm.wait_stream(compute) before the all-reduce")
        if r.second.name == "optimizer":
            recorded = [c for c in _calls(sim, "record")]
            if recorded and recorded[-1]["stream"] is sim.default_stream:
                raise Wrong(f"{r}. The Event you returned was recorded on the compute stream, where it marks a point "
                            f"of compute's queue: the unpacks are on comm. Record it on comm (done.record(comm)), "
                            f"after the last unpack")
            raise Wrong(f"{r}. The Event you return must be recorded on comm *after* the last unpack "
                        "(done.record(comm) at the end), so the optimizer waits for every reduction")
    if reads:
        raise Wrong(f"{reads[0]}: order each reader after its writer")
    others = [r for r in sim.races if r.kind == "two unordered writes"]
    if others:
        raise Wrong(f"{others[0]}: order each writer after the one before it")


@lifetime.case("a bucket's memory is not reused while the comm stream still uses it",
               hint="the allocator follows only the stream a block was allocated on; another stream still "
                    "using it must be made known to it before the block is freed",
               reveal="bucket.record_stream(comm) before bucket.free()")
def _(learner):
    """Property: on the same runs, no bucket's block is handed to a new tensor while the comm stream still uses
    it, the host never waits, and compute never waits for comm inside the loop."""
    _lifetime_falsify(learner, _lifetime_reuse)
    sim, grads = _run_lifetime(learner)
    buckets = [t for t in sim.tensors if t.name.startswith("pack(")]
    return (f"{len(buckets)} buckets, no early reuse; the allocator created {sim.reserved_blocks} blocks "
            f"for {len(sim.tensors)} tensors (freed buckets come back once comm has passed them)")


def _lifetime_reuse(sim: SimDevice, grads) -> None:
    if any(r.kind == "read before write" for r in sim.races):
        raise Wrong(f"fix the ordering first: {sim.first_race()}")
    frees = _calls(sim, "free")
    buckets = [t for t in sim.tensors if t.name.startswith("pack(")]
    if len(frees) < len(buckets):
        raise Wrong(f"{len(buckets) - len(frees)} bucket(s) never freed: in PyTorch the bucket's last "
                    "reference dies at the end of the loop body, so call bucket.free() there")
    reuse = [r for r in sim.races if r.kind != "read before write"]
    if reuse:
        recorded = _calls(sim, "record_stream")
        if recorded and all(c["stream"] is sim.default_stream for c in recorded):
            raise Wrong(f"{reuse[0]}. record_stream(compute) changes nothing: the bucket was allocated on "
                        "the compute stream, which the allocator already follows; the *other* stream that uses "
                        "it is the one it does not know about", reveal="bucket.record_stream(comm)")
        if not recorded:
            raise Wrong(f"{reuse[0]}. The allocator gave the freed bucket's block to the next pack on the "
                        "compute stream while the comm stream was still reducing it: nothing told the allocator "
                        "that the comm stream uses it", reveal="bucket.record_stream(comm) before bucket.free()")
        raise Wrong(f"{reuse[0]}: some buckets were freed while the comm stream used them, unknown to the "
                    f"allocator", reveal="bucket.record_stream(comm) on every bucket, before it is freed")
    if _calls(sim, "synchronize"):
        raise Wrong("the host synchronized: that makes reuse safe, but the host stops queuing and the next "
                    "pack no longer overlaps the reduction. record_stream keeps it safe without waiting")
    packs, reduces = _lifetime_ops(sim, "pack"), _lifetime_ops(sim, "all-reduce")
    for i in range(len(packs) - 1):
        if reduces[i].happens_before(packs[i + 1]):
            raise Wrong(f"pack of bucket {i + 1} waited for the all-reduce of bucket {i}: the compute stream "
                        "must not wait for comm inside the loop (only the optimizer waits, on the returned event)")
    if _calls(sim, "poll"):
        raise Wrong("the host polled an event (query() in a loop): that is a host wait, and the next pack no longer "
                    "overlaps the reduction. record_stream keeps the reuse safe without waiting")
