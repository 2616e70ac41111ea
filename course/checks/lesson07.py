"""Lesson 07 checks: accumulation without sync, tied/frozen/unused parameters, clipping after the
sync; and `drift_runs`, the two-process measurement behind the lesson's figure.

Every multi-process check compares the learner's data parallelism (2 gloo ranks, each on half
the batch) with single-process training on the whole batch, step by step: that is what "correct"
means for data parallelism (CS336's test). A rank that waits for a collective its peer never
issues fails after a short process-group timeout instead of hanging.

Each exercise also states its property on drawn cases (course/checks/drawn.py) with ranks as threads of this
process: 2, 3 and 4 ranks, float32 and float64, drawn shapes, accumulation lengths, which ranks skip the branch,
frozen and untied weights, max_norm below and above the norm. Every rank's result is read and the rank that breaks
the property is named; the first failing case is shrunk and shown in the hint, never the answer.
"""

from __future__ import annotations

import contextlib
import copy
import math
import random
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from course.checks.drawn import after_colon, falsify, root_error, run_thread_ranks
from course.checks.lesson10.threads import ThreadWorld
from course.grading import Exercise, Wrong, load_module
from course.lib import TinyMLP
from hfstream.testing import RankFailure, run_on_ranks

PG_TIMEOUT_S = 8.0      # a collective with no partner fails after this long, not never
RUN_TIMEOUT_S = 60.0
PARITY_TOL = 1e-5       # fp32: the two runs differ only in how the batch mean is summed


# --------------------------------------------------------------------------- shared pieces
class TiedBranchLM(nn.Module):
    """A tiny language model with every hard case at once.

    - ``embed.weight`` is tied to the output projection (``out.weight is embed.weight``): one
      tensor, two uses, one gradient;
    - ``frozen`` is a linear layer with ``requires_grad=False``: no gradient, no hook;
    - ``extra`` is a branch that a step may skip (``use_extra=False``): its gradient never arrives.
    """

    def __init__(self, vocab: int = 16, dim: int = 8, freeze: bool = True, seed: int = 0, tie: bool = True):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.embed = nn.Embedding(vocab, dim)
        self.frozen = nn.Linear(dim, dim)
        self.mix = nn.Linear(dim, dim)
        self.extra = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, vocab, bias=False)
        if tie:
            self.out.weight = self.embed.weight      # tied, as GPT-2's lm_head and wte
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        self.frozen.requires_grad_(not freeze)

    def forward(self, ids: torch.Tensor, use_extra: bool = True) -> torch.Tensor:
        h = torch.tanh(self.mix(self.frozen(self.embed(ids))))
        if use_extra:
            h = h + torch.tanh(self.extra(h))
        return self.out(h)


def lm_batch(step: int, n: int = 8, seq: int = 6, vocab: int = 16) -> torch.Tensor:
    g = torch.Generator().manual_seed(500 + step)
    return torch.randint(0, vocab, (n, seq), generator=g)


