"""10.sharded_step: a rank's clipped SGD step on the slice it owns, with the global norm."""

from __future__ import annotations

import functools
import math
import random
from dataclasses import dataclass, replace

import torch

from course.checks.drawn import after_colon, falsify, root_error, run_thread_ranks
from course.grading import Exercise, Wrong

from .threads import _close, _your_line, run_ranks


# =============================================================================================
# 10.sharded_step
# =============================================================================================
step_ex = Exercise("10.sharded_step", uses=["sharded_sgd_step"], title="a sharded, clipped optimizer step")

STEP_SIZE = 5
STEP_LR = 0.5
STEP_WORLDS = (2, 4)
STEP_NORMS = (1.0, 100.0)           # clipping active, then inactive (a coefficient above 1 would scale up)
STEP_HINT = ("the number returned must be the 2-norm of the whole mean gradient, every slice of it, and the same "
             "on every rank, though each rank holds only its own slice")
STEP_REVEAL = ("sq = (g.double() ** 2).sum().reshape(1); dist.all_reduce(sq); norm = sq.sqrt().item(); "
               "coef = min(1.0, max_norm / (norm + 1e-6)); flat_params[mine].add_(g, alpha=-lr * coef)   "
               "# g = grad_buffer[mine], mine = slice(rank * S, (rank + 1) * S)")


def step_slices(world_size: int, size: int = STEP_SIZE) -> list[torch.Tensor]:
    """The mean gradient's N slices: slice 0 is large (norm 4), the others small (norm 0.3): ranks disagree."""
    g = torch.Generator().manual_seed(7)
    out = []
    for j in range(world_size):
        v = torch.randn(size, generator=g)
        out.append(v / v.norm() * (4.0 if j == 0 else 0.3))
    return out


