"""Lesson 03 checks: timing the data wait, a depth-N prefetcher, the depth a bursty loader needs.

The prefetcher is graded on behaviour only (what it yields, how far its thread runs ahead, where
an error surfaces, whether a thread is left behind), never on speed. Every call into the learner's
iterator runs in a helper thread with a deadline, so a hang becomes a hint instead of a timeout.
"""

from __future__ import annotations

import math
import queue
import random
import statistics
import threading
import time

from course.checks.drawn import falsify
from course.grading import Exercise, Wrong

_HELPER = "course-check-"      # name prefix of this module's own threads
_DEADLINE_S = 5.0              # how long one call into the learner's iterator may take


# --------------------------------------------------------------------------- helpers
class _Item:
    """A batch with an identity: equal only to itself, so copies are caught."""

    def __init__(self, index: int):
        self.index = index

    def __repr__(self) -> str:
        return f"batch{self.index}"


class _Source:
    """An iterable of `_Item`s that records how many were pulled, and by which threads.

    ``n=None`` is a long source (10 000 items); ``fail_at=k`` raises ``self.error`` instead of
    yielding item k; ``release()`` makes it end at its next pull (frees a thread still reading it).
    """

    def __init__(self, n: int | None = None, fail_at: int | None = None, delay_s: float = 0.0):
        self.n = 10_000 if n is None else n
        self.fail_at = fail_at
        self.delay_s = delay_s
        self.error = ValueError(f"collate failed on batch {fail_at}")
        self.items: list[_Item] = []
        self.threads: set[int] = set()
        self._released = False

    @property
    def pulled(self) -> int:
        return len(self.items)

    def release(self) -> None:
        self._released = True

    def __iter__(self):
        for i in range(self.n):
            if self._released:
                return
            self.threads.add(threading.get_ident())
            if self.delay_s:
                time.sleep(self.delay_s)
            if i == self.fail_at:
                raise self.error
            self.items.append(_Item(i))
            yield self.items[-1]


def _within(seconds: float, fn, *args):
    """Run ``fn(*args)`` in a daemon thread; return (finished, value, exception, thread id)."""
    box: dict = {}

    def run():
        box["ident"] = threading.get_ident()
        try:
            box["value"] = fn(*args)
        except BaseException as e:   # noqa: BLE001 - handed back to the case
            box["error"] = e

    t = threading.Thread(target=run, name=f"{_HELPER}consumer", daemon=True)
    t.start()
    t.join(seconds)
    return (not t.is_alive()), box.get("value"), box.get("error"), box.get("ident")


def _settle(src: _Source, quiet_s: float = 0.25, limit_s: float = 3.0) -> int:
    """Wait until ``src`` has not been pulled for ``quiet_s`` (the thread is blocked); return the count."""
    deadline = time.monotonic() + limit_s
    last, since = src.pulled, time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.02)
        now = src.pulled
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            break
    return src.pulled


def _new_threads(before: set) -> list[threading.Thread]:
    return [t for t in threading.enumerate()
            if t not in before and t.is_alive() and not t.name.startswith(_HELPER)]


def _call(learner, src, depth):
    gen = learner.prefetch(src, depth)
    if not hasattr(gen, "__next__"):
        raise Wrong(f"prefetch(...) returned {type(gen).__name__}, not an iterator: write it as a generator "
                    "(a function that `yield`s each batch)")
    return gen


# --------------------------------------------------------------------------- 03.data_wait
data_wait = Exercise("03.data_wait", uses=["timed_epoch", "expected_step_ms"],
                     title="measure the data wait, predict the step")


class _SlowNext:
    """Four batches, each taking ``ms`` inside next()."""

    def __init__(self, ms: float, n: int = 4):
        self.ms, self.n = ms, n

    def __iter__(self):
        for i in range(self.n):
            time.sleep(self.ms / 1e3)
            yield i


class _Pausing:
    """Batches whose next() pauses a different time each (ms)."""

    def __init__(self, pauses):
        self.pauses = pauses

    def __iter__(self):
        for i, p in enumerate(self.pauses):
            time.sleep(p / 1e3)
            yield i


@data_wait.case("data_wait_ms is the time inside next(), step_ms the whole step",
                hint="data wait is the time spent getting the batch only; the step runs from its start to its end; "
                     "both in milliseconds",
                reveal="t0 = perf_counter(); batch = next(it); t1 = perf_counter(); step(batch); "
                       "t2 = perf_counter(): wait = t1 - t0, step = t2 - t0, in milliseconds", timeout=30)
