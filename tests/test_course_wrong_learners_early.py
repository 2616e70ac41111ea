"""The grader's wrong learners for lessons 00-04 and 09 (issue 46): for every graded exercise, at least
three plausible wrong answers (the kinds a learner writes: an off-by-one, a hard-coded world size, a
median for a mean, a falsy value taken for a missing one, a span that exists but ends at the wrong
time, a loader that never pauses or yields None, a gradient that is None). Each was shown wrong on an
input outside the old checks (the comment above it says which), and each test asserts that the check
now fails it with a first message naming the mistake, not blaming something the learner did right.
The reference solutions pass the same cases.

Only in-process cases run here (drawn cases, thread ranks, simulated devices, canned measurements),
so the file takes seconds; the gloo and measured cases keep their own tests (test_course_lessonNN.py)."""

from __future__ import annotations

import textwrap

import pytest

from course.grading import LEARNER_PREAMBLE, Learner, check, get_exercise, run_case, run_cell


@pytest.fixture(autouse=True)
def _progress_elsewhere(tmp_path, monkeypatch):
    monkeypatch.setenv("HFSTREAM_COURSE_PROGRESS", str(tmp_path / "progress.json"))


def _changed(source: str, old: str, new: str) -> str:
    assert source.count(old) == 1, old
    return source.replace(old, new)


def _run(exercise: str, source: str, titles: list[str] | None = None) -> list:
    """The results of ``exercise``'s cases (only those whose title starts with one of ``titles``) on
    ``source``; a case whose ``after=`` failed above is skipped as in a real check."""
    ns = run_cell(LEARNER_PREAMBLE + textwrap.dedent(source))
    if titles is None:
        return list(check(exercise, namespace=ns, quiet=True))
    ex = get_exercise(exercise)
    learner, out, failed = Learner(ns, ex), [], {}
    for case in ex.cases:
        if not any(case.title.startswith(t) for t in titles):
            continue
        above = next((t for t in failed if t in case.after), None)
        r = run_case(ex, case, learner, 0, above, failed.get(above, ""))
        if not r.passed:
            failed[case.title] = r.message
        out.append(r)
    return out


def _first(exercise: str, source: str, titles: list[str] | None = None) -> str:
    results = _run(exercise, source, titles)
    failing = [r for r in results if not r.passed]
    assert failing, f"{exercise}: the wrong answer passed every case"
    return failing[0].message


def _passes(exercise: str, source: str, titles: list[str] | None = None) -> None:
    results = _run(exercise, source, titles)
    assert results and all(r.passed for r in results), [(r.case, r.message) for r in results if not r.passed]


# (exercise, id, source, words the first message holds, words it must not hold, the cases to run)
WRONG: list[tuple] = []
RIGHT: dict[str, tuple[str, list[str] | None]] = {}


def wrong(exercise, name, source, says, not_says=(), titles=None):
    WRONG.append(pytest.param(exercise, source, says, not_says, titles, id=f"{exercise}:{name}"))


# =============================================================================================== 00.real_apis
API_RIGHT = """
import importlib, dataclasses
def api_exists(spec):
    if spec.startswith("torchrun "):
        from torch.distributed.run import get_args_parser
        flag = spec.split(maxsplit=1)[1]
        return any(flag in a.option_strings for a in get_args_parser()._actions)
    parts = spec.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if hasattr(obj, attr):
                obj = getattr(obj, attr)
            elif dataclasses.is_dataclass(obj) and attr in {f.name for f in dataclasses.fields(obj)}:
                obj = None
            else:
                return False
        return True
    return False
CLAIMS = ["torch.Stream", "torch.distributed.stream"]
is_real = {c: api_exists(c) for c in CLAIMS}
"""
RIGHT["00.real_apis"] = (API_RIGHT, None)
# getattr(obj, attr, None) and "None means missing": torch.version.hip (None on a CPU or CUDA build) and
# nn.Module.dump_patches (False) exist. The old check's names all had truthy values.
wrong("00.real_apis", "falsy_value_taken_for_missing", _changed(API_RIGHT, """            if hasattr(obj, attr):
                obj = getattr(obj, attr)
            elif""", """            if getattr(obj, attr, None) is not None:
                obj = getattr(obj, attr)
            elif"""), ["exists: its value is", "hasattr"], ["module"])
# vars(obj): only what a class defines itself; torch.Tensor.record_stream lives on TensorBase. The old check
# failed it, blaming the split into module and attributes ("Which of its parts is a module").
wrong("00.real_apis", "own_vars_only", _changed(API_RIGHT, """            if hasattr(obj, attr):
                obj = getattr(obj, attr)""", """            if attr in vars(obj):
                obj = vars(obj)[attr]"""), ["inherits it from", "vars()"], ["Which of its parts is a module"])
