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
import time
from types import SimpleNamespace

import torch
import torch.nn as nn

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


@spans_ex.case("nested blocks and a block that raises are both recorded",
               hint="a span must be recorded however its block ends, and nested blocks each get their own",
               reveal="wrap the yield in try/finally so the span is appended even when the block raises")
def _(learner):
    rec = learner.Spans(rank=0, clock=_FakeClock())
    with rec.span("compute", "step"):
        with rec.span("compute", "forward"):
            pass
    names = sorted(s[2] for s in rec.spans)
    if names != ["forward", "step"]:
        raise Wrong(f"nested spans gave {names}; expected both 'forward' and 'step'")
    outer = next(s for s in rec.spans if s[2] == "step")
    inner = next(s for s in rec.spans if s[2] == "forward")
    if not (outer[3] <= inner[3] and inner[4] <= outer[4]):
        raise Wrong(f"the outer span {outer} does not contain the inner {inner}")
    rec = learner.Spans(rank=0, clock=_FakeClock())
    raised = False
    try:
        with rec.span("compute", "backward"):
            raise ValueError("a phase that fails")
    except ValueError:
        raised = True
    if not raised:
        raise Wrong("the recorder swallowed the block's exception: re-raise it (a plain try/finally does)")
    if not rec.spans:
        raise Wrong("a block that raised left no span: put the append in a `finally:` so a failing phase "
                    "still shows on the timeline (the step that crashed is the one you want to see)")


@spans_ex.case("with the default clock, spans are in perf_counter seconds",
               hint="without a clock argument the recorder must still time in seconds, on the clock hfstream's spans"
                    " use",
        reveal="default clock=time.perf_counter; keep seconds (hfstream spans and plot_timeline use seconds)")
def _(learner):
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


# --------------------------------------------------------------------------- 01.phases
class _ReferenceSpans:
    """The recorder the check hands to `train_loop`, so 01.phases does not depend on 01.spans."""

    def __init__(self):
        self.spans = []

    @contextlib.contextmanager
    def span(self, lane, name):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.spans.append((0, lane, name, start, time.perf_counter()))


class _Probe:
    """Notes when each phase really ran: (phase, start, end)."""

    MS = {"data": 6, "forward": 8, "backward": 12, "optimizer": 4}

    def __init__(self):
        self.events = []
        self.losses = []      # every forward's loss, in the order they were computed
        self.grads = []       # the gradient each optimizer step saw

    def work(self, phase):
        t0 = time.perf_counter()
        time.sleep(self.MS[phase] / 1e3)
        self.events.append((phase, t0, time.perf_counter()))


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
        out = _SlowGrad.apply(self.w, self.probe)
        loss = (out * input_ids.float()).mean()
        self.probe.losses.append(float(loss))
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


def _probe_batches(probe, n):
    for i in range(n):
        probe.work("data")
        yield {"input_ids": torch.full((4,), float(i + 1)), "labels": torch.zeros(4)}


phases = Exercise("01.phases", uses=["train_loop"], title="a training loop timed phase by phase")


def _run_probe(learner, steps=3, extra=2):
    probe, rec = _Probe(), _ReferenceSpans()
    model = _ProbeModel(probe)
    opt = _ProbeOptimizer(model.parameters(), probe)
    losses = learner.train_loop(model, _probe_batches(probe, steps + extra), opt, rec, steps)
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


@phases.case("exactly `steps` steps, one span per phase per step, losses returned",
             hint="the loop must run exactly `steps` steps, one span per phase per step, and return one loss per "
                  "step",
             reveal="loop `steps` times; fetch one batch per step; return a list of the step losses")
def _(learner):
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
        if g is not None and not torch.allclose(g, torch.full_like(g, own)):
            raise Wrong(f"step {k + 1}'s optimizer saw a gradient of {float(g[0]):.2f} per element, its own batch "
                        f"gives {own:.2f}: the earlier steps' gradients were still in .grad (backward adds to "
                        f".grad). Clear the gradients once per step, in the optimizer phase")
    if values != probe.losses[:3] and values == probe.losses[:3][::-1]:
        raise Wrong("the losses came back last step first: return them in the order the steps ran")
    if not all(math.isclose(v, w, rel_tol=1e-6) for v, w in zip(values, probe.losses)):
        raise Wrong(f"the losses returned {values} are not the steps' losses {probe.losses[:3]}, in order")


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
    raise AssertionError(f"got {({k: round(v, 3) for k, v in got.items()})}, expected {_WANT}")


@breakdown_ex.case("spans in any order; warmup=0 keeps every step",
                   hint="spans can arrive in any order, and warmup=0 keeps every step",
                   reveal="sort the spans by start time before grouping them into steps")
def _(learner):
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
    got = _result(learner, _synthetic(micro=2), warmup=1)
    if _close(got, _WANT):
        return "2 micro-steps per step summed"
    if math.isclose(got["forward_ms"], 10.0, rel_tol=1e-6):
        raise Wrong("with 2 forward spans per step you averaged over spans: a step's forward time is the sum "
                    "of its forward spans; average over *steps*")
    raise AssertionError(f"got {got}, expected {_WANT}")