def _(learner):
    """Property: per step, data_wait_ms is the time inside that step's next() and step_ms runs from asking for
    the batch to the end of step(batch), in ms; on a loader pausing differently per batch, each its own."""
    calls = []

    def step(batch):
        calls.append(batch)
        time.sleep(0.060)

    out = learner.timed_epoch(_SlowNext(30.0), step)
    if not isinstance(out, dict) or not {"data_wait_ms", "step_ms"} <= set(out):
        raise Wrong('return a dict with two lists: {"data_wait_ms": [...], "step_ms": [...]}')
    waits, steps = list(out["data_wait_ms"]), list(out["step_ms"])
    if calls != [0, 1, 2, 3]:
        raise Wrong(f"step() was called with {calls} for a loader of 4 batches [0, 1, 2, 3]: "
                    "call it once per batch, in order, until next() raises StopIteration")
    if len(waits) != 4 or len(steps) != 4:
        raise Wrong(f"4 steps ran but you returned {len(waits)} data waits and {len(steps)} step times: "
                    "append one of each per step")
    w, s = statistics.median(waits), statistics.median(steps)
    if s < 1.0 and w < 1.0:
        raise Wrong(f"your times look like seconds (median step {s:.3f}): return milliseconds, (t1 - t0) * 1e3")
    if w > 75:
        raise Wrong(f"your data wait ({w:.0f} ms) includes the step: stop its clock right after next() returns")
    if w < 10:
        raise Wrong(f"your data wait is {w:.1f} ms but each next() sleeps 30 ms: a `for` loop calls next() "
                    "before your timer starts; call batch = next(it) yourself between two perf_counter() reads")
    if s < 80:
        raise Wrong(f"your step time ({s:.0f} ms) leaves out the data wait: step_ms runs from asking for the "
                    "batch to the end of step(batch), so it is data wait + compute (30 + 60 ms here)")
    assert 28 <= w <= 70, f"median data wait {w:.1f} ms, expected about 30"
    assert 85 <= s <= 150, f"median step {s:.1f} ms, expected about 90"
    # A loader that pauses differently for each batch: each step's wait is its own batch's pause.
    # (Only the ranking of the waits and a lower bound are asked: a loaded machine adds to every sleep.)
    pauses = (2.0, 40.0, 2.0, 20.0)
    out = learner.timed_epoch(_Pausing(pauses), lambda batch: time.sleep(0.008))
    got = [float(v) for v in out["data_wait_ms"]]
    ranked = sorted(range(len(got)), key=lambda k: -got[k])[:2] if len(got) == len(pauses) else []
    if ranked != [1, 3] or got[1] < 39.5 or got[3] < 19.5:
        raise Wrong(f"a loader whose next() pauses {', '.join(f'{q:g}' for q in pauses)} ms for batches 0 to 3 gave "
                    f"data waits of {', '.join(f'{v:.0f}' for v in got)} ms: each step's wait must be the time of "
                    f"its own batch's next(). Time next() for the batch that step then uses, in that same step")
    return f"data wait {w:.0f} ms, step {s:.0f} ms (30 + 60 expected); waits of {len(pauses)} uneven pauses each its own"


@data_wait.case("max_steps stops the loop early",
                hint="given max_steps, the loop must stop after that many steps",
                reveal="loop while max_steps is None or len(steps) < max_steps", timeout=30)
def _(learner):
    """Property: max_steps=3 on a loader of 100 batches runs exactly 3 steps and returns 3 of each time."""
    calls = []
    out = learner.timed_epoch(list(range(100)), calls.append, max_steps=3)
    if len(calls) == 100:
        raise Wrong("with max_steps=3 you ran all 100 batches: stop after max_steps steps")
    if len(calls) != 3:
        raise Wrong(f"with max_steps=3 step() ran {len(calls)} times: check the count before each step "
                    "(an off-by-one?)")
    assert len(out["step_ms"]) == 3 and len(out["data_wait_ms"]) == 3, \
        f"3 steps ran but the lists hold {len(out['data_wait_ms'])} and {len(out['step_ms'])} entries"


class _Counted:
    """A loader of given items (None and 0 among them) that counts the items it gave."""

    def __init__(self, items):
        self.items, self.given = list(items), 0

    def __iter__(self):
        for item in self.items:
            self.given += 1
            yield item


