"""Lesson 05 checks: per-parameter overlap (gradient hooks + asynchronous all-reduce), a fixed
launch order that survives unused parameters, and the measured timeline.

Two tools do the grading:

- `Recorder` wraps ``torch.distributed.all_reduce`` inside a rank and notes every call: how big,
  whether ``async_op=True``, whether backward was still running, when it was launched and when
  it completed. The learner's code calls ``dist.all_reduce`` by attribute, so it goes through it.
- `fake_ranks` plays two ranks one after the other in this process with a stand-in
  ``all_reduce`` that only records: it shows, without any risk of a hang, which reductions each
  rank would launch and in which order. Real gloo processes then check the numbers.

The figure's runs (`measure_overlap`) live here too: spawned ranks need an importable function.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from course.checks.drawn import raise_smallest
from course.grading import Exercise, Learner, Wrong, get_exercise, is_stub, load_module

# --------------------------------------------------------------------------- shared tools
# A launch loop that never moves on (``while self.next < n: self._launch(self.next)`` without the
# ``+= 1``) would otherwise launch until the machine runs out of memory: both stand-ins stop it here.
RUNAWAY_CALLS = 10_000
RUNAWAY = (f"more than {RUNAWAY_CALLS} all-reduces in one step: a launch loop that never moves on to the next "
           f"one (does it advance its index?)")


class Recorder:
    """Stands in for ``torch.distributed.all_reduce`` in a rank and records every call.

    ``in_backward`` is set by the caller around ``loss.backward()``; each call notes it, so a
    reduction launched from a gradient hook is told apart from one launched after backward.
    """

    def __init__(self):
        self.real = dist.all_reduce
        self.calls: list[dict[str, Any]] = []
        self.in_backward = False

    def __call__(self, tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        call = {"numel": tensor.numel(), "async": bool(async_op), "in_backward": self.in_backward,
                "launch": time.perf_counter(), "done": None}
        if len(self.calls) >= RUNAWAY_CALLS:
            raise RuntimeError(RUNAWAY)
        self.calls.append(call)
        work = self.real(tensor, op=op, group=group, async_op=async_op)
        if work is None:
            call["done"] = time.perf_counter()
        else:
            def finished(_fut, call=call):
                call["done"] = time.perf_counter()
            try:
                work.get_future().add_done_callback(finished)
            except Exception:   # a Work without a future: the launch is all we know
                pass
        return work

    @contextlib.contextmanager
    def installed(self):
        self.real = dist.all_reduce
        dist.all_reduce = self
        try:
            yield self
        finally:
            dist.all_reduce = self.real

    def take(self) -> list[dict[str, Any]]:
        calls, self.calls = self.calls, []
        return calls


class _FakeWork:
    def __init__(self, tensor):
        self.tensor = tensor

    def wait(self, timeout=None):
        return True

    def is_completed(self):
        return True

    def is_success(self):
        return True

    def get_future(self):
        fut = torch.futures.Future()
        fut.set_result([self.tensor])
        return fut


@contextlib.contextmanager
def fake_ranks(world_size: int = 2):
    """Inside the block, this process pretends to be one of ``world_size`` ranks: ``all_reduce``
    records its calls (and reduces nothing), ``get_world_size`` answers ``world_size``.

    Yields the list the calls go to; set ``.in_backward`` on the returned object around backward.
    """
    names = ("all_reduce", "get_world_size", "get_rank", "is_initialized", "is_available", "barrier")
    saved = {n: getattr(dist, n) for n in names}

    class Log(list):
        in_backward = False

    log = Log()

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if len(log) >= RUNAWAY_CALLS:
            raise RuntimeError(RUNAWAY)
        log.append({"tensor": tensor, "numel": tensor.numel(), "ptr": tensor.data_ptr(),
                    "async": bool(async_op), "in_backward": log.in_backward})
        return _FakeWork(tensor) if async_op else None

    dist.all_reduce = all_reduce
    dist.get_world_size = lambda group=None: world_size
    dist.get_rank = lambda group=None: 0
    dist.is_initialized = lambda: True
    dist.is_available = lambda: True
    dist.barrier = lambda *a, **k: None
    try:
        yield log
    finally:
        for n, fn in saved.items():
            setattr(dist, n, fn)


def rank_failure_message(exc: Exception, hint: str) -> str:
    """The first failing rank's last traceback line, then the hint."""
    text = str(exc)
    last = ""
    for block in text.split("--- rank ")[1:]:
        lines = [ln.strip() for ln in block.strip().splitlines() if ln.strip()]
        if lines:
            last = lines[-1]
            break
    return f"a rank failed: {last or text.strip().splitlines()[0]}. Hint: {hint}"


def run_ranks(fn, *args, hint: str, timeout: float = 90.0, pg_timeout_s: float = 30.0):
    """`run_on_ranks` on 2 gloo processes; a failure becomes a `Wrong` naming the rank's error."""
    from hfstream.testing import RankFailure, run_on_ranks

    try:
        return run_on_ranks(fn, 2, *args, timeout=timeout, pg_timeout_s=pg_timeout_s)
    except RankFailure as exc:
        if "timed out" in str(exc) or "Timed out" in str(exc) or "timeout" in str(exc).lower():
            raise Wrong(f"the ranks did not finish (a hang: a reduction one rank launched and the other "
                        f"never did?). Hint: {hint}") from None
        raise Wrong(rank_failure_message(exc, hint)) from None


def _memo(learner: Learner) -> dict:
    return learner.facts


def cached(key: str, learner: Learner, compute):
    """Run ``compute(path)`` once per check call; later cases reuse the facts (or the failure)."""
    return learner.once(key, lambda: compute(learner.module_file()))


def _classify(got, mean, local, world_size) -> str:
    """Which of mean / sum / local / divided-twice / missing ``got`` (a list of grads) is."""
    if any(g is None for g in got):
        return "missing"

    def close(a, b):
        return all(torch.allclose(x, y, rtol=1e-4, atol=1e-6) for x, y in zip(a, b))

    if close(got, mean):
        return "mean"
    if close(got, [m * world_size for m in mean]):
        return "sum"
    if close(got, local):
        return "local"
    if close(got, [m / world_size for m in mean]):
        return "twice"
    return "other"


def _reference_grads(ref, loss, recorder_real, world_size):
    """Each rank's own gradients (zeros where there is none) and their mean: the serial way."""
    loss.backward()
    local = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in ref.parameters()]
    summed = [t.clone() for t in local]
    for t in summed:
        recorder_real(t)          # blocking, and not counted as the learner's
    return local, [t / world_size for t in summed]


