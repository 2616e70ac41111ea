"""Lesson 01 checks: a span recorder, a loop instrumented phase by phase, a per-step breakdown.

The loop check runs the learner's `train_loop` on probes (a model, an optimizer and a batch
iterator that sleep a known time and note when they really ran), so it can tell which span
covers which phase however noisy the machine: a span is right when it *contains* the phase it
names, and wrong when it also contains another one.
"""

from __future__ import annotations

import contextlib
import math
import random
import statistics
import time
from types import SimpleNamespace

import torch
import torch.nn as nn

from course.checks.drawn import falsify
from course.grading import Exercise, Wrong

PHASES = (("data", "data wait"), ("compute", "forward"), ("compute", "backward"), ("compute", "optimizer"))
KEYS = {"data wait": "data_wait_ms", "forward": "forward_ms", "backward": "backward_ms", "optimizer": "optimizer_ms"}


class _FakeClock:
    """A clock that ticks a fixed amount per read, so a span's start and end are known in advance."""

    def __init__(self, start: float = 100.0, tick: float = 0.25):
        self.now, self.tick, self.reads = start, tick, 0

    def __call__(self) -> float:
        t = self.now
        self.now += self.tick
        self.reads += 1
        return t


# --------------------------------------------------------------------------- 01.spans
spans_ex = Exercise("01.spans", uses=["Spans"], title="a span recorder")


def _one_span(learner, rank=3, clock=None):
    clock = clock or _FakeClock()
    rec = learner.Spans(rank=rank, clock=clock)
    with rec.span("compute", "forward"):
        pass
    return rec, clock


@spans_ex.case("a block becomes one (rank, lane, name, start, end) tuple from the recorder's clock",
               hint="a span is the time from just before the block runs to just after it, read from the "
                    "recorder's own clock, and it is kept in self.spans as one tuple",
               reveal="start = self.clock() before the yield, end = self.clock() after it; "
                      "append (self.rank, lane, name, start, end) to self.spans")
def _(learner):
    """Property: one block on rank 3 leaves one tuple (3, lane, name, start, end), start and end the recorder's
    clock read when the block begins and when it ends."""
    rec, clock = _one_span(learner)
    spans = list(rec.spans)
    if not spans:
        raise Wrong("the block ran but `self.spans` is empty: append one tuple when the block ends")
    if len(spans) != 1:
        raise Wrong(f"one block should give one span, got {len(spans)}: {spans}")
    got = tuple(spans[0])
    if clock.reads == 0:
        raise Wrong("the recorder never called self.clock(): read the clock passed to __init__ "
                    "(tests and other lessons swap it), not time.perf_counter() directly")
    if len(got) == 4 and got[0] == "compute":
        raise Wrong(f"got {got}: the span starts with the rank, (rank, lane, name, start, end), so spans of "
                    "several processes can share one timeline")
    if len(got) != 5:
        raise Wrong(f"a span has 5 fields (rank, lane, name, start, end), got {got}")
    if got[:3] != (3, "compute", "forward"):
        raise Wrong(f"got {got[:3]} for the first three fields, expected (rank, lane, name) = (3, 'compute', 'forward')")
    start, end = got[3], got[4]
    if start == end:
        raise Wrong("start == end: you read the clock twice on the same side of the `yield`. Read it "
                    "once before the yield (start) and once after (end)")
    if (start, end) != (100.0, 100.25):
        if end < start:
            raise Wrong(f"end {end} is before start {start}: store (start, end) in that order")
        raise Wrong(f"start/end are {start}/{end}, expected the clock's first two readings 100.0/100.25: "
                    "read self.clock() exactly once when the block starts and once when it ends, and keep "
                    "its value as is (seconds)")


@spans_ex.case("with the default clock, spans are in perf_counter seconds",
               hint="without a clock argument the recorder must still time in seconds, on the clock hfstream's spans"
                    " use",
        reveal="default clock=time.perf_counter; keep seconds (hfstream spans and plot_timeline use seconds)")
def _(learner):
    """Property: without a clock argument, a 20 ms block's span lies within perf_counter's reading around it, in
    seconds."""
    rec = learner.Spans()
    t0 = time.perf_counter()
    with rec.span("data", "data wait"):
        time.sleep(0.02)
    t1 = time.perf_counter()
    (rank, lane, name, start, end), = [tuple(s) for s in rec.spans]
    if end - start > 1.0:
        raise Wrong(f"a 20 ms block lasted {end - start:.1f}: keep seconds, not milliseconds (do not multiply by 1e3)")
    if not (t0 <= start <= end <= t1):
        raise Wrong("the default clock should be time.perf_counter (a monotonic clock); time.time() can jump")
    assert end - start >= 0.019, f"a 20 ms sleep gave a span of {(end - start) * 1e3:.1f} ms"
    return f"a 20 ms block measured {(end - start) * 1e3:.1f} ms"