def _draw_sources(seed: int = 31, count: int = 8) -> list[tuple]:
    """``(items, max_steps)``: 0 to 6 items, some None or 0 (a loader may yield those), and max_steps None, 0, below,
    equal to and above the length."""
    rng = random.Random(seed)
    out = []
    for k in range(count):
        n = rng.randint(2, 6) if k else 0
        items = [rng.choice([None, 0, f"b{i}", f"b{i}", f"b{i}"]) for i in range(n)]
        if k in (1, 2) and None not in items:
            items[rng.randrange(n)] = None
        limit = (None, 0, max(1, n - 2), n, n + 2)[k % 5]
        out.append((tuple(items), limit))
    return out


def _source_mistake(learner, case) -> str | None:
    items, limit = case
    src, calls = _Counted(items), []
    out = learner.timed_epoch(src, calls.append, max_steps=limit)
    m = len(items) if limit is None else min(limit, len(items))
    if calls != list(items[:m]):
        if limit == 0 and calls:
            return (f"with max_steps=0 you ran {len(calls)} steps: 0 is a limit too; test `max_steps is None`, not "
                    f"the truth of max_steps")
        if len(calls) < m and items[len(calls)] in (None, 0):
            return (f"your loop stopped at batch {len(calls)}, which is {items[len(calls)]!r}: a loader may yield "
                    f"None or 0 like any batch; the loop ends only when next() raises StopIteration")
        return f"step() was called with {calls}, expected the loader's first {m} batches in order"
    if src.given > m:
        return (f"with max_steps={limit} the loader gave {src.given} batches for {m} steps: you took a batch after "
                f"the last step and dropped it. Check the count before calling next()")
    lens = (len(out["data_wait_ms"]), len(out["step_ms"]))
    if lens != (m, m):
        return f"{m} steps ran but you returned {lens[0]} data waits and {lens[1]} step times"
    return None


@data_wait.case("drawn loaders: every batch, None and 0 included, exactly max_steps of them, none taken past the last",
                hint="each batch of the loader, whatever its value, gets one step, until the loader ends or max_steps "
                     "steps ran; no batch is taken from the loader that no step uses",
                after="data_wait_ms is the time inside next(), step_ms the whole step")
def _(learner):
    """Property: on drawn loaders of 0 to 6 batches (some None or 0) and max_steps None, 0, below, equal to and
    above their length, step() gets the loader's first min(n, max_steps) batches in order, the loader gives no
    more than those, and one wait and one step time come back per step."""
    cases = _draw_sources()

    def smaller(case):
        items, limit = case
        for i in range(len(items)):
            yield (items[:i] + items[i + 1:], limit if limit is None else min(limit, len(items) - 1))

    found = falsify(cases, lambda case: (None if (why := _source_mistake(learner, case)) is None
                                         else f"loader {list(case[0])}, max_steps={case[1]}: {why}"),
                    smaller=smaller, kind=lambda m: m.split(": ", 1)[-1][:30])
    if found is None:
        return f"{len(cases)} drawn loaders"
    raise Wrong(str(found))


@data_wait.case("expected step: collate + compute at depth 0, max(collate, compute) with a prefetcher",
                hint="at depth 0 nothing runs beside the step; with a prefetcher the next batch is collated while "
                     "this one computes",
                reveal="depth 0: nothing overlaps; depth >= 1: the next collate runs during this compute")
def _(learner):
    """Property: for drawn collate and compute times on both sides of each other and depths 0 to 5, the step is
    collate + compute without a prefetcher and max(collate, compute) with one."""
    rng = random.Random(32)
    drawn = [(float(rng.randint(1, 60)), float(rng.randint(1, 60)), rng.randint(0, 5)) for _ in range(10)]
    for collate, compute, depth in [(30.0, 20.0, 0), (30.0, 20.0, 2), (10.0, 40.0, 1), (10.0, 40.0, 0),
                                    (10.0, 40.0, 4)] + drawn:
        want = collate + compute if depth == 0 else max(collate, compute)
        got = learner.expected_step_ms(collate, compute, depth)
        if got is not None and math.isclose(got, want, rel_tol=1e-9):
            continue
        if depth > 1 and got is not None and any(math.isclose(got, v, rel_tol=1e-9) for v in (
                max(collate / depth, compute), max(collate, compute / depth), (collate + compute) / depth)):
            raise Wrong(f"expected_step_ms({collate:g}, {compute:g}, depth={depth}) returned {got:g}: depth is how "
                        f"many batches wait ready, not how many are made at once; one thread collates one batch at "
                        f"a time, so a deeper queue divides neither the collate nor the compute")
        if depth == 0 and got is not None and math.isclose(got, max(collate, compute)):
            raise Wrong("without a prefetcher (depth=0) nothing overlaps: the loop collates, then computes, "
                        "so a step costs collate_ms + compute_ms")
        if depth > 0 and got is not None and math.isclose(got, collate + compute):
            raise Wrong("with a prefetcher the next batch is collated while this step computes: the step "
                        "costs the longer of the two, max(collate_ms, compute_ms)")
        if got is not None and math.isclose(got, min(collate, compute)):
            raise Wrong("a step cannot be shorter than either of its parts: max, not min")
        raise AssertionError(f"expected_step_ms({collate}, {compute}, depth={depth}) returned {got}, expected {want}")
    return f"5 cases and {len(drawn)} drawn"


