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
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from course.grading import Exercise, Learner, Wrong, get_exercise, is_stub, load_module

# --------------------------------------------------------------------------- shared tools
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
    """Facts shared by the cases of one `check()` call (one `Learner`), never across calls: a
    re-run of the check runs the learner's code again, so a passing flake is not remembered."""
    return learner.__dict__.setdefault("_lesson_facts", {})


def cached(key: str, learner: Learner, compute):
    """Run ``compute(path)`` once per check call; later cases reuse the facts (or the failure)."""
    memo = _memo(learner)
    if key not in memo:
        try:
            memo[key] = ("ok", compute(learner.module_file()))
        except Wrong as exc:
            memo[key] = ("wrong", str(exc))
    kind, value = memo[key]
    if kind == "wrong":
        raise Wrong(value)
    return value


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
            steps.append({"calls": len(calls), "async": [c["async"] for c in calls],
                          "in_backward": sum(c["in_backward"] for c in calls), "calls_before_return": in_backward,
                          "result": _classify(got, mean, local, world_size)})
            for p, m in zip(ref.parameters(), mean):
                p.grad = m.clone()
            opt.step(); ref_opt.step()
            opt.zero_grad(set_to_none=True); ref_opt.zero_grad(set_to_none=True)
    return {"params": sum(1 for _ in model.parameters()), "steps": steps}


HOOK_HINT = ("in __init__, p.register_post_accumulate_grad_hook(self._on_grad_ready) for every parameter; "
             "in the hook, dist.all_reduce(param.grad, async_op=True) and keep the Work")
FINISH_HINT = "finish(): wait() on each Work, then divide the summed gradient by the world size; then clear the list"


def _overlap_facts(learner: Learner) -> dict:
    return cached("05.overlap_hook", learner,
                  lambda path: run_ranks(_overlap_rank, path, hint=HOOK_HINT)[0])


@overlap_hook.case("one asynchronous all-reduce per parameter, launched from its hook during backward",
                   hint=HOOK_HINT, timeout=150)
def _(learner):
    src = learner.source("OverlapSync")
    if "register_hook(" in src and "register_post_accumulate_grad_hook" not in src:
        raise Wrong("Tensor.register_hook fires with the gradient *before* it is accumulated into .grad "
                    "(and .grad may still be None then): use p.register_post_accumulate_grad_hook(fn), "
                    "which calls fn(param) once param.grad is final")
    facts = _overlap_facts(learner)
    n = facts["params"]
    for i, st in enumerate(facts["steps"], 1):
        if st["calls"] and not all(st["async"]) and st["in_backward"]:
            raise Wrong("dist.all_reduce without async_op=True blocks the hook, and backward with it, until the "
                        "reduction is done: nothing overlaps (and it returns None, not a Work). Pass "
                        "async_op=True, keep the Work, wait in finish()")
        if "error" in st:
            raise Wrong(f"step {i}: your code raised {st['error']}. Hint: {HOOK_HINT}")
        if st["calls"] == 0:
            raise Wrong(f"step {i}: no all-reduce was launched at all: the hook must call "
                        f"dist.all_reduce(param.grad, async_op=True)")
        if st["in_backward"] == 0:
            raise Wrong("you reduced after backward: every all-reduce was launched once loss.backward() had "
                        "returned, so none can overlap it. Register a hook per parameter "
                        "(register_post_accumulate_grad_hook) and launch the reduction from it")
        if not all(st["async"]):
            raise Wrong("dist.all_reduce without async_op=True blocks the hook, and backward with it, until the "
                        "reduction is done: nothing overlaps. Pass async_op=True, keep the Work, wait in finish()")
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
    return f"{n} reductions per step, all launched during backward"


@overlap_hook.case("after finish() every .grad is the mean over 2 gloo ranks, two steps in a row",
                   hint=FINISH_HINT, timeout=150)
