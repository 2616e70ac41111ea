"""10.pipelined_step: step each bucket's slice and launch its all-gather at once, in forward order;
and the measurement of what that buys on rank 0 (its steps timed, the gathers on a simulated link)."""

from __future__ import annotations

import functools
import random
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from course.checks.drawn import after_colon, falsify, root_error, run_thread_ranks
from course.grading import Exercise, Wrong

from .threads import ThreadWorld, _your_line, in_threads, run_ranks

# =============================================================================================
# 10.pipelined_step
# =============================================================================================
pipe_ex = Exercise("10.pipelined_step", uses=["pipelined_step"],
                   title="the step and the all-gathers, pipelined bucket by bucket")

P_SIZES = (7, 5, 6, 4)          # each bucket's slice per rank, bucket 0 the forward's first
PIPE_HINT = ("each bucket's gather can leave as soon as that bucket's slice is stepped, and not before; the "
             "forward needs bucket 0 first; nothing in the step needs a gather to have arrived")
PIPE_REVEAL = ("works = []; for i in range(len(mine)): step_slice(i); works.append(dist.all_gather_single("
               "gathered[i], mine[i], async_op=True)); return works")
VALUES_CASE = "every bucket's gather carries its updated slices (2 ranks, 4 buckets)"


def _slices(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11 + rank)
    return [torch.randn(s, generator=g) for s in P_SIZES]


def _stepped(rank: int) -> list[torch.Tensor]:
    """What the slices of ``rank`` hold after the course's step: x - 0.1 * (x + i)."""
    return [x - 0.1 * (x + i) for i, x in enumerate(_slices(rank))]


def _run_pipelined(rank: int, world, fn, mine: list[torch.Tensor], world_size: int) -> dict:
    """One rank's ``fn(mine, gathered, step_slice)`` on its slices ``mine``, the works it returned waited for.

    Returns its event ``log``, ``ptr`` (a slice's address -> its bucket), the ``gathered`` buffers, the works
    ``returned`` and ``order`` (the bucket each one gathers), ``stepped`` (buckets in the order stepped), ``seq``
    (its steps and gather launches, in order) and whether a gather was launched synchronously or waited for.
    """
    gathered = [torch.zeros(world_size * m.numel(), dtype=m.dtype) for m in mine]
    ptr = {m.data_ptr(): i for i, m in enumerate(mine)}
    stepped: list[int] = []

    def step_slice(i):
        i = int(i)
        if i in stepped:
            raise RuntimeError(f"step_slice({i}) called twice: each bucket's slice is stepped once per step")
        stepped.append(i)
        world.note(rank, "step", bucket=i)
        with torch.no_grad():
            mine[i].sub_(0.1 * (mine[i] + i))

    world.take(rank)
    works = fn(mine, gathered, step_slice)
    log = world.take(rank)
    returned = list(works) if isinstance(works, (list, tuple)) else None
    outputs = {g.data_ptr(): i for i, g in enumerate(gathered)}
    order = None if returned is None else [
        outputs.get(getattr(getattr(getattr(w, "_op", None), "tensor", None), "data_ptr", lambda: None)())
        for w in returned]
    for w in returned or []:
        if w is not None and hasattr(w, "wait"):
            w.wait()
    seq = [("step", e["bucket"]) if e["event"] == "step" else ("gather", ptr.get(e.get("src_ptr")))
           for e in log if e["event"] == "step" or (e["event"] == "launch" and e["kind"] == "all_gather")]
    return {"log": log, "ptr": ptr, "gathered": gathered, "returned": returned, "order": order,
            "stepped": stepped, "seq": seq,
            "sync": any(e["event"] == "launch" and e["kind"] == "all_gather" and not e.get("async_op") for e in log),
            "waited": any(e["event"] == "wait" and e.get("kind") == "all_gather" for e in log)}


def _pipe_rank(rank, world_size, world, fn):
    return _run_pipelined(rank, world, fn, _slices(rank), world_size)