# --------------------------------------------------------------------------- 03.prefetcher
prefetcher = Exercise("03.prefetcher", uses=["prefetch"], title="a depth-N prefetcher")


@prefetcher.case("yields the same batches, in order, read by a background thread",
                 hint="the batches must come out as they went in, every one of them, read by a thread other than the"
                      " loop's",
        reveal="a thread pulls from the iterable and q.put()s each item, then an end marker; "
                      "the generator q.get()s and yields until the marker", timeout=60)
def _(learner):
    """Property: for depths 1, 2, 4 and sources of 0, 1, 3, 10 batches, the generator yields the very objects of
    the source, all of them, in order, pulled by a thread other than the loop's."""
    for depth in (1, 2, 4):
        for n in (0, 1, 3, 10):
            src = _Source(n)
            done, got, err, consumer = _within(_DEADLINE_S, lambda: list(_call(learner, src, depth)))
            src.release()
            if not done:
                raise Wrong(f"list(prefetch(<{n} batches>, depth={depth})) never finished: after the last batch "
                            "the thread must put an end marker in the queue, and the generator must return when "
                            "it gets it (without one it waits forever on an empty queue)")
            if err is not None:
                raise err
            want = src.items
            indices = [getattr(b, "index", b) for b in got]
            if len(got) != n:
                lost = "the first" if indices == list(range(1, n)) else "the last" if indices == list(range(n - 1)) else None
                why = f": {lost} batch is lost" if lost else ""
                raise Wrong(f"a source of {n} batches gave {len(got)} (depth={depth}){why}. Yield every item the "
                            "thread took, and put the end marker after the last one")
            if indices != list(range(n)):
                raise Wrong(f"batches came out as {indices[:8]}, not in the loader's order: one thread, one FIFO "
                            "queue, and yield them as they come")
            if not all(a is b for a, b in zip(got, want)):
                raise Wrong("the batches are copies: yield the very objects the loader produced (a prefetcher "
                            "moves work earlier, it does not change the data)")
            if n and src.threads <= {consumer}:
                raise Wrong("the loader was read by the training loop's own thread, so nothing is prepared ahead: "
                            "start a threading.Thread that pulls from the iterable and puts into the queue")
    return "depths 1, 2, 4 and sources of 0, 1, 3, 10 batches"


SLOW = -1.0            # a pause in `_Items` that outlasts any timeout the consumer waits with (`_OutlastGets`)
SLOW_CAP_S = 2.0       # ... up to this long: a get() timeout of 2 s or less that ends the epoch is caught


class _OutlastGets:
    """While installed, notes every ``queue.Queue.get`` with a timeout (the consumer's wait for a batch) and when
    it would give up: a slow batch that pauses until then, and a little more, outlasts that wait whatever its
    timeout, so a consumer that takes an empty queue for the end is caught, and one that blocks without a
    timeout (the lesson's) costs the check 50 ms, not a second."""

    def __init__(self):
        self.give_up = 0.0

    def __enter__(self):
        self._get = get = queue.Queue.get
        watch = self

        def noted(q, block=True, timeout=None):
            if block and timeout is not None:
                watch.give_up = max(watch.give_up, time.monotonic() + min(float(timeout), SLOW_CAP_S))
            return get(q, block, timeout)

        queue.Queue.get = noted
        return self

    def __exit__(self, *exc):
        queue.Queue.get = self._get
        return False

    def pause(self) -> float:
        start = time.monotonic()
        while time.monotonic() < max(start + 0.05, self.give_up + 0.1) and time.monotonic() < start + SLOW_CAP_S + 0.2:
            time.sleep(0.01)
        return time.monotonic() - start