def lm_loss(model: nn.Module, ids: torch.Tensor, use_extra: bool = True) -> torch.Tensor:
    logits = model(ids[:, :-1], use_extra=use_extra)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def mlp_batch(step: int, n: int = 16, dim: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(900 + step)
    x = torch.randn(n, dim, generator=g)
    return x, torch.sin(x) + 0.1 * torch.randn(n, dim, generator=g)


def mlp_loss(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


def shard(t: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    n = t.shape[0] // world_size
    return t[rank * n:(rank + 1) * n]


def _max_diff(a: nn.Module, b: nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in str(text).strip().splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def _rank_error(failure: RankFailure) -> str:
    """The most telling line of a RankFailure: a traceback's last line, else the first message."""
    blocks = str(failure).split("--- rank ")[1:]
    lines = [_last_line(b) for b in blocks]
    for ln in lines:
        if "timed out" not in ln and "Connection closed" not in ln:
            return ln
    return lines[0] if lines else str(failure)[:200]


class _CountAllReduce:
    """Counts `dist.all_reduce` calls made through the module attribute (as learner code does)."""

    def __init__(self):
        self.calls = 0
        self.micro_step = None      # set by the caller: the micro-step whose backward is running
        self.micro_steps: list = []  # the micro-step of each call
        self._real = dist.all_reduce

    def __call__(self, *args, **kwargs):
        self.calls += 1
        self.micro_steps.append(self.micro_step)
        return self._real(*args, **kwargs)

    def install(self) -> "_CountAllReduce":
        dist.all_reduce = self
        return self


# --------------------------------------------------------------------------- 07.accumulation
accumulation = Exercise("07.accumulation", uses=["MiniSync", "AccumSync", "accumulation_step"],
                        title="accumulate without communicating")

ACCUM, ACCUM_STEPS = 4, 3


@accumulation.case("no_sync() turns sync off inside, and restores what was there on exit",
                   hint="inside the block sync is off; after it, whatever was set before is back, also when the "
                        "block raises",
                   reveal="save require_backward_grad_sync, set it False, yield inside try, restore it in finally")
def _(learner):
    """Property: inside no_sync() require_backward_grad_sync is False, and on leaving it, normally or by an exception,
    it is back to what it was before (True or False)."""
    sync = object.__new__(learner.AccumSync)      # no process group needed to test the flag
    sync.require_backward_grad_sync = True
    cm = sync.no_sync()
    if not hasattr(cm, "__enter__"):
        raise Wrong("no_sync() must return a context manager: decorate it with @contextlib.contextmanager and yield")
    with cm:
        if sync.require_backward_grad_sync is not False:
            raise Wrong("inside `with sync.no_sync():` require_backward_grad_sync must be False")
    if sync.require_backward_grad_sync is not True:
        raise Wrong("after the `with` block require_backward_grad_sync must be True again, or the last "
                    "micro-step never communicates")
    with contextlib.suppress(ValueError):
        with sync.no_sync():
            raise ValueError("a micro-step that fails")
    if sync.require_backward_grad_sync is not True:
        raise Wrong("an exception inside no_sync() left sync switched off: restore the flag in a `finally:`")
    sync.require_backward_grad_sync = False
    with sync.no_sync():
        pass
    if sync.require_backward_grad_sync is not False:
        raise Wrong("no_sync() set the flag to True on exit although it was False before: restore the previous "
                    "value (DDP's no_sync does), so nested blocks and Accelerate's own switch keep working")


def _accumulation_rank(rank, world_size, path):
    counter = _CountAllReduce().install()
    mod = load_module(path)
    model = TinyMLP(dim=8, hidden=16, layers=3, seed=0)      # same weights on every rank: MiniSync does not broadcast
    ref = copy.deepcopy(model)
    sync = mod.AccumSync(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.2)
    out = {"params": sum(1 for _ in model.parameters()), "collectives": [], "diff": [], "ratio": [], "error": None}
    for step in range(ACCUM_STEPS):
        x, y = mlp_batch(step)
        mine = [(shard(x, rank, world_size)[k::ACCUM], shard(y, rank, world_size)[k::ACCUM]) for k in range(ACCUM)]
        before = [p.detach().clone() for p in model.parameters()]
        ref_before = [p.detach().clone() for p in ref.parameters()]
        calls = counter.calls
        counter.micro_steps, counter.micro_step = [], -1

        def loss_fn(m, batch):          # the k-th call is micro-step k: its backward follows it
            counter.micro_step += 1
            return mlp_loss(m, batch)

        try:
            mod.accumulation_step(model, sync, opt, mine, loss_fn)
        except Exception as e:   # report it; the peer fails on its own at the process-group timeout
            out["error"] = f"step {step}: {type(e).__name__}: {_last_line(e)}"
            break
        out["collectives"].append(counter.calls - calls)
        out.setdefault("synced_at", []).append(sorted(set(counter.micro_steps)))
        mlp_loss(ref, (x, y)).backward()                    # the whole global batch, one process
        ref_opt.step()
        ref_opt.zero_grad()
        out["diff"].append(_max_diff(model, ref))
        moved = math.sqrt(sum(((p.detach() - b) ** 2).sum().item() for p, b in zip(model.parameters(), before)))
        ref_moved = math.sqrt(sum(((p.detach() - b) ** 2).sum().item() for p, b in zip(ref.parameters(), ref_before)))
        out["ratio"].append(moved / ref_moved if ref_moved > 0 else math.nan)
        with torch.no_grad():                               # restart from the reference: one mistake, one step
            for p, q in zip(model.parameters(), ref.parameters()):
                p.copy_(q)
    return out


_RUNS: dict[str, list] = {}   # one two-rank run serves both cases of 07.accumulation


def _run_accumulation(learner):
    path = learner.module_file()
    with open(path) as f:
        text = f.read()
    if text not in _RUNS:
        try:
            _RUNS.clear()
            _RUNS[text] = run_on_ranks(_accumulation_rank, 2, path, timeout=RUN_TIMEOUT_S, pg_timeout_s=PG_TIMEOUT_S)
        except RankFailure as e:
            _RUNS[text] = [{"error": _rank_error(e), "collectives": [], "diff": [], "ratio": [], "params": 0}] * 2
    return _RUNS[text]


def _first_error(res) -> str | None:
    """The rank's own error before a peer's "connection closed" or timeout, which only follow from it."""
    errors = [r["error"] for r in res if r.get("error")]
    own = [e for e in errors if not any(s in e for s in ("Connection closed", "Timed out", "timed out"))]
    return (own or errors or [None])[0]


def _accumulation_error(res) -> None:
    err = _first_error(res)
    if err is None:
        return
    if "second gradient" in err:
        raise Wrong("a micro-step's backward fired a hook whose reduction was already launched: the hook must "
                    "return without communicating while require_backward_grad_sync is False, and "
                    f"accumulation_step must run every micro-step but the last inside sync.no_sync() ({err})")
    if "NoneType" in err and "wait" in err:
        raise Wrong("finish() found reductions that were never launched: the last micro-step's backward must run "
                    "with sync on (outside no_sync()), and finish() is called once, after it "
                    f"({err})")
    raise AssertionError(f"2 ranks: {err}")


@accumulation.case("two ranks: one all-reduce per parameter per optimizer step",
                   hint="count the all-reduces: one per parameter per optimizer step, however many micro-batches it "
                        "has",
                   reveal="micro-steps 0..N-2 under sync.no_sync(), the last one outside it, then one finish()",
                   timeout=90)
def _(learner):
    """Property: on 2 gloo ranks accumulating 4 micro-batches per optimizer step, each optimizer step launches exactly
    one all-reduce per parameter."""
    res = _run_accumulation(learner)
    _accumulation_error(res)
    n = res[0]["params"]
    counts = res[0]["collectives"]
    if counts and counts[0] == ACCUM * n:
        raise Wrong(f"{counts[0]} all-reduces per optimizer step = {ACCUM} micro-steps x {n} parameters: you "
                    "communicated on every micro-step. Run all but the last under sync.no_sync(), and make the "
                    "hook return early while require_backward_grad_sync is False")
    if counts and counts[0] == 0:
        raise Wrong("no all-reduce at all in a step: the last micro-step must run outside no_sync()")
    assert counts == [n] * len(counts), f"all-reduces per optimizer step: {counts}, expected {n} (one per parameter)"
    return f"{n} all-reduces per step for {ACCUM} micro-steps"


@accumulation.case("two ranks x 4 micro-batches give the single-process large-batch step",
                   hint="the accumulated step must be the large-batch step: check how much each micro-batch "
                        "contributes, and how often you step",
                   reveal="divide each micro-batch's loss by the number of micro-batches; step and zero_grad once",
                   timeout=90)
def _(learner):
    """Property: 2 gloo ranks x 4 micro-batches give, step after step, the weights of one process training on the whole
    batch (within PARITY_TOL)."""
    res = _run_accumulation(learner)
    _accumulation_error(res)
    ratio, diff = res[0]["ratio"], res[0]["diff"]
    synced = [at for r in res for at in r.get("synced_at", [])]
    if synced and all(at and ACCUM - 1 not in at for at in synced):
        first = synced[0][0] + 1
        raise Wrong(f"your all-reduces run during micro-step {first}'s backward, not the last one's "
                    f"({ACCUM}): they average only the gradients summed so far, and the micro-batches after "
                    "it stay on their own rank, so the ranks step differently. Keep sync off for every "
                    "micro-step but the last",
                    reveal="with sync.no_sync() if k < n - 1 else contextlib.nullcontext(): ...")
    if ratio and math.isclose(ratio[0], ACCUM, rel_tol=0.05):
        raise Wrong(f"your step is {ratio[0]:.2f}x the large-batch step: the large batch's loss is the mean of the "
                    f"micro-batch losses, so divide each micro-batch loss by {ACCUM} (= len(micro_batches)) "
                    "before backward")
    if ratio and math.isclose(ratio[0], 1 / ACCUM, rel_tol=0.05):
        raise Wrong(f"your step is 1/{ACCUM} of the large-batch step: divide each micro-batch loss by the number of "
                    "micro-batches once, not the gradient again")
    if ratio and math.isclose(ratio[0], 1 / len(res), rel_tol=0.05):
        raise Wrong(f"your step is 1/{len(res)} of the large-batch step on {len(res)} ranks: you divided by the world "
                    "size, which finish() already does when it turns the sum over the ranks into the mean")
    if diff and diff[0] < PARITY_TOL and any(d > PARITY_TOL for d in diff[1:]):
        raise Wrong("the first step matches but later ones do not: each step's backward adds onto the gradients "
                    "the step before left behind", reveal="optimizer.zero_grad() after optimizer.step()")
    assert diff and max(diff) < PARITY_TOL, (
        f"after each step the weights differ from single-process training by up to {max(diff or [math.inf]):.3g}")
    a, b = (r["diff"] for r in res)
    assert max(abs(x - y) for x, y in zip(a, b)) < PARITY_TOL, "the two ranks ended with different weights"
    return f"max difference {max(diff):.1e}"


# --------------------------------------------------------------------------- drawn cases, on thread ranks
# Each exercise's property is also checked on cases drawn from a seeded space (course/checks/drawn.py): 2, 3 and 4
# ranks, float32 and float64, drawn model shapes, and per exercise the accumulation length, which rank skips the
# branch at which step, a frozen or untied weight, a max_norm the gradient stays above or below. The ranks are threads
# of this process (lesson 10's stand-in for torch.distributed): a case takes milliseconds, every rank's weights are
# read and the rank that breaks the property is named; the first failing case is shrunk, and the hint shows it and
# what the learner's code did, never the answer.
DRAWN_CASES = 4         # per exercise, each of 2 optimizer steps: with shrinking, about a second on two cores
DRAWN_STEPS = 2
DRAWN_LR = 0.3


def _tol(dtype: torch.dtype) -> dict:
    return dict(rtol=1e-4, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-9, atol=1e-12)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _own_error(errors: list) -> tuple[int, str] | None:
    """The first rank's own error as ``(rank, "Type: last line")``, not a peer's wait for it; None when none raised."""
    found = root_error(errors)
    if found is None:
        return None
    rank, exc = found
    return rank, f"{type(exc).__name__}: {_last_line(exc)}"


def _ratio(got: list[torch.Tensor], want: list[torch.Tensor], start: list[torch.Tensor]) -> float:
    """How long the learner's step was, as a multiple of the right one (both from ``start``)."""
    moved = math.sqrt(sum(float(((g - s).double() ** 2).sum()) for g, s in zip(got, start)))
    right = math.sqrt(sum(float(((w - s).double() ** 2).sum()) for w, s in zip(want, start)))
    return moved / right if right > 0 else math.nan


@dataclass(frozen=True)
class AccumDraw:
    """One drawn 07.accumulation case: ``world_size`` ranks, each stepping once per ``accum`` micro-batches of 2
    samples, on TinyMLP(dim, hidden, layers) in ``dtype``."""

    world_size: int
    accum: int
    dtype: torch.dtype
    dim: int
    hidden: int
    layers: int
    seed: int

    def __str__(self) -> str:
        return (f"{self.world_size} ranks, {self.accum} micro-batch{'es' if self.accum != 1 else ''} per optimizer "
                f"step, {_dtype_name(self.dtype)}, TinyMLP(dim={self.dim}, hidden={self.hidden}, layers={self.layers})")


# (ranks, micro-batches): as many micro-batches as the old check's 4 in none of them, and never as many as ranks, so
# that a step 1/N too short and one 1/accum too short tell apart
ACCUM_SHAPES = ((3, 5), (2, 3), (4, 6), (2, 1))


def draw_accumulation(seed: int = 7, count: int = DRAWN_CASES) -> list[AccumDraw]:
    rng = random.Random(seed)
    return [AccumDraw(n, a, (torch.float64, torch.float32)[k % 2], rng.randint(3, 7), rng.randint(4, 12),
                      rng.randint(2, 4), rng.randrange(1000)) for k, (n, a) in enumerate(ACCUM_SHAPES[:count])]


def _accum_model(case: AccumDraw) -> nn.Module:
    return TinyMLP(dim=case.dim, hidden=case.hidden, layers=case.layers, seed=case.seed).to(case.dtype)


def _accum_micro(case: AccumDraw, step: int, rank: int, k: int):
    g = torch.Generator().manual_seed(case.seed * 1000 + 100 * step + 10 * rank + k)
    x = torch.randn(2, case.dim, generator=g, dtype=torch.float64).to(case.dtype)
    return x, torch.sin(3 * x)


def _accum_reference(case: AccumDraw) -> list[list[torch.Tensor]]:
    """The weights of one process after each step, its loss the mean over every rank's micro-batches."""
    model, out = _accum_model(case), []
    for step in range(DRAWN_STEPS):
        micro = [_accum_micro(case, step, r, k) for r in range(case.world_size) for k in range(case.accum)]
        (sum(mlp_loss(model, b) for b in micro) / len(micro)).backward()
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(DRAWN_LR * p.grad)
                p.grad = None
        out.append([p.detach().clone() for p in model.parameters()])
    return out


def _accum_ranks(learner, case: AccumDraw) -> tuple[list, list]:
    """Every rank's steps: the micro-step each all-reduce was launched in (the one whose loss came last before it),
    and the weights after each optimizer step."""
    world = ThreadWorld(case.world_size, timeout_s=3.0, fail_fast=True)

    def fn(rank):
        model = _accum_model(case)
        sync = learner.AccumSync(model)
        opt = torch.optim.SGD(model.parameters(), lr=DRAWN_LR)
        steps = []
        for step in range(DRAWN_STEPS):
            micro = [_accum_micro(case, step, rank, k) for k in range(case.accum)]
            world.take(rank)

            def loss_fn(m, batch):
                world.note(rank, "micro-step")
                return mlp_loss(m, batch)

            learner.accumulation_step(model, sync, opt, micro, loss_fn)
            k, launched_in = -1, []
            for e in world.take(rank):
                k += e["event"] == "micro-step"
                if e["event"] == "launch" and e["kind"] == "all_reduce":
                    launched_in.append(k)
            steps.append({"launched_in": launched_in, "params": [p.detach().clone() for p in model.parameters()]})
        return steps

    return run_thread_ranks(case.world_size, fn, world=world)


def _accum_mistake(learner, case: AccumDraw) -> str | None:
    """None when every rank launches one all-reduce per parameter per step, all in the last micro-step, and ends
    every step with the weights of one process on the whole batch; else what the first rank that did not did."""
    results, errors = _accum_ranks(learner, case)
    failed = _own_error(errors)
    if failed is not None:
        rank, err = failed
        if "second gradient" in err:
            return (f"rank {rank} raised {err}: a micro-step's backward fired a hook whose reduction was already "
                    f"launched; while require_backward_grad_sync is False the hook returns without communicating")
        return f"rank {rank} raised {err}"
    n_params, a, n = 2 * case.layers, case.accum, case.world_size
    ref = _accum_reference(case)
    start = [p.detach().clone() for p in _accum_model(case).parameters()]
    for rank, steps in enumerate(results):
        launched = steps[0]["launched_in"]
        if a > 1 and len(launched) == a * n_params:
            return (f"rank {rank}: {len(launched)} all-reduces in one optimizer step = {a} micro-steps x {n_params} "
                    f"parameters: it communicated on every micro-step, where one all-reduce per parameter, in the last "
                    f"micro-step, is all the step needs")
        if len(launched) != n_params:
            return (f"rank {rank}: {len(launched)} all-reduces in one optimizer step of {a} micro-step(s), for "
                    f"{n_params} parameters: one per parameter per optimizer step")
        if any(k != a - 1 for k in launched):
            return (f"rank {rank}: the all-reduces ran during micro-step {min(launched) + 1}'s backward, not the last "
                    f"one's ({a}): they average only the gradients summed so far, and the micro-batches after it stay "
                    f"on their own rank")
    for s in range(DRAWN_STEPS):
        before = start if s == 0 else ref[s - 1]
        for rank, steps in enumerate(results):
            got = steps[s]["params"]
            if all(torch.allclose(x, w, **_tol(case.dtype)) for x, w in zip(got, ref[s])):
                continue
            if s > 0:
                return (f"rank {rank}: the first optimizer step is right and the second is not: the second step's "
                        f"backward adds onto gradients the first step left behind")
            r = _ratio(got, ref[s], before)
            near = lambda x: math.isclose(r, x, rel_tol=0.02)      # noqa: E731
            if a > 1 and near(a):
                return (f"rank {rank}: its step is {r:.2f} x the large-batch step, {a} x: the large batch's loss is the "
                        f"mean of the {a} micro-batch losses, and each micro-batch's loss was not divided by their "
                        f"number")
            if a != 4 and near(a / 4):
                return (f"rank {rank}: its step is {r:.2f} x the large-batch step, {a}/4: each micro-batch's loss was "
                        f"divided by 4 whatever the number of micro-batches ({a} here), not by len(micro_batches)")
            if a > 1 and near(1 / a):
                return (f"rank {rank}: its step is 1/{a} of the large-batch step: the 1/{a} of the micro-batches was "
                        f"applied twice (to each loss, and again to the gradient); once is the mean")
            if near(1 / n):
                return (f"rank {rank}: its step is 1/{n} of the large-batch step, 1/N for {n} ranks: it divided by the "
                        f"world size, which finish() already does when it turns the sum over the ranks into the mean")
            diff = max(float((x - w).abs().max()) for x, w in zip(got, ref[s]))
            return (f"rank {rank}: after optimizer step {s + 1} the weights differ from one process training on every "
                    f"rank's micro-batches by {diff:.3g} (its step is {r:.2f} x the right one)")
    return None


def _smaller_accum(case: AccumDraw):
    for w in (2, 3):
        if w < case.world_size:
            yield replace(case, world_size=w)
    for a in (1, 2, 3):
        if a < case.accum:
            yield replace(case, accum=a)
    if case.dtype != torch.float32:
        yield replace(case, dtype=torch.float32)
    if case.layers > 2:
        yield replace(case, layers=2)
    if (case.dim, case.hidden) != (3, 4):
        yield replace(case, dim=3, hidden=4)


def _raise_drawn(cases, mistake, smaller, reveal: str) -> str:
    """`falsify` over the drawn cases: the first that fails, shrunk, as a `Wrong` that shows it (not the answer)."""
    found = falsify(cases, lambda c: None if (why := mistake(c)) is None else f"{c}: {why}", smaller=smaller,
                    budget=12, kind=after_colon)
    if found is not None:
        raise Wrong(str(found), reveal=reveal)
    return f"{len(cases)} drawn cases of {DRAWN_STEPS} steps, every rank read"


@accumulation.case("drawn: 2, 3 and 4 ranks, 1 to 6 micro-batches, float32 and float64, every rank's weights",
                   hint="one all-reduce per parameter per optimizer step, during the last micro-step's backward, and "
                        "the large-batch step on every rank, whatever the number of ranks and micro-batches",
                   reveal="n = len(micro_batches); micro-steps 0..n-2 under sync.no_sync(), the last outside it, each "
                          "loss divided by n; then one finish(), step(), zero_grad()",
                   timeout=90, after="two ranks x 4 micro-batches give the single-process large-batch step")
def _(learner):
    """Property: on drawn cases (2, 3 and 4 thread ranks, 1 to 6 micro-batches, float32 and float64, drawn TinyMLP
    shapes), every rank launches exactly one all-reduce per parameter per optimizer step, all in the last micro-step,
    and after each of 2 steps holds the weights of one process training on every rank's micro-batches."""
    return _raise_drawn(draw_accumulation(), lambda c: _accum_mistake(learner, c), _smaller_accum,
                        "n = len(micro_batches); with sync.no_sync() if k < n - 1 else contextlib.nullcontext(): "
                        "(loss_fn(model, batch) / n).backward(); then sync.finish(); optimizer.step(); "
                        "optimizer.zero_grad()")


# --------------------------------------------------------------------------- 07.unused_and_tied
unused = Exercise("07.unused_and_tied", uses=["MiniSync", "RobustSync"],
                  title="tied, frozen and unused parameters")

# Which rank runs the `extra` branch at each step: everyone, one rank, nobody, the other rank.
USE_EXTRA = [(True, True), (True, False), (False, False), (False, True)]


@unused.case("each trainable tensor once, frozen ones skipped, in reverse registration order",
             hint="every parameter that trains, exactly once (a tied weight is one tensor), frozen ones left out, in"
                  " the order backward produces them",
             reveal="[p for p in model.parameters() if p.requires_grad], reversed: parameters() already "
                    "yields a tied tensor once")
def _(learner):
    """Property: hooked_parameters(model) yields every parameter that requires grad exactly once (the tied weight
    once), no frozen one, in reverse registration order, on a model with a tied and a frozen weight."""
    model = TiedBranchLM()
    sync = object.__new__(learner.RobustSync)     # only the method; no process group, no hooks
    got = list(sync.hooked_parameters(model))
    want = [p for p in reversed(list(model.parameters())) if p.requires_grad]
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    if any(not getattr(p, "requires_grad", False) for p in got):
        frozen = next(names.get(id(p), "?") for p in got if not p.requires_grad)
        raise Wrong(f"you included the frozen {frozen!r} (requires_grad=False): registering a gradient hook on it "
                    "raises, and a gradient that never comes cannot be waited for. Keep only p.requires_grad")
    ids = [id(p) for p in got]
    if len(ids) != len(set(ids)):
        dup = next(names.get(i, "?") for i in ids if ids.count(i) > 1)
        raise Wrong(f"{dup!r} is in your list twice: it is tied (out.weight is embed.weight), one tensor whose hook "
                    "must fire once and whose gradient is reduced once. Walking modules (or "
                    "named_parameters(remove_duplicate=False)) meets it twice; model.parameters() does not")
    missing = [names.get(id(p), "?") for p in want if id(p) not in set(ids)]
    if missing:
        raise Wrong(f"trainable parameters missing from your list: {missing}")
    if ids == [id(p) for p in reversed(want)]:
        raise Wrong("the order is registration order: backward produces the last layer's gradient first, so "
                    "reverse it (any order is correct if all ranks share it, but this one lets reductions start "
                    "during backward)")
    assert ids == [id(p) for p in want], "the order is not the reverse of model.parameters()"
    return f"{len(got)} tensors"


@dataclass(frozen=True)
class UnusedDraw:
    """One drawn 07.unused_and_tied case: ``world_size`` ranks train TiedBranchLM(vocab, dim) in ``dtype`` for as
    many steps as ``uses`` has rows; ``uses[s][r]``: rank r runs the ``extra`` branch at step s."""

    world_size: int
    dtype: torch.dtype
    vocab: int
    dim: int
    freeze: bool
    tie: bool
    uses: tuple[tuple[bool, ...], ...]
    seed: int

    def __str__(self) -> str:
        steps = "; ".join(f"at step {s + 1} `extra` runs on rank{'s' if sum(u) != 1 else ''} "
                          f"{', '.join(str(r) for r, on in enumerate(u) if on) or 'none'}" for s, u in enumerate(self.uses))
        return (f"{self.world_size} ranks, {_dtype_name(self.dtype)}, TiedBranchLM(vocab={self.vocab}, dim={self.dim}), "
                f"{'frozen layer' if self.freeze else 'nothing frozen'}, {'tied' if self.tie else 'untied'} output; "
                f"{steps}")


def draw_unused(seed: int = 11, count: int = DRAWN_CASES) -> list[UnusedDraw]:
    """2, 3 and 4 ranks (3 first); in each case a step where some ranks use the branch and others do not (which ones
    drawn, not always the last), then a step drawn freely; a frozen layer in most, an untied output in some."""
    rng = random.Random(seed)
    out = []
    for k in range(count):
        n = (3, 4, 2, 3)[k % 4]
        users = rng.sample(range(n), rng.randint(1, n - 1))
        mixed = tuple(r in users for r in range(n))
        free = tuple(rng.random() < 0.5 for _ in range(n))
        out.append(UnusedDraw(n, (torch.float64, torch.float32)[k % 2], rng.randint(5, 12), rng.randint(3, 6),
                              k % 4 != 2, k % 4 != 1, (mixed, free), rng.randrange(1000)))
    return out


def _unused_model(case: UnusedDraw) -> nn.Module:
    return TiedBranchLM(case.vocab, case.dim, case.freeze, case.seed, case.tie).to(case.dtype)


def _unused_ids(case: UnusedDraw, step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(case.seed * 1000 + 10 * step + rank)
    return torch.randint(0, case.vocab, (3, 5), generator=g)


def _unused_reference(case: UnusedDraw) -> list[dict]:
    """Per step: the weights before it, each rank's own gradient at them (zeros for a branch it skipped), and the
    weights of one process after it, trained on every rank's batch with that rank's choice of branch."""
    model, out = _unused_model(case), []
    for s, uses in enumerate(case.uses):
        start = {n: p.detach().clone() for n, p in model.named_parameters()}
        local = []
        for r in range(case.world_size):
            lm_loss(model, _unused_ids(case, s, r), use_extra=uses[r]).backward()
            local.append({n: (torch.zeros_like(p) if p.grad is None else p.grad.clone())
                          for n, p in model.named_parameters() if p.requires_grad})
            model.zero_grad(set_to_none=True)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if p.requires_grad:
                    p.sub_(DRAWN_LR * sum(loc[n] for loc in local) / case.world_size)
        out.append({"start": start, "local": local, "after": {n: p.detach().clone() for n, p in model.named_parameters()}})
    return out


def _unused_ranks(learner, case: UnusedDraw) -> tuple[list, list]:
    def fn(rank):
        model = _unused_model(case)
        sync = learner.RobustSync(model)
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=DRAWN_LR)
        steps = []
        for s, uses in enumerate(case.uses):
            lm_loss(model, _unused_ids(case, s, rank), use_extra=uses[rank]).backward()
            sync.finish()
            opt.step()
            opt.zero_grad()
            steps.append({n: p.detach().clone() for n, p in model.named_parameters()})
        if hasattr(sync, "close"):
            sync.close()
        return steps

    return run_thread_ranks(case.world_size, fn)


def _unused_mistake(learner, case: UnusedDraw) -> str | None:
    """None when no rank raises or hangs and every rank ends every step with the weights of one process trained on
    every rank's batch (the frozen layer unmoved); else what the first rank that did not did."""
    results, errors = _unused_ranks(learner, case)
    failed = _own_error(errors)
    if failed is not None:
        rank, err = failed
        if "different type" in err or "dtype" in err:
            return (f"rank {rank} raised {err.split(':')[0]} on a {_dtype_name(case.dtype)} model: the zero gradient "
                    f"given to a parameter without one must have the parameter's dtype; torch.zeros(p.shape) is "
                    f"float32 whatever the model is")
        if "NoneType" in err and "wait" in err:
            return (f"rank {rank} raised {err}: finish() waited on a reduction that was never launched: the unused "
                    f"branch's hooks never fired, so the in-order launcher stopped there. Launch the rest from "
                    f"finish()")
        if "NoneType" in err:
            return (f"rank {rank} raised {err}: a parameter this rank did not use has .grad None; give it zeros so it "
                    f"contributes nothing to the mean and its all-reduce still happens")
        if "waited" in err or "different sizes" in err:
            return (f"rank {rank} raised {err}: the ranks did not launch the same all-reduces in the same order; a "
                    f"parameter this rank did not use must still be reduced (zeros), in its place in the order")
        return f"rank {rank} raised {err}"
    ref = _unused_reference(case)
    n = case.world_size
    for s, truth in enumerate(ref):
        skipped = [r for r in range(n) if not case.uses[s][r]]
        for rank, steps in enumerate(results):
            got = steps[s]
            for name, value in got.items():
                want = truth["after"][name]
                if torch.allclose(value, want, **_tol(case.dtype)):
                    continue
                if name not in truth["local"][0]:
                    return f"rank {rank}: the frozen {name} changed at step {s + 1}; it gets no gradient and no reduction"
                applied = (truth["start"][name] - value) / DRAWN_LR
                local = [loc[name] for loc in truth["local"]]
                total = sum(local)
                close = lambda x: torch.allclose(applied, x, rtol=1e-3, atol=1e-6)     # noqa: E731
                if n != 2 and close(total / 2):
                    return (f"rank {rank}: at step {s + 1} {name} moved by the sum over the {n} ranks divided by 2: "
                            f"the mean divides by the world size, whatever it is")
                lost = [r for r in skipped if bool(local[r].abs().sum() > 0)]
                if lost and close(sum(local[r] for r in range(n) if r not in lost) / n):
                    return (f"rank {rank}: at step {s + 1} {name} moved by the mean without the gradient of rank"
                            f"{'s' if len(lost) > 1 else ''} {', '.join(map(str, lost))}, which skipped `extra` but "
                            f"used {name}: that gradient had arrived, waiting behind the unused branch in the launch "
                            f"order, and was overwritten with zeros; zeros go only where .grad is None")
                if close(local[rank]):
                    return f"rank {rank}: at step {s + 1} {name} moved by this rank's own gradient, never averaged"
                diff = float((value - want).abs().max())
                return (f"rank {rank}: after step {s + 1} {name} differs from one process training on every rank's "
                        f"batch by {diff:.3g}")
    return None


def _smaller_unused(case: UnusedDraw):
    for w in (2, 3):
        if w < case.world_size:
            # keep a rank that uses the branch and one that does not, at the step that mixes them
            mixed = case.uses[0]
            keep = [mixed.index(True), mixed.index(False)]
            keep += [r for r in range(case.world_size) if r not in keep][:w - 2]
            keep.sort()
            yield replace(case, world_size=w, uses=tuple(tuple(u[r] for r in keep) for u in case.uses))
    if len(case.uses) > 1:
        yield replace(case, uses=case.uses[:1])
    if case.dtype != torch.float32:
        yield replace(case, dtype=torch.float32)
    if case.freeze:
        yield replace(case, freeze=False)
    if not case.tie:
        yield replace(case, tie=True)
    if (case.vocab, case.dim) != (5, 3):
        yield replace(case, vocab=5, dim=3)


@unused.case("drawn: 2, 3 and 4 ranks, which rank skips the branch, frozen or not, tied or not, float32 and float64",
             hint="a parameter a rank did not use is still reduced, with zeros like the parameter, in its place in "
                  "the order; one that had a gradient keeps it; the mean divides by the world size",
             reveal="finish(): for i from self.next on: p = self.params[i]; if p.grad is None: p.grad = "
                    "torch.zeros_like(p); self._launch(i); then wait for each work and divide by self.world_size",
             timeout=90, after="each trainable tensor once, frozen ones skipped, in reverse registration order")
def _(learner):
    """Property: on drawn cases (2, 3 and 4 thread ranks, drawn ranks skipping the branch at each of 2 steps, a frozen
    layer or not, a tied output or not, float32 and float64, drawn sizes), no rank raises or hangs, and every rank
    ends every step with the weights of one process trained on every rank's batch, the frozen layer unmoved."""
    return _raise_drawn(draw_unused(), lambda c: _unused_mistake(learner, c), _smaller_unused,
                        "finish(): while self.next < len(self.params): p = self.params[self.next]; if p.grad is None: "
                        "p.grad = torch.zeros_like(p); self._launch(self.next); then for p, work in zip(self.params, "
                        "self.works): work.wait(); p.grad.div_(self.world_size); self._reset()")


def _unused_rank(rank, world_size, path):
    mod = load_module(path)
    model = TiedBranchLM()
    ref = copy.deepcopy(model)
    sync = mod.RobustSync(model)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    ref_opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.5)
    frozen_before = model.frozen.weight.detach().clone()
    out = {"diff": [], "error": None, "frozen_moved": False, "hooked": len(sync.params)}
    for step, flags in enumerate(USE_EXTRA):
        ids = lm_batch(step)
        try:
            lm_loss(model, shard(ids, rank, world_size), use_extra=flags[rank]).backward()
            sync.finish()
            opt.step()
            opt.zero_grad()
        except Exception as e:
            out["error"] = f"step {step} (extra branch used on ranks {[r for r in range(2) if flags[r]]}): " \
                           f"{type(e).__name__}: {_last_line(e)}"
            break
        # The reference: one process, the whole batch, each half with its rank's branch choice.
        sum(lm_loss(ref, shard(ids, r, world_size), use_extra=flags[r]) for r in range(world_size)).div(world_size).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        out["diff"].append(_max_diff(model, ref))
    out["frozen_moved"] = not torch.equal(model.frozen.weight, frozen_before)
    return out


@unused.case("two ranks, a branch unused on one rank or both: parity with one process, no hang",
             after="drawn: 2, 3 and 4 ranks, which rank skips the branch, frozen or not, tied or not, float32 and "
                   "float64",
             hint="a parameter whose gradient never came must still be reduced, on every rank and in the same order,"
                  " or a rank waits forever",
             reveal="finish(): launch every parameter not launched yet, in order, with zeros where .grad is None; "
                    "then wait for all and divide",
             timeout=90)
def _(learner):
    """Property: on 2 gloo ranks with a branch unused on one rank or on both, no rank hangs, the frozen layer never
    moves, and every step's weights match one process's training (within PARITY_TOL)."""
    path = learner.module_file()
    try:
        res = run_on_ranks(_unused_rank, 2, path, timeout=RUN_TIMEOUT_S, pg_timeout_s=PG_TIMEOUT_S)
    except RankFailure as e:
        err = _rank_error(e)
        if "timed out" in str(e) and "NoneType" not in err:
            raise Wrong("a rank hung (stopped after the process-group timeout): it waited for an all-reduce its "
                        "peer never launched. In finish(), launch every parameter not launched yet, so both ranks "
                        f"issue the same collectives in the same order ({err})")
        raise AssertionError(f"a rank failed: {err}")
    err = _first_error(res)
    if err:
        if "step 0" in err:
            raise AssertionError(f"with every parameter used: {err}")
        if "NoneType" in err and "wait" in err:
            raise Wrong("finish() waited on a reduction that was never launched: the unused branch's hooks never "
                        "fired, so the in-order launcher stopped there. Launch the rest from finish() "
                        f"({err})")
        if "NoneType" in err or "None" in err:
            raise Wrong("an unused parameter's .grad is None: give it zeros (torch.zeros_like(p)) so it contributes "
                        f"nothing to the mean and the collective still happens ({err})")
        if "Timed out" in err or "timeout" in err.lower() or "Connection closed" in err:
            raise Wrong("the ranks' collectives did not match: when the branch is unused on one rank, the other "
                        "rank still reduces it, so this rank must launch it too (zeros), in the same order "
                        f"({err})")
        raise AssertionError(f"2 ranks: {err}")
    if res[0]["frozen_moved"]:
        raise Wrong("the frozen layer changed: it must get no gradient and no reduction")
    diff = res[0]["diff"]
    bad = [(s, d) for s, d in enumerate(diff) if d > PARITY_TOL]
    if bad:
        step, d = bad[0]
        flags = USE_EXTRA[step]
        raise AssertionError(f"step {step} (branch used on ranks {[r for r in range(2) if flags[r]]}): weights "
                             f"differ from single-process training by {d:.3g}")
    return f"4 steps, max difference {max(diff):.1e}"


# --------------------------------------------------------------------------- 07.clip_after_sync
clip = Exercise("07.clip_after_sync", uses=["synced_clip_step"], title="clip the averaged gradient")


class TwoRankStandIn:
    """Stands in for a sync over two ranks inside one process: ``finish()`` averages this process's
    ``.grad`` with the gradient the other rank computed on its half of the batch."""

    def __init__(self, model: nn.Module, other_grads: list[torch.Tensor]):
        self.model, self.other = model, other_grads
        self.calls = 0
        self.norm_seen = None   # the local gradient norm when finish() was called

    @torch.no_grad()
    def finish(self) -> None:
        self.calls += 1
        params = list(self.model.parameters())
        self.norm_seen = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params])).item()
        for p, g in zip(params, self.other):
            p.grad.add_(g).div_(2)