# torchrun flags compared with each action's dest: `--training-script` (a positional argument) is taken for a
# flag and `-r` is missed. The old check's flags all had a dest of the same name.
wrong("00.real_apis", "torchrun_dest_not_option_strings", _changed(
    API_RIGHT, "return any(flag in a.option_strings for a in get_args_parser()._actions)",
    "return any(a.dest == flag.lstrip('-').replace('-', '_') for a in get_args_parser()._actions)"),
    ["positional arguments", "option strings"])
# A class's own __annotations__: Seq2SeqTrainingArguments inherits include_for_metrics (a factory default)
# from TrainingArguments. The old check asked TrainingArguments only.
wrong("00.real_apis", "fields_from_own_annotations", _changed(
    API_RIGHT, "attr in {f.name for f in dataclasses.fields(obj)}", "attr in obj.__annotations__"),
    ["inherits it from TrainingArguments", "dataclasses.fields()"])

# =============================================================================================== 00.ceiling
CEILING = """
def ceiling_ms(data_wait_ms, forward_ms, backward_ms, comm_busy_ms, optimizer_ms):
    return forward_ms + max(backward_ms, comm_busy_ms) + optimizer_ms

def efficiency(step_ms, data_wait_ms, forward_ms, backward_ms, comm_busy_ms, optimizer_ms):
    return ceiling_ms(data_wait_ms, forward_ms, backward_ms, comm_busy_ms, optimizer_ms) / step_ms
"""
RIGHT["00.ceiling"] = (CEILING, None)
# The data-bound step's formula in the ceiling: right while the data wait is short, as in every old case.
wrong("00.ceiling", "data_wait_sets_the_ceiling", _changed(
    CEILING, "return forward_ms + max(backward_ms, comm_busy_ms) + optimizer_ms",
    "return max(data_wait_ms, forward_ms + max(backward_ms, comm_busy_ms) + optimizer_ms)"),
    ["data wait longer than the step set the ceiling"])
# The optimizer overlapped with the link: right whenever comm is shorter than backward; the old check failed
# it with "returned 45, expected 48".
wrong("00.ceiling", "optimizer_beside_the_link", _changed(
    CEILING, "return forward_ms + max(backward_ms, comm_busy_ms) + optimizer_ms",
    "return forward_ms + max(backward_ms + optimizer_ms, comm_busy_ms)"),
    ["optimizer run while the link still reduces"])
# Efficiency as the compute's share of the step: equal to the right one whenever comm < backward (the old
# check's only efficiency case).
wrong("00.ceiling", "efficiency_as_compute_share", _changed(
    CEILING, "return ceiling_ms(data_wait_ms, forward_ms, backward_ms, comm_busy_ms, optimizer_ms) / step_ms",
    "return (forward_ms + backward_ms + optimizer_ms) / step_ms"), ["divided the compute"])
# ceiling_ms called with the parts in another order: on the old case it happened to give the same 33 ms.
wrong("00.ceiling", "efficiency_parts_shifted", _changed(
    CEILING, "return ceiling_ms(data_wait_ms, forward_ms, backward_ms, comm_busy_ms, optimizer_ms) / step_ms",
    "return ceiling_ms(forward_ms, backward_ms, comm_busy_ms, optimizer_ms, data_wait_ms) / step_ms"),
    ["in another order"])

# =============================================================================================== 00.predict
PREDICT = """
def predict_step_ms(schedule, data_ms, forward_ms, backward_ms, comm_ms, optimizer_ms):
    if schedule == "serial":
        return data_ms + forward_ms + backward_ms + comm_ms + optimizer_ms
    if schedule == "prefetch":
        return max(data_ms, forward_ms + backward_ms + comm_ms + optimizer_ms)
    if schedule == "overlap":
        return data_ms + forward_ms + max(backward_ms, comm_ms) + optimizer_ms
    return max(data_ms, forward_ms + max(backward_ms, comm_ms) + optimizer_ms)
"""
OVERLAPPED = "    return max(data_ms, forward_ms + max(backward_ms, comm_ms) + optimizer_ms)"
RIGHT["00.predict"] = (PREDICT, None)
# The optimizer after the wait for data: off by the optimizer (a few ms) only when data-bound, inside the
# measured tolerance.
wrong("00.predict", "optimizer_after_the_data", _changed(
    PREDICT, OVERLAPPED, "    return max(data_ms, forward_ms + max(backward_ms, comm_ms)) + optimizer_ms"),
    ["optimizer after the wait for data"])
# The exposed reduction after the data: wrong only when data-bound and comm > backward, a pair no measured
# scenario has.
wrong("00.predict", "exposed_comm_after_the_data", _changed(
    PREDICT, OVERLAPPED, "    return max(data_ms, forward_ms + backward_ms + optimizer_ms) + max(0, comm_ms - backward_ms)"),
    ["exposed part after the wait for data"])