class _Items:
    """A loader of given items, pausing ``pauses[i]`` seconds before item i (SLOW: outlasting the consumer's
    wait, `_OutlastGets`); it counts what it gave and how long it paused."""

    def __init__(self, items, pauses, watch=None):
        self.items, self.pauses, self.given, self.watch = list(items), list(pauses), 0, watch
        self.paused = [0.0] * len(self.items)

    def __iter__(self):
        for k, (item, pause) in enumerate(zip(self.items, self.pauses)):
            if pause == SLOW and self.watch is not None:
                self.paused[k] = self.watch.pause()
            elif pause > 0:
                time.sleep(pause)
                self.paused[k] = pause
            self.given += 1
            yield item


def _draw_item_sources(seed: int = 35, count: int = 5) -> list[tuple]:
    """``(items, pauses, depth)``: 1 to 6 items, None, 0 and [] among them, depths 1 to 4, short pauses (0 to 20
    ms), and one source that pauses before its second batch longer than the consumer is willing to wait (SLOW)."""
    rng = random.Random(seed)
    out = []
    for k in range(count):
        n = rng.randint(2, 6)
        items = [rng.choice([None, 0, [], object(), object()]) for _ in range(n)]
        if k == 0:
            items[rng.randrange(n)] = None
        pauses = [0.0] * n if k % 2 else [rng.choice((0.0, 0.005, 0.02)) for _ in range(n)]
        if k == count - 1:
            items, pauses = [object(), object(), object()], [0.0, SLOW, 0.0]
        out.append((tuple(items), tuple(pauses), rng.randint(1, 4)))
    return out


def _describe_items(items) -> str:
    return "[" + ", ".join(repr(i) if i is None or (isinstance(i, (int, list)) and not i) else "a batch"
                           for i in items) + "]"


def _items_mistake(learner, case) -> str | None:
    items, pauses, depth = case
    with _OutlastGets() as watch:
        src = _Items(items, pauses, watch)
        done, got, err, _ = _within(_DEADLINE_S + SLOW_CAP_S + sum(p for p in pauses if p > 0),
                                    lambda: list(_call(learner, src, depth)))
    if not done:
        return "list(prefetch(...)) never finished"
    if err is not None:
        return f"it raised {type(err).__name__}: {err}"
    if len(got) == len(items) and all(a is b for a, b in zip(got, items)):
        return None
    k = next((i for i, (a, b) in enumerate(zip(got, items)) if a is not b), len(got))
    if len(got) < len(items) and k == len(got):
        if items[k] is None or (isinstance(items[k], (int, list)) and not items[k]):
            return (f"your prefetcher ended at batch {k}, which is {items[k]!r}: a loader may yield None, 0 or an "
                    f"empty batch like any other; the end marker must be something no loader yields (a tagged "
                    f"tuple, or a unique object())")
        if pauses[k] == SLOW:
            return (f"your prefetcher ended after {k} batches while the loader was still preparing batch {k} (it "
                    f"took {src.paused[k]:.2g} s, longer than your wait for it): an empty queue means a slow "
                    f"loader, not the end. Only the end marker ends the loop (a get() with a timeout that returns "
                    f"on queue.Empty ends a slow epoch early)")
        return f"a source of {len(items)} batches gave {len(got)}"
    return f"batch {k} came out as another object than the loader's"


@prefetcher.case("drawn loaders: every batch, None and 0 included, however long the loader pauses",
                 hint="every item the loader yields comes out, whatever its value, and the epoch ends only when the "
                      "loader ends, however long it takes for a batch",
                 after="yields the same batches, in order, read by a background thread", timeout=60)
def _(learner):
    """Property: for drawn loaders (items that are None, 0 or empty among real ones, depths 1 to 4, pauses of 0 to
    20 ms, and one batch slower than the consumer waits for it, up to SLOW_CAP_S), the generator yields every item,
    the very objects, in order."""
    cases = _draw_item_sources()

    def smaller(case):
        items, pauses, depth = case
        if depth > 1:
            yield (items, pauses, 1)
        for i in range(len(items)):
            if len(items) > 1:
                yield (items[:i] + items[i + 1:], pauses[:i] + pauses[i + 1:], depth)

    found = falsify(cases, lambda case: (None if (why := _items_mistake(learner, case)) is None
                                         else f"loader {_describe_items(case[0])}, depth={case[2]}: {why}"),
                    smaller=smaller, budget=4, kind=lambda m: m.split(": ", 1)[-1][:25])
    if found is None:
        return f"{len(cases)} drawn loaders, one with a batch slower than the wait for it"
    raise Wrong(str(found))


