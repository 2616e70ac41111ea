"""Drawn cases: a check states the property an exercise must hold and tests it on cases drawn from
a seeded generator, not only on the cases its author chose; the first case that fails is shrunk to
a small one, which the hint shows (the input and what the learner's code did, never the answer).

`falsify` is that loop for every lesson: ``prop(case)`` returns None while the property holds, else
what went wrong on that case; ``smaller(case)`` offers smaller cases from the same space (fewer ranks,
shorter sources, rounder numbers), tried in order, and the smallest that still fails is kept.

The rest of this module is the space of lessons 05 and 06: a seeded generator of small models (frozen
parameters, a rank that skips a parameter, gradients that arrive out of launch order, 2 to 4 ranks),
and one step of a learner's sync run on thread ranks that reads every rank.

The properties the checks state on these cases:

- **launched on time**: after the hook of each parameter, a rank has launched exactly the units (a
  parameter in 05, a bucket in 06) at the head of the launch order whose gradients have all arrived
  on that rank, no fewer (a launch left for a later hook) and no more;
- **the mean on every rank**: after ``finish()``, every parameter that requires grad holds the mean
  over the ranks of their gradients, zeros for a rank that did not use it, on *every* rank, the
  rank that skipped included; a frozen parameter is never reduced and keeps ``.grad is None``.

A gradient arrives when backward finishes it: `Chain` uses its parameters one after the other in a
drawn order, so they arrive in the reverse of that order, which is not the reverse registration
order a sync launches in. The ranks are threads of this process with lesson 10's logging stand-in
for torch.distributed (`course.checks.lesson10.threads.ThreadWorld`): a step takes milliseconds,
and a pattern that would hang real ranks fails after a few seconds.
"""

from __future__ import annotations

import random
import re
import threading
import time
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
import torch.nn as nn

RUNAWAY_CALLS = 10_000


# =============================================================================================
# Drawing and shrinking, for every lesson
# =============================================================================================
@dataclass
class Counterexample:
    """The smallest failing case `falsify` found.

    Args:
        case: the case, after shrinking.
        message: what went wrong on it (``prop``'s answer).
        index: which drawn case failed first (1-based).
        drawn: how many cases were drawn in all.
        shrunk: whether ``case`` is smaller than the drawn one.
    """

    case: object
    message: str
    index: int
    drawn: int
    shrunk: bool

    def __str__(self) -> str:
        where = (f"drawn case {self.index} of {self.drawn}, shrunk to a smallest one that still fails"
                 if self.shrunk else f"drawn case {self.index} of {self.drawn}")
        return f"{self.message} [{where}]"


def falsify(cases, prop, smaller=None, budget: int = 60, kind=None) -> Counterexample | None:
    """The first case of ``cases`` for which ``prop`` fails, shrunk; None when the property holds on all.

    Args:
        cases: the drawn cases, in order.
        prop: ``prop(case) -> None`` when the property holds, else a message naming what went wrong.
            An exception it raises counts as a failure, named by its type and message.
        smaller: ``smaller(case)`` yields smaller cases, smallest first; each one that still fails
            replaces the case, and shrinking starts again from it.
        budget: at most this many calls of ``prop`` while shrinking (a check's time stays bounded).
        kind: ``kind(message)``: a smaller case replaces the case only when it fails the same way (the same
            kind), so that shrinking keeps the mistake it found and does not wander to another.
    """
    cases = list(cases)

    def fails(case) -> str | None:
        try:
            return prop(case)
        except AssertionError as exc:   # a diagnosis (`Wrong`) raised inside the property: its own words
            return str(exc)
        except Exception as exc:    # noqa: BLE001 - the learner's code raised on this case: that is a failure
            return f"{type(exc).__name__}: {exc}"

    for index, case in enumerate(cases, 1):
        message = fails(case)
        if message is None:
            continue
        shrunk, calls, progress = False, 0, smaller is not None
        while progress and calls < budget:
            progress = False
            for candidate in smaller(case):
                if calls >= budget:
                    break
                calls += 1
                why = fails(candidate)
                if why is not None and (kind is None or kind(why) == kind(message)):
                    case, message, shrunk, progress = candidate, why, True, True
                    break
        return Counterexample(case, message, index, len(cases), shrunk)
    return None