def gradient_arrivals(model, loss_fn) -> tuple[list[tuple[float, str]], float]:
    """When each parameter's gradient became final in one backward (after a warm-up one), in ms
    from the start of ``loss_fn().backward()``, and when backward returned.

    The notebook's first cell shows the result; how it is measured (a post-accumulate-grad hook
    per parameter) is the exercise that follows, so it lives here.
    """
    name_of = {p: n for n, p in model.named_parameters()}
    arrivals = []
    handles = [p.register_post_accumulate_grad_hook(lambda p: arrivals.append((time.perf_counter(), name_of[p])))
               for p in model.parameters() if p.requires_grad]
    try:
        loss_fn().backward()             # warm-up
        model.zero_grad(set_to_none=True)
        arrivals.clear()
        loss = loss_fn()
        t0 = time.perf_counter()
        loss.backward()
        t1 = time.perf_counter()
    finally:
        for h in handles:
            h.remove()                   # hooks stay until removed
        model.zero_grad(set_to_none=True)
    return [((t - t0) * 1e3, name) for t, name in arrivals], (t1 - t0) * 1e3


# =============================================================================================
# 05.overlap_hook
# =============================================================================================
overlap_hook = Exercise("05.overlap_hook", uses=["OverlapSync"], title="a hook per parameter, an async all-reduce each")

DIM, HIDDEN, LAYERS = 16, 24, 3


def _overlap_rank(rank: int, world_size: int, path: str) -> dict:
    from course.lib import TinyMLP, random_regression

    mod = load_module(path)
    rec = Recorder()
    with rec.installed():
        model = TinyMLP(dim=DIM, hidden=HIDDEN, layers=LAYERS, seed=0)
        ref = TinyMLP(dim=DIM, hidden=HIDDEN, layers=LAYERS, seed=0)
        sync = mod.OverlapSync(model)
        rec.take()   # whatever construction did is not a step's reduction
        opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
        steps = []
        for step in range(2):
            x, y = random_regression(n=8, dim=DIM, seed=10 * step + rank)
            loss = F.mse_loss(model(x), y)
            rec.in_backward = True
            try:
                loss.backward()
                rec.in_backward = False
                in_backward = len(rec.calls)
                sync.finish()
            except Exception as exc:
                # Both ranks run the same code, so both stop here; what was launched still
                # says what went wrong (a blocking all-reduce returns None, not a Work).
                calls = rec.take()
                steps.append({"calls": len(calls), "async": [c["async"] for c in calls],
                              "in_backward": sum(c["in_backward"] for c in calls),
                              "error": f"{type(exc).__name__}: {exc}".strip().splitlines()[0]})
                break
            calls = rec.take()
            got = [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]
            local, mean = _reference_grads(ref, F.mse_loss(ref(x), y), rec.real, world_size)
            left = getattr(sync, "works", None)
            steps.append({"calls": len(calls), "async": [c["async"] for c in calls],
                          "in_backward": sum(c["in_backward"] for c in calls), "calls_before_return": in_backward,
                          "left_over": len(left) if isinstance(left, (list, tuple, dict, set)) else 0,
                          "result": _classify(got, mean, local, world_size)})
            for p, m in zip(ref.parameters(), mean):
                p.grad = m.clone()
            opt.step(); ref_opt.step()
            opt.zero_grad(set_to_none=True); ref_opt.zero_grad(set_to_none=True)
    return {"params": sum(1 for _ in model.parameters()), "steps": steps}


# First stage of each hint: what must happen. The code behind it is the case's `reveal`, shown
# only from the third failure in a row (course.grading.REVEAL_AFTER).
HOOK_HINT = ("every parameter that requires grad needs a post-accumulate-grad hook; the hook starts the "
             "asynchronous all-reduce of that parameter's .grad, keeps the Work, and returns without waiting")
HOOK_REVEAL = ("__init__: self.handles.append(p.register_post_accumulate_grad_hook(self._on_grad_ready)) for each "
               "p in model.parameters() with p.requires_grad; _on_grad_ready: "
               "self.works.append((param, dist.all_reduce(param.grad, async_op=True)))")
FINISH_HINT = ("finish() waits for every Work launched this step, turns each sum into a mean, and leaves no Work "
               "behind for the next step")
FINISH_REVEAL = "for param, work in self.works: work.wait(); param.grad.div_(self.world_size)   then: self.works = []"


BLOCKING = ("the all-reduce in your hook is blocking: it returns only once the reduction is done (and returns "
            "None, not a Work), so backward stands still inside every hook and nothing overlaps. Use the "
            "asynchronous form, keep the Work it returns, and wait for it in finish()")
ASYNC_REVEAL = "self.works.append((param, dist.all_reduce(param.grad, async_op=True)))"


def _overlap_facts(learner: Learner) -> dict:
    def every_rank(path):
        ranks = run_ranks(_overlap_rank, path, hint=HOOK_HINT)
        return dict(ranks[0], by_rank=ranks)        # rank 0's launches; every rank's results (the parity case)
    return cached("05.overlap_hook", learner, every_rank)


OVERLAP_LAUNCH = "one asynchronous all-reduce per parameter, launched from its hook during backward"