def _pipe_facts(learner) -> list[dict]:
    def compute():
        return run_ranks(functools.partial(_pipe_rank, fn=learner.pipelined_step), 2, PIPE_HINT, PIPE_REVEAL)
    return learner.once("10.pipelined_step", compute)


def _gathers(res: dict) -> list[dict]:
    return [e for e in res["log"] if e["event"] == "launch" and e["kind"] == "all_gather"]


@pipe_ex.case(VALUES_CASE, hint=PIPE_HINT, reveal=PIPE_REVEAL, timeout=60)
def _(learner):
    """Property: on 2 thread ranks with 4 buckets, every bucket's slice is stepped, its all-gather launched
    asynchronously and its Work returned in bucket order, and each gathered buffer holds both ranks' stepped slices."""
    results = _pipe_facts(learner)
    n = len(P_SIZES)
    want = [torch.cat([_stepped(r)[i] for r in range(2)]) for i in range(n)]
    before = [torch.cat([_slices(r)[i] for r in range(2)]) for i in range(n)]
    for rank, res in enumerate(results):
        if sorted(res["stepped"]) != list(range(n)):
            missing = sorted(set(range(n)) - set(res["stepped"]))
            raise Wrong(f"rank {rank} never stepped bucket(s) {missing}: the optimizer step of this rank is "
                        f"step_slice(i) for every bucket i", reveal=PIPE_REVEAL)
        gathers = _gathers(res)
        if not gathers:
            raise Wrong("no all-gather was launched: after its step each rank holds only its own slice of every "
                        "bucket until a gather brings the other ranks' slices", reveal=PIPE_REVEAL)
        if any(not e.get("async_op") for e in gathers):
            raise Wrong("a gather was launched synchronously (async_op=False): the step then stops until the "
                        "bytes have crossed the link, for every bucket, and nothing overlaps", reveal=PIPE_REVEAL)
        if res["returned"] is None or len(res["returned"]) != n or any(
                w is None or not hasattr(w, "wait") for w in res["returned"]):
            got = "nothing" if res["returned"] is None else f"{len(res['returned'])} item(s)"
            raise Wrong(f"pipelined_step returned {got}: return the {n} works in flight, one per bucket, so that "
                        f"the next forward can wait for each where it needs it (as ParamGather.wait_for did)",
                        reveal=PIPE_REVEAL)
        order = res["order"]
        if None not in order and order != list(range(n)):
            raise Wrong(f"rank {rank}: the works came back as the gathers of buckets {order}: the contract is one "
                        f"work per bucket in bucket order, because the next forward's pre-hook for bucket i waits "
                        f"for works[i], and any other order makes it wait for another bucket's gather",
                        reveal=PIPE_REVEAL)
        for i in range(n):
            got = res["gathered"][i]
            if torch.allclose(got, want[i]):
                continue
            if torch.allclose(got, before[i]):
                raise Wrong(f"rank {rank}: bucket {i}'s gather brought the values from before the step: a "
                            f"collective reads its input when it is launched, so its slice must be stepped first",
                            reveal=PIPE_REVEAL)
            raise Wrong(f"rank {rank}: bucket {i}'s gathered buffer does not hold every rank's stepped slice in rank "
                        f"order: gather bucket i's own slice (mine[i]) into bucket i's output (gathered[i])",
                        reveal=PIPE_REVEAL)
    return f"{n} buckets, each gathered with both ranks' stepped slices"


@pipe_ex.case("each gather leaves as soon as its slice is stepped, in forward order, and nothing waits",
              hint=PIPE_HINT, reveal=PIPE_REVEAL, timeout=60, after=VALUES_CASE)