def after_colon(message: str) -> str:
    """The diagnosis of a message written ``"what the code did: what is wrong"`` (a `falsify` kind), its numbers
    left out, so that the same mistake on a smaller case (2 ranks for 3, "twice" for "3 times") is the same kind."""
    why = message.split(": ", 1)[-1]
    return re.sub(r"\d+(\.\d+)?", "#", why.replace("twice", "2 times"))[:80]


def common_reason(candidates: list[list[str]]) -> str | None:
    """The first reason (in the order of the first failing case's list) that every failing case offers: one mistake
    that explains every failure, rather than the first that fits one case (two mistakes can give the same number on
    one case, never on all of them)."""
    for why in (candidates[0] if candidates else []):
        if all(why in c for c in candidates[1:]):
            return why
    return None


def simpler_numbers(values: tuple, keep=lambda values: True):
    """Smaller tuples of numbers: one value at a time replaced by 0, 1, 2, 5, 10 or itself rounded (those below
    it), first positions first; ``keep`` filters out those that leave the space (a part that must be > 0)."""
    for i, v in enumerate(values):
        for small in (0.0, 1.0, 2.0, 5.0, 10.0, float(round(v))):
            if abs(small) < abs(v) and small != v:
                out = values[:i] + (type(v)(small) if isinstance(v, int) else small,) + values[i + 1:]
                if keep(out):
                    yield out


def world_sizes_below(n: int):
    """Fewer ranks: 2, then 3, below ``n``."""
    return [w for w in (2, 3) if w < n]