@overlap_hook.case(OVERLAP_LAUNCH, hint=HOOK_HINT, reveal=HOOK_REVEAL, timeout=150)
def _(learner):
    """Property: on 2 gloo ranks for 2 steps, each parameter that requires grad launches one asynchronous all-reduce of
    its .grad from its own hook during backward, none twice; on 4 drawn models with frozen parameters (2 to 4 thread
    ranks, every rank read), a frozen parameter gets no hook and no reduction, and each hook launches its own
    parameter's reduction before it returns."""
    src = learner.source("OverlapSync")
    if "register_hook(" in src and "register_post_accumulate_grad_hook" not in src:
        raise Wrong("Tensor.register_hook fires with this backward's incoming gradient *before* it is "
                    "accumulated into .grad (.grad may still be None then): the hook you need is the "
                    "post-accumulate one, called with the parameter once param.grad is final",
                    reveal="p.register_post_accumulate_grad_hook(self._on_grad_ready)")
    facts = _overlap_facts(learner)
    n = facts["params"]
    for i, st in enumerate(facts["steps"], 1):
        if st["calls"] and not all(st["async"]) and st["in_backward"]:
            raise Wrong(BLOCKING, reveal=ASYNC_REVEAL)
        if "error" in st:
            raise Wrong(f"step {i}: your code raised {st['error']}. Hint: {HOOK_HINT}")
        if st["calls"] == 0:
            raise Wrong(f"step {i}: no all-reduce was launched at all: the hook must start the reduction of "
                        f"param.grad", reveal=HOOK_REVEAL)
        if st["in_backward"] == 0:
            raise Wrong("you reduced after backward: every all-reduce was launched once loss.backward() had "
                        "returned, so none can overlap it. Register a hook per parameter "
                        "(register_post_accumulate_grad_hook) and launch the reduction from it")
        if not all(st["async"]):
            raise Wrong(BLOCKING, reveal=ASYNC_REVEAL)
        if st["calls"] > n and i == 1:
            raise Wrong(f"{st['calls']} all-reduces for {n} parameters: each gradient was reduced more than "
                        f"once (in the hook and again in finish()?). finish() only waits and divides")
        if st["calls"] != n:
            if i == 2 and st["calls"] > n:
                raise Wrong(f"step 2 launched {st['calls']} all-reduces for {n} parameters: clear the list of "
                            f"Works at the end of finish(), or step 2 waits on step 1's works again")
            raise Wrong(f"step {i}: {st['calls']} all-reduces for {n} parameters: one per parameter that "
                        f"requires grad, each from its own hook")
        if st["in_backward"] != n:
            raise Wrong(f"step {i}: only {st['in_backward']} of {n} reductions started during backward: every "
                        f"parameter needs its own hook")
    _check_drawn_overlap_launches(learner)
    return (f"{n} reductions per step, all launched during backward; {OVERLAP_DRAWS} drawn models with frozen "
            f"parameters on 2 to 4 ranks: none of them hooked")


@overlap_hook.case("after finish() every .grad is the mean over 2 gloo ranks, two steps in a row",
                   hint=FINISH_HINT, reveal=FINISH_REVEAL, after=OVERLAP_LAUNCH, timeout=150)
def _(learner):
    """Property: after finish() every .grad is the mean over the ranks, on both gloo ranks for 2 steps in a row, and on
    every rank of 4 drawn models (2 to 4 thread ranks), a frozen parameter's .grad left None."""
    for rank, facts in enumerate(_overlap_facts(learner)["by_rank"]):
        _overlap_parity(rank, facts)
    _check_drawn_overlap_means(learner)
    return f"matches the serial all-reduce on both ranks, and on every rank of {OVERLAP_DRAWS} drawn models"


def _overlap_parity(rank: int, facts: dict) -> None:
    """The parity case on one gloo rank's steps (rank 0 named as before; another rank by number)."""
    at = "" if rank == 0 else f"rank {rank}, "
    for i, st in enumerate(facts["steps"], 1):
        if "error" in st:
            raise Wrong(f"{at}step {i}: your code raised {st['error']}, so there are no gradients to compare. "
                        f"Hint: {FINISH_HINT}")
        if st.get("left_over"):
            raise Wrong(f"step {i}: finish() returned with {st['left_over']} Works still in self.works, so the next "
                        f"finish() waits on them again and divides those gradients a second time (while the new "
                        f"reductions may still be writing them): clear the list at the end of finish()",
                        reveal=FINISH_REVEAL)
        r = st["result"]
        if r == "mean":
            continue
        if r == "sum":
            raise Wrong("the gradients are the sum over ranks, not the mean: all_reduce adds; divide by the "
                        "world size in finish(), after the Work is done", reveal=FINISH_REVEAL)
        if r == "local":
            raise Wrong("the gradients are still this rank's own: all_reduce works in place on the tensor you "
                        "pass. Reduce param.grad itself (not a copy), or copy the result back in finish()",
                        reveal=ASYNC_REVEAL)
        if r == "twice" and i == 2:
            raise Wrong("step 2's gradients were divided twice: clear the list of (param, Work) at the end of "
                        "finish(), or the next finish() divides the old entries again")
        if r == "twice":
            raise Wrong("the gradients were divided by the world size twice (once in the hook, once in finish()?)")
        if r == "missing":
            raise Wrong(f"step {i}: some .grad is None after finish(): the hook must not replace or drop param.grad")
        raise AssertionError(f"{at}step {i}: the gradients after finish() differ from the mean over ranks "
                             f"(did you divide before the reduction finished? wait() first)")



# Drawn cases (course/checks/drawn.py): frozen parameters in every case, gradients out of registration
# order, 2 to 4 thread ranks, every rank read. The property: a hook per parameter that requires grad and
# none for a frozen one; each hook launches its own parameter's reduction before it returns; after
# finish() every rank holds the mean, and a frozen parameter's .grad stays None.
OVERLAP_DRAWS = 4


def _drawn_overlap(learner) -> tuple:
    from course.checks.drawn import draw_cases, run_draws

    def compute():
        return run_draws(draw_cases(5, OVERLAP_DRAWS, frozen_every=1, skip=False),
                         lambda model, d: learner.OverlapSync(model))
    return learner.once("05.overlap_hook-drawn", compute)


def rank_error(draw, steps, what: str) -> str | None:
    """The first rank that raised, where, and the line of the learner's code; None when none raised."""
    from course.checks.lesson10.threads import PeerFailed, _your_line

    for rank, st in enumerate(steps):
        if (st.error is not None and not isinstance(st.error, (TimeoutError, PeerFailed))
                and "waited" not in str(st.error)):
            text = str(st.error).strip().splitlines()
            return (f"rank {rank} raised {type(st.error).__name__} in {what if st.where == 'construct' else st.where}: "
                    f"{text[0] if text else ''}{_your_line(st.error)}")
    for rank, st in enumerate(steps):
        if st.error is not None:
            return f"rank {rank}: {str(st.error).strip().splitlines()[0]}"
    return None


