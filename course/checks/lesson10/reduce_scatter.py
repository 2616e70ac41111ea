"""10.reduce_scatter: a reduce-scatter built from all-to-all, checked on 2, 3 and 4 thread ranks.

The property: for any world size N (a power of two or not), any slice size S, any floating dtype and
values of any size, rank r ends with the mean over all ranks of slice r of their tensors, in the
input's dtype. Pairings that only work on powers of two (partner = rank ^ step) meet their first
counterexample at N = 3; buffers made without dtype= (float32) meet theirs at float64 and bfloat16."""

from __future__ import annotations

import functools
import itertools
import random
import re

import torch

from course.checks.drawn import falsify
from course.grading import Exercise, Learner, Wrong, get_exercise, is_stub

from .threads import REFUSED, _close, _unwaited, _your_line, in_threads, raise_rank_error


# =============================================================================================
# 10.reduce_scatter
# =============================================================================================
rs_ex = Exercise("10.reduce_scatter", uses=["reduce_scatter_mean"], title="a reduce-scatter from all-to-all")

RS_REFUSE = {name: REFUSED[name] for name in ("all_reduce", "reduce_scatter_single", "reduce_scatter_tensor",
                                              "reduce_scatter")}
RS_SIZES = (3, 1000)       # elements per rank's slice
RS_WORLDS = (2, 4, 3)      # 3 (last, after the powers of two): a rank ^ step pairing reaches a rank past N
RS_HINT = ("rank r must end with the mean over all ranks of slice r of their tensors (S elements) and nothing "
           "else: compare what each rank holds after your exchange with that, on 2 ranks and S = 3")
RS_REVEAL = ("received = torch.empty_like(flat); dist.all_to_all_single(received, flat); "
             "return received.view(N, -1).sum(0) / N   # N = dist.get_world_size()")