def run_thread_ranks(world_size: int, fn, wait_s: float = 3.0, timeout_s: float = 20.0, world=None):
    """``fn(rank)`` on ``world_size`` thread ranks with the course's stand-in for torch.distributed installed
    (lesson 10's `ThreadWorld`); returns ``(results, errors)``, one entry per rank. A rank whose peer raised stops
    waiting for it at once (its error is a `PeerFailed`: `root_error` skips those). Pass ``world`` (a `ThreadWorld`
    made with ``fail_fast=True``) to read its log of launches and waits afterwards."""
    from course.checks.lesson10.threads import ThreadWorld

    world = world if world is not None else ThreadWorld(world_size, timeout_s=wait_s, fail_fast=True)
    results, errors = [None] * world_size, [None] * world_size

    def body(rank):
        world.local.rank = rank
        try:
            results[rank] = fn(rank)
        except BaseException as exc:      # reported by the check, which names the rank
            errors[rank] = exc
            world.fail(rank)

    with world.installed():
        threads = [threading.Thread(target=body, args=(r,), daemon=True, name=f"course-rank-{r}")
                   for r in range(world_size)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + timeout_s
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
    for r, t in enumerate(threads):
        if t.is_alive() and errors[r] is None:
            errors[r] = TimeoutError(f"rank {r} did not finish within {timeout_s:.0f} s (a loop that never ends?)")
    return results, errors


def root_error(errors: list) -> tuple[int, BaseException] | None:
    """The first rank's error that is its own, not a wait for a peer that had failed; None when no rank raised."""
    from course.checks.lesson10.threads import PeerFailed

    mine = [(r, e) for r, e in enumerate(errors) if e is not None and not isinstance(e, PeerFailed)]
    anyone = [(r, e) for r, e in enumerate(errors) if e is not None]
    return (mine or anyone or [None])[0]


@dataclass
class Draw:
    """One drawn case.

    Args:
        index: its number in the draw (1-based), for messages.
        world_size: ranks (2, 3 or 4).
        sizes: elements of each parameter ``p0, p1, ...`` in registration order (all different).
        use_order: the order forward uses them in; gradients arrive in its reverse.
        frozen: parameters with requires_grad=False.
        skipped: ``{rank: [parameters that rank does not use this step]}``.
        buckets: a plan (lists of names, launch order) over the trainable parameters, for lesson 06.
    """

    index: int
    world_size: int
    sizes: list[int]
    use_order: list[int]
    frozen: list[str] = field(default_factory=list)
    skipped: dict[int, list[str]] = field(default_factory=dict)
    buckets: list[list[str]] = field(default_factory=list)

    @property
    def names(self) -> list[str]:
        return [f"p{i}" for i in range(len(self.sizes))]

    @property
    def trainable(self) -> list[str]:
        return [n for n in self.names if n not in self.frozen]

    def arrivals(self, rank: int) -> list[str]:
        """The order this rank's gradients become final in."""
        return [f"p{i}" for i in reversed(self.use_order)
                if f"p{i}" not in self.frozen and f"p{i}" not in self.skipped.get(rank, [])]

    def describe(self) -> str:
        who = ("; ".join(f"rank {r} skips {', '.join(ns)}" for r, ns in sorted(self.skipped.items()))
               or "every rank uses all")
        frozen = f"; frozen: {', '.join(self.frozen)}" if self.frozen else ""
        plan = f"; buckets {self.buckets}" if self.buckets else ""
        return (f"drawn case {self.index}: {self.world_size} ranks, parameters {', '.join(self.names)} used in the "
                f"order {', '.join(f'p{i}' for i in self.use_order)}{frozen}; {who}{plan}")


class Chain(nn.Module):
    """Parameters ``p0 ... pK-1`` of different sizes, used one after the other in ``use_order``: the
    gradient of a parameter used later is final earlier."""

    def __init__(self, sizes: list[int], frozen=()):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        for i, size in enumerate(sizes):
            self.register_parameter(f"p{i}", nn.Parameter(torch.randn(size, generator=g) * 0.3,
                                                          requires_grad=f"p{i}" not in frozen))
            self.register_buffer(f"w{i}", torch.randn(size, generator=g))

    def forward(self, x: torch.Tensor, use_order, skipped=()) -> torch.Tensor:
        h = x
        for i in use_order:
            if f"p{i}" in skipped:
                continue
            p, w = getattr(self, f"p{i}"), getattr(self, f"w{i}")
            h = torch.tanh(h * (1 + 0.2 * p.mean()) + 0.3 * (p * w).sum())
        return h.square().mean()


def draw_cases(seed: int, count: int, *, frozen_every: int = 0, skip: bool = True,
               buckets: bool = False) -> list[Draw]:
    """``count`` cases from ``random.Random(seed)``: world sizes 2, 3, 4 in turn; 4 to 6 parameters; a use
    order that makes some hook complete more than one unit at the head of the launch order; one rank
    (drawn, not always the last) that skips a parameter, with ``skip``; a frozen parameter in every
    ``frozen_every``-th case (1: all, 2: every other, 0: none); with ``buckets``, a plan of 2 or 3
    buckets in reverse registration order."""
    rng = random.Random(seed)
    out = []
    for index in range(1, count + 1):
        k = rng.randint(4, 6)
        sizes = rng.sample(range(2, 40), k)
        names = [f"p{i}" for i in range(k)]
        froze = [rng.choice(names)] if frozen_every and (index - 1) % frozen_every == 0 else []
        trainable = [n for n in names if n not in froze]
        order = trainable[::-1]                        # the launch order of lessons 05 and 06
        while True:
            use = rng.sample(range(k), k)
            arrive = [f"p{i}" for i in reversed(use) if f"p{i}" not in froze]
            # some parameter arrives before the one ahead of it in the launch order: that one's hook
            # then completes two at once
            if any(order.index(a) > order.index(b) for a, b in zip(arrive, arrive[1:])):
                break
        world = (2, 3, 4)[(index - 1) % 3]
        skipper = rng.randrange(world)
        skipped = {skipper: [rng.choice(trainable)]} if skip else {}
        plan = []
        if buckets:
            cuts = sorted(rng.sample(range(1, len(order)), rng.randint(1, 2)))
            plan = [order[a:b] for a, b in zip([0, *cuts], [*cuts, len(order)])]
        out.append(Draw(index, world, sizes, use, froze, skipped, plan))
    return out


@dataclass
class RankStep:
    """What one rank did in one drawn step."""

    launches_after: list[tuple[str, int]]     # (parameter whose hook just ran, all-reduces launched so far)
    numels: list[int]                          # every all-reduce's size, in launch order
    grads: dict[str, torch.Tensor | None]      # .grad after finish()
    local: dict[str, torch.Tensor]             # this rank's own gradient (zeros where it has none)
    error: BaseException | None = None
    where: str = ""                            # "construct", "backward" or "finish"


def run_drawn_step(draw: Draw, make_sync, timeout_s: float = 20.0) -> list[RankStep]:
    """One step of ``make_sync(model)`` on ``draw.world_size`` thread ranks: every rank's launches
    after every hook, and its gradients after ``finish()``."""
    from course.checks.lesson10.threads import ThreadWorld

    # A step takes milliseconds: a wait this long is a hang; a rank whose peer raised stops waiting at once.
    world = ThreadWorld(draw.world_size, timeout_s=3.0, fail_fast=True)
    steps: list[RankStep | None] = [None] * draw.world_size
    calls: dict[int, list[int]] = {r: [] for r in range(draw.world_size)}

    def body(rank: int) -> None:
        world.local.rank = rank
        skipped = draw.skipped.get(rank, [])
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(100 * draw.index + rank))
        ref = Chain(draw.sizes, draw.frozen)
        ref(x, draw.use_order, skipped).backward()
        local = {n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
                 for n, p in ref.named_parameters() if p.requires_grad}
        model = Chain(draw.sizes, draw.frozen)
        st = RankStep([], calls[rank], {}, local)
        steps[rank] = st
        where = "construct"
        try:
            sync = make_sync(model, draw)
            calls[rank].clear()
            for n, p in model.named_parameters():
                if p.requires_grad:        # after the learner's hooks: runs once theirs has
                    p.register_post_accumulate_grad_hook(
                        lambda _p, n=n: st.launches_after.append((n, len(calls[rank]))))
            where = "backward"
            model(x, draw.use_order, skipped).backward()
            where = "finish"
            sync.finish()
            st.grads = {n: (None if p.grad is None else p.grad.detach().clone()) for n, p in model.named_parameters()}
            if hasattr(sync, "close"):
                sync.close()
        except BaseException as exc:      # reported by the check, which names it
            st.error, st.where = exc, where
            world.fail(rank)

    with world.installed():
        inner = dist.all_reduce

        def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
            mine = calls[world.rank]
            if len(mine) >= RUNAWAY_CALLS:
                raise RuntimeError(f"more than {RUNAWAY_CALLS} all-reduces in one step: a launch loop that never "
                                   f"moves on to the next one")
            mine.append(tensor.numel())
            return inner(tensor, op=op, group=group, async_op=async_op)

        dist.all_reduce = all_reduce
        try:
            threads = [threading.Thread(target=body, args=(r,), daemon=True, name=f"course-drawn-{r}")
                       for r in range(draw.world_size)]
            for t in threads:
                t.start()
            deadline = time.monotonic() + timeout_s
            for t in threads:
                t.join(max(0.0, deadline - time.monotonic()))
        finally:
            dist.all_reduce = inner
    for r, st in enumerate(steps):
        if st is None or threads[r].is_alive():
            steps[r] = RankStep([], calls[r], {}, {}, TimeoutError(f"rank {r} did not finish within {timeout_s:.0f} s"),
                                "finish")
    return steps