def _check_drawn_overlap_launches(learner, pairs=None) -> None:
    """The end of OVERLAP_LAUNCH: on the drawn models, no hook or all-reduce for a frozen parameter, and each
    hook launches its own parameter's reduction before it returns, on every rank."""
    if pairs is None:       # each drawn case in turn; the first that fails, shrunk
        return raise_smallest(_drawn_overlap(learner), lambda p: _check_drawn_overlap_launches(learner, p),
                              lambda model, d: learner.OverlapSync(model))
    for draw, steps in pairs:
        crashed = rank_error(draw, steps, "OverlapSync(model)")
        if crashed and any(st.where == "construct" for st in steps) and draw.frozen:
            raise Wrong(f"a frozen parameter got a hook: {crashed}, on a model whose {', '.join(draw.frozen)} has "
                        f"requires_grad=False ({draw.describe()}). A frozen parameter gets no gradient: hook only "
                        f"the parameters that require grad, and reduce nothing for the others", reveal=HOOK_REVEAL)
        if crashed:
            raise Wrong(f"{crashed} ({draw.describe()}). Hint: {HOOK_HINT}")
        for rank, st in enumerate(steps):
            if len(st.numels) > len(draw.trainable):
                raise Wrong(f"a frozen parameter was reduced: rank {rank} launched {len(st.numels)} all-reduces for "
                            f"{len(draw.trainable)} parameters that require grad ({draw.describe()}). A frozen "
                            f"parameter has no gradient to average: leave it out", reveal=HOOK_REVEAL)
            for k, (name, launched) in enumerate(st.launches_after, 1):
                if launched < k:
                    raise Wrong(f"rank {rank}: when the hook of {name} returned, {launched} all-reduces had been "
                                f"launched for the {k} gradients that had arrived ({draw.describe()}): each hook "
                                f"launches its own parameter's reduction before it returns", reveal=HOOK_REVEAL)


def _check_drawn_overlap_means(learner, pairs=None) -> None:
    """The end of the parity case: on the drawn models, every rank holds the mean, frozen .grad None."""
    from course.checks.drawn import first_wrong_grad

    if pairs is None:
        return raise_smallest(_drawn_overlap(learner), lambda p: _check_drawn_overlap_means(learner, p),
                              lambda model, d: learner.OverlapSync(model))
    for draw, steps in pairs:
        crashed = rank_error(draw, steps, "OverlapSync(model)")
        if crashed:
            raise Wrong(f"{crashed} ({draw.describe()}). Hint: {FINISH_HINT}")
        wrong = first_wrong_grad(draw, steps)
        if wrong:
            raise Wrong(f"{wrong} ({draw.describe()}). Hint: {FINISH_HINT}", reveal=FINISH_REVEAL)


# =============================================================================================
# 05.finish — a fixed launch order, unused parameters included
# =============================================================================================
ordered = Exercise("05.finish", uses=["OrderedOverlapSync"], title="one launch order on every rank, unused parameters too")


class Branchy(nn.Module):
    """A model whose ``expert`` only some ranks use and whose ``spare`` no rank uses.

    Every parameter has a different number of elements, so a reduction says which one it is.
    """

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.inp = nn.Linear(3, 6)             # 18, 6
        self.expert = nn.Linear(6, 6, bias=False)   # 36
        self.spare = nn.Parameter(torch.zeros(5))   # 5: never used
        self.out = nn.Linear(6, 4)             # 24, 4
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)

    def forward(self, x, use_expert: bool):
        h = torch.tanh(self.inp(x))
        if use_expert:
            h = h + torch.tanh(self.expert(h))
        return self.out(h)


def _names_by_numel(model) -> dict[int, str]:
    return {p.numel(): n for n, p in model.named_parameters()}


def _fake_sequences(cls) -> dict:
    """Three steps of two ranks (rank 1 skips ``expert``) with the stand-in all-reduce; in the third both
    ranks use ``spare`` too, so on rank 0 every parameter's hook fires and the head runs off the end of
    the order inside a hook."""
    out = {}
    for rank in (0, 1):
        model = Branchy()
        names = _names_by_numel(model)
        with fake_ranks(2) as log:
            sync = cls(model)
            log.clear()
            steps = []
            for step in range(3):
                x = torch.randn(4, 3, generator=torch.Generator().manual_seed(step))
                loss = model(x, use_expert=(rank == 0)).square().mean()
                if step == 2:
                    loss = loss + model.spare.square().sum()
                log.in_backward = True
                loss.backward()
                log.in_backward = False
                sync.finish()
                steps.append([(names.get(c["numel"], f"<{c['numel']} elements>"), c["in_backward"]) for c in log])
                log.clear()
                model.zero_grad(set_to_none=True)
        out[rank] = steps
    return out


ORDER_HINT = ("a hook marks its parameter ready, then launches parameters from the head of self.order for as long "
              "as the head is ready; finish() launches the rest in order, waits for each and divides, then resets "
              "the per-step state")
ORDER_REVEAL = ("_on_grad_ready: self.ready[i] = True; while self.next < len(self.order) and self.ready[self.next]: "
                "self._launch(self.next); self.next += 1.   finish(): the same loop without the ready test, then "
                "for p, work in self.works: work.wait(); p.grad.div_(self.world_size); then self.works, self.next = "
                "[], 0 and self.ready = [False] * len(self.order)")


def _ordered_fake(learner):
    memo = _memo(learner)
    if "05.finish-fake" not in memo:
        try:
            memo["05.finish-fake"] = ("ok", _fake_sequences(learner.OrderedOverlapSync))
        except Exception as exc:   # report it in the case, like any crash of the learner's code
            memo["05.finish-fake"] = ("error", exc)
    kind, value = memo["05.finish-fake"]
    if kind == "error":
        raise value
    return value


def _diagnose_order(seqs: dict) -> str | None:
    """A Wrong message for a launch pattern that would hang real ranks, or None."""
    every = [n for n, _ in Branchy().named_parameters()]
    for step in range(len(seqs[0])):
        r0 = [n for n, _ in seqs[0][step]]
        r1 = [n for n, _ in seqs[1][step]]
        for rank, seq in ((0, r0), (1, r1)):
            dup = sorted({n for n in seq if seq.count(n) > 1})
            if dup:
                return (f"step {step + 1}, rank {rank}: {dup[0]} was reduced {seq.count(dup[0])} times: launch each "
                        f"parameter exactly once per step (advance self.next past what you launch)")
            if step >= 1 and not seq:
                return (f"step {step + 1} launched nothing: finish() must leave the per-step state (self.next, self.ready) "
                        "as __init__ set it, for the next step")
            missing = [n for n in every if n not in seq]
            if missing:
                who = ("no rank uses it" if missing[0] == "spare" and step < 2
                       else f"rank {rank} did not use it this step" if missing[0] != "spare" else "")
                who = who or "every parameter was used: the last hook launched the whole order"
                return (f"step {step + 1}, rank {rank}: {missing[0]} was never reduced ({who}), so its partner rank "
                        f"waits forever for that all-reduce. finish() must launch every parameter not launched yet, "
                        f"with zeros for a missing .grad (self._launch does that)")
        if r0 != r1:
            k = next((i for i, (a, b) in enumerate(zip(r0, r1)) if a != b), min(len(r0), len(r1)))
            a = r0[k] if k < len(r0) else "nothing"
            b = r1[k] if k < len(r1) else "nothing"
            return (f"step {step + 1}: the ranks launched their reductions in different orders (rank 0: "
                    f"{', '.join(r0)}; rank 1, which skipped `expert`: {', '.join(r1)}). Collectives are matched "
                    f"by order, so rank 0's all-reduce of {a} met rank 1's of {b}: launch only from the head of "
                    f"self.order, never a parameter while one ahead of it is still waiting")
    return None