# A drawn program of blocks: (lane, name, raises, children). A block that raises raises after its children,
# and the program catches it right outside that block, so its parent goes on.
_LANES = {"data wait": "data", "collate": "data", "forward": "compute", "backward": "compute", "optimizer": "compute",
          "step": "compute", "all-reduce": "comm", "bucket 0": "comm"}


def _draw_program(rng: random.Random, depth: int = 0) -> tuple:
    count = rng.randint(1, 3) if depth == 0 else rng.choice((0, 0, 1, 2))
    blocks = []
    for _ in range(count):
        name = rng.choice(list(_LANES))
        children = _draw_program(rng, depth + 1) if depth < 2 else ()
        blocks.append((_LANES[name], name, rng.random() < 0.3, children))
    return tuple(blocks)


def _draw_span_cases(seed: int = 11, count: int = 8) -> list[tuple]:
    """``(rank, program)`` cases: a nested block in every case after the first two, a block that raises in at least
    every other one."""
    rng = random.Random(seed)
    out = []
    while len(out) < count:
        program = _draw_program(rng)
        nested = any(children for *_, children in program)
        raises = any(_raising(program))
        k = len(out)
        if (k >= 2 and not nested) or (k % 2 == 1 and not raises):
            continue
        out.append((rng.randrange(8), program))
    return out


def _raising(program):
    for _, _, raises, children in program:
        yield raises
        yield from _raising(children)


def _describe_program(program) -> str:
    parts = []
    for lane, name, raises, children in program:
        text = f"'{name}'" + (" (raises)" if raises else "")
        if children:
            text += " holding " + _describe_program(children)
        parts.append(text)
    return "[" + ", ".join(parts) + "]"


def _smaller_programs(case):
    """A block dropped (its children moved up), or a raise taken away."""
    rank, program = case

    def variants(blocks):
        for i, (lane, name, raises, children) in enumerate(blocks):
            yield blocks[:i] + children + blocks[i + 1:]
            if raises:
                yield blocks[:i] + ((lane, name, False, children),) + blocks[i + 1:]
            for inner in variants(children):
                yield blocks[:i] + ((lane, name, raises, inner),) + blocks[i + 1:]

    if rank:
        yield (0, program)
    for v in variants(program):
        if v:
            yield (rank, v)


class _SetClock:
    """A clock the check moves itself: every read returns the time the check last set."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _play(learner, case) -> tuple[list, list, str | None]:
    """Run a drawn program on the learner's recorder; returns (the spans it recorded, the spans each block
    should have left, a note when an exception did not come out of its block)."""
    rank, program = case
    clock = _SetClock()
    rec = learner.Spans(rank=rank, clock=clock)
    want, raised, ticks = [], set(), iter(range(1, 1000))

    class Raised(Exception):
        pass

    note = None

    def run(blocks):
        nonlocal note
        for lane, name, raises, children in blocks:
            clock.now = float(next(ticks))
            start = clock.now
            try:
                with rec.span(lane, name):
                    run(children)
                    clock.now = float(next(ticks))
                    want.append((rank, lane, name, start, clock.now))
                    if raises:
                        raised.add(start)
                        raise Raised(name)
            except Raised as exc:
                if exc.args[0] != name:
                    raise
            else:
                if raises and note is None:
                    note = (f"the exception of '{name}' did not come out of its block: your recorder swallowed it "
                            f"(re-raise it; a plain try/finally does)")
            clock.now = float(next(ticks))      # time passes between blocks

    run(program)
    return [tuple(s) for s in rec.spans], want, raised, note


def _span_mistake(got: list, want: list, raised: set) -> str | None:
    """What the recorded spans get wrong against the blocks' own start and end; None when they match."""
    if sorted(got, key=repr) == sorted(want, key=repr):
        return None
    for w in want:
        if w in got:
            continue
        same = [g for g in got if len(g) == 5 and g[:3] == w[:3]]
        starts = {v[3]: v for v in want}
        ends = {v[4]: v for v in want}
        if not same:
            return (f"the block '{w[2]}' (from t={w[3]:g} to t={w[4]:g}) left no span: every block leaves one, however "
                    f"it ends" + (": it raised, and the code after your `yield` never ran; put the append in a "
                                  "`finally:`" if w[3] in raised else ""))
        g = min(same, key=lambda g: abs((g[3] or 0) - w[3]))
        if g[4] is None:
            return (f"the span of '{w[2]}' has no end (None): it was recorded when the block began and its end was "
                    f"never written" + (": the block raised, and your code after the `yield` never ran (a finally "
                                         "block runs however the block ends)" if w[3] in raised else ""))
        if g[3] != w[3] and g[3] in starts and starts[g[3]][3] > w[3]:
            inner = starts[g[3]]
            return (f"the span of '{w[2]}' starts at t={g[3]:g}, when the block '{inner[2]}' inside it began, not at "
                    f"t={w[3]:g} when it began itself: its start was kept where the nested block's start overwrote it "
                    f"(on the recorder, self): keep each block's start in a local variable of span()")
        if g[4] != w[4] and g[4] in ends and ends[g[4]] is not w:
            other = ends[g[4]]
            return (f"the span of '{w[2]}' ends at t={g[4]:g}, when the block '{other[2]}' ended, not at t={w[4]:g} "
                    f"when it ended itself: at the end of a block your code wrote into another block's record (the "
                    f"last one appended is a nested block's, not this one's): keep a reference to this block's own")
        return f"the span of '{w[2]}' is {g}, but its block ran from t={w[3]:g} to t={w[4]:g}"
    extra = [g for g in got if g not in want]
    return f"a span no block left: {extra[0]}" if extra else None