@prefetcher.case("runs ahead of the loop by at most depth batches",
                 hint="the thread may run at most `depth` batches ahead of the loop",
                 reveal="queue.Queue(maxsize=depth): the thread keeps it full and blocks in put() when it is",
                 timeout=60)
def _(learner):
    """Property: at depth 1 and 3, once the thread has settled it has pulled depth or depth + 1 batches more than
    the loop took, never more and never fewer."""
    for depth in (1, 3):
        src = _Source(60)
        gen = _call(learner, src, depth)
        taken = 0
        try:
            for upto in (1, 3):
                while taken < upto:
                    done, _, err, _ = _within(_DEADLINE_S, next, gen)
                    if not done:
                        raise Wrong(f"next() on prefetch(<60 batches>, depth={depth}) waited {_DEADLINE_S:.0f} s "
                                    "for a batch that was ready in the loader: does the thread start, and put "
                                    "each item in the queue?")
                    if err is not None:
                        raise err
                    taken += 1
                pulled = _settle(src)
                ahead = pulled - taken
                if ahead > depth + 1:
                    raise Wrong(f"with depth={depth}, the loop had taken {taken} batch(es) and your thread had "
                                f"already pulled {pulled}: {ahead} ahead. Bound the queue, "
                                "queue.Queue(maxsize=depth), so the thread runs at most depth batches ahead "
                                "(plus the one in its hand waiting for room); an unbounded queue stages the "
                                "whole epoch in memory")
                if ahead < depth:
                    raise Wrong(f"with depth={depth}, while the loop worked on batch {taken - 1} your thread had "
                                f"prepared only {ahead} batch(es) ahead: a prefetcher keeps pulling until "
                                "depth batches wait in the queue, without waiting to be asked")
        finally:
            _within(_DEADLINE_S, getattr(gen, "close", lambda: None))
            src.release()
    return "depth 1 and 3: ahead by depth (+1 in hand)"


@prefetcher.case("a loader error surfaces at the step that would have consumed its batch",
                 hint="a loader error must surface in the loop, at the step that would have consumed that batch: not"
                      " earlier, and not only in the thread",
                 reveal="in the thread: try/except around the loop, put ('error', exc) in the queue; in the "
                        "generator: raise it when it comes out", timeout=60)
def _(learner):
    """Property: a loader that raises at batch 5 gives the loop batches 0-4, then the loader's own exception."""
    src = _Source(10, fail_at=5)

    def consume():
        got = []
        try:
            for b in _call(learner, src, 2):
                got.append(b)
        except Exception as e:   # noqa: BLE001 - we want to see which one
            return got, e
        return got, None

    done, value, err, _ = _within(_DEADLINE_S, consume)
    src.release()
    if not done:
        raise Wrong("the loader raised in batch 5 and your loop hung: an exception ends the thread silently, and "
                    "the consumer waits forever on get(). Catch it in the thread, put it in the queue, and raise "
                    "it in the generator when it comes out")
    if err is not None:
        raise err
    got, exc = value
    if exc is None:
        raise Wrong(f"the loader raised ValueError after 5 batches, but your loop ended quietly after {len(got)}: "
                    "the error was swallowed and training would go on with a truncated epoch. Raise it in the "
                    "consumer")
    if exc is not src.error and not (type(exc) is ValueError and str(exc) == str(src.error)):
        chain, seen = exc, []
        while chain is not None and chain not in seen:
            seen.append(chain)
            chain = chain.__cause__ or chain.__context__
        if src.error in seen:
            raise Wrong(f"you raised {type(exc).__name__} around the loader's ValueError: raise the loader's own "
                        "exception object (`raise exc`), so the training script's `except ValueError` still "
                        "catches it")
        raise exc        # the learner's own code crashed: show where
    if len(got) < 5:
        raise Wrong(f"the loader's error surfaced at step {len(got)}, but batches 0-4 came before it and were "
                    "ready: send the error through the queue, behind them, so it surfaces at step 5 where the "
                    "stock loop raises it")
    assert [getattr(b, "index", b) for b in got] == list(range(5)), \
        f"before the error the loop got {got}, expected batches 0-4"
    return "5 batches, then the loader's own ValueError"


@prefetcher.case("stopping early (break, close(), an error) leaves no thread behind",
                 hint="however the loop stops, the thread must end too, also one blocked waiting for room in the "
                      "queue",
                 reveal="in the generator's finally: set a threading.Event, let a blocked put() see it "
                        "(put(item, timeout=0.05) in a loop that checks it), then join() the thread",
                 timeout=90)