# The reduction timed from the step's start, as if it ran beside forward too: the old check failed it in the
# comm-bound scenario with the bare numbers ("you predicted 60 ms, the step measured 85 ms").
wrong("00.predict", "reduction_from_the_step_start", _changed(
    PREDICT, OVERLAPPED, "    return max(data_ms, forward_ms + backward_ms + optimizer_ms, comm_ms)"),
    ["starts with backward"])


# =============================================================================================== 01.spans
SPANS = """
class Spans:
    def __init__(self, rank=0, clock=time.perf_counter):
        self.rank = rank
        self.clock = clock
        self.spans = []

    @contextlib.contextmanager
    def span(self, lane, name):
        start = self.clock()
        try:
            yield
        finally:
            self.spans.append((self.rank, lane, name, start, self.clock()))
"""
RIGHT["01.spans"] = (SPANS, None)
# The start kept on the recorder: a nested block overwrites it, so the outer span starts when the inner one
# did. The old nested case only asked that the outer span contain the inner one, which it still does.
wrong("01.spans", "start_kept_on_self", _changed(SPANS, """        start = self.clock()
        try:
            yield
        finally:
            self.spans.append((self.rank, lane, name, start, self.clock()))""", """        self.start = self.clock()
        try:
            yield
        finally:
            self.spans.append((self.rank, lane, name, self.start, self.clock()))"""), ["inside it began", "local"])
# Recorded when the block begins, its end written into the last record appended: a nested block's record.
# The old check crashed on the None end ("TypeError: '<=' not supported").
wrong("01.spans", "end_written_into_the_last_record", _changed(SPANS, """        start = self.clock()
        try:
            yield
        finally:
            self.spans.append((self.rank, lane, name, start, self.clock()))""", """        self.spans.append([self.rank, lane, name, self.clock(), None])
        try:
            yield
        finally:
            self.spans[-1][4] = self.clock()"""), ["another block's record"], ["TypeError"])
# Recorded when the block begins and ended after the yield, without a finally: a block that raises leaves a span
# with no end. The old check only asked that a span exist.
wrong("01.spans", "no_end_when_the_block_raises", _changed(SPANS, """        start = self.clock()
        try:
            yield
        finally:
            self.spans.append((self.rank, lane, name, start, self.clock()))""", """        record = [self.rank, lane, name, self.clock(), None]
        self.spans.append(record)
        yield
        record[4] = self.clock()"""), ["has no end", "finally"])

# =============================================================================================== 01.phases
LOOP = """
def train_loop(model, batches, optimizer, spans, steps):
    it = iter(batches)
    losses = []
    for _ in range(steps):
        with spans.span("data", "data wait"):
            batch = next(it)
        with spans.span("compute", "forward"):
            loss = model(**batch).loss
        with spans.span("compute", "backward"):
            loss.backward()
        with spans.span("compute", "optimizer"):
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
    return losses
"""
RIGHT["01.phases"] = (LOOP, None)
# iter(batches) in every step: a generator (the old check's only loader) goes on, a list or a DataLoader starts
# over and every step trains on the first batch.
wrong("01.phases", "iter_in_every_step", _changed(_changed(LOOP, "    it = iter(batches)\n", ""),
                                                  "batch = next(it)", "batch = next(iter(batches))"),
      ["first batch again", "iter(batches) was called in every step"])
# The gradients cleared before the optimizer step: it steps on None and changes nothing. The old check skipped a
# None gradient.
wrong("01.phases", "zero_grad_before_step", _changed(LOOP, """            optimizer.step()
            optimizer.zero_grad()""", """            optimizer.zero_grad()
            optimizer.step()"""), ["found no gradient", "between"])
# The loader indexed like a list: right for a list, a TypeError on any other iterable; the old check reported
# the crash with the span hint ("each phase must run inside the span that names it").
wrong("01.phases", "loader_indexed", _changed(_changed(LOOP, "    it = iter(batches)\n", ""),
                                              "    for _ in range(steps):", "    for i in range(steps):").replace(
    "batch = next(it)", "batch = batches[i]"), ["any iterable", "no [i]"], ["inside the span that names it"])