def _span_kind(message: str) -> str:
    for words in ("left no span", "has no end", "inside it began", "when the block '", "swallowed", "no block left"):
        if words in message:
            return words
    return "other"


# The lesson's two programs, before the drawn ones: a block inside another, and a block that raises.
_FIXED_PROGRAMS = [(0, (("compute", "step", False, (("compute", "forward", False, ()),)),)),
                   (0, (("compute", "backward", True, ()),))]


@spans_ex.case("nested blocks and blocks that raise: one span per block, from its own start to its own end",
               hint="each block's span starts when that block starts and ends when that block ends, however its "
                    "blocks nest and however they end",
               reveal="start = self.clock() in a local variable before the yield; try: yield; finally: "
                      "self.spans.append((self.rank, lane, name, start, self.clock()))")
def _(learner):
    """Property: on a nested block, a block that raises, and drawn programs of nested blocks (some raising, on
    drawn ranks), each block leaves exactly one span (rank, lane, name, start, end) whose start and end are the
    clock's readings when that very block began and ended, and its exception still comes out."""
    cases = _FIXED_PROGRAMS + _draw_span_cases()

    def prop(case):
        got, want, raised, note = _play(learner, case)
        why = note or _span_mistake(got, want, raised)
        return None if why is None else f"blocks {_describe_program(case[1])} on rank {case[0]}: {why}"

    found = falsify(cases, prop, smaller=_smaller_programs, kind=_span_kind)
    if found is None:
        return f"a nested block, a raising one and {len(cases) - 2} drawn programs"
    raise Wrong(str(found), reveal="start = self.clock() in a local variable before the yield; try: yield; "
                                   "finally: self.spans.append((self.rank, lane, name, start, self.clock()))")


# --------------------------------------------------------------------------- 01.phases
class _Ticks:
    """A logical clock shared by the check's recorder and its probes: every read is one tick later, so which
    span contains which phase is exact, whatever the machine's load (and nothing sleeps)."""

    def __init__(self):
        self.now = 0

    def __call__(self) -> int:
        self.now += 1
        return self.now


class _ReferenceSpans:
    """The recorder the check hands to `train_loop`, so 01.phases does not depend on 01.spans."""

    def __init__(self, clock):
        self.spans = []
        self.clock = clock

    @contextlib.contextmanager
    def span(self, lane, name):
        start = self.clock()
        try:
            yield
        finally:
            self.spans.append((0, lane, name, start, self.clock()))


class _Probe:
    """Notes when each phase really ran: (phase, start, end), on the check's logical clock."""

    def __init__(self, clock):
        self.clock = clock
        self.events = []
        self.losses = []      # every forward's loss, in the order they were computed
        self.inputs = []      # the batch value every forward saw
        self.grads = []       # the gradient each optimizer step saw

    def work(self, phase):
        t0 = self.clock()
        self.events.append((phase, t0, self.clock()))


class _SlowGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, probe):
        ctx.probe = probe
        return w.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.probe.work("backward")
        return grad, None


class _ProbeModel(nn.Module):
    def __init__(self, probe):
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))
        self.probe = probe

    def forward(self, input_ids, labels=None, **kwargs):
        self.probe.work("forward")
        self.probe.inputs.append(float(input_ids[0]))
        out = _SlowGrad.apply(self.w, self.probe)
        loss = (out * input_ids.float()).mean()
        self.probe.losses.append(float(loss.detach()))
        return SimpleNamespace(loss=loss, logits=out)


class _ProbeOptimizer(torch.optim.SGD):
    def __init__(self, params, probe):
        super().__init__(params, lr=0.1)
        self.probe = probe

    def step(self, closure=None):
        self.probe.work("optimizer")
        w = self.param_groups[0]["params"][0]
        self.probe.grads.append(None if w.grad is None else w.grad.detach().clone())
        return super().step(closure)


def _batch(value: float) -> dict:
    return {"input_ids": torch.full((4,), float(value)), "labels": torch.zeros(4)}