def _clip_setup(max_norm: float, lr: float = 0.1):
    x, y = mlp_batch(0)
    model = TinyMLP(dim=8, hidden=16, layers=3, seed=3)
    other = copy.deepcopy(model)
    mlp_loss(other, (x[8:], y[8:])).backward()
    mlp_loss(model, (x[:8], y[:8])).backward()
    local = [p.grad.clone() for p in model.parameters()]
    remote = [p.grad.clone() for p in other.parameters()]
    mean = [(a + b) / 2 for a, b in zip(local, remote)]

    def norm(gs):
        return torch.linalg.vector_norm(torch.stack([g.norm() for g in gs])).item()

    def clipped(gs):
        n = norm(gs)
        return [g * min(1.0, max_norm / (n + 1e-6)) for g in gs]

    start = [p.detach().clone() for p in model.parameters()]
    want = [p - lr * g for p, g in zip(start, clipped(mean))]
    clip_first = [p - lr * (a + b) / 2 for p, a, b in zip(start, clipped(local), clipped(remote))]
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    return model, TwoRankStandIn(model, remote), opt, dict(mean_norm=norm(mean), local_norm=norm(local), want=want,
                                                           clip_first=clip_first)


def _close(params, expected) -> bool:
    return all(torch.allclose(p.detach(), e, rtol=1e-5, atol=1e-7) for p, e in zip(params, expected))