# =============================================================================================== 01.breakdown
BREAKDOWN = """
def breakdown(spans, warmup=1):
    steps = []
    for s in sorted(spans, key=lambda s: s[3]):
        if s[2] == "data wait" or not steps:
            steps.append([])
        steps[-1].append(s)
    kept = steps[warmup:] or steps
    out = {}
    for name, key in (("data wait", "data_wait_ms"), ("forward", "forward_ms"),
                      ("backward", "backward_ms"), ("optimizer", "optimizer_ms")):
        out[key] = sum((s[4] - s[3]) * 1e3 for step in kept for s in step if s[2] == name) / len(kept)
    out["step_ms"] = sum((max(s[4] for s in step) - step[0][3]) * 1e3 for step in kept) / len(kept)
    return out
"""
RIGHT["01.breakdown"] = (BREAKDOWN, None)
# The median over steps: the old check's varied steps (20, 30, 40 ms after warm-up) have median = mean.
wrong("01.breakdown", "median_over_steps", """
import statistics
def breakdown(spans, warmup=1):
    steps = []
    for s in sorted(spans, key=lambda s: s[3]):
        if s[2] == "data wait" or not steps:
            steps.append([])
        steps[-1].append(s)
    kept = steps[warmup:] or steps
    out = {}
    for name, key in (("data wait", "data_wait_ms"), ("forward", "forward_ms"),
                      ("backward", "backward_ms"), ("optimizer", "optimizer_ms")):
        out[key] = statistics.median(sum((s[4] - s[3]) * 1e3 for s in step if s[2] == name) for step in kept)
    out["step_ms"] = statistics.median((max(s[4] for s in step) - step[0][3]) * 1e3 for step in kept)
    return out
""", ["median"])
# The last step dropped as "maybe unfinished": the old check said "Skip exactly `warmup` steps", which this
# learner did.
wrong("01.breakdown", "last_step_dropped", _changed(BREAKDOWN, "kept = steps[warmup:] or steps",
                                                    "kept = steps[warmup:-1] or steps"),
      ["left out the last step"], ["Skip exactly"])
# The step as the time to the next step's start: on the old check's steps 1 s apart the generic "got {...},
# expected {...}".
wrong("01.breakdown", "step_to_the_next_start", _changed(
    BREAKDOWN, 'out["step_ms"] = sum((max(s[4] for s in step) - step[0][3]) * 1e3 for step in kept) / len(kept)',
    'starts = [step[0][3] for step in steps] + [max(s[4] for s in steps[-1])]\n'
    '    out["step_ms"] = sum((starts[i + 1] - starts[i]) * 1e3 for i in range(len(steps) - len(kept), len(steps))) '
    '/ len(kept)'), ["next step's start"])


# =============================================================================================== 02.order
ORDER = """
def start_copy(sim, side, host):
    with side:
        x = sim.copy_in(host)
    ready = sim.Event()
    ready.record(side)
    return x, ready


def consume(sim, compute, x, ready):
    ready.wait(compute)
    return sim.compute("step", x)


def prefetch_loop(sim, host_batches, start=None, use=None):
    start, use = start or start_copy, use or consume
    compute = sim.current_stream()
    side = sim.Stream("copy")
    outs, nxt = [], start(sim, side, host_batches[0])
    for i in range(len(host_batches)):
        cur = nxt
        if i + 1 < len(host_batches):
            nxt = start(sim, side, host_batches[i + 1])
        outs.append(use(sim, compute, *cur))
    return outs
"""
RIGHT["02.order"] = (ORDER, None)
# The copy left on the current (compute) stream: no race, no overlap; the old check blamed the ordering ("the
# ordering must be between the streams, not done by the host").
wrong("02.order", "copy_on_the_compute_stream", _changed(ORDER, """    with side:
        x = sim.copy_in(host)""", """    x = sim.copy_in(host)"""), ["copies ran on the compute stream"], ["not done by the host"])
# The host polls the event until the copy is done: the old simulator's query() never moved the host clock, so the
# check hung until its 120 s timeout.
wrong("02.order", "host_polls_the_event", _changed(ORDER, "    ready.wait(compute)\n",
                                                   "    while not ready.query():\n        pass\n"),
      ["polled the event", "host wait"])
# The wait queued after the step: the old message told the learner to do what they did ("record an Event ...
# and wait on it from the compute stream").
wrong("02.order", "wait_after_the_step", _changed(ORDER, """    ready.wait(compute)
    return sim.compute("step", x)""", """    y = sim.compute("step", x)
    ready.wait(compute)
    return y"""), ["only after the step was queued"])

# =============================================================================================== 02.lifetime
LIFETIME = """
def reduce_buckets(sim, comm, grads):
    compute = sim.current_stream()
    for g in grads:
        bucket = sim.compute("pack", g)
        comm.wait_stream(compute)
        with comm:
            sim.kernel("all-reduce", reads=[bucket], writes=[bucket])
            sim.kernel("unpack", reads=[bucket], writes=[g])
        bucket.record_stream(comm)
        bucket.free()
    done = sim.Event()
    done.record(comm)
    return done
"""
RIGHT["02.lifetime"] = (LIFETIME, None)
# One wait, before the first bucket: the old message said "nothing made the comm stream wait".
wrong("02.lifetime", "one_wait_for_every_bucket", _changed(
    LIFETIME, "        comm.wait_stream(compute)\n", "        if g is grads[0]:\n            comm.wait_stream(compute)\n"),
    ["needs its own wait"], ["nothing made the comm stream wait"])