def _probe_batches(probe, n, values=None):
    values = values or [i + 1 for i in range(n)]
    for v in values[:n]:
        probe.work("data")
        yield _batch(v)


class _Loader:
    """A loader like a DataLoader or a list: iterable again and again, every pass from its first batch."""

    def __init__(self, probe, values):
        self.probe, self.values = probe, values

    def __iter__(self):
        return _probe_batches(self.probe, len(self.values), self.values)

    def __repr__(self) -> str:
        return f"a DataLoader of {len(self.values)} batches"


phases = Exercise("01.phases", uses=["train_loop"], title="a training loop timed phase by phase")


def _call_loop(learner, model, batches, opt, rec, steps):
    try:
        return learner.train_loop(model, batches, opt, rec, steps)
    except TypeError as e:
        if "subscriptable" in str(e) or "has no len" in str(e):
            raise Wrong(f"train_loop raised TypeError: {e}: `batches` is any iterable (a DataLoader, a generator), "
                        f"which has no [i] and no len(); take one iterator from it and call next() on it once per "
                        f"step") from None
        raise


def _run_probe(learner, steps=3, extra=2):
    clock = _Ticks()
    probe, rec = _Probe(clock), _ReferenceSpans(clock)
    model = _ProbeModel(probe)
    opt = _ProbeOptimizer(model.parameters(), probe)
    losses = _call_loop(learner, model, _probe_batches(probe, steps + extra), opt, rec, steps)
    return probe, rec, losses


def _containing(spans, t0, t1):
    return [s for s in spans if s[3] <= t0 + 1e-6 and t1 <= s[4] + 1e-6]


@phases.case("each phase runs inside the span that names it, and in no other",
             hint="each phase must run inside the span that names it, in its lane; compare your names and lanes with"
                  " the table above the exercise",
             reveal="time `batch = next(it)` as ('data', 'data wait'), the model call as ('compute', 'forward'), "
                    "loss.backward() as ('compute', 'backward'), optimizer.step() and zero_grad() as "
                    "('compute', 'optimizer')")
def _(learner):
    """Property: every data fetch, forward, backward and optimizer step runs inside the span of its own name and
    lane, and inside no span of another phase (on the check's logical clock: exact on any machine)."""
    probe, rec, _ = _run_probe(learner)
    spans = [tuple(s) for s in rec.spans]
    if not spans:
        raise Wrong("train_loop recorded no spans: wrap each phase in `with spans.span(lane, name):`")
    names = {s[2] for s in spans}
    expected = {name for _, name in PHASES}
    if not expected <= names:
        missing = sorted(expected - names)
        if missing == ["data wait"]:
            raise Wrong("no 'data wait' span: a `for batch in batches:` loop fetches in its header, outside any "
                        "span, so the fetch is never timed",
                        reveal="it = iter(batches), then time `batch = next(it)` as ('data', 'data wait')")
        raise Wrong(f"missing span name(s) {missing}; the loop recorded {sorted(names)}. Use exactly the names "
                    "'data wait', 'forward', 'backward', 'optimizer' (hfstream's StepTimeline names, which "
                    "plot_timeline colours)")
    for lane, name in PHASES:
        wrong_lane = [s for s in spans if s[2] == name and s[1] != lane]
        if wrong_lane:
            raise Wrong(f"'{name}' belongs in lane '{lane}', got lane '{wrong_lane[0][1]}'")
    for phase, t0, t1 in probe.events:
        want = "data wait" if phase == "data" else phase
        around = _containing(spans, t0, t1)
        around_names = {s[2] for s in around} & expected
        if want not in around_names:
            if around_names:
                other = sorted(around_names)[0]
                raise Wrong(f"the {phase} ran inside your '{other}' span, not inside a '{want}' span: "
                            f"close the '{other}' block before the {phase} starts")
            if phase == "data":
                raise Wrong("fetching a batch ran outside every span: `for batch in batches:` fetches in the loop "
                            "header, where no span can reach it",
                            reveal="it = iter(batches), then time `batch = next(it)` inside ('data', 'data wait')")
            raise Wrong(f"the {phase} ran outside every span: wrap it in `with spans.span(..., '{want}'):`")
        extra = sorted(around_names - {want})
        if extra:
            raise Wrong(f"the {phase} also ran inside your '{extra[0]}' span: each phase in its own block, "
                        f"so '{extra[0]}' does not include {phase} time")
    return "data, forward, backward and optimizer each timed by their own span"


_NO_GRAD = ("step {step}'s optimizer.step() found no gradient (.grad is None): the gradients were cleared between "
            "backward and the optimizer step, so the step changed nothing. Clear them after optimizer.step() (or "
            "before backward), never between the two")