@clip.case("finish(), then clip the mean, then step: the norm is the averaged gradient's",
           hint="the norm to clip by is the averaged gradient's, the same on every rank, and the step must "
                "use the clipped gradient; return the norm before clipping",
           reveal="sync.finish(); norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm); "
                  "optimizer.step(); optimizer.zero_grad(); return float(norm)")
def _(learner):
    """Property: synced_clip_step syncs once, then clips the averaged gradient by its own norm and steps, returning
    that norm before clipping; with max_norm above the norm the step is plain SGD on the mean (a stand-in second
    rank)."""
    max_norm = 0.05
    model, sync, opt, truth = _clip_setup(max_norm)
    assert truth["mean_norm"] > 2 * max_norm            # clipping really clips here
    got = learner.synced_clip_step(sync, model, opt, max_norm)
    if sync.calls == 0:
        raise Wrong("you never called sync.finish(): the gradients were never averaged over ranks")
    if sync.calls > 1:
        raise Wrong(f"sync.finish() was called {sync.calls} times: once per optimizer step")
    if sync.norm_seen is not None and math.isclose(sync.norm_seen, max_norm, rel_tol=1e-3):
        raise Wrong("you clipped before finish(): each rank clipped its own gradient with its own norm, and "
                    "their average is not the clipped average. Call sync.finish() first, then clip")
    params = list(model.parameters())
    if _close(params, truth["clip_first"]) and not _close(params, truth["want"]):
        raise Wrong("your weights are those of clipping each rank's gradient before averaging: call "
                    "sync.finish() first, then clip the mean")
    assert _close(params, truth["want"]), "the weights after your step differ from: clip(mean gradient), then SGD"
    if got is None:
        raise Wrong("return the norm clip_grad_norm_ gives back (Trainer logs it as grad_norm)")
    got = float(got)
    if math.isclose(got, max_norm, rel_tol=1e-3):
        raise Wrong("you returned the norm after clipping (= max_norm): return what clip_grad_norm_ returns, "
                    "the total norm before clipping, the number Trainer logs as grad_norm")
    if math.isclose(got, truth["local_norm"], rel_tol=1e-4):
        raise Wrong("you returned this rank's own gradient norm, measured before finish(): measure after the sync")
    assert math.isclose(got, truth["mean_norm"], rel_tol=1e-4), (
        f"returned norm {got:.4g}, the averaged gradient's norm is {truth['mean_norm']:.4g}")
    # A max_norm the gradient stays below: the step is plain SGD on the mean (clipping never scales up).
    big = 50.0
    model, sync, opt, below = _clip_setup(big)
    assert below["mean_norm"] < big / 2
    got_below = learner.synced_clip_step(sync, model, opt, big)
    if not _close(list(model.parameters()), below["want"]):
        raise Wrong(f"with max_norm={big:g}, above the averaged gradient's norm ({below['mean_norm']:.3f}), the step "
                    f"must be plain SGD on the mean gradient, and yours changed the weights otherwise: clipping only "
                    f"ever shrinks a gradient (the coefficient max_norm / norm is capped at 1)")
    if got_below is not None and not math.isclose(float(got_below), below["mean_norm"], rel_tol=1e-4):
        raise Wrong(f"with max_norm={big:g} you returned {float(got_below):.4g}; the averaged gradient's norm "
                    f"is {below['mean_norm']:.4g}, whether or not it was clipped")
    return f"norm {got:.3f} clipped to {max_norm}; below max_norm={big:g} left as is"