# The wait queued inside `with comm:` after the all-reduce: same old message.
wrong("02.lifetime", "wait_after_the_all_reduce", _changed(_changed(
    LIFETIME, "        comm.wait_stream(compute)\n", ""),
    '            sim.kernel("all-reduce", reads=[bucket], writes=[bucket])\n',
    '            sim.kernel("all-reduce", reads=[bucket], writes=[bucket])\n            comm.wait_stream(compute)\n'),
    ["only after the all-reduce"], ["nothing made the comm stream wait"])
# The returned event recorded on the current (compute) stream after the loop: the old message told the learner
# to record it at the end, which they did.
wrong("02.lifetime", "event_on_the_compute_stream", _changed(LIFETIME, "    done.record(comm)", "    done.record()"),
      ["recorded on the compute stream"])


# =============================================================================================== 03.data_wait
DATA_WAIT = """
def timed_epoch(batches, step, max_steps=None):
    waits, steps = [], []
    it = iter(batches)
    while max_steps is None or len(steps) < max_steps:
        t0 = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            break
        t1 = time.perf_counter()
        step(batch)
        t2 = time.perf_counter()
        waits.append((t1 - t0) * 1e3)
        steps.append((t2 - t0) * 1e3)
    return {"data_wait_ms": waits, "step_ms": steps}


def expected_step_ms(collate_ms, compute_ms, depth):
    if depth == 0:
        return collate_ms + compute_ms
    return max(collate_ms, compute_ms)
"""
RIGHT["03.data_wait"] = (DATA_WAIT, None)
# next(it, None) as the end: a loader that yields None (a step with no input, a filtered sample) ends the epoch.
# The old check's loaders yielded 0, 1, 2, 3.
wrong("03.data_wait", "none_ends_the_epoch", _changed(DATA_WAIT, """        try:
            batch = next(it)
        except StopIteration:
            break""", """        batch = next(it, None)
        if batch is None:
            break"""), ["which is None", "StopIteration"])
# `if max_steps and ...`: max_steps=0 is falsy and runs the whole loader. The old check tried max_steps=3 only.
wrong("03.data_wait", "max_steps_zero_runs_everything", _changed(
    DATA_WAIT, "    while max_steps is None or len(steps) < max_steps:",
    "    while not max_steps or len(steps) < max_steps:"), ["max_steps=0", "is None"])
# The count checked after next(): one batch taken from the loader and dropped. The old check's loader was a list.
wrong("03.data_wait", "a_batch_taken_past_the_last_step", _changed(_changed(
    DATA_WAIT, "    while max_steps is None or len(steps) < max_steps:", "    while True:"), """            break
        t1 = time.perf_counter()""", """            break
        if max_steps is not None and len(steps) >= max_steps:
            break
        t1 = time.perf_counter()"""), ["took a batch after the last step"])
# A deeper queue taken to divide the collate: the old check failed it with the bare numbers.
wrong("03.data_wait", "depth_divides_the_collate", _changed(
    DATA_WAIT, "    return max(collate_ms, compute_ms)", "    return max(collate_ms / depth, compute_ms)"),
      ["one thread collates one batch at a time"])

# =============================================================================================== 03.prefetcher
PREFETCH = """
def prefetch(iterable, depth=2):
    q = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item):
        while not stop.is_set():
            try:
                q.put(item, timeout=0.05)
                return True
            except queue.Full:
                pass
        return False

    def produce():
        try:
            for item in iterable:
                if not put(("batch", item)):
                    return
        except BaseException as exc:
            put(("error", exc))
            return
        put(("end", None))

    thread = threading.Thread(target=produce, name="prefetch", daemon=True)
    thread.start()
    try:
        while True:
            kind, payload = q.get()
            if kind == "end":
                return
            if kind == "error":
                raise payload
            yield payload
    finally:
        stop.set()
        thread.join()
"""
RIGHT["03.prefetcher"] = (PREFETCH, None)
# None as the end marker (the lesson warns against it): the old check's loaders never yielded None.
wrong("03.prefetcher", "none_as_the_end_marker", _changed(_changed(_changed(
    PREFETCH, 'if not put(("batch", item)):', "if not put(item):"), 'put(("end", None))', "put(None)"),
    """            kind, payload = q.get()
            if kind == "end":
                return
            if kind == "error":
                raise payload
            yield payload""", """            item = q.get()
            if item is None:
                return
            if isinstance(item, tuple) and item and item[0] == "error":
                raise item[1]
            yield item"""), ["which is None", "end marker"])
# get(timeout=0.5) and queue.Empty taken for the end: an epoch ends at the loader's first slow batch. The old
# check's loaders never paused.
wrong("03.prefetcher", "empty_queue_taken_for_the_end", _changed(PREFETCH, """            kind, payload = q.get()""",
                                                               """            try:
                kind, payload = q.get(timeout=0.5)
            except queue.Empty:
                return"""), ["still preparing batch", "not the end"])