@phases.case("exactly `steps` steps, one span per phase per step, losses returned",
             hint="the loop must run exactly `steps` steps, one span per phase per step, and return one loss per "
                  "step",
             reveal="loop `steps` times; fetch one batch per step; return a list of the step losses")
def _(learner):
    """Property: steps=3 runs 3 steps, each fetching one batch, running backward once, stepping the optimizer on
    that batch's own gradient (never None, never an earlier step's added to it), and its loss comes back in order."""
    probe, rec, losses = _run_probe(learner, steps=3)
    counts = {name: sum(1 for s in rec.spans if s[2] == name) for _, name in PHASES}
    steps_run = sum(1 for e in probe.events if e[0] == "optimizer")
    if steps_run != 3:
        raise Wrong(f"train_loop(..., steps=3) ran {steps_run} optimizer steps: stop after `steps`, even when "
                    "the loader has more batches")
    if any(c != 3 for c in counts.values()):
        raise Wrong(f"expected one span per phase per step (3 each), got {counts}")
    try:
        values = [float(v) for v in losses]
    except (TypeError, ValueError):
        raise Wrong(f"return the losses as a list (one per step), got {type(losses).__name__}") from None
    if len(values) != 3 or not all(math.isfinite(v) for v in values):
        raise Wrong(f"expected 3 finite losses, got {values}")
    fetched = sum(1 for e in probe.events if e[0] == "data")
    if fetched != 3:
        raise Wrong(f"3 steps fetched {fetched} batches: fetch exactly one batch per step")
    backwards = sum(1 for e in probe.events if e[0] == "backward")
    if backwards != 3:
        raise Wrong(f"3 steps ran backward {backwards} times: every step computes its gradients (loss.backward()) "
                    f"before the optimizer steps, or the optimizer steps on stale or no gradients")
    # Batch k holds k + 1 everywhere, so step k's own gradient is (k + 1) / 4 per element.
    for k, g in enumerate(probe.grads):
        own = (k + 1) / 4
        if g is None:
            raise Wrong(_NO_GRAD.format(step=k + 1))
        if not torch.allclose(g, torch.full_like(g, own)):
            raise Wrong(f"step {k + 1}'s optimizer saw a gradient of {float(g[0]):.2f} per element, its own batch "
                        f"gives {own:.2f}: the earlier steps' gradients were still in .grad (backward adds to "
                        f".grad). Clear the gradients once per step, in the optimizer phase")
    if values != probe.losses[:3] and values == probe.losses[:3][::-1]:
        raise Wrong("the losses came back last step first: return them in the order the steps ran")
    if not all(math.isclose(v, w, rel_tol=1e-6) for v, w in zip(values, probe.losses)):
        raise Wrong(f"the losses returned {values} are not the steps' losses {probe.losses[:3]}, in order")


def _draw_loaders(seed: int = 12, count: int = 6) -> list[tuple]:
    """``(kind, steps, values)``: a loader that is a list, a generator or a DataLoader-like object (every pass
    from its first batch), 1 to 4 steps, 0 to 2 batches to spare, each batch a different value."""
    rng = random.Random(seed)
    out = []
    for k in range(count):
        steps = rng.randint(2, 4) if k < 3 else rng.randint(1, 4)
        values = [float(v) for v in rng.sample(range(1, 40), steps + rng.randint(0, 2))]
        out.append((("list", "DataLoader", "generator")[k % 3], steps, values))
    return out


def _loop_mistake(learner, case) -> str | None:
    kind, steps, values = case
    clock = _Ticks()
    probe, rec = _Probe(clock), _ReferenceSpans(clock)
    model = _ProbeModel(probe)
    opt = _ProbeOptimizer(model.parameters(), probe)
    batches = ([_batch(v) for v in values] if kind == "list" else _Loader(probe, values) if kind == "DataLoader"
               else _probe_batches(probe, len(values), values))
    losses = _call_loop(learner, model, batches, opt, rec, steps)
    ran = len(probe.grads)
    if ran != steps:
        return f"{ran} optimizer steps ran, not {steps}: run exactly `steps` steps"
    for k in range(steps):
        seen = probe.inputs[k] if k < len(probe.inputs) else None
        if seen != values[k]:
            if seen == values[0] and kind != "generator":
                return (f"step {k + 1} trained on the loader's first batch again: iter(batches) was called in every "
                        f"step, and a list or a DataLoader starts over at its first batch on every iter(). Take the "
                        f"iterator once, before the loop")
            return f"step {k + 1} trained on batch {values.index(seen) + 1 if seen in values else '?'}, not batch {k + 1}"
        g = probe.grads[k]
        if g is None:
            return _NO_GRAD.format(step=k + 1)
        if not torch.allclose(g, torch.full_like(g, values[k] / 4)):
            return (f"step {k + 1}'s optimizer saw a gradient other than its own batch's: an earlier step's was "
                    f"still in .grad (backward adds to .grad). Clear the gradients once per step")
    got = [float(v) for v in losses]
    if got != probe.losses[:steps]:
        return f"the losses returned, {got}, are not the steps' losses in order"
    return None