@clip.case("the step leaves no gradient behind for the next one",
           hint="the gradients this step used are still there when the next step's backward adds to them",
           reveal="optimizer.zero_grad() after optimizer.step()")
def _(learner):
    """Property: after synced_clip_step no parameter keeps a non-zero .grad for the next step's backward to add to."""
    model, sync, opt, _ = _clip_setup(0.05)
    learner.synced_clip_step(sync, model, opt, 0.05)
    left = [p.grad for p in model.parameters() if p.grad is not None and p.grad.abs().sum() > 0]
    if left:
        raise Wrong("gradients are still there after your step: the next step's backward adds onto them",
                    reveal="optimizer.zero_grad() after optimizer.step()")


class MeanSync:
    """The sync the drawn clip cases hand the learner, one per thread rank: ``finish()`` all-reduces every ``.grad``
    there is and divides it by the world size; it notes the norm of this rank's own gradient when called."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.calls = 0
        self.norm_seen = None

    @torch.no_grad()
    def finish(self) -> None:
        self.calls += 1
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        self.norm_seen = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))
        for g in grads:
            dist.all_reduce(g)
            g.div_(dist.get_world_size())


@dataclass(frozen=True)
class ClipDraw:
    """One drawn 07.clip_after_sync case: ``world_size`` ranks, TinyMLP(dim, hidden, layers) in ``dtype`` with its
    first layer frozen or not, and ``max_norm`` = ``scale`` x the averaged gradient's norm (below 1: clipping
    clips)."""

    world_size: int
    dtype: torch.dtype
    dim: int
    hidden: int
    layers: int
    frozen: bool
    scale: float
    seed: int

    def __str__(self) -> str:
        return (f"{self.world_size} ranks, {_dtype_name(self.dtype)}, TinyMLP(dim={self.dim}, hidden={self.hidden}, "
                f"layers={self.layers}){', its first layer frozen' if self.frozen else ''}, max_norm {self.scale:g} x "
                f"the averaged gradient's norm")


def draw_clip(seed: int = 13, count: int = DRAWN_CASES) -> list[ClipDraw]:
    """3, 2 and 4 ranks; max_norm a drawn fraction of the norm (clipping), or above it, in turn; a frozen first layer
    in every other case."""
    rng = random.Random(seed)
    return [ClipDraw((3, 2, 4, 3)[k % 4], (torch.float64, torch.float32)[k % 2], rng.randint(3, 7), rng.randint(4, 12),
                     rng.randint(2, 4), k % 2 == 0, rng.choice((0.1, 0.3, 0.5)) if k % 4 != 3 else 2.0,
                     rng.randrange(1000)) for k in range(count)]


def _clip_model(case: ClipDraw) -> nn.Module:
    model = TinyMLP(dim=case.dim, hidden=case.hidden, layers=case.layers, seed=case.seed).to(case.dtype)
    if case.frozen:
        model.layers[0].requires_grad_(False)
    return model


def _clip_batch(case: ClipDraw, rank: int):
    g = torch.Generator().manual_seed(case.seed * 100 + rank)
    x = torch.randn(3, case.dim, generator=g, dtype=torch.float64).to(case.dtype) * (1 + rank)
    return x, torch.sin(3 * x)


def _norm(grads) -> float:
    return float(torch.linalg.vector_norm(torch.stack([g.double().norm() for g in grads])))


def _clip_truth(case: ClipDraw) -> dict:
    """Each rank's own gradient, their mean and its norm, max_norm, and the weights after the right step and after
    clipping each rank's gradient before averaging."""
    model = _clip_model(case)
    params = [p for p in model.parameters() if p.requires_grad]
    local = []
    for r in range(case.world_size):
        mlp_loss(model, _clip_batch(case, r)).backward()
        local.append([p.grad.clone() for p in params])
        model.zero_grad(set_to_none=True)
    mean = [sum(gs) / case.world_size for gs in zip(*local)]
    norm = _norm(mean)
    max_norm = case.scale * norm
    clip = lambda gs: [g * min(1.0, max_norm / (_norm(gs) + 1e-6)) for g in gs]      # noqa: E731
    start = [p.detach().clone() for p in params]
    step = lambda gs: [p - DRAWN_LR * g for p, g in zip(start, gs)]                    # noqa: E731
    first = [sum(gs) / case.world_size for gs in zip(*(clip(loc) for loc in local))]
    return dict(local=local, norm=norm, max_norm=max_norm, start=start, want=step(clip(mean)), clip_first=step(first),
                unclipped=step(mean), scaled=step([g * max_norm / (norm + 1e-6) for g in mean]),
                local_norms=[_norm(loc) for loc in local])