ORDER_CASE = "every rank launches the same reductions in the same order, unused parameters included"


@ordered.case(ORDER_CASE, hint=ORDER_HINT, reveal=ORDER_REVEAL, timeout=60)
def _(learner):
    """Property: every rank launches the same reductions in the same order, rank 1 skipping `expert` included, some of
    them during backward; on 6 drawn models (gradients out of the launch order, a drawn rank that skips, 2 to 4
    thread ranks) no hook returns with a ready parameter at the head of self.order left unlaunched."""
    seqs = _ordered_fake(learner)
    problem = _diagnose_order(seqs)
    if problem:
        raise Wrong(problem, reveal=ORDER_REVEAL)
    during = sum(b for _, b in seqs[0][0])
    if during == 0:
        raise Wrong("everything was launched from finish(), after backward: nothing overlaps. In the hook, launch "
                    "the parameters at the head of self.order as soon as they are ready")
    first = [n for n, _ in seqs[0][0]]
    _check_drawn_finish_on_time(learner)
    return (f"order {' > '.join(first)}; {during} launched during backward; every hook on time in {FINISH_DRAWS} "
            f"drawn models (arrival orders, a rank that skips, 2 to 4 ranks)")


def _ordered_rank(rank: int, world_size: int, path: str) -> dict:
    mod = load_module(path)
    rec = Recorder()
    with rec.installed():
        model, ref = Branchy(), Branchy()
        sync = mod.OrderedOverlapSync(model)
        rec.take()
        opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
        results = []
        for step in range(2):
            x = torch.randn(4, 3, generator=torch.Generator().manual_seed(10 * step + rank))
            use = rank == 0
            model(x, use).square().mean().backward()
            sync.finish()
            rec.take()
            got = [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]
            local, mean = _reference_grads(ref, ref(x, use).square().mean(), rec.real, world_size)
            names = [n for n, _ in model.named_parameters()]
            # The spare parameter, unused everywhere: zeros or None are both fine (DDP leaves None).
            i = names.index("spare")
            if got[i] is None:
                got[i] = torch.zeros_like(mean[i])
            results.append(_classify(got, mean, local, world_size))
            for p, m in zip(ref.parameters(), mean):
                p.grad = m.clone()
            opt.step(); ref_opt.step()
            opt.zero_grad(set_to_none=True); ref_opt.zero_grad(set_to_none=True)
    return {"results": results}


@ordered.case("2 gloo ranks, `expert` unused on rank 1: no hang, and .grad is the mean (zeros for the rank "
              "that skipped it)", hint=ORDER_HINT, reveal=ORDER_REVEAL, after=ORDER_CASE, timeout=150)
def _(learner):
    """Property: on 2 gloo ranks with `expert` unused on rank 1, 2 steps end without a hang and every rank's .grad is
    the serial mean (the skipping rank counted as zeros); on 6 drawn models every rank, the one that skipped
    included, holds the mean."""
    # after=ORDER_CASE: a launch pattern that would hang real ranks is reported above, never run here.
    ranks = cached("05.finish", learner,
                   lambda path: run_ranks(_ordered_rank, path, hint=ORDER_HINT, timeout=90, pg_timeout_s=20))
    for rank, facts in enumerate(ranks):                      # rank 1 is the one that skips `expert`
        _ordered_parity(rank, facts)
    _check_drawn_finish_means(learner)
    return f"2 steps, parity with the serial all-reduce on both ranks; the mean on every rank of {FINISH_DRAWS} drawn models"


def _ordered_parity(rank: int, facts: dict) -> None:
    who = f"rank {rank}" + (" (which skipped `expert`)" if rank == 1 else "")
    for i, r in enumerate(facts["results"], 1):
        if r == "mean":
            continue
        if r == "sum":
            raise Wrong("the gradients are the sum over ranks: divide by the world size after each wait()")
        if r == "local":
            raise Wrong("the gradients are still each rank's own: wait() for each Work in finish() (and reduce "
                        "param.grad in place: self._launch does)")
        if r == "missing":
            raise Wrong(f"step {i}, {who}: a used parameter has no .grad after finish()")
        raise AssertionError(f"step {i}, {who}: the gradients after finish() differ from the serial mean ({r})")



# Drawn cases (course/checks/drawn.py): gradients that arrive out of the launch order, so that one hook
# completes several parameters at the head; a rank (drawn) that skips a parameter; frozen parameters in
# every other case; 2 to 4 thread ranks, every rank read. The property: when a hook returns, every
# parameter at the head of self.order whose gradient has arrived has been launched; after finish()
# every rank, the one that skipped included, holds the mean.
FINISH_DRAWS = 6


def _drawn_finish(learner) -> list:
    from course.checks.drawn import draw_cases, run_draws

    def compute():
        return run_draws(draw_cases(6, FINISH_DRAWS, frozen_every=2),
                         lambda model, d: learner.OrderedOverlapSync(model))
    return learner.once("05.finish-drawn", compute)


def _check_drawn_finish_on_time(learner, pairs=None) -> None:
    """The end of ORDER_CASE: on the drawn models, no hook returns with a ready head left unlaunched."""
    from course.checks.drawn import first_late_launch

    if pairs is None:
        return raise_smallest(_drawn_finish(learner), lambda p: _check_drawn_finish_on_time(learner, p),
                              lambda model, d: learner.OrderedOverlapSync(model))
    for draw, steps in pairs:
        crashed = rank_error(draw, steps, "OrderedOverlapSync(model)")
        if crashed:
            raise Wrong(f"{crashed} ({draw.describe()}). Hint: {ORDER_HINT}")
        late = first_late_launch(draw, steps, [[n] for n in draw.trainable[::-1]])
        if late:
            raise Wrong(f"a hook launched fewer parameters than it made ready: {late} ({draw.describe()}). When "
                        f"gradients arrive out of the launch order, one hook can complete several parameters at the "
                        f"head; the hook goes on launching from the head for as long as the head is ready, or "
                        f"those reductions wait and overlap less", reveal=ORDER_REVEAL)