@phases.case("drawn loaders: step k trains on batch k with its own gradient",
             hint="each step fetches the next batch of one pass over the loader, and the optimizer steps on that "
                  "batch's gradient", after="exactly `steps` steps, one span per phase per step, losses returned")
def _(learner):
    """Property: for a loader that is a list, a generator or a DataLoader (which starts over on every iter()),
    and 1 to 4 steps, step k trains on the k-th batch of one pass and steps the optimizer on its own gradient."""
    cases = _draw_loaders()
    found = falsify(cases, lambda case: (None if (why := _loop_mistake(learner, case)) is None
                                         else f"{case[0]} of {len(case[2])} batches, steps={case[1]}: {why}"),
                    smaller=lambda case: ((case[0], st, case[2][:n]) for st in range(1, case[1] + 1)
                                          for n in range(st, len(case[2]) + 1) if (st, n) != (case[1], len(case[2]))),
                    kind=lambda m: m.split(": ", 1)[-1][:40])
    if found is None:
        return f"{len(cases)} drawn loaders (lists, generators, DataLoaders)"
    raise Wrong(str(found))


# --------------------------------------------------------------------------- 01.breakdown
breakdown_ex = Exercise("01.breakdown", uses=["breakdown"], title="a per-step breakdown from spans")

# One step's spans as (name, start ms, end ms) from the step's start; gaps are real time too.
_STEP = (("data wait", 0, 10), ("forward", 11, 31), ("backward", 31, 71), ("optimizer", 72, 82))
_WANT = {"data_wait_ms": 10.0, "forward_ms": 20.0, "backward_ms": 40.0, "optimizer_ms": 10.0, "step_ms": 82.0}


def _synthetic(steps=4, warm_forward_ms=500.0, micro=1):
    """Spans of ``steps`` steps, 1 s apart; step 0 has a slow first forward (warm-up)."""
    out = []
    for k in range(steps):
        t = 10.0 + k
        shift = 0.0
        for name, a, b in _STEP:
            if name in ("forward", "backward") and micro > 1:
                # Gradient accumulation: the same phase split into `micro` pieces, back to back.
                piece = (b - a) / micro
                for m in range(micro):
                    out.append((0, "compute", name, t + (shift + a + m * piece) / 1e3,
                                t + (shift + a + (m + 1) * piece) / 1e3))
                continue
            extra = warm_forward_ms if (k == 0 and name == "forward") else 0.0
            lane = "data" if name == "data wait" else "compute"
            out.append((0, lane, name, t + (shift + a) / 1e3, t + (shift + b + extra) / 1e3))
            shift += extra
    return out


def _close(got, want, rel=1e-6):
    return all(math.isclose(got.get(k, math.nan), v, rel_tol=rel, abs_tol=1e-9) for k, v in want.items())


def _result(learner, spans, **kw):
    got = learner.breakdown(spans, **kw)
    if not isinstance(got, dict):
        raise Wrong(f"breakdown should return a dict of floats, got {type(got).__name__}")
    missing = [k for k in _WANT if k not in got]
    if missing:
        raise Wrong(f"missing key(s) {missing}: return {sorted(_WANT)} (the names of hfstream's step report)")
    return {k: float(got[k]) for k in _WANT}


@breakdown_ex.case("mean milliseconds per step after warm-up, step = first span start to last span end",
                   hint="the breakdown is per step, in milliseconds, without the warm-up steps; a step's phases add "
                        "up to its time",
        reveal="group spans into steps (a step starts at its 'data wait'), skip the first `warmup` "
                        "steps, average each phase's (end - start) * 1e3 over the kept steps")
def _(learner):
    """Property: on 4 identical steps after a slow first one, the mean ms per step of each phase after warm-up,
    and the step's wall time (gaps included)."""
    got = _result(learner, _synthetic(), warmup=1)
    if _close(got, _WANT):
        return "10 / 20 / 40 / 10 ms parts, 82 ms step"
    if _close(got, {k: v / 1e3 for k, v in _WANT.items()}):
        raise Wrong("the values are in seconds: spans hold seconds, the breakdown is in milliseconds (x 1e3)")
    if got["forward_ms"] > 100:
        raise Wrong(f"forward_ms = {got['forward_ms']:.1f}: the first step (a 500 ms warm-up forward) was counted. "
                    "Skip the first `warmup` steps: they pay one-time costs (allocation, lazy init, caches)")
    if math.isclose(got["step_ms"], 80.0, rel_tol=1e-6):
        raise Wrong("step_ms = 80 is the sum of the parts; the step's wall time also holds the gaps between "
                    "phases (82 ms here): take the last span's end minus the first span's start, per step")
    if math.isclose(got["forward_ms"], 60.0, rel_tol=1e-6) or math.isclose(got["forward_ms"], 80.0, rel_tol=1e-6):
        raise Wrong("you summed the phases over all kept steps: divide by the number of steps (a mean per step)")
    why = _breakdown_mistake(got, _synthetic(), 1)
    if why and not why.startswith("the breakdown is not"):
        raise Wrong(f"4 steps after a slow first one, warmup=1: {why}")
    raise AssertionError(f"got {({k: round(v, 3) for k, v in got.items()})}, expected {_WANT}")