def _clip_ranks(learner, case: ClipDraw, max_norm: float) -> tuple[list, list]:
    def fn(rank):
        model = _clip_model(case)
        mlp_loss(model, _clip_batch(case, rank)).backward()
        sync = MeanSync(model)
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=DRAWN_LR)
        got = learner.synced_clip_step(sync, model, opt, max_norm)
        return {"norm": got, "calls": sync.calls, "norm_seen": sync.norm_seen,
                "params": [p.detach().clone() for p in model.parameters() if p.requires_grad],
                "grads_left": any(p.grad is not None and bool(p.grad.abs().sum() > 0) for p in model.parameters())}

    return run_thread_ranks(case.world_size, fn)


def _clip_mistake(learner, case: ClipDraw) -> str | None:
    """None when every rank syncs once, returns the averaged gradient's norm before clipping, steps with that
    gradient clipped to max_norm, and leaves no gradient behind; else what the first rank that did not did."""
    truth = _clip_truth(case)
    results, errors = _clip_ranks(learner, case, truth["max_norm"])
    failed = _own_error(errors)
    if failed is not None:
        rank, err = failed
        if "NoneType" in err and case.frozen:
            return (f"rank {rank} raised {err}: a frozen parameter has no .grad; the norm is over the gradients there "
                    f"are (clip_grad_norm_ skips a parameter whose .grad is None)")
        return f"rank {rank} raised {err}"
    close = lambda got, want: all(torch.allclose(a, b, **_tol(case.dtype)) for a, b in zip(got, want))  # noqa: E731
    near = lambda a, b: math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-9)                                    # noqa: E731
    clips = truth["max_norm"] < truth["norm"]
    for rank, res in enumerate(results):
        if res["calls"] != 1:
            return f"rank {rank}: sync.finish() was called {res['calls']} times; once per optimizer step"
        if clips and res["norm_seen"] is not None and near(res["norm_seen"], truth["max_norm"]):
            return (f"rank {rank}: the gradient had already been clipped when finish() was called: each rank clipped "
                    f"its own gradient by its own norm, and their average is not the clipped average")
        got = res["params"]
        if not close(got, truth["want"]):
            if clips and close(got, truth["clip_first"]):
                return (f"rank {rank}: its weights are those of clipping each rank's gradient before averaging; the "
                        f"norm to clip by is the averaged gradient's, after finish()")
            if not clips and close(got, truth["scaled"]):
                return (f"rank {rank}: max_norm is above the averaged gradient's norm, and the gradient was scaled up "
                        f"to max_norm; clipping only ever shrinks a gradient")
            if clips and close(got, truth["unclipped"]):
                return f"rank {rank}: the norm is above max_norm, yet the step used the averaged gradient unclipped"
            diff = max(float((a - b).abs().max()) for a, b in zip(got, truth["want"]))
            return f"rank {rank}: the weights after the step differ from SGD on the clipped mean gradient by {diff:.3g}"
        if res["grads_left"]:
            return f"rank {rank}: gradients are still there after the step; the next step's backward adds onto them"
        value = res["norm"]
        if value is None or (isinstance(value, torch.Tensor) and value.numel() != 1):
            return f"rank {rank}: synced_clip_step returned {value!r}, not the norm (one number)"
        value = float(value)
        if near(value, truth["norm"]):
            continue
        if clips and near(value, truth["max_norm"]):
            return f"rank {rank}: it returned the norm after clipping (= max_norm), not the norm before"
        if near(value, truth["local_norms"][rank]):
            return f"rank {rank}: it returned this rank's own gradient norm, measured before finish()"
        return f"rank {rank}: it returned {value:.6g}; the averaged gradient's norm is {truth['norm']:.6g}"
    return None