def _check_drawn_finish_means(learner, pairs=None) -> None:
    """The end of the gloo case: on the drawn models, every rank (the one that skipped included) holds the mean."""
    from course.checks.drawn import first_wrong_grad

    if pairs is None:
        return raise_smallest(_drawn_finish(learner), lambda p: _check_drawn_finish_means(learner, p),
                              lambda model, d: learner.OrderedOverlapSync(model))
    for draw, steps in pairs:
        crashed = rank_error(draw, steps, "OrderedOverlapSync(model)")
        if crashed:
            raise Wrong(f"{crashed} ({draw.describe()}). Hint: {ORDER_HINT}")
        wrong = first_wrong_grad(draw, steps)
        if wrong:
            raise Wrong(f"{wrong} ({draw.describe()}). Hint: {ORDER_HINT}", reveal=ORDER_REVEAL)


# =============================================================================================
# The figure: serial vs per-parameter overlap on 2 gloo ranks over a simulated link
# =============================================================================================
FIG_DIM, FIG_LAYERS, FIG_BATCH = 384, 6, 768


def _timed_step(model, x, y, opt, rec, sync, serial: bool, world_size: int) -> tuple[dict, list]:
    """One step; returns its parts (ms) and its spans (lane, name, start, end)."""
    rec.take()
    t0 = time.perf_counter()
    loss = F.mse_loss(model(x), y)
    t1 = time.perf_counter()
    rec.in_backward = True
    loss.backward()
    rec.in_backward = False
    t2 = time.perf_counter()
    if serial:   # lesson 04's way: every reduction after backward
        works = [(p, dist.all_reduce(p.grad, async_op=True)) for p in reversed(list(model.parameters()))]
        for p, w in works:
            w.wait()
            p.grad.div_(world_size)
    else:
        sync.finish()
    t3 = time.perf_counter()
    opt.step()
    opt.zero_grad(set_to_none=True)
    t4 = time.perf_counter()
    calls = rec.take()
    comm = [(c["launch"], c["done"] or t3) for c in calls]
    from hfstream.gradsync import union_length

    parts = {"forward_ms": (t1 - t0) * 1e3, "backward_ms": (t2 - t1) * 1e3, "exposed_comm_ms": (t3 - t2) * 1e3,
             "optimizer_ms": (t4 - t3) * 1e3, "step_ms": (t4 - t0) * 1e3,
             "comm_busy_ms": union_length(comm) * 1e3, "collectives": len(calls),
             "launched_in_backward": sum(c["in_backward"] for c in calls)}
    spans = [("compute", "forward", t0, t1), ("compute", "backward", t1, t2), ("compute", "exposed comm", t2, t3),
             ("compute", "optimizer", t3, t4)] + [("comm", "reduction", a, b) for a, b in comm]
    return parts, spans


def _run_modes(models, x, y, opts, rec, sync, steps, world_size, rank) -> tuple[dict, list]:
    """``steps`` measured pairs of steps (serial, overlap), after one warm-up pair, taking turns so
    that a busy moment of the machine hits both; returns their parts and the last pair's spans."""
    records, spans = {"serial": [], "overlap": []}, []
    for i in range(steps + 1):
        for mode in ("serial", "overlap"):
            dist.barrier()
            parts, sp = _timed_step(models[mode], x, y, opts[mode], rec, sync, mode == "serial", world_size)
            if i == 0:
                continue                     # warm-up
            records[mode].append(parts)
            if i == steps:                   # the last pair of steps goes on the timeline
                spans += [(rank, lane, name, a, b) for lane, name, a, b in sp]
    return records, spans


def _demo_rank(rank: int, world_size: int, path: str | None, steps: int, link_ratio: float) -> dict:
    from course.lib import TinyMLP, random_regression
    from hfstream.gradsync import GradSync
    from hfstream.testing.link import SimulatedLink, ring_allreduce_bytes

    models = {mode: TinyMLP(dim=FIG_DIM, hidden=FIG_DIM, layers=FIG_LAYERS, seed=0) for mode in ("serial", "overlap")}
    x, y = random_regression(n=FIG_BATCH, dim=FIG_DIM, seed=1 + rank)
    # Size the link from this machine's backward: all gradients take link_ratio x backward on it.
    bwd = []
    for _ in range(8):
        loss = F.mse_loss(models["serial"](x), y)
        t = time.perf_counter()
        loss.backward()
        bwd.append(time.perf_counter() - t)
        models["serial"].zero_grad(set_to_none=True)
    agreed = torch.tensor([min(bwd[2:])])       # after 2 warm-ups, the least disturbed backward
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    grad_bytes = sum(p.numel() * p.element_size() for p in models["serial"].parameters())
    rate_mbit = ring_allreduce_bytes(grad_bytes, world_size) * 8 / (link_ratio * agreed.item()) / 1e6
    link = SimulatedLink(rate_mbit=rate_mbit, latency_ms=0.2)
    # The reductions launched last (when backward ends) are those of the first layer: on the
    # simulated link they need at least this long after backward, whatever overlaps before.
    tail_floor_ms = sum(link.transfer_s(p.numel() * p.element_size(), world_size)
                        for p in models["overlap"].layers[0].parameters()) * 1e3
    rec = Recorder()
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in models.items()}
    with rec.installed():
        if path is None:
            sync = GradSync(models["overlap"], bucket_mb=0)   # the library: one bucket per parameter
        else:
            sync = load_module(path).OverlapSync(models["overlap"])
        rec.take()
        # 1. The real thing: gloo over this machine's loopback, nothing simulated.
        loopback, _ = _run_modes(models, x, y, opts, rec, sync, steps, world_size, rank)
    # 2. The same two steps over the simulated link (installed under the recorder, so the
    #    recorder sees each reduction complete when the link says it does).
    with link.installed(), rec.installed():
        simulated, spans = _run_modes(models, x, y, opts, rec, sync, steps, world_size, rank)
    if hasattr(sync, "close"):
        sync.close()
    return {"records": {"loopback": loopback, "simulated": simulated}, "spans": spans, "rate_mbit": rate_mbit,
            "latency_ms": link.latency_ms, "tail_floor_ms": tail_floor_ms, "grad_mib": grad_bytes / 2**20,
            "probe_backward_ms": agreed.item() * 1e3, "params": sum(1 for _ in models["overlap"].parameters())}