# join(timeout=0.05) in the finally: the thread, still inside a slow loader's next(), runs on after the loop has
# moved on. The old check stopped the loop only on loaders that never paused.
wrong("03.prefetcher", "join_with_a_timeout", _changed(PREFETCH, "        thread.join()", "        thread.join(timeout=0.05)"),
      ["while the loader pauses", "still running"])

# =============================================================================================== 03.depth
DEPTH = """
def longest_wait_ms(worst_collate_ms, compute_ms, depth):
    if depth == 0:
        return worst_collate_ms
    return max(0.0, worst_collate_ms - (depth + 1) * compute_ms)


def depth_needed(worst_collate_ms, compute_ms):
    return max(1, math.ceil(worst_collate_ms / compute_ms) - 1)
"""
RIGHT["03.depth"] = (DEPTH, None)
# `>` where `>=` belongs: one too deep exactly when the slow batch is a whole number of steps; the old check said
# "the batch in the thread's hand counts too", which this learner counted.
wrong("03.depth", "strict_at_the_boundary", _changed(DEPTH, "    return max(1, math.ceil(worst_collate_ms / compute_ms) - 1)",
                                                     """    depth = 1
    while (depth + 1) * compute_ms <= worst_collate_ms:
        depth += 1
    return depth"""), ["which is no wait", ">="], ["in the thread's hand"])
# A search over depths 1 to 9: right for every old case (the deepest answer there was 8).
wrong("03.depth", "search_stops_at_nine", _changed(DEPTH, "    return max(1, math.ceil(worst_collate_ms / compute_ms) - 1)",
                                                   """    for depth in range(1, 10):
        if longest_wait_ms(worst_collate_ms, compute_ms, depth) == 0:
            return depth"""), ["past the depths you searched"])
# A search from depth 0: with no slow batch at all it answers 0, "no prefetcher".
wrong("03.depth", "search_from_depth_zero", _changed(DEPTH, "    return max(1, math.ceil(worst_collate_ms / compute_ms) - 1)",
                                                     """    depth = 0
    while longest_wait_ms(worst_collate_ms, compute_ms, depth) > 0:
        depth += 1
    return depth"""), ["smallest depth >= 1 is 1"])


# =============================================================================================== 04 (thread ranks)
AVERAGE = """
def broadcast_parameters(model):
    for p in model.parameters():
        dist.broadcast(p.data, src=0)


def average_gradients(model):
    world_size = dist.get_world_size()
    for p in model.parameters():
        if p.grad is None:
            continue
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
        p.grad /= world_size
"""
DRAWN = ["drawn worlds"]           # the thread-rank cases; the gloo ones run in test_course_lesson04.py
RIGHT["04.average_gradients"] = (AVERAGE, DRAWN)
# The world size written as 2: right on the old check's 2 gloo processes.
wrong("04.average_gradients", "divided_by_two", _changed(AVERAGE, "        p.grad /= world_size", "        p.grad /= 2"),
      ["divided by 2", "dist.get_world_size()"], titles=DRAWN)
# requires_grad asked instead of the gradient: a parameter no forward used has requires_grad=True and .grad None.
# The old check's only gradient-less parameter was frozen.
wrong("04.average_gradients", "requires_grad_for_a_gradient", _changed(
    AVERAGE, "        if p.grad is None:\n            continue", "        if not p.requires_grad:\n            continue"),
    ["no gradient", "test the gradient, not requires_grad"], titles=DRAWN)
# The division dedented out of the loop: only the last parameter is averaged. The old check said "rank 0's
# gradients differ from the mean over ranks by 0.7".
wrong("04.average_gradients", "division_after_the_loop", _changed(
    AVERAGE, "        p.grad /= world_size", "    p.grad /= world_size"), ["after the loop", "last parameter"],
    titles=DRAWN)

TRAIN = AVERAGE + """

def sgd_step(model, lr):
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= lr * p.grad


def train_data_parallel(model, x, y, steps, lr):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    x_shard, y_shard = x.chunk(world_size)[rank], y.chunk(world_size)[rank]
    broadcast_parameters(model)
    losses = []
    for _ in range(steps):
        model.zero_grad()
        loss = F.mse_loss(model(x_shard), y_shard)
        loss.backward()
        average_gradients(model)
        sgd_step(model, lr)
        losses.append(loss.item())
    return losses
"""
RIGHT["04.train_parity"] = (TRAIN, DRAWN)
# Two shards, whatever the world size: right on 2 gloo processes; rank 2 of 3 has none.
wrong("04.train_parity", "two_shards", _changed(
    TRAIN, "x.chunk(world_size)[rank], y.chunk(world_size)[rank]", "x.chunk(2)[rank], y.chunk(2)[rank]"),
    ["no shard for rank 2", "world_size pieces"], titles=DRAWN)