@breakdown_ex.case("spans in any order; warmup=0 keeps every step",
                   hint="spans can arrive in any order, and warmup=0 keeps every step",
                   reveal="sort the spans by start time before grouping them into steps")
def _(learner):
    """Property: the breakdown does not depend on the order the spans arrive in; warmup=0 keeps every step."""
    spans = _synthetic()
    random.Random(0).shuffle(spans)
    got = _result(learner, spans, warmup=1)
    if not _close(got, _WANT):
        raise Wrong("shuffled spans gave a different breakdown: spans arrive in the order blocks *close* "
                    "(an inner span before its outer one), so sort by start time first")
    got = _result(learner, _synthetic(steps=3, warm_forward_ms=0.0), warmup=0)
    assert _close(got, _WANT), f"warmup=0 over 3 identical steps gave {got}, expected {_WANT}"
    got = _result(learner, _varied(), warmup=1)
    want = {"data_wait_ms": 30.0, "step_ms": 102.0}
    why = None if _close(got, want) else _breakdown_mistake(got, _varied(), 1)
    if why and not why.startswith("the breakdown is not"):
        raise Wrong(f"steps whose data waits take 10, 20, 30 and 40 ms (warmup=1): {why}")
    if not _close(got, want):
        raise Wrong(f"steps whose data waits take 10, 20, 30 and 40 ms (warmup=1) gave data_wait_ms = "
                    f"{got.get('data_wait_ms', math.nan):.1f} and step_ms = {got.get('step_ms', math.nan):.1f}; "
                    f"the mean over the 3 steps after the first is 30 and 102. Skip exactly `warmup` steps, and "
                    f"keep an inner span (the 'collate' inside each 'data wait') in the step it started in")


def _varied() -> list[tuple]:
    """4 steps whose data wait takes 10, 20, 30, 40 ms, each holding an inner 'collate' span, in the order
    their blocks close (the inner span first)."""
    out = []
    for k in range(4):
        t, d = 10.0 + k, 10.0 * (k + 1)
        out += [(0, "data", "collate", t + 0.001, t + (d - 1) / 1e3), (0, "data", "data wait", t, t + d / 1e3)]
        for name, a, b in (("forward", 1, 21), ("backward", 21, 61), ("optimizer", 62, 72)):
            out.append((0, "compute", name, t + (d + a) / 1e3, t + (d + b) / 1e3))
    return out


@breakdown_ex.case("several micro-steps per step (gradient accumulation) add up",
                   hint="a step can hold several spans of one phase (one per micro-step)",
                   reveal="sum each phase over a step's spans, then average over steps")
def _(learner):
    """Property: a step's phase time is the sum of its spans of that phase (micro-steps), averaged over steps."""
    got = _result(learner, _synthetic(micro=2), warmup=1)
    if _close(got, _WANT):
        return "2 micro-steps per step summed"
    if math.isclose(got["forward_ms"], 10.0, rel_tol=1e-6):
        raise Wrong("with 2 forward spans per step you averaged over spans: a step's forward time is the sum "
                    "of its forward spans; average over *steps*")
    raise AssertionError(f"got {got}, expected {_WANT}")