def _summarise(out: list[dict], phase: str, steps: int) -> dict:
    """Median over steps of each part (mean over ranks; a step lasts as long as its slowest rank)."""
    summary = {}
    for mode in ("serial", "overlap"):
        per_step = [{k: statistics.fmean(r["records"][phase][mode][s][k] for r in out)
                     for k in out[0]["records"][phase][mode][s]}
                    | {"step_ms": max(r["records"][phase][mode][s]["step_ms"] for r in out)}
                    for s in range(steps)]
        summary[mode] = {k: statistics.median(s[k] for s in per_step) for k in per_step[0]}
    s = summary["serial"]
    summary["ceiling_ms"] = s["forward_ms"] + max(s["backward_ms"], s["comm_busy_ms"]) + s["optimizer_ms"]
    return summary


def measure_overlap(namespace: dict, steps: int = 6, link_ratio: float = 0.8) -> dict:
    """Serial and per-parameter overlap side by side on 2 gloo ranks: first over the real loopback,
    then over a simulated link whose bandwidth is sized from this machine's backward.

    Uses the notebook's `OverlapSync` once it is written, else hfstream's ``GradSync(bucket_mb=0)``.
    Returns, per phase (``"loopback"``, ``"simulated"``), the median parts of each mode and the
    ceiling (from the serial steps); the link; and the spans of the last simulated pair of steps.
    """
    from hfstream.testing import run_on_ranks

    cls = namespace.get("OverlapSync")
    path = None
    if cls is not None and not is_stub(cls):
        path = Learner(namespace, get_exercise("05.overlap_hook")).module_file()
    who = "your OverlapSync" if path else "hfstream's GradSync(bucket_mb=0) (OverlapSync is not written yet)"
    out = run_on_ranks(_demo_rank, 2, path, steps, link_ratio, timeout=120, pg_timeout_s=60)
    return {"who": who, "loopback": _summarise(out, "loopback", steps), "simulated": _summarise(out, "simulated", steps),
            "spans": out[0]["spans"] + out[1]["spans"], "rate_mbit": out[0]["rate_mbit"],
            "latency_ms": out[0]["latency_ms"], "tail_floor_ms": out[0]["tail_floor_ms"],
            "probe_backward_ms": out[0]["probe_backward_ms"], "link_ratio": link_ratio,
            "grad_mib": out[0]["grad_mib"], "params": out[0]["params"]}


# =============================================================================================
# A torch.profiler trace of one step whose hooks launch the all-reduces (the GPU cells of 05, 06)
# =============================================================================================
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
COMM_MARK = ("nccl", "gloo:", "allreduce", "all_reduce", "onerank")


@contextlib.contextmanager
def one_rank_group(device: torch.device):
    """A process group of one rank in this process (NCCL on CUDA, gloo elsewhere), unless one exists.

    One rank reduces with itself, but the collective still goes through the backend: on CUDA
    NCCL runs it on its own stream, which is what the trace shows.
    """
    import tempfile

    if dist.is_initialized():
        yield dist.get_backend()
        return
    backend = "nccl" if device.type == "cuda" and dist.is_nccl_available() else "gloo"
    store_file = tempfile.NamedTemporaryFile(prefix="hfstream-course-store-", delete=False).name
    os.remove(store_file)   # FileStore creates it
    dist.init_process_group(backend, store=dist.FileStore(store_file, 1), rank=0, world_size=1)
    try:
        yield backend
    finally:
        dist.destroy_process_group()
        with contextlib.suppress(OSError):
            os.remove(store_file)


def _hook_launcher(model, buckets, op=dist.ReduceOp.SUM):
    """Hooks that launch one asynchronous all-reduce per bucket (a list of lists of parameters), in
    order, as soon as the head buckets are complete; returns (handles, finish)."""
    pending = [len(b) for b in buckets]
    bucket_of = {p: i for i, b in enumerate(buckets) for p in b}
    state = {"next": 0}
    works: list = []

    def launch(i):
        members = buckets[i]
        if len(members) == 1:
            works.append((None, members, dist.all_reduce(members[0].grad, op=op, async_op=True)))
        else:
            flat = torch.cat([p.grad.reshape(-1) for p in members])
            works.append((flat, members, dist.all_reduce(flat, op=op, async_op=True)))

    def on_ready(param):
        pending[bucket_of[param]] -= 1
        while state["next"] < len(buckets) and pending[state["next"]] == 0:
            launch(state["next"])
            state["next"] += 1

    def finish():
        for flat, members, work in works:
            work.wait()
            if flat is not None:
                offset = 0
                for p in members:
                    p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
                    offset += p.numel()
        works.clear()
        state["next"] = 0
        pending[:] = [len(b) for b in buckets]

    handles = [p.register_post_accumulate_grad_hook(on_ready) for b in buckets for p in b]
    return handles, finish


def trace_overlap_step(device: torch.device, path, bucket_mb: float = 0.0, dim: int = 1024, hidden: int = 4096,
                       layers: int = 8, batch: int = 8192) -> dict:
    """Profile one training step (after a warm-up) whose hooks launch asynchronous all-reduces.

    On a one-rank process group (`one_rank_group`). ``bucket_mb=0``: one all-reduce per parameter
    (lesson 05); larger: DDP's buckets, each packed into one flat tensor (lesson 06). Writes the
    Chrome trace to ``path`` (open it in https://ui.perfetto.dev) and returns what
    `read_trace` finds in it.
    """
    from torch.profiler import profile, record_function

    from course.lib import TinyMLP
    from hfstream.gradsync.buckets import plan_buckets

    model = TinyMLP(dim=dim, hidden=hidden, layers=layers).to(device)
    x = torch.randn(batch, dim, device=device)
    by_name = dict(model.named_parameters())
    buckets = [[by_name[n] for n in b.names] for b in plan_buckets(list(model.named_parameters()), bucket_mb)]

    def sync_device():
        if device.type != "cpu":
            torch.accelerator.synchronize()

    with one_rank_group(device) as backend:
        # NCCL skips an in-place sum over one rank (there is nothing to add) but runs an average
        # (a kernel that scales by 1/N): AVG keeps the collective on the device, as with N ranks.
        op = dist.ReduceOp.AVG if backend == "nccl" else dist.ReduceOp.SUM
        handles, finish = _hook_launcher(model, buckets, op)
        try:
            for profiled in (False, True):           # the first step warms up (communicator, allocator)
                ctx = profile(activities=list(torch.profiler.supported_activities())) if profiled \
                    else contextlib.nullcontext()
                with ctx as prof:
                    loss = model(x).square().mean()
                    with record_function("course: backward"):
                        loss.backward()
                    with record_function("course: finish"):
                        finish()
                    sync_device()
                model.zero_grad(set_to_none=True)
        finally:
            for h in handles:
                h.remove()
    prof.export_chrome_trace(str(path))
    found = read_trace(path)
    found.update(backend=backend, device=str(device), buckets=len(buckets), path=str(path))
    return found