def _(learner):
    """Property: on rank 0 the events run step 0, gather 0, step 1, gather 1, ... (each gather launched as soon as its
    slice is stepped, in forward order), and nothing waits on a gather."""
    res = _pipe_facts(learner)[0]
    n, ptr = len(P_SIZES), res["ptr"]
    log, seq = res["log"], res["seq"]
    gathers = _gathers(res)
    order = [ptr.get(e.get("src_ptr")) for e in gathers]
    if order != list(range(n)):
        raise Wrong(f"the gathers went out in the order {order}: a link carries one transfer after the other, so "
                    f"the forward, which needs bucket 0 first, waits behind the others. Forward order: bucket 0 "
                    f"first", reveal=PIPE_REVEAL)
    waits = [e for e in log if e["event"] == "wait" and e.get("kind") == "all_gather"]
    if waits:
        raise Wrong("pipelined_step waited for a gather itself: the step then stands still while the bytes cross "
                    "the link; the forward's pre-hooks wait, each for its own bucket, later", reveal=PIPE_REVEAL)
    first_gather = next(k for k, (what, _) in enumerate(seq) if what == "gather")
    steps_before = sum(what == "step" for what, _ in seq[:first_gather])
    if steps_before == n:
        raise Wrong(f"you stepped all {n} slices before launching any gather: bucket 0's gather then waits for the "
                    f"other {n - 1} slices' steps, and the link stays idle during the whole step. A bucket's gather "
                    f"needs only that bucket's slice", reveal=PIPE_REVEAL)
    want = [x for i in range(n) for x in (("step", i), ("gather", i))]
    if seq != want:
        k = next(k for k, (a, b) in enumerate(zip(seq, want)) if a != b) if len(seq) == len(want) else None
        if steps_before == 2 and seq[first_gather] == ("gather", 0):
            raise Wrong("each gather left one step late: bucket 0's gather went out only after bucket 1's slice "
                        "was stepped, so the link waits a slice-time for every bucket. A bucket's gather needs "
                        "nothing but its own stepped slice", reveal=PIPE_REVEAL)
        where = f" (it first differs at event {k}: {seq[k][0]} of bucket {seq[k][1]})" if k is not None else ""
        raise AssertionError(f"rank 0's steps and gathers ran in another order than the pipelined one{where}")
    return f"{n} times: step bucket i, launch its gather; no wait"


# Drawn cases (course/checks/drawn.py): 2, 3 and 4 ranks, 1 to 6 buckets of drawn sizes, float32 and float64, every
# rank's log and gathered buffers read. The property: on every rank, for each bucket in forward order, its slice is
# stepped and its all-gather launched at once (asynchronously, nothing waited), and every bucket's output holds every
# rank's stepped slice, in rank order; one work per bucket comes back, in bucket order.
@dataclass(frozen=True)
class PipeDraw:
    world_size: int
    sizes: tuple[int, ...]
    dtype: torch.dtype
    seed: int

    def __str__(self) -> str:
        return (f"{self.world_size} ranks, {len(self.sizes)} bucket{'s' if len(self.sizes) != 1 else ''} of "
                f"{', '.join(map(str, self.sizes))} elements per rank, {str(self.dtype).replace('torch.', '')}")


def draw_pipelined(seed: int = 31, count: int = 4) -> list[PipeDraw]:
    """3, 2 and 4 ranks in turn; never the old check's 4 buckets in the first cases (3, 5, 2, 6)."""
    rng = random.Random(seed)
    return [PipeDraw((3, 2, 4, 3)[k % 4], tuple(rng.randint(1, 9) for _ in range((3, 5, 2, 6)[k % 4])),
                     (torch.float64, torch.float32)[k % 2], rng.randrange(1000)) for k in range(count)]