def _draw_runs(seed: int = 13, count: int = 6) -> list[tuple]:
    """``(warmup, micro, table)`` runs: 3 to 6 steps, 0 to 2 of them warm-up, 1 to 3 micro-steps each; ``table``
    holds each step's (data wait, forward, backward, optimizer) in whole ms, one step after warm-up far slower
    than the others (so that a median is not the mean), and a 'collate' span inside some steps' data wait."""
    rng = random.Random(seed)
    out = []
    for k in range(count):
        warmup, micro = k % 3, 1 + (k // 2) % 3
        n = warmup + rng.randint(3, 4)
        table = [[rng.randint(2, 12), rng.randint(5, 20), rng.randint(10, 40), rng.randint(2, 8)] for _ in range(n)]
        slow = rng.randrange(warmup, n)
        table[slow] = [v * rng.randint(4, 6) for v in table[slow]]
        out.append((warmup, micro, tuple(tuple(r) for r in table)))
    return out


def _spans_of(case) -> tuple[list, list[float]]:
    """A run's spans (shuffled, seconds, 1 ms gaps between phases, a 'collate' inside every other data wait),
    and each step's wall time in ms."""
    warmup, micro, table = case
    spans, walls, t = [], [], 5.0
    for k, (d, f, b, o) in enumerate(table):
        start = t
        spans.append((0, "data", "data wait", t, t + d / 1e3))
        if k % 2:
            spans.append((0, "data", "collate", t + 0.0005, t + (d - 0.5) / 1e3))
        t += (d + 1) / 1e3
        for name, ms in (("forward", f), ("backward", b)):
            for _ in range(micro):
                spans.append((0, "compute", name, t, t + ms / micro / 1e3))
                t += ms / micro / 1e3
        t += 1 / 1e3
        spans.append((0, "compute", "optimizer", t, t + o / 1e3))
        t += o / 1e3
        walls.append((t - start) * 1e3)
        t += 3 / 1e3                                # between steps: the loop's own bookkeeping
    random.Random(len(spans)).shuffle(spans)
    return spans, walls


def _step_rows(spans) -> list[list[float]]:
    """Per step (a step starts at its 'data wait'): data wait, forward, backward, optimizer, wall time, and the
    time to the next step's start (the last step: its wall time), in ms."""
    steps = []
    for sp in sorted(spans, key=lambda sp: sp[3]):
        if sp[2] == "data wait" or not steps:
            steps.append([])
        steps[-1].append(sp)
    rows = []
    for i, step in enumerate(steps):
        parts = [sum((sp[4] - sp[3]) * 1e3 for sp in step if sp[2] == name)
                 for name in ("data wait", "forward", "backward", "optimizer")]
        wall = (max(sp[4] for sp in step) - step[0][3]) * 1e3
        period = (steps[i + 1][0][3] - step[0][3]) * 1e3 if i + 1 < len(steps) else wall
        rows.append(parts + [wall, period])
    return rows


_KEYS = ("data_wait_ms", "forward_ms", "backward_ms", "optimizer_ms", "step_ms")


def _breakdown_mistake(got: dict, spans, warmup: int) -> str | None:
    """What a breakdown that is not the mean per step after warm-up did instead, when it is a known mistake;
    None when it is right; a generic sentence otherwise."""
    rows = _step_rows(spans)

    def over(kept, how=statistics.fmean, col=4):
        return {key: how(r[i if i < 4 else col] for r in kept) for i, key in enumerate(_KEYS)} if kept else None

    if _close(got, over(rows[warmup:]), rel=1e-4):
        return None
    for want, why in [
        (over(rows[warmup:], statistics.median), "you took the median over steps: the breakdown is the mean per step, "
                                                 "so a slow step counts by its whole time"),
        (over(rows[warmup:-1]), "you left out the last step: every step after the warm-up counts"),
        (over(rows[warmup + 1:]), f"you skipped {warmup + 1} steps for warmup={warmup}: skip exactly `warmup`"),
        (over(rows[warmup - 1:]) if warmup else None,
         f"you skipped {warmup - 1} steps for warmup={warmup}: skip exactly `warmup`"),
        (over(rows[warmup:], col=5), "step_ms ran to the next step's start: a step ends with its last span's end"),
    ]:
        if want is not None and _close(got, want, rel=1e-4):
            return why
    return "the breakdown is not each phase's mean ms per step over the steps after warm-up"


@breakdown_ex.case("drawn runs: the mean per step after warm-up, however the steps vary",
                   hint="the breakdown is the mean per step, over the steps after the first `warmup`; a step's phase "
                        "sums its spans of that phase; a step runs from its first span's start to its last span's end",
                   after="mean milliseconds per step after warm-up, step = first span start to last span end")
def _(learner):
    """Property: on drawn runs (3 to 6 steps, warmup 0 to 2, 1 to 3 micro-steps, one slow step so that a median is
    not the mean, inner spans, spans in any order), each key is its mean per step over the steps after warm-up."""
    cases = _draw_runs()

    def prop(case):
        spans, _ = _spans_of(case)
        got = _result(learner, spans, warmup=case[0])
        why = _breakdown_mistake(got, spans, case[0])
        table = "; ".join("/".join(str(v) for v in row) for row in case[2])
        return None if why is None else (f"{len(case[2])} steps (data/forward/backward/optimizer ms: {table}), "
                                         f"warmup={case[0]}, {case[1]} micro-step(s): {why}")

    def smaller(case):
        warmup, micro, table = case
        if micro > 1:
            yield (warmup, 1, table)
        for i in range(warmup, len(table)):          # drop a step after warm-up, keep at least two
            if len(table) - warmup > 2:
                yield (warmup, micro, table[:i] + table[i + 1:])

    found = falsify(cases, prop, smaller=smaller, kind=lambda m: m.split(": ", 2)[-1])
    if found is None:
        return f"{len(cases)} drawn runs"
    raise Wrong(str(found))