def smaller_draws(draw: Draw):
    """Smaller cases of the same model: fewer ranks (the rank that skips kept, renumbered into the smaller world),
    no frozen parameter (when no bucket plan depends on which are trainable), no rank that skips."""
    for world in (2, 3):
        if world < draw.world_size:
            skipped: dict[int, list[str]] = {}
            for rank, names in draw.skipped.items():
                skipped.setdefault(min(rank, world - 1), []).extend(names)
            yield replace(draw, world_size=world, skipped=skipped)
    if draw.frozen and not draw.buckets:
        yield replace(draw, frozen=[])
    if draw.skipped:
        yield replace(draw, skipped={})


def raise_smallest(pairs, check, make_sync, budget: int = 8) -> None:
    """Run ``check`` (which raises `Wrong` on a list of ``(draw, steps)``) on each drawn case in turn; the first
    that fails is shrunk (`smaller_draws`, each candidate run again on thread ranks and kept while it fails the
    same way), and the smallest one's `Wrong` is raised, saying which drawn case it came from."""
    from course.grading import Wrong

    pairs = list(pairs)
    for index, (draw, steps) in enumerate(pairs, 1):
        try:
            check([(draw, steps)])
            continue
        except Wrong as exc:
            first = exc
        kind = lambda w: re.sub(r"\d+", "#", str(w))[:30]          # noqa: E731
        best, shrunk, calls, progress = first, False, 0, True
        while progress and calls < budget:
            progress = False
            for candidate in smaller_draws(draw):
                if calls >= budget:
                    break
                calls += 1
                try:
                    check([(candidate, run_drawn_step(candidate, make_sync))])
                except Wrong as exc:
                    if kind(exc) == kind(best):
                        draw, best, shrunk, progress = candidate, exc, True, True
                        break
        note = (f" [drawn case {index} of {len(pairs)}, shrunk to a smallest one that still fails]" if shrunk
                else f" [drawn case {index} of {len(pairs)}]")
        raise Wrong(str(best) + note, reveal=best.reveal)