# The learning rate scaled by the world size ("linear scaling"): the old check said "the gradients were summed
# over the ranks", which this learner's average_gradients did not do.
wrong("04.train_parity", "learning_rate_times_world", _changed(TRAIN, "        sgd_step(model, lr)",
                                                               "        sgd_step(model, lr * world_size)"),
      ["learning rate", "do not scale"], ["summed"], titles=DRAWN)
# The loss divided by the world size before backward, and the average on top: steps N times too small. The old
# check gave the bare distance to the reference.
wrong("04.train_parity", "divided_twice", _changed(TRAIN, "        loss.backward()", "        (loss / world_size).backward()"),
      ["divided by the world size twice"], titles=DRAWN)


# =============================================================================================== 09.scaling
SCALING = """
def ring_allreduce_ms(nbytes, world_size, link_gbs, latency_us):
    if world_size <= 1:
        return 0.0
    n = world_size
    return 2 * (n - 1) / n * nbytes / (link_gbs * 1e9) * 1e3 + 2 * (n - 1) * latency_us * 1e-3


def predict_step(world_size, forward_ms, backward_ms, optimizer_ms, bucket_bytes, link_gbs, latency_us):
    busy = sum(ring_allreduce_ms(b, world_size, link_gbs, latency_us) for b in bucket_bytes)
    return {"comm_busy_ms": busy,
            "step_serial_ms": forward_ms + backward_ms + busy + optimizer_ms,
            "ideal_ms": forward_ms + max(backward_ms, busy) + optimizer_ms}
"""
RIGHT["09.scaling"] = (SCALING, None)
# 2N latencies instead of 2(N-1): the old check gave the bare numbers ("returned 1.0585, the planner says 1.0485").
wrong("09.scaling", "latency_two_n", _changed(SCALING, "+ 2 * (n - 1) * latency_us * 1e-3", "+ 2 * n * latency_us * 1e-3"),
      ["2(N-1) steps, not 2N"])
# An integer division in the ring factor: right at N = 2, the old check's other sizes gave the bare numbers.
wrong("09.scaling", "integer_ring_factor", _changed(SCALING, "return 2 * (n - 1) / n * nbytes", "return 2 * (n - 1) // n * nbytes"),
      ["integer division", "cross the link in a reduce-scatter and again"])
# The planner's default link written into predict_step: the old check only ever passed 25 GB/s and 5 us.
wrong("09.scaling", "default_link_hard_coded", _changed(
    SCALING, "busy = sum(ring_allreduce_ms(b, world_size, link_gbs, latency_us) for b in bucket_bytes)",
    "busy = sum(ring_allreduce_ms(b, world_size, 25.0, 5.0) for b in bucket_bytes)"), ["default link", "passed in"])

# =============================================================================================== 09.crossover
CROSSOVER = SCALING + """

def crossover_world_size(backward_ms, bucket_bytes, link_gbs, latency_us, max_world_size=2**40):
    def busy(n):
        return sum(ring_allreduce_ms(b, n, link_gbs, latency_us) for b in bucket_bytes)

    if busy(max_world_size) <= backward_ms:
        return None
    lo, hi = 1, max_world_size
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if busy(mid) <= backward_ms else (lo, mid)
    return hi


def min_link_gbs(world_size, backward_ms, bucket_bytes, latency_us):
    n = world_size
    if n <= 1:
        return 0.0
    left_ms = backward_ms - 2 * (n - 1) * latency_us * 1e-3 * len(bucket_bytes)
    if left_ms <= 0:
        return math.inf
    return 2 * (n - 1) / n * sum(bucket_bytes) / (left_ms / 1e3) / 1e9
"""
RIGHT["09.crossover"] = (CROSSOVER, None)
# The bisection started at N = 2 ("one device has nothing to reduce"): when N = 2 already exceeds, it answers 3.
# The old check's crossovers were at 5, 687 and 1694.
wrong("09.crossover", "search_from_two", _changed(CROSSOVER, "    lo, hi = 1, max_world_size", "    lo, hi = 2, max_world_size"),
      ["never tried N = 2"])
# Doubling to find an upper end, then bisecting: the doubling overshoots max_world_size and gives up. The old
# check's max_world_size was 2**40, 8 or 4, powers of two the doubling lands on.
wrong("09.crossover", "doubling_past_the_limit", _changed(CROSSOVER, """    if busy(max_world_size) <= backward_ms:
        return None
    lo, hi = 1, max_world_size""", """    hi = 1
    while busy(hi) <= backward_ms:
        hi *= 2
        if hi > max_world_size:
            return None
    lo = hi // 2"""), ["at N = max_world_size itself"])