def _(learner):
    """Property: after a `break`, a close() or a loader error, and after a `break` while the loader pauses between
    batches, no thread of the prefetcher runs on once the loop has moved on, and it pulls no more batches."""
    def stop_by_break(src):
        for i, _ in enumerate(_call(learner, src, 2)):
            if i == 2:
                break

    def stop_by_close(src):
        gen = _call(learner, src, 2)
        next(gen)
        next(gen)
        if not hasattr(gen, "close"):
            raise Wrong("prefetch(...) has no close(): write it as a generator, so that Python closes it (and "
                        "runs its finally block) when the loop stops early")
        gen.close()

    def stop_by_error(src):
        try:
            for _ in _call(learner, src, 2):
                pass
        except ValueError:
            pass

    def stop_while_paused(src):
        for _ in _call(learner, src, 2):
            break

    for how, fn, src, used in (("`break` after 3 batches", stop_by_break, _Source(), 3),
                               ("gen.close() after 2 batches", stop_by_close, _Source(), 2),
                               ("the loader's error", stop_by_error, _Source(n=50, fail_at=4), 5),
                               ("`break` after 1 batch while the loader pauses 0.15 s before each batch",
                                stop_while_paused, _Source(delay_s=0.15), 1)):
        before = set(threading.enumerate())
        done, _, err, _ = _within(_DEADLINE_S, fn, src)
        left_at_return = _new_threads(before)     # still running when the loop's stop returned
        try:
            if not done:
                raise Wrong(f"stopping early ({how}) hung: your generator's finally waits for a thread that "
                            "cannot finish, typically one blocked in q.put() on a full queue that nobody reads "
                            "any more. Set a stop Event first, and put with a timeout in a loop that checks it "
                            "(or drain the queue) before join()")
            if err is not None:
                raise err
            deadline = time.monotonic() + 2.0
            while _new_threads(before) and time.monotonic() < deadline:
                time.sleep(0.02)
            alive = _new_threads(before)
            if alive:
                pulled = src.pulled
                time.sleep(0.3)
                if src.pulled > pulled:
                    raise Wrong(f"once the loop stopped ({how}), your thread kept pulling batches from the loader ({src.pulled} so "
                                "far): check a stop Event (threading.Event) in the thread's loop and set it in the "
                                "generator's finally")
                raise Wrong(f"once the loop stopped ({how}), the prefetch thread ({alive[0].name}) is still alive, most likely "
                            "blocked in put() on a full queue for a consumer that is gone: in the generator's "
                            "finally, set a stop Event, make the thread put(item, timeout=0.05) in a loop that "
                            "checks it (or drain the queue), then join() it")
            # depth 2: at most 2 batches in the queue and 1 in the thread's hand beyond those the loop used
            if src.pulled > used + 2 + 1:
                raise Wrong(f"once the loop stopped ({how}) after using {used} batch(es), your thread went on "
                            f"pulling from the loader ({src.pulled} pulled) before it ended: when a put() finds the "
                            f"stop Event set, the thread must stop reading the loader, not only skip the put")
            if left_at_return:
                raise Wrong(f"once the loop stopped ({how}), your generator returned while its thread "
                            f"({left_at_return[0].name}) was still running (it ended a moment later): wait for the "
                            f"thread to end in the generator's finally, so that nothing of the prefetcher runs on "
                            f"after the loop has moved on")
        finally:
            src.release()
    return "break, close() and a loader error each leave no thread"


# --------------------------------------------------------------------------- 03.depth
depth_ex = Exercise("03.depth", uses=["longest_wait_ms", "depth_needed"], title="how deep the prefetcher must be")


def _longest(worst, compute, depth):
    return worst if depth == 0 else max(0.0, worst - (depth + 1) * compute)


@depth_ex.case("the slow batch waits for what (depth + 1) steps of compute do not cover",
               hint="count how much compute runs while the slow batch is being collated, at each depth",
               reveal="depth 0: the whole collate; depth >= 1: max(0, worst - (depth + 1) * compute)")