def _smaller_clip(case: ClipDraw):
    for w in (2, 3):
        if w < case.world_size:
            yield replace(case, world_size=w)
    if case.dtype != torch.float32:
        yield replace(case, dtype=torch.float32)
    if case.frozen:
        yield replace(case, frozen=False)
    if case.layers > 2:
        yield replace(case, layers=2)
    if (case.dim, case.hidden) != (3, 4):
        yield replace(case, dim=3, hidden=4)


@clip.case("drawn: 2, 3 and 4 ranks, a frozen layer or not, max_norm below or above the norm, float32 and float64",
           hint="on every rank: finish() once, the norm of the averaged gradients there are, the clip only ever "
                "shrinking, the step, no gradient left; return the norm before clipping",
           reveal="sync.finish(); norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm); "
                  "optimizer.step(); optimizer.zero_grad(); return float(norm)",
           timeout=90, after="finish(), then clip the mean, then step: the norm is the averaged gradient's")
def _(learner):
    """Property: on drawn cases (2, 3 and 4 thread ranks, a frozen first layer or not, max_norm a drawn fraction of
    the averaged gradient's norm or above it, float32 and float64, drawn TinyMLP shapes), every rank calls finish()
    once, steps with the averaged gradient clipped to max_norm, leaves no gradient behind, and returns the averaged
    gradient's norm before clipping."""
    return _raise_drawn(draw_clip(), lambda c: _clip_mistake(learner, c), _smaller_clip,
                        "sync.finish(); norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm); "
                        "optimizer.step(); optimizer.zero_grad(); return float(norm)")