# The latency paid once for all the buckets: the old check's 8b model had buckets enough that the numbers said
# only "it should just fit".
wrong("09.crossover", "latency_paid_once", _changed(
    CROSSOVER, "    left_ms = backward_ms - 2 * (n - 1) * latency_us * 1e-3 * len(bucket_bytes)",
    "    left_ms = backward_ms - 2 * (n - 1) * latency_us * 1e-3"), ["paid the latency terms once"])

# =============================================================================================== 09.final_challenge
SCHEDULE = SCALING + """

def overlap_step_ms(buckets, forward_ms, backward_ms, optimizer_ms, world_size, link_gbs, latency_us):
    end = 0.0
    for nbytes, ready in buckets:
        end = max(ready * backward_ms, end) + ring_allreduce_ms(nbytes, world_size, link_gbs, latency_us)
    return forward_ms + max(backward_ms, end) + optimizer_ms


def final_run_config():
    return {"grad_sync": "overlap", "bucket_mb": 0.125, "prefetch_depth": 2}
"""
SCHEDULE_CASES = ["your overlapped step", "the configuration is one"]      # not the measured 2-rank run
RIGHT["09.final_challenge"] = (SCHEDULE, SCHEDULE_CASES)
LOOP = """    end = 0.0
    for nbytes, ready in buckets:
        end = max(ready * backward_ms, end) + ring_allreduce_ms(nbytes, world_size, link_gbs, latency_us)"""
# The link started with the first bucket and never idle: right whenever the link is the bottleneck, as on every
# old case but one.
wrong("09.final_challenge", "link_never_idles", _changed(SCHEDULE, LOOP, """    end = buckets[0][1] * backward_ms
    for nbytes, ready in buckets:
        end += ring_allreduce_ms(nbytes, world_size, link_gbs, latency_us)"""), ["link waits for it"],
      titles=SCHEDULE_CASES)
# The last bucket timed alone, from its ready time.
wrong("09.final_challenge", "last_bucket_alone", _changed(SCHEDULE, LOOP, """    nbytes, ready = buckets[-1]
    end = ready * backward_ms + ring_allreduce_ms(nbytes, world_size, link_gbs, latency_us)"""),
      ["last bucket alone"], titles=SCHEDULE_CASES)
# The ready fraction taken of forward + backward (the step's clock): every bucket starts late by r x forward.
wrong("09.final_challenge", "ready_of_the_whole_step", _changed(
    SCHEDULE, "end = max(ready * backward_ms, end)", "end = max(ready * (forward_ms + backward_ms), end)"),
      ["ready fraction is of backward alone"], titles=SCHEDULE_CASES)


@pytest.fixture
def quiet_machine(monkeypatch):
    """00.predict's measured cases on a canned measurement: every step exactly as the schedules say."""
    from course.checks import lesson00

    f, b, o = 20.0, 30.0, 5.0
    scenarios = {}
    for name, (schedule, data_share, comm_share) in lesson00.SCENARIOS.items():
        d, c = data_share * (f + b + o), comm_share * b
        step = lesson00._right(schedule, d, f, b, c, o)
        steps = [{"forward_ms": f, "backward_ms": b, "optimizer_ms": o, "step_ms": step}] * 6
        scenarios[name] = {"schedule": schedule, "data_ms": d, "comm_ms": c, "steps": steps, "step_ms": step}
    monkeypatch.setattr(lesson00, "LAST_SCHEDULES", {"scenarios": scenarios})
    monkeypatch.setattr(lesson00, "_remeasure", lambda name: scenarios[name])


# =============================================================================================== the tests
def test_every_graded_exercise_of_lessons_00_to_04_and_09_has_three_wrong_learners():
    from collections import Counter

    counts = Counter(p.values[0] for p in WRONG)
    for exercise in RIGHT:
        assert counts[exercise] >= 3, (exercise, counts[exercise])


@pytest.mark.parametrize("lesson", ["00", "01", "02", "03", "04", "05", "06", "07", "08", "09", "10"])
def test_every_case_states_the_property_it_checks(lesson):
    from course.grading import lesson_exercises

    for exercise in lesson_exercises(lesson):
        for case in exercise.cases:
            doc = (case.fn.__doc__ or "").strip()
            assert doc.startswith("Property: ") and len(doc) > 60, (exercise.id, case.title, doc)


@pytest.mark.parametrize("exercise", sorted(RIGHT))
def test_the_reference_solution_passes(exercise, quiet_machine):
    source, titles = RIGHT[exercise]
    _passes(exercise, source, titles)


@pytest.mark.parametrize("exercise, source, says, not_says, titles", WRONG)
def test_the_wrong_learner_fails_with_a_first_message_naming_the_mistake(exercise, source, says, not_says, titles,
                                                                        quiet_machine):
    message = _first(exercise, source, titles)
    for words in says:
        assert words in message, (words, message)
    for words in not_says:
        assert words not in message, (words, message)