def _(learner):
    """Property: for drawn slow batches (none at all, shorter than a step, exact multiples of a step, up to 60
    steps long) and depths 0 to 8, the wait is the collate at depth 0 and what (depth + 1) steps of compute do not
    cover above."""
    rng = random.Random(33)
    drawn = [(float(rng.choice((0, rng.randint(1, 30), 25 * rng.randint(1, 8), rng.randint(30, 1500)))), 25.0,
              rng.randint(0, 8)) for _ in range(12)]
    for worst, compute, depth in ((100.0, 25.0, 1), (100.0, 25.0, 2), (100.0, 25.0, 3), (100.0, 25.0, 6),
                                  (40.0, 25.0, 1), (100.0, 25.0, 0), (10.0, 25.0, 0), *drawn):
        want = _longest(worst, compute, depth)
        got = learner.longest_wait_ms(worst, compute, depth)
        if got is not None and math.isclose(got, want, abs_tol=1e-9):
            continue
        if depth == 0:
            raise Wrong(f"longest_wait_ms({worst}, {compute}, depth=0) returned {got}: without a prefetcher "
                        "nothing is ready in advance, so the step waits for the whole collate")
        if got is not None and math.isclose(got, max(0.0, worst - depth * compute), abs_tol=1e-9):
            raise Wrong("count the batch in the thread's hand too: depth batches wait in the queue and the thread "
                        "finishes the one it holds, so (depth + 1) * compute_ms of work is ready")
        if got is not None and got < 0:
            raise Wrong(f"a wait is never negative (you returned {got}): max(0, ...)")
        raise AssertionError(f"longest_wait_ms({worst}, {compute}, {depth}) returned {got}, expected {want}")
    return f"7 cases and {len(drawn)} drawn"


@depth_ex.case("depth_needed: the smallest depth >= 1 with no wait",
               hint="the answer is the smallest depth >= 1 at which the slow batch no longer makes the loop wait",
               reveal="the smallest depth >= 1 with (depth + 1) * compute_ms >= worst_collate_ms")
def _(learner):
    """Property: for drawn slow batches (none, shorter than a step, exact multiples of a step where the wait is
    exactly 0, and up to 60 steps long), depth_needed is the smallest depth >= 1 whose longest wait is 0."""
    rng = random.Random(34)
    fixed = [(100.0, 25.0), (101.0, 25.0), (20.0, 25.0), (50.0, 25.0), (75.0, 25.0), (260.0, 30.0)]
    drawn = [(0.0, 25.0), (float(25 * rng.randint(2, 9)), 25.0), (float(rng.randint(800, 1500)), 25.0),
             *((float(rng.randint(1, 400)), float(rng.randint(5, 50))) for _ in range(6))]
    misses = []
    for worst, compute in fixed + drawn:
        want = next(d for d in range(1, 1000) if _longest(worst, compute, d) == 0)
        got = learner.depth_needed(worst, compute)
        if got != want:
            misses.append((worst, compute, got, want))
    if not misses:
        return f"6 cases and {len(drawn)} drawn"
    exact = [m for m in misses if m[0] > 0 and m[0] % m[1] == 0 and m[2] == m[3] + 1]
    if exact and len(exact) == len(misses):
        worst, compute, got, want = exact[0]
        raise Wrong(f"depth_needed({worst:g}, {compute:g}) returned {got}: at depth {want} the ready batches cover "
                    f"{(want + 1) * compute:g} ms, exactly the slow batch's {worst:g} ms, so the wait is 0, which is "
                    f"no wait. Your answers are right wherever the collate is not a whole number of steps: compare "
                    f"with >=, not >")
    worst, compute, got, want = misses[0]
    if got is None or (isinstance(got, int) and got < want and worst / compute > 10
                       and all(m[0] / m[1] > 10 for m in misses)):
        raise Wrong(f"depth_needed({worst:g}, {compute:g}) returned {got!r}: the answer, {want}, lies past the depths "
                    f"you searched. A slow batch can be any number of steps long: compute the depth from the two "
                    f"times, or search without a fixed bound")
    if worst == 0 and got != want:
        raise Wrong(f"depth_needed(0, {compute:g}) returned {got!r}: with no slow batch no depth waits, and the "
                    f"smallest depth >= 1 is 1 (depth 0 means no prefetcher at all)")
    if got == want + 1 and got == math.ceil(worst / compute):
        raise Wrong(f"depth_needed({worst}, {compute}) returned {got}, one too deep: the batch in the "
                    "thread's hand counts too, so depth + 1 steps of compute are ready")
    if got == 0 or (got is not None and got < 1):
        raise Wrong(f"depth_needed({worst}, {compute}) returned {got}: depth 0 means no prefetcher at all; "
                    "the answer is at least 1")
    if got is not None and got == want - 1:
        raise Wrong(f"depth_needed({worst}, {compute}) returned {got}, which leaves a wait of "
                    f"{_longest(worst, compute, got):.0f} ms: round up (math.ceil), not down")
    raise AssertionError(f"depth_needed({worst}, {compute}) returned {got}, expected {want}")