def _(learner):
    facts = _overlap_facts(learner)
    for i, st in enumerate(facts["steps"], 1):
        if "error" in st:
            raise Wrong(f"step {i}: your code raised {st['error']}, so there are no gradients to compare. "
                        f"Hint: {FINISH_HINT}")
        r = st["result"]
        if r == "mean":
            continue
        if r == "sum":
            raise Wrong("the gradients are the sum over ranks, not the mean: all_reduce adds; divide by the "
                        "world size in finish(), after work.wait()")
        if r == "local":
            raise Wrong("the gradients are still this rank's own: all_reduce works in place on the tensor you "
                        "pass. Reduce param.grad itself (not a copy), or copy the result back in finish()")
        if r == "twice" and i == 2:
            raise Wrong("step 2's gradients were divided twice: clear the list of (param, Work) at the end of "
                        "finish(), or the next finish() divides the old entries again")
        if r == "twice":
            raise Wrong("the gradients were divided by the world size twice (once in the hook, once in finish()?)")
        if r == "missing":
            raise Wrong(f"step {i}: some .grad is None after finish(): the hook must not replace or drop param.grad")
        raise AssertionError(f"step {i}: the gradients after finish() differ from the mean over ranks "
                             f"(did you divide before the reduction finished? wait() first)")
    return "matches the serial all-reduce on both ranks"


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
    """Two steps of two ranks (rank 1 skips ``expert``) with the stand-in all-reduce."""
    out = {}
    for rank in (0, 1):
        model = Branchy()
        names = _names_by_numel(model)
        with fake_ranks(2) as log:
            sync = cls(model)
            log.clear()
            steps = []
            for step in range(2):
                x = torch.randn(4, 3, generator=torch.Generator().manual_seed(step))
                loss = model(x, use_expert=(rank == 0)).square().mean()
                log.in_backward = True
                loss.backward()
                log.in_backward = False
                sync.finish()
                steps.append([(names.get(c["numel"], f"<{c['numel']} elements>"), c["in_backward"]) for c in log])
                log.clear()
                model.zero_grad(set_to_none=True)
        out[rank] = steps
    return out


ORDER_HINT = ("_on_grad_ready: mark parameter i ready, then launch (self._launch) every ready parameter at the head "
              "of self.order; finish(): launch the rest in order, wait each, divide, and reset next/ready")


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
    for step in (0, 1):
        r0 = [n for n, _ in seqs[0][step]]
        r1 = [n for n, _ in seqs[1][step]]
        for rank, seq in ((0, r0), (1, r1)):
            dup = sorted({n for n in seq if seq.count(n) > 1})
            if dup:
                return (f"step {step + 1}, rank {rank}: {dup[0]} was reduced {seq.count(dup[0])} times: launch each "
                        f"parameter exactly once per step (advance self.next past what you launch)")
            if step == 1 and not seq:
                return ("step 2 launched nothing: finish() must reset self.next and self.ready for the next step")
            missing = [n for n in every if n not in seq]
            if missing:
                who = "no rank uses it" if missing[0] == "spare" else f"rank {rank} did not use it this step"
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


@ordered.case("every rank launches the same reductions in the same order, unused parameters included",
              hint=ORDER_HINT, timeout=60)
def _(learner):
    seqs = _ordered_fake(learner)
    problem = _diagnose_order(seqs)
    if problem:
        raise Wrong(problem)
    during = sum(b for _, b in seqs[0][0])
    if during == 0:
        raise Wrong("everything was launched from finish(), after backward: nothing overlaps. In the hook, launch "
                    "the parameters at the head of self.order as soon as they are ready")
    first = [n for n, _ in seqs[0][0]]
    return f"order {' > '.join(first)}; {during} launched during backward"


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
              "that skipped it)", hint=ORDER_HINT, timeout=150)
def _(learner):
    try:
        problem = _diagnose_order(_ordered_fake(learner))
    except Exception:
        problem = None   # the first case reports the crash; the real run will show it too
    if problem:
        raise Wrong("not run on real ranks: with the launch pattern the previous case found, they would hang. "
                    "Fix that first")
    facts = cached("05.finish", learner,
                   lambda path: run_ranks(_ordered_rank, path, hint=ORDER_HINT, timeout=90, pg_timeout_s=20)[0])
    for i, r in enumerate(facts["results"], 1):
        if r == "mean":
            continue
        if r == "sum":
            raise Wrong("the gradients are the sum over ranks: divide by the world size after each wait()")
        if r == "local":
            raise Wrong("the gradients are still each rank's own: wait() for each Work in finish() (and reduce "
                        "param.grad in place: self._launch does)")
        if r == "missing":
            raise Wrong(f"step {i}: a used parameter has no .grad after finish()")
        raise AssertionError(f"step {i}: the gradients after finish() differ from the serial mean ({r})")
    return "2 steps, parity with the serial all-reduce"


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