def step_inputs(rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(flat_params, grad_buffer) on ``rank``: the parameters agree; the buffer holds the mean only in slice
    ``rank``; elsewhere this rank's unreduced contributions (large, different per rank)."""
    size = STEP_SIZE
    params = torch.linspace(-1.0, 1.0, world_size * size)
    buf = torch.full((world_size * size,), 5.0 + rank) * torch.cos(torch.arange(world_size * size, dtype=torch.float32))
    buf[rank * size:(rank + 1) * size] = step_slices(world_size)[rank]
    return params, buf


def _step_rank(rank, world_size, world, fn):
    out = []
    for max_norm in STEP_NORMS:
        params, buf = step_inputs(rank, world_size)
        before = buf.clone()
        norm = fn(params, buf, STEP_LR, max_norm)
        out.append({"max_norm": max_norm, "norm": norm, "params": params.clone(), "log": world.take(rank),
                    "buffer_changed_outside": not torch.equal(_outside(buf, rank, world_size),
                                                              _outside(before, rank, world_size))})
    return out


def _outside(t: torch.Tensor, rank: int, n: int) -> torch.Tensor:
    size = t.numel() // n
    return torch.cat([t[:rank * size], t[(rank + 1) * size:]])


def _step_facts(learner) -> dict:
    def compute():
        facts = {}
        for n in STEP_WORLDS:
            facts[n] = run_ranks(functools.partial(_step_rank, fn=learner.sharded_sgd_step), n, STEP_HINT, STEP_REVEAL,
                                 where=f"{n} ranks: ")
        return facts
    return learner.once("10.sharded_step", compute)


def _as_float(value, n, rank) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise Wrong(f"{n} ranks, rank {rank}: sharded_sgd_step returned a tensor of {value.numel()} elements: "
                        f"return the total norm, one number (a float or a 1-element tensor)")
        return float(value.item())
    if isinstance(value, (int, float)):
        return float(value)
    raise Wrong(f"sharded_sgd_step returned {type(value).__name__}: return the total norm before clipping "
                f"(a float), as torch.nn.utils.clip_grad_norm_ does")


def _local_norm_why(n: int, rank: int, got: float, log: list[dict]) -> None:
    """A `Wrong` naming why a rank returned its own slice's norm, from what its log shows it launched and
    waited for: no collective at all, or an asynchronous all-reduce read before its wait()."""
    launched = [e for e in log if e["event"] == "launch"]
    if not launched:
        raise Wrong(f"{n} ranks: rank {rank} returned {got:.4f}, the norm of its own slice, and launched no "
                    f"collective: it never heard from the other ranks. A rank holds one slice of the gradient; "
                    f"the whole norm needs every slice's share, combined across the ranks before it is read",
                    reveal=STEP_REVEAL)
    waited = {e["op"] for e in log if e["event"] == "wait"}
    pending = [e for e in launched if e["kind"] == "all_reduce" and e.get("async_op")]
    if pending:
        never = [e for e in pending if e["op"] not in waited]
        raise Wrong(f"{n} ranks: rank {rank} launched its all-reduce with async_op=True and returned {got:.4f}, "
                    f"its own slice's norm: the number was read before the all-reduce finished"
                    + (" (its work was never waited for)" if never else " (wait() came after the read)")
                    + ". Until wait() returns, the tensor still holds this rank's own value (on a real process "
                      "group, whatever has arrived so far)", reveal=STEP_REVEAL)


def _near(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-6)


@step_ex.case("it returns the whole gradient's 2-norm, the same number on every rank (2 and 4 ranks)",
              hint=STEP_HINT, reveal=STEP_REVEAL, timeout=60)
def _(learner):
    """Property: on 2 and 4 thread ranks, every rank returns the 2-norm of the whole gradient (all ranks' slices
    together), the same number on each."""
    facts = _step_facts(learner)
    for n, results in facts.items():
        slices = step_slices(n)
        truth = math.sqrt(sum(float(s.double().pow(2).sum()) for s in slices))
        local = [float(s.norm()) for s in slices]
        gots = [_as_float(runs[0]["norm"], n, rank) for rank, runs in enumerate(results)]
        if not _near(max(local), truth) and all(_near(g, max(local)) for g in gots):
            raise Wrong(f"{n} ranks: every rank returned {gots[0]:.4f}, the largest of the slices' norms: the "
                        f"all-reduce took the maximum over the ranks, not the sum of their squared norms, so "
                        f"the clip sees only the biggest slice (the whole gradient's norm is {truth:.4f})",
                        reveal=STEP_REVEAL)
        for rank, runs in enumerate(results):
            got = _as_float(runs[0]["norm"], n, rank)
            if _near(got, truth):
                continue
            _, buf = step_inputs(rank, n)
            if _near(got, local[rank]):
                _local_norm_why(n, rank, got, runs[0]["log"])
                raise Wrong(f"{n} ranks: rank {rank} returned {got:.4f}, the norm of its own slice (the local "
                            f"norm); the whole gradient's is {truth:.4f}. Clipped with the local norm, every rank "
                            f"scales its slice by a different coefficient and the step is not the unsharded one",
                            reveal=STEP_REVEAL)
            if _near(got, float(buf.norm())):
                raise Wrong(f"{n} ranks: rank {rank} took the norm of the whole buffer, slices it does not own "
                            f"included: those hold this rank's own unreduced gradients, not the mean. Use slice "
                            f"`rank` only", reveal=STEP_REVEAL)
            if _near(got, sum(local)):
                raise Wrong(f"{n} ranks: {got:.4f} is the sum of the ranks' norms, but the norms of disjoint pieces "
                            f"do not add up to the norm of the whole (legs of 3 and 4 make a hypotenuse of 5, not 7)",
                            reveal=STEP_REVEAL)
            if _near(got, truth ** 2):
                raise Wrong(f"{n} ranks: {got:.4f} is the squared norm of the whole gradient, not its norm",
                            reveal=STEP_REVEAL)
            if _near(got, truth / n) or _near(got, math.sqrt(truth ** 2 / n)):
                raise Wrong(f"{n} ranks: {got:.4f} is the norm divided by N (or the mean of the squares): you "
                            f"averaged over the ranks, but the slices are disjoint pieces of one gradient, not N "
                            f"copies of it", reveal=STEP_REVEAL)
            raise AssertionError(f"{n} ranks: rank {rank} returned {got:.4f}, the whole gradient's norm is "
                                 f"{truth:.4f}")
    return "the global norm on every rank"


@step_ex.case("each rank steps only its own slice, by -lr x the gradient clipped with the global norm",
              hint=("clip as clip_grad_norm_ does, with the same coefficient on every rank; change only the slice "
                    "this rank owns"), reveal=STEP_REVEAL, timeout=60,
              after="it returns the whole gradient's 2-norm, the same number on every rank (2 and 4 ranks)")
def _(learner):
    """Property: on 2 and 4 thread ranks, with clipping active and inactive, each rank changes only its own slice, to p
    - lr x min(1, max_norm / global norm) x its gradient slice."""
    facts = _step_facts(learner)
    for n, results in facts.items():
        slices = step_slices(n)
        truth = math.sqrt(sum(float(s.double().pow(2).sum()) for s in slices))
        size = STEP_SIZE
        for rank, runs in enumerate(results):
            for run in runs:
                start, _ = step_inputs(rank, n)
                got = run["params"]
                mine = slice(rank * size, (rank + 1) * size)
                if not torch.equal(_outside(got, rank, n), _outside(start, rank, n)):
                    raise Wrong(f"{n} ranks: rank {rank} changed slices it does not own. Each rank steps only its "
                                f"own 1/N: that is why the step costs optimizer/N, and with AdamW why it keeps only "
                                f"1/N of the state. The owners step the other slices; the all-gather brings them "
                                f"(next exercise)", reveal=STEP_REVEAL)
                g, p0, mx = slices[rank], start[mine], run["max_norm"]
                coef = min(1.0, mx / (truth + 1e-6))
                if _close(got[mine], p0 - STEP_LR * coef * g, rtol=1e-4):
                    continue
                raw = mx / (truth + 1e-6)
                local = min(1.0, mx / (float(g.norm()) + 1e-6))
                if _close(got[mine], p0 - STEP_LR * local * g, rtol=1e-4):
                    raise Wrong(f"{n} ranks: rank {rank} clipped with the local norm (its slice's, "
                                f"{float(g.norm()):.3f}) instead of the global one ({truth:.3f}) it returned: "
                                f"every rank must scale by the same coefficient", reveal=STEP_REVEAL)
                if raw > 1 and _close(got[mine], p0 - STEP_LR * raw * g, rtol=1e-4):
                    raise Wrong(f"max_norm={mx:g}, norm {truth:.2f}: you scaled the gradient *up* by "
                                f"{raw:.1f}. Clipping only ever shrinks a gradient", reveal=STEP_REVEAL)
                if coef < 1 and _close(got[mine], p0 - STEP_LR * g, rtol=1e-4):
                    raise Wrong(f"max_norm={mx:g}, norm {truth:.2f}: the norm exceeds max_norm, yet your step used "
                                f"the gradient unclipped", reveal=STEP_REVEAL)
                if _close(got[mine], p0 + STEP_LR * coef * g, rtol=1e-4):
                    raise Wrong("the step went uphill: SGD subtracts lr x gradient", reveal=STEP_REVEAL)
                if _close(got[mine], p0):
                    raise Wrong(f"{n} ranks: rank {rank}'s own slice did not change: update flat_params in place "
                                f"(its slice is a view: flat_params[a:b].add_(...))", reveal=STEP_REVEAL)
                raise AssertionError(f"{n} ranks, rank {rank}, max_norm={mx:g}: the slice after the step differs from "
                                     f"-lr x the clipped gradient")
    return "2 and 4 ranks, clipping active and inactive"


# Drawn cases (course/checks/drawn.py): 2, 3 and 4 ranks, slices of drawn sizes, float32 and float64, one rank's
# slice far larger than the others (drawn which), max_norm below or above the global norm; every rank read. The
# property: every rank returns the whole mean gradient's 2-norm, the same number, and changes only its own slice, by
# -lr x its gradient slice x min(1, max_norm / that norm).
@dataclass(frozen=True)
class StepDraw:
    world_size: int
    size: int
    dtype: torch.dtype
    big: int            # the rank whose slice of the mean gradient is large
    scale: float        # max_norm = scale x the global norm
    seed: int

    def __str__(self) -> str:
        return (f"{self.world_size} ranks, S = {self.size}, {str(self.dtype).replace('torch.', '')}, rank "
                f"{self.big}'s slice the largest, max_norm {self.scale:g} x the global norm")


def draw_step(seed: int = 23, count: int = 4) -> list[StepDraw]:
    rng = random.Random(seed)
    return [StepDraw((3, 4, 2, 3)[k % 4], rng.randint(1, 9), (torch.float64, torch.float32)[k % 2],
                     rng.randrange((3, 4, 2, 3)[k % 4]), (0.3, 0.6, 2.0, 0.1)[k % 4], rng.randrange(1000))
            for k in range(count)]


def _drawn_step_slices(case: StepDraw) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(case.seed)
    out = []
    for j in range(case.world_size):
        v = torch.randn(case.size, generator=g, dtype=torch.float64) + 0.1
        out.append((v / v.norm() * (4.0 if j == case.big else 0.3 + 0.1 * j)).to(case.dtype))
    return out


def _drawn_step_inputs(case: StepDraw, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    n, size = case.world_size, case.size
    params = torch.linspace(-1.0, 1.0, n * size, dtype=torch.float64).to(case.dtype)
    buf = (torch.full((n * size,), 5.0 + rank, dtype=torch.float64)
           * torch.cos(torch.arange(n * size, dtype=torch.float64))).to(case.dtype)
    buf[rank * size:(rank + 1) * size] = _drawn_step_slices(case)[rank]
    return params, buf


def _step_drawn_mistake(learner, case: StepDraw) -> str | None:
    """None when every rank holds the property above; else what the first rank that broke it did."""
    slices = _drawn_step_slices(case)
    truth = math.sqrt(sum(float(s.double().pow(2).sum()) for s in slices))
    max_norm = case.scale * truth
    n, size = case.world_size, case.size

    def fn(rank):
        params, buf = _drawn_step_inputs(case, rank)
        norm = learner.sharded_sgd_step(params, buf, STEP_LR, max_norm)
        return norm, params.clone()

    results, errors = run_thread_ranks(n, fn)
    found = root_error(errors)
    if found is not None:
        rank, exc = found
        text = str(exc).strip().splitlines()
        return f"rank {rank} raised {type(exc).__name__}: {text[-1] if text else ''}{_your_line(exc)}"
    local = [float(s.double().norm()) for s in slices]
    for rank, (norm, got) in enumerate(results):
        start, buf = _drawn_step_inputs(case, rank)
        moved = (got != start).nonzero().reshape(-1).tolist()
        mine = slice(rank * size, (rank + 1) * size)
        if any(not rank * size <= k < (rank + 1) * size for k in moved):
            return (f"rank {rank} changed elements {moved[0]} to {moved[-1]}; its slice is elements {rank * size} to "
                    f"{(rank + 1) * size - 1} (S = {n * size} / {n}): it steps only the slice it owns, whatever the "
                    f"world size")
        if isinstance(norm, torch.Tensor) and norm.numel() == 1:
            norm = norm.item()
        if not isinstance(norm, (int, float)):
            return f"rank {rank} returned {type(norm).__name__}, not the total norm (a float)"
        norm = float(norm)
        if not _near(norm, truth):
            if _near(norm, local[rank]):
                return f"rank {rank} returned {norm:.4f}, the norm of its own slice; the whole gradient's is {truth:.4f}"
            if _near(norm, max(local)):
                return f"rank {rank} returned {norm:.4f}, the largest slice's norm (a maximum over the ranks, not a sum)"
            if _near(norm, sum(local)):
                return f"rank {rank} returned {norm:.4f}, the sum of the ranks' norms, not the norm of the whole"
            return f"rank {rank} returned {norm:.4f}; the whole gradient's norm is {truth:.4f}"
        g = slices[rank]
        coef = min(1.0, max_norm / (truth + 1e-6))
        tol = 1e-4 if case.dtype == torch.float32 else 1e-9
        if torch.allclose(got[mine], start[mine] - STEP_LR * coef * g, rtol=tol, atol=tol):
            continue
        own = min(1.0, max_norm / (local[rank] + 1e-6))
        if torch.allclose(got[mine], start[mine] - STEP_LR * own * g, rtol=tol, atol=tol):
            return (f"rank {rank} clipped with its own slice's norm ({local[rank]:.3f}), not the global one "
                    f"({truth:.3f}) it returned: its coefficient {own:.3f}, the others' {coef:.3f}")
        if got.dtype != case.dtype:
            return f"rank {rank}'s parameters came back as {got.dtype}, given {case.dtype}"
        return f"rank {rank}'s slice after the step differs from -lr x the gradient clipped with the global norm"
    return None


def _smaller_step(case: StepDraw):
    for w in (2, 3):
        if w < case.world_size:
            yield replace(case, world_size=w, big=min(case.big, w - 1))
    if case.dtype != torch.float32:
        yield replace(case, dtype=torch.float32)
    if case.size > 2:
        yield replace(case, size=2)


@step_ex.case("drawn: 2, 3 and 4 ranks, drawn slice sizes, float32 and float64, every rank read",
              hint=STEP_HINT, reveal=STEP_REVEAL, timeout=60,
              after="it returns the whole gradient's 2-norm, the same number on every rank (2 and 4 ranks)")
def _(learner):
    """Property: on drawn cases (2, 3 and 4 thread ranks, slices of 1 to 9 elements, float32 and float64, a drawn
    rank's slice the largest, max_norm below or above the global norm), every rank returns the global norm and changes
    only its own slice, by -lr x its gradient slice x min(1, max_norm / global norm)."""
    cases = draw_step()
    found = falsify(cases, lambda c: None if (why := _step_drawn_mistake(learner, c)) is None else f"{c}: {why}",
                    smaller=_smaller_step, budget=12, kind=after_colon)
    if found is not None:
        raise Wrong(str(found), reveal=STEP_REVEAL)
    return f"{len(cases)} drawn cases, every rank read"
