"""Lesson 07 checks: accumulation without sync, tied/frozen/unused parameters, clipping after the
sync; and `drift_runs`, the two-process measurement behind the lesson's figure.

Every multi-process check compares the learner's data parallelism (2 gloo ranks, each on half
the batch) with single-process training on the whole batch, step by step: that is what "correct"
means for data parallelism (CS336's test). A rank that waits for a collective its peer never
issues fails after a short process-group timeout instead of hanging.
"""

from __future__ import annotations

import contextlib
import copy
import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

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

    def __init__(self, vocab: int = 16, dim: int = 8, freeze: bool = True, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.embed = nn.Embedding(vocab, dim)
        self.frozen = nn.Linear(dim, dim)
        self.mix = nn.Linear(dim, dim)
        self.extra = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, vocab, bias=False)
        self.out.weight = self.embed.weight          # tied, as GPT-2's lm_head and wte
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
    if diff and diff[0] < PARITY_TOL and any(d > PARITY_TOL for d in diff[1:]):
        raise Wrong("the first step matches but later ones do not: each step's backward adds onto the gradients "
                    "the step before left behind", reveal="optimizer.zero_grad() after optimizer.step()")
    assert diff and max(diff) < PARITY_TOL, (
        f"after each step the weights differ from single-process training by up to {max(diff or [math.inf]):.3g}")
    a, b = (r["diff"] for r in res)
    assert max(abs(x - y) for x, y in zip(a, b)) < PARITY_TOL, "the two ranks ended with different weights"
    return f"max difference {max(diff):.1e}"


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