def run_draws(draws: list[Draw], make_sync) -> list[tuple[Draw, list[RankStep]]]:
    """`run_drawn_step` on each draw in turn, stopping after the first one where a rank raised (its peers then
    wait out the timeout: one such draw is enough to name it)."""
    out = []
    for draw in draws:
        steps = run_drawn_step(draw, make_sync)
        out.append((draw, steps))
        if any(st.error is not None for st in steps):
            break
    return out


def expected_launched(draw: Draw, rank: int, units: list[list[str]], arrived: list[str]) -> int:
    """How many units (lists of names, in launch order) are complete at the head, given what has arrived."""
    have = set(arrived)
    k = 0
    while k < len(units) and all(n in have for n in units[k]):
        k += 1
    return k


def first_late_launch(draw: Draw, steps: list[RankStep], units: list[list[str]]) -> str | None:
    """The first hook, on any rank, after which fewer units were launched than were complete at the head;
    None when every hook launched all it completed."""
    for rank, st in enumerate(steps):
        arrived = []
        for name, launched in st.launches_after:
            arrived.append(name)
            want = expected_launched(draw, rank, units, arrived)
            if launched < want:
                label = lambda u: "[" + ", ".join(u) + "]" if len(u) > 1 else u[0]      # noqa: E731
                late = ", ".join(label(u) for u in units[launched:want])
                return (f"rank {rank}: when the hook of {name} returned, the first {want} of the launch order "
                        f"({', '.join(label(u) for u in units[:want])}) had all their gradients (arrived so far: "
                        f"{', '.join(arrived)}), but only {launched} had been launched: {late} waited for a later "
                        f"hook or finish()")
    return None


def mean_over_ranks(draw: Draw, steps: list[RankStep]) -> dict[str, torch.Tensor]:
    return {n: sum(st.local[n] for st in steps) / draw.world_size for n in draw.trainable}


def first_wrong_grad(draw: Draw, steps: list[RankStep]) -> str | None:
    """The first rank and parameter whose .grad after finish() is not the mean over the ranks; None when
    every rank holds it (a parameter no rank used may stay None; a frozen one must)."""
    mean = mean_over_ranks(draw, steps)
    used_anywhere = {n for n in draw.trainable if any(n not in draw.skipped.get(r, []) for r in range(draw.world_size))}
    for rank, st in enumerate(steps):
        skipped = draw.skipped.get(rank, [])
        for n in draw.frozen:
            if st.grads.get(n) is not None:
                return (f"rank {rank}: the frozen {n} (requires_grad=False) has a .grad after finish(); it must "
                        f"stay None")
        for n in draw.trainable:
            got, want = st.grads.get(n), mean[n]
            if got is None and n not in used_anywhere:
                continue
            if got is not None and got.shape == want.shape and torch.allclose(got, want, rtol=1e-4, atol=1e-6):
                continue
            state = ("has no .grad" if got is None else
                     "holds zeros" if not got.any() else
                     "holds its own gradient" if torch.allclose(got, st.local[n], rtol=1e-4, atol=1e-6) else
                     "holds the sum over the ranks" if torch.allclose(got, want * draw.world_size, rtol=1e-4, atol=1e-6)
                     else "holds something else")
            if n in skipped:
                return (f"rank {rank}, which did not use {n}, {state} in {n}.grad after finish(), not the mean of "
                        f"the other ranks' gradients (over {draw.world_size} ranks)")
            return f"rank {rank}: {n}.grad {state} after finish(), not the mean over the {draw.world_size} ranks"
    return None