def rs_input(rank: int, world_size: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s contribution: ``world_size * size`` values, different on every rank and in every slice."""
    k = torch.arange(world_size * size, dtype=torch.float32)
    return torch.sin(k * 0.37 + rank * 1.3) * (rank + 1) + 0.1 * (k // size) + 0.01 * rank


def _rs_rank(rank, world_size, world, fn):
    out = []
    for size in RS_SIZES:
        flat = rs_input(rank, world_size, size)
        got = fn(flat)
        out.append({"size": size, "got": None if got is None else torch.as_tensor(got).detach().clone(),
                    "log": world.take(rank)})
    return out


def _peer_beyond(exc: BaseException, n: int) -> bool:
    """Whether ``exc`` names rank N or beyond, a rank that does not exist: the thread ranks' refusal of such a
    peer, or an index past the N chunks of the input."""
    found = re.search(r"named peer (-?\d+)", str(exc))
    if found is not None:
        return int(found.group(1)) >= n
    found = re.search(r"index (\d+) is out of bounds for dimension 0 with size (\d+)", str(exc))
    return found is not None and int(found.group(2)) == n and int(found.group(1)) >= n


def _beyond(exc: BaseException) -> str:
    return re.search(r"(?:named peer|index) (-?\d+)", str(exc)).group(1)


def _rs_facts(learner) -> dict:
    def compute():
        facts = {}
        for n in RS_WORLDS:
            results, errors, world = in_threads(functools.partial(_rs_rank, fn=learner.reduce_scatter_mean), n,
                                                refuse=RS_REFUSE)
            bad = [(r, e) for r, e in enumerate(errors) if e is not None and _peer_beyond(e, n)]
            if bad and not any(e["event"] == "refused" for e in world.log):
                r, exc = bad[0]
                raise Wrong(f"{n} ranks: rank {r} paired itself with rank {_beyond(exc)}, which does not exist at "
                            f"N = {n} ({str(exc).splitlines()[0]}{_your_line(exc)}): a pairing such as partner = rank "
                            f"^ step covers every rank only when N is a power of two. Exchange with every other rank "
                            f"by a rule that holds for any N", reveal=RS_REVEAL)
            if any(errors):
                raise_rank_error(errors, world, RS_HINT, RS_REVEAL, where=f"{n} ranks: ")
            facts[n] = results
        return facts
    return learner.once("10.reduce_scatter", compute)


def _rs_diagnose(got: torch.Tensor | None, rank: int, n: int, size: int, log: list[dict],
                 inputs: list[torch.Tensor] | None = None) -> str | None:
    """None when ``got`` is this rank's mean slice; else what the learner's result is instead."""
    inputs = inputs if inputs is not None else [rs_input(r, n, size) for r in range(n)]
    chunk = lambda r, j: inputs[r][j * size:(j + 1) * size]          # noqa: E731 (slice j of rank r)
    total = sum(chunk(r, rank) for r in range(n))
    if got is None:
        return "reduce_scatter_mean returned None: return this rank's slice of the mean (a tensor of S elements)"
    if _close(got, total / n):
        return None
    late = _unwaited(log)
    if late:
        return (f"you launched {late[0]['kind']} with async_op=True and never waited for it: its output is not "
                f"there until work.wait() returns (or launch it without async_op)")
    g = got.reshape(-1)
    if g.numel() == n * size:
        full_mean = sum(inputs) / n
        if _close(g, full_mean):
            return (f"you returned the whole mean ({n}*S elements): that is what an all-reduce leaves. A reduce-"
                    f"scatter leaves each rank only its own slice: S elements, slice `rank`")
        return (f"you returned {n}*S elements, the size of the input: return S elements, this rank's slice of the "
                f"mean (the received chunks summed)")
    if g.numel() != size:
        return f"you returned {g.numel()} elements for S = {size}: return this rank's slice, S = flat.numel() // N"
    if _close(g, total):
        return "that is the sum over the ranks, not the mean: divide by the world size N (once)"
    if _close(g, total / n / n):
        return ("you averaged twice: the result is the mean divided by N again. Divide by N once, either each "
                "contribution before the exchange or the sum after it, not both")
    if _close(g, chunk(rank, rank)) or _close(g, chunk(rank, rank) / n):
        return ("that is this rank's own slice, not reduced: add what every other rank sent for slice `rank` "
                "to your own contribution")
    for j in range(n):
        if j != rank and (_close(g, sum(chunk(r, j) for r in range(n)) / n)):
            return (f"rank {rank} holds the mean of slice {j}: rank r must end with slice r (elements r*S to "
                    f"(r+1)*S), so send slice j to rank j, not the other way round")
    for k in range(1, n):                 # some peers' contributions never arrived
        for ranks in itertools.combinations(range(n), k):
            part = sum(chunk(r, rank) for r in ranks)
            if rank in ranks and (_close(g, part / n) or _close(g, part / k)):
                gone = [r for r in range(n) if r not in ranks]
                return (f"rank {rank} holds the contributions of ranks {', '.join(map(str, ranks))} only: what rank"
                        f"{'s' if len(gone) > 1 else ''} {', '.join(map(str, gone))} sent for slice {rank} never "
                        f"arrived. Every rank must exchange with every other rank, for any N: a pairing that "
                        f"covers everyone only when N is a power of two (partner = rank ^ step) skips peers at N = 3")
    if n == 2 and (_close(g, chunk(1 - rank, rank)) or _close(g, chunk(1 - rank, rank) / n)):
        return ("that is only what the other rank sent: the mean needs your own contribution to slice `rank` "
                "too")
    return "the result is not this rank's slice of the mean"


@rs_ex.case("each rank ends with the mean of its own slice (2, 3 and 4 ranks, S = 3 and 1000)", hint=RS_HINT,
            reveal=RS_REVEAL, timeout=60)
def _(learner):
    """Property: on 2, 3 and 4 thread ranks and S = 3 and 1000, every rank r ends with the mean over the ranks of
    slice r; the first rank that breaks it is named."""
    facts = _rs_facts(learner)
    for n, results in facts.items():
        for rank, per_size in enumerate(results):
            for item in per_size:
                why = _rs_diagnose(item["got"], rank, n, item["size"], item["log"])
                if why:
                    raise Wrong(f"{n} ranks, rank {rank}, S = {item['size']}: {why}", reveal=RS_REVEAL)
    return "the mean slice on every rank"


def _draw_rs(seed: int = 101, count: int = 6) -> list[tuple]:
    """``(N, S, dtype, seed, scale)``: 2, 3 and 4 ranks, slices of 1 to 97 elements, float32, float64 and bfloat16,
    values from 1e-3 to 1e3 in size."""
    rng = random.Random(seed)
    dtypes = (torch.float64, torch.bfloat16, torch.float32)
    return [((3, 2, 4)[k % 3], rng.choice((1, 2, 5, 7, 64, rng.randint(8, 97))), dtypes[k % 3], rng.randrange(1000),
             rng.choice((1e-3, 1.0, 1e3))) for k in range(count)]


def _drawn_input(rank: int, case) -> torch.Tensor:
    n, size, dtype, seed, scale = case
    g = torch.Generator().manual_seed(seed * 10 + rank)
    return (torch.randn(n * size, generator=g, dtype=torch.float64) * scale).to(dtype)


def _rs_drawn_mistake(learner, case) -> str | None:
    n, size, dtype, seed, scale = case
    results, errors, world = in_threads(lambda rank, _n, _w: learner.reduce_scatter_mean(_drawn_input(rank, case)),
                                        n, refuse=RS_REFUSE)
    if any(errors):
        r, exc = next((r, e) for r, e in enumerate(errors) if e is not None)
        text = str(exc).strip().splitlines()
        return f"rank {r} raised {type(exc).__name__}: {text[-1] if text else ''}{_your_line(exc)}"
    inputs = [_drawn_input(r, case) for r in range(n)]
    for rank, got in enumerate(results):
        want = sum(x.double()[rank * size:(rank + 1) * size] for x in inputs) / n
        if got is None:
            return f"rank {rank} returned None"
        got = torch.as_tensor(got)
        if got.dtype != dtype:
            return (f"rank {rank} returned {str(got.dtype).replace('torch.', '')} for a "
                    f"{str(dtype).replace('torch.', '')} input: a buffer made with torch.empty(...) or torch.zeros(...) "
                    f"without dtype= is float32; make it like the input (torch.empty_like(flat), or dtype=flat.dtype)")
        if got.numel() != size:
            return f"rank {rank} returned {got.numel()} elements for S = {size}"
        tol = {torch.bfloat16: 2e-2, torch.float32: 1e-5, torch.float64: 1e-10}[dtype]
        if not torch.allclose(got.double(), want, rtol=tol, atol=tol * scale):
            if dtype == torch.float64 and torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5 * scale):
                return (f"rank {rank}'s mean is right only to float32's precision: what the other ranks sent was "
                        f"rounded to float32 on its way, in a buffer made without dtype= (torch.empty(...) is float32); "
                        f"make every buffer like the input (torch.empty_like(flat), or dtype=flat.dtype)")
            why = _rs_diagnose(got.double(), rank, n, size, [], inputs=[x.double() for x in inputs])
            return f"rank {rank}: {why or 'the result is not the mean of slice ' + str(rank)}"
    return None


@rs_ex.case("drawn inputs: any slice size, float32, float64 and bfloat16, values of any size",
            hint=RS_HINT, reveal=RS_REVEAL, timeout=60,
            after="each rank ends with the mean of its own slice (2, 3 and 4 ranks, S = 3 and 1000)")
def _(learner):
    """Property: on 2, 3 and 4 ranks with drawn slices (1 to 97 elements), dtypes (float32, float64, bfloat16) and
    values (1e-3 to 1e3), rank r ends with the mean of slice r, in the input's dtype, S elements."""
    cases = _draw_rs()
    found = falsify(cases, lambda c: (None if (why := _rs_drawn_mistake(learner, c)) is None else
                                      f"{c[0]} ranks, S = {c[1]}, {str(c[2]).replace('torch.', '')}, values near "
                                      f"{c[4]:g}: {why}"),
                    smaller=lambda c: ((w, *c[1:]) for w in (2, 3) if w < c[0]),
                    kind=lambda m: m.split(": ", 1)[-1].split(" ", 2)[-1][:40])
    if found is not None:
        raise Wrong(str(found), reveal=RS_REVEAL)
    return f"{len(cases)} drawn inputs"


@rs_ex.case("it sends each peer only that peer's slice: (N-1)/N of the tensor, half an all-reduce's bytes",
            hint="count what each rank sends: a peer needs only its own slice of your tensor", timeout=60,
            after="each rank ends with the mean of its own slice (2, 3 and 4 ranks, S = 3 and 1000)")
def _(learner):
    """Property: each rank puts (N-1)/N of its tensor's bytes on the wire, one slice to each peer."""
    facts = _rs_facts(learner)
    for n, results in facts.items():
        for rank, per_size in enumerate(results):
            item = per_size[-1]
            nbytes = n * item["size"] * 4
            sent = sum(e["bytes"] for e in item["log"] if e["event"] == "launch")
            want = (n - 1) / n * nbytes
            if sent > 1.01 * want:
                raise Wrong(f"{n} ranks: rank {rank} sent {sent / nbytes:.2f} x the tensor's bytes, a reduce-scatter "
                            f"needs {want / nbytes:.2f} x: (N-1) slices of S elements, one to each peer. Sending "
                            f"every peer the whole tensor costs N-1 times that; an all-reduce 2(N-1)/N",
                            reveal="each peer j needs only flat[j*S:(j+1)*S]: dist.all_to_all_single(received, flat)")
            if sent < 0.99 * want:
                raise AssertionError(f"{n} ranks: rank {rank} sent {sent:.0f} bytes, fewer than the "
                                     f"{want:.0f} every peer's slice takes")
    return "2 ranks: 0.50 x the tensor, 3 ranks: 0.67 x, 4 ranks: 0.75 x (an all-reduce: 1.00 x, 1.33 x, 1.50 x)"


def learner_reduce_scatter(namespace: dict) -> str | None:
    """The learner's reduce_scatter_mean written to a file for gloo ranks; None while it is a stub."""
    fn = namespace.get("reduce_scatter_mean")
    if fn is None or is_stub(fn):
        return None
    return Learner(namespace, get_exercise("10.reduce_scatter")).module_file()