def _demo_rank(rank: int, world_size: int, path: str | None, steps: int, link_ratio: float) -> dict:
    from course.lib import TinyMLP, random_regression
    from hfstream.gradsync import GradSync
    from hfstream.tools.bench.link import SimulatedLink, ring_allreduce_bytes

    serial_model = TinyMLP(dim=FIG_DIM, hidden=FIG_DIM, layers=FIG_LAYERS, seed=0)
    overlap_model = TinyMLP(dim=FIG_DIM, hidden=FIG_DIM, layers=FIG_LAYERS, seed=0)
    x, y = random_regression(n=FIG_BATCH, dim=FIG_DIM, seed=1 + rank)
    # Size the link from this machine's backward: all gradients take link_ratio x backward on it.
    bwd = []
    for _ in range(8):
        loss = F.mse_loss(serial_model(x), y)
        t = time.perf_counter()
        loss.backward()
        bwd.append(time.perf_counter() - t)
        serial_model.zero_grad(set_to_none=True)
    agreed = torch.tensor([min(bwd[2:])])       # after 2 warm-ups, the least disturbed backward
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    grad_bytes = sum(p.numel() * p.element_size() for p in serial_model.parameters())
    rate_mbit = ring_allreduce_bytes(grad_bytes, world_size) * 8 / (link_ratio * agreed.item()) / 1e6
    link = SimulatedLink(rate_mbit=rate_mbit, latency_ms=0.2)
    rec = Recorder()
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in (("serial", serial_model), ("overlap", overlap_model))}
    records = {"serial": [], "overlap": []}
    spans = []
    with link.installed(), rec.installed():
        if path is None:
            sync = GradSync(overlap_model, bucket_mb=0)   # the library: one bucket per parameter
        else:
            sync = load_module(path).OverlapSync(overlap_model)
        rec.take()
        for i in range(steps + 1):           # interleaved, so a slow moment of the machine hits both
            for mode, model in (("serial", serial_model), ("overlap", overlap_model)):
                dist.barrier()
                parts, sp = _timed_step(model, x, y, opts[mode], rec, sync, mode == "serial", world_size)
                if i == 0:
                    continue                 # warm-up
                records[mode].append(parts)
                if i == steps:               # the last pair of steps goes on the timeline
                    spans += [(rank, lane, name, a, b) for lane, name, a, b in sp]
        if hasattr(sync, "close"):
            sync.close()
    return {"records": records, "spans": spans, "rate_mbit": rate_mbit, "grad_mib": grad_bytes / 2**20,
            "params": sum(1 for _ in overlap_model.parameters())}


def measure_overlap(namespace: dict, steps: int = 6, link_ratio: float = 0.8) -> dict:
    """Run serial and per-parameter overlap side by side on 2 gloo ranks over a simulated link.

    Uses the notebook's `OverlapSync` once it is written, else hfstream's ``GradSync(bucket_mb=0)``.
    Returns the per-step parts of each mode (rank 0 and 1), the median step of each, the
    ceiling (from the serial steps) and the spans of the last pair of steps for the timeline.
    """
    from hfstream.testing import run_on_ranks

    cls = namespace.get("OverlapSync")
    path = None
    if cls is not None and not is_stub(cls):
        path = Learner(namespace, get_exercise("05.overlap_hook")).module_file()
    who = "your OverlapSync" if path else "hfstream's GradSync(bucket_mb=0) (OverlapSync is not written yet)"
    out = run_on_ranks(_demo_rank, 2, path, steps, link_ratio, timeout=120, pg_timeout_s=60)
    summary = {}
    for mode in ("serial", "overlap"):
        per_step = [{k: statistics.fmean(r["records"][mode][s][k] for r in out) for k in out[0]["records"][mode][s]}
                    | {"step_ms": max(r["records"][mode][s]["step_ms"] for r in out)}
                    for s in range(steps)]
        summary[mode] = {k: statistics.median(s[k] for s in per_step) for k in per_step[0]}
    s = summary["serial"]
    ceiling = s["forward_ms"] + max(s["backward_ms"], s["comm_busy_ms"]) + s["optimizer_ms"]
    return {"who": who, "summary": summary, "ceiling_ms": ceiling, "spans": out[0]["spans"] + out[1]["spans"],
            "rate_mbit": out[0]["rate_mbit"], "grad_mib": out[0]["grad_mib"], "params": out[0]["params"]}