def _drawn_slices(case: PipeDraw, rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(case.seed * 10 + rank)
    return [torch.randn(s, generator=g, dtype=torch.float64).to(case.dtype) for s in case.sizes]


def _pipe_drawn_rank(rank, case: PipeDraw, world, fn):
    return _run_pipelined(rank, world, fn, _drawn_slices(case, rank), case.world_size)


def _pipe_drawn_mistake(learner, case: PipeDraw) -> str | None:
    """None when every rank holds the property above; else what the first rank that broke it did."""
    world = ThreadWorld(case.world_size, timeout_s=3.0, fail_fast=True)
    results, errors = run_thread_ranks(case.world_size, lambda r: _pipe_drawn_rank(r, case, world,
                                                                                    learner.pipelined_step),
                                       world=world)
    found = root_error(errors)
    if found is not None:
        rank, exc = found
        text = str(exc).strip().splitlines()
        said = f"rank {rank} raised {type(exc).__name__}: {text[-1] if text else ''}{_your_line(exc)}"
        if isinstance(exc, IndexError):
            return (f"{said}: this case has {len(case.sizes)} bucket{'s' if len(case.sizes) != 1 else ''}; the "
                    f"buckets are those of mine, however many")
        return said
    n = len(case.sizes)
    stepped = [_drawn_slices(case, r) for r in range(case.world_size)]
    stepped = [[x - 0.1 * (x + i) for i, x in enumerate(s)] for s in stepped]
    for rank, res in enumerate(results):
        if sorted(res["stepped"]) != list(range(n)):
            missing = sorted(set(range(n)) - set(res["stepped"]))
            return (f"rank {rank} stepped buckets {res['stepped']} of {n}: bucket(s) {missing} never; the number of "
                    f"buckets is len(mine), whatever it is")
        if res["sync"]:
            return f"rank {rank} launched a gather synchronously (async_op=False): the step stops until it has crossed"
        if res["waited"]:
            return f"rank {rank} waited for a gather itself: the step stands still while the bytes cross the link"
        want = [x for i in range(n) for x in (("step", i), ("gather", i))]
        if res["seq"] != want:
            gathers = [i for what, i in res["seq"] if what == "gather"]
            if gathers != list(range(n)):
                return f"rank {rank}'s gathers went out in the order {gathers}, for {n} buckets in forward order"
            first = next(k for k, (what, _) in enumerate(res["seq"]) if what == "gather")
            if first == n:
                return (f"rank {rank} stepped all {n} slices before launching any gather: bucket 0's gather waited "
                        f"for the other slices' steps")
            return (f"rank {rank}'s steps and gathers ran as {res['seq'][:2 * n]}: a bucket's gather leaves right "
                    f"after its own slice's step")
        if res["order"] is None or len(res["order"]) != n or res["order"] != list(range(n)):
            return (f"rank {rank} returned the works of buckets {res['order']}: one work per bucket, {n} of them, in "
                    f"bucket order")
        for i in range(n):
            got = res["gathered"][i]
            want = torch.cat([stepped[r][i] for r in range(case.world_size)])
            if got.dtype != case.dtype or not torch.allclose(got, want):
                return f"rank {rank}: bucket {i}'s gathered buffer does not hold every rank's stepped slice in rank order"
    return None


def _smaller_pipe(case: PipeDraw):
    for w in (2, 3):
        if w < case.world_size:
            yield replace(case, world_size=w)
    for k in (1, 2, 3):
        if k < len(case.sizes):
            yield replace(case, sizes=case.sizes[:k])
    if case.dtype != torch.float32:
        yield replace(case, dtype=torch.float32)
    if any(s > 2 for s in case.sizes):
        yield replace(case, sizes=tuple(min(s, 2) for s in case.sizes))


@pipe_ex.case("drawn: 2, 3 and 4 ranks, 1 to 6 buckets of drawn sizes, float32 and float64, every rank read",
              hint=PIPE_HINT, reveal=PIPE_REVEAL, timeout=60, after=VALUES_CASE)
def _(learner):
    """Property: on drawn cases (2, 3 and 4 thread ranks, 1 to 6 buckets of 1 to 9 elements, float32 and float64),
    every rank steps each bucket's slice and launches its all-gather at once, in forward order, asynchronously and
    without waiting, returns one work per bucket in bucket order, and each output holds every rank's stepped slice."""
    cases = draw_pipelined()
    found = falsify(cases, lambda c: None if (why := _pipe_drawn_mistake(learner, c)) is None else f"{c}: {why}",
                    smaller=_smaller_pipe, budget=12, kind=after_colon)
    if found is not None:
        raise Wrong(str(found), reveal=PIPE_REVEAL)
    return f"{len(cases)} drawn cases, every rank read"


# =============================================================================================
# The measurement: your schedule and "step everything, then gather" on rank 0
# =============================================================================================
def step_then_gather(mine, gathered, step_slice):
    """The schedule lesson 10's ParamGather had: every slice stepped, then every gather launched."""
    import torch.distributed as dist

    for i in range(len(mine)):
        step_slice(i)
    return [dist.all_gather_single(g, m, async_op=True) for g, m in zip(gathered, mine)]


def _timed_rank(rank, world_size, world, fn, sizes, rounds, link_ms_per_elem):
    g = torch.Generator().manual_seed(rank)
    mine = [torch.randn(s, generator=g) for s in sizes]
    moment = [torch.zeros(s) for s in sizes]
    gathered = [torch.zeros(world_size * s) for s in sizes]
    spans: list[tuple[int, float, float]] = []

    def step_slice(i):
        t0 = time.perf_counter()
        with torch.no_grad():       # a momentum SGD step, repeated: the optimizer's work on one slice
            for _ in range(rounds):
                moment[i].mul_(0.9).add_(mine[i], alpha=0.1)
                mine[i].add_(moment[i].sqrt().abs_(), alpha=-1e-6)
        spans.append((int(i), t0, time.perf_counter()))

    world.take(rank)
    start = time.perf_counter()
    works = fn(mine, gathered, step_slice)
    end = time.perf_counter()
    launches = [(e["t"], e.get("src_ptr")) for e in world.take(rank)
                if e["event"] == "launch" and e["kind"] == "all_gather"]
    for w in works or []:
        w.wait()
    ptr = {m.data_ptr(): i for i, m in enumerate(mine)}
    # The link: one gather after the other, each taking its bytes' time (SimulatedLink's rule, no latency).
    free, link = 0.0, []
    for t, p in sorted(launches):
        i = ptr.get(p)
        if i is None:
            continue
        begin = max(t - start, free)
        free = begin + sizes[i] * link_ms_per_elem / 1e3
        link.append((i, begin, free, t - start))
    last = max((b for _, _, b in spans), default=end)       # the end of the last slice's step
    last_start = max((a for _, a, _ in spans), default=end)  # when the last slice's step began
    return {"steps": [(i, a - start, b - start) for i, a, b in spans], "link": [x[:3] for x in link],
            "launched": [x[3] for x in link], "step_end": last - start, "last_step_start": last_start - start}


def measure_pipelining(namespace: dict, buckets: int = 6, elems: int = 60_000, repeats: int = 5) -> dict:
    """Rank 0 of 2 thread ranks, your `pipelined_step` and `step_then_gather`, interleaved ``repeats``
    times (the median run of each by when its last gather arrived). The steps run for real; each gather
    holds a simulated link for as long as its slice took to step (measured first), so the link is
    exactly as fast as the step and any saving is the overlap."""
    sizes = [elems] * buckets
    probe = []
    for _ in range(3):
        results, errors, world = in_threads(functools.partial(_timed_rank, fn=step_then_gather, sizes=sizes,
                                                              rounds=8, link_ms_per_elem=0.0), 2)
        probe.append(sum(b - a for _, a, b in results[0]["steps"]) / buckets)
    per_step_s = sorted(probe)[1]
    ms_per_elem = per_step_s * 1e3 / elems
    fns = {"yours": namespace.get("pipelined_step"), "step, then gather": step_then_gather}
    runs: dict[str, list[dict]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            if fn is None:
                continue
            results, errors, world = in_threads(functools.partial(_timed_rank, fn=fn, sizes=sizes, rounds=8,
                                                                  link_ms_per_elem=ms_per_elem), 2)
            if any(errors) or not results[0] or not results[0]["link"]:
                continue
            runs[name].append(results[0])
    out = {"buckets": buckets, "slice_step_ms": per_step_s * 1e3, "runs": {}}
    for name, rs in runs.items():
        if not rs:
            continue
        rs.sort(key=lambda r: max(b for _, _, b in r["link"]))
        r = rs[len(rs) // 2]
        r["last_arrival_ms"] = max(b for _, _, b in r["link"]) * 1e3
        r["first_launch_ms"] = min(a for _, a, _ in r["link"]) * 1e3
        r["step_ms"] = r["step_end"] * 1e3
        r["under_step"] = sum(t < r["last_step_start"] for t in r["launched"])   # sent while slices were stepped
        r["hideable_ms"] = sum(b - a for i, a, b in r["steps"] if i != 0) * 1e3      # the steps after the first
        arrivals = [max(b for _, _, b in x["link"]) * 1e3 for x in rs]
        r["spread_ms"], r["runs"] = (min(arrivals), max(arrivals)), len(rs)
        out["runs"][name] = r
    return out


def pipelining_sentences(m: dict) -> list[str]:
    """What the measurement shows, computed from it."""
    runs = m["runs"]
    if "yours" not in runs:
        return ["pipelined_step did not run (write exercise 10.pipelined_step first); only the unpipelined "
                "schedule was measured"]
    y, s = runs["yours"], runs["step, then gather"]
    n = m["buckets"]
    saved = s["last_arrival_ms"] - y["last_arrival_ms"]
    lines = [f"one slice's step took {m['slice_step_ms']:.1f} ms, and so does one gather on this link; the step of "
             f"all {n} slices took {y['step_ms']:.0f} ms (yours) and {s['step_ms']:.0f} ms (step, then gather);",
             f"yours: the first gather left {y['first_launch_ms']:.1f} ms into the step, {y['under_step']} of {n} "
             f"were launched before the last slice's step began, and the last arrived {y['last_arrival_ms']:.0f} ms "
             f"after the step began (median of {y['runs']} runs: "
             f"{y['spread_ms'][0]:.0f} to {y['spread_ms'][1]:.0f} ms);",
             f"step, then gather: the first gather left {s['first_launch_ms']:.0f} ms in, after the whole step "
             f"({s['under_step']} launched before its last slice), and "
             f"the last arrived {s['last_arrival_ms']:.0f} ms in ({s['spread_ms'][0]:.0f} to "
             f"{s['spread_ms'][1]:.0f} ms);"]
    if saved > 0.1 * s["last_arrival_ms"]:
        lines.append(f"so the parameters were complete {saved:.0f} ms sooner ({saved / s['last_arrival_ms']:.0%}); "
                     f"what pipelining can hide at most is the step of every slice but the first, "
                     f"{s['hideable_ms']:.0f} ms in the step-then-gather run (a run's own steps vary by a few ms)")
    else:
        lines.append(f"so pipelining saved {saved:.0f} ms here, less than a tenth: on this run the step and the "
                     f"gathers did not overlap as the schedule allows (a busy machine, or a schedule that waits)")
    return lines


def pipelining_figure(m: dict, path) -> Path:
    """Rank 0: the slices' steps and the gathers on the link, for both schedules."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8.4, 2.9))
    ax = fig.subplots()
    rows = []
    for k, (name, r) in enumerate(m["runs"].items()):
        base = 2 * (len(m["runs"]) - 1 - k)
        for i, a, b in r["steps"]:
            ax.barh(base + 1, (b - a) * 1e3, left=a * 1e3, height=0.6, color="#8172b2", edgecolor="white")
            ax.text((a + b) / 2 * 1e3, base + 1, f"step {i}", ha="center", va="center", fontsize=6, color="white")
        for i, a, b in r["link"]:
            ax.barh(base, (b - a) * 1e3, left=a * 1e3, height=0.6, color="#c44e52", edgecolor="white")
            ax.text((a + b) / 2 * 1e3, base, f"gather {i}", ha="center", va="center", fontsize=6, color="white")
        ax.axvline(r["last_arrival_ms"], ymin=0, ymax=1, color="#444444", linewidth=0.5, linestyle=":")
        rows += [(base + 1, f"{name}: step"), (base, f"{name}: link")]
    ax.set_yticks([y for y, _ in rows], [t for _, t in rows], fontsize=8)
    ax.set_xlabel("ms since the step began (rank 0; steps measured, gathers on a simulated link)")
    ax.set_title("step each slice, launch its gather at once, vs step everything, then gather", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return Path(path)