# --------------------------------------------------------------------------- the lesson's figure
DRIFT_VARIANTS = ("no_sync, clip after finish()", "every micro-step synced", "clip before the sync",
                  "bf16 on the wire")


def drift_runs(rank, world_size, steps=8, accum=2, max_norm=0.3, lr=0.5):
    """Train `TiedBranchLM` with hfstream's GradSync on this rank's half of each batch, four ways,
    and measure after every step the largest difference from single-process training.

    The branch runs on rank 0 only at odd steps; the model has a tied and a frozen weight; each
    optimizer step accumulates ``accum`` micro-batches and clips to ``max_norm``. Returns, per
    variant, ``{"drift": [max |param - reference| per step], "collectives": [per step]}``.
    """
    from hfstream import GradSync

    out = {}
    for variant in DRIFT_VARIANTS:
        torch.manual_seed(rank)                       # different on purpose: GradSync broadcasts rank 0's weights
        model = TiedBranchLM(seed=rank)
        kwargs = {"bucket_mb": 0.0}                   # one all-reduce per parameter: easy to count
        if variant == "clip before the sync":
            kwargs["mode"] = "serial"                 # reduces in finish(), so a clip before it is a local clip
        if variant == "bf16 on the wire":
            kwargs["comm_dtype"] = "bf16"
        sync = GradSync(model, **kwargs)
        ref = TiedBranchLM(seed=0) if rank == 0 else None
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
        drift, collectives = [], []
        for step in range(steps):
            ids = lm_batch(step, n=16)
            use = [step % 2 == 1, False]              # the branch: rank 0, odd steps only
            mine = shard(ids, rank, world_size)
            micro = [mine[k::accum] for k in range(accum)]
            count = 0
            for k, mb in enumerate(micro):
                last = k == accum - 1
                if variant == "every micro-step synced":
                    (lm_loss(model, mb, use[rank]) / accum).backward()
                    sync.finish()
                    count += sync.stats.num_collectives
                    continue
                with contextlib.nullcontext() if last else sync.no_sync():
                    (lm_loss(model, mb, use[rank]) / accum).backward()
            if variant == "clip before the sync":
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            if variant != "every micro-step synced":
                sync.finish()
                count = sync.stats.num_collectives
            if variant != "clip before the sync":
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            opt.step()
            opt.zero_grad()
            collectives.append(count)
            if ref is not None:
                ref_loss = sum(lm_loss(ref, shard(ids, r, world_size), use[r]) for r in range(world_size)) / world_size
                ref_loss.backward()
                torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
                with torch.no_grad():
                    for p in ref.parameters():
                        if p.grad is not None:
                            p.sub_(lr * p.grad)
                            p.grad = None
                drift.append(_max_diff(model, ref))
        sync.close()
        out[variant] = {"drift": drift, "collectives": collectives}
    return out