def read_trace(path) -> dict:
    """The spans of a Chrome trace that say where communication sits relative to backward.

    Times are ms from the start of the host's ``course: backward`` annotation. Returns
    ``host_backward`` (start, end), ``host_launches`` (each ``c10d::allreduce_`` on the host),
    ``comm`` (each collective where it ran: the backend's annotation on its own thread, and on a
    GPU the kernels on the communication stream), ``device_backward`` (start, end of the kernels
    launched during backward, on the compute stream; None on CPU) and ``lanes``: per thread or
    stream, its (name, start, end) spans, for `trace_figure`.
    """
    import json

    events = [e for e in json.loads(Path(path).read_text()).get("traceEvents", [])
              if e.get("ph") == "X" and "ts" in e and "dur" in e]
    marks = [e for e in events if e.get("name") == "course: backward" and e.get("cat") in ("user_annotation", "cpu_op")]
    if not marks:
        raise ValueError(f"{path}: no 'course: backward' annotation in the trace")
    origin = marks[0]["ts"]

    def span(e):
        return ((e["ts"] - origin) / 1e3, (e["ts"] + e["dur"] - origin) / 1e3)

    host_backward = span(marks[0])
    host_tid = marks[0].get("tid")
    launch_events = [e for e in events if e.get("name") == "c10d::allreduce_"]
    launches = [span(e) for e in launch_events]
    is_comm = lambda e: any(m in e.get("name", "").lower() for m in COMM_MARK)   # noqa: E731
    backend_spans = [(e.get("tid"), span(e)) for e in events
                     if e.get("cat") == "user_annotation" and is_comm(e) and e.get("tid") != host_tid]
    device = [e for e in events if e.get("cat") in DEVICE_CATS]
    # A device event belongs to backward when the host launched it during backward: the runtime
    # call that launched it carries the same correlation id.
    launched_at = {e.get("args", {}).get("correlation"): e["ts"] for e in events
                   if e.get("cat") in ("cuda_runtime", "cuda_driver", "runtime", "driver")}
    def launched_by_allreduce(e):   # its runtime launch happened inside a host c10d::allreduce_
        t = launched_at.get(e.get("args", {}).get("correlation"))
        return t is not None and any(a["ts"] <= t <= a["ts"] + a["dur"] for a in launch_events)

    comm_device = [e for e in device if is_comm(e) or launched_by_allreduce(e)]
    comm_streams = {e.get("args", {}).get("stream") for e in comm_device}
    compute = [e for e in device if e.get("args", {}).get("stream") not in comm_streams]
    in_bwd = [e for e in compute
              if marks[0]["ts"] <= launched_at.get(e.get("args", {}).get("correlation"), -1) <= marks[0]["ts"] + marks[0]["dur"]]
    in_bwd_ids = {id(e) for e in in_bwd}
    device_backward = None
    if in_bwd:
        device_backward = (min(span(e)[0] for e in in_bwd), max(span(e)[1] for e in in_bwd))
    lanes: dict[str, list] = {"host: backward": [("backward", *host_backward)],
                              "host: all-reduce launches": [("launch", *s) for s in launches]}
    for tid, s in backend_spans:
        lanes.setdefault(f"backend thread {tid}", []).append(("all-reduce", *s))
    for e in compute:
        lanes.setdefault(f"device stream {e.get('args', {}).get('stream')} (compute)", []).append(
            ("backward" if id(e) in in_bwd_ids else "other", *span(e)))
    for e in comm_device:
        lanes.setdefault(f"device stream {e.get('args', {}).get('stream')} (comm)", []).append(("all-reduce", *span(e)))
    comm = [s for _, s in backend_spans] + [span(e) for e in comm_device]
    bwd_end = device_backward[1] if device_backward else host_backward[1]
    return {"host_backward": host_backward, "host_launches": launches, "device_backward": device_backward,
            "comm": comm, "comm_device": [span(e) for e in comm_device],
            "comm_before_backward_end": sum(1 for a, _ in ([span(e) for e in comm_device] or [s for _, s in backend_spans])
                                            if a < bwd_end),
            "lanes": lanes}


def trace_findings(found: dict) -> list[str]:
    """What a `trace_overlap_step` trace shows, in sentences (lessons 05 and 06 print them)."""
    lines = []
    bwd = found["device_backward"]
    if bwd:
        lines.append(f"backward's kernels on the device: {bwd[0]:.2f} to {bwd[1]:.2f} ms after loss.backward() "
                     f"started on the host")
    if found["comm_device"]:
        lines.append(f"{len(found['comm_device'])} all-reduce kernels on the device, {found['comm_before_backward_end']} "
                     f"of them starting before backward's last kernel ends")
    else:
        lines.append("no all-reduce kernel in the trace: this backend ran the one-rank reductions without the device; "
                     "the host lanes still show each launch from its hook")
    return lines


def trace_figure(found: dict, path, title: str) -> Path:
    """One lane per host thread / device stream of a `read_trace` result; backward in blue."""
    from matplotlib.figure import Figure

    colors = {"backward": "#4c72b0", "launch": "#8172b3", "all-reduce": "#dd8452", "other": "#bbbbbb"}
    lanes = found["lanes"]
    fig = Figure(figsize=(9, 0.9 + 0.45 * len(lanes)))
    ax = fig.subplots()
    seen = set()
    for y, (lane, spans) in enumerate(reversed(list(lanes.items()))):
        for name, a, b in spans:
            ax.barh(y, max(b - a, 0.01), left=a, height=0.6, color=colors.get(name, "#999999"),
                    label=name if name not in seen else None)
            seen.add(name)
    ax.set_yticks(range(len(lanes)), list(reversed(list(lanes))), fontsize=7)
    ax.set_xlabel("ms from the start of loss.backward() on the host")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return Path(path)
