"""Lesson 06 checks: DDP's bucket plan, a bucketed overlapping sync, and the cap sweep.

The plan is compared with hfstream's planner (``hfstream.gradsync.buckets.plan_buckets``, which
follows DDP's ``_compute_bucket_assignment_by_size``); the usual wrong rules (forward order,
``>`` for ``>=``, "close before it would overflow", elements for bytes, MB for MiB, a lost last
bucket) are recomputed here so a mismatch can name the rule the learner used. The bucketed sync
runs in 2 gloo processes under the `Recorder` of lesson 05, which counts the collectives and
their order.
"""

from __future__ import annotations

import math
import statistics
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from course.checks.lesson05 import (RUNAWAY, Branchy, Recorder, _classify, _memo, _reference_grads, cached,
                                    fake_ranks, run_ranks)
from course.grading import Exercise, Learner, Wrong, get_exercise, is_stub, load_module

MiB = 2**20


# =============================================================================================
# 06.plan_buckets
# =============================================================================================
plan_ex = Exercise("06.plan_buckets", uses=["plan_buckets"], title="DDP's bucket plan")


def _rule(sizes: list[tuple[str, int]], cap: float, *, reverse=True, ge=True, overflow=False,
          keep_last=True) -> list[list[str]]:
    """A bucket planner over (name, bytes), with switches for the usual mistakes."""
    items = list(reversed(sizes)) if reverse else list(sizes)
    out, cur, size = [], [], 0
    for name, nbytes in items:
        if overflow and cur and size + nbytes > cap:   # "close before it would overflow"
            out.append(cur)
            cur, size = [], 0
        cur.append(name)
        size += nbytes
        if not overflow and (size >= cap if ge else size > cap):
            out.append(cur)
            cur, size = [], 0
    if cur and keep_last:
        out.append(cur)
    return out


# (name, shape) in registration order: an embedding, two blocks, a head. float32.
SHAPES = [("embed.weight", (40, 16)), ("block0.weight", (16, 16)), ("block0.bias", (16,)),
          ("block1.weight", (16, 16)), ("block1.bias", (16,)), ("head.weight", (8, 16)), ("head.bias", (8,))]
# Bytes: embed 2560, block weights 1024, block biases 64, head.weight 512, head.bias 32.
CAPS_MB = [0.0, math.inf, 608 / MiB, 1600 / MiB, 1000 / MiB, 3000 / MiB, 0.0006]
# Reverse cumulative bytes: 32, 544, 608, 1632, ... so 608 B is reached exactly (>= vs >); 1600 B
# overflows mid-bucket ("close before it would overflow" differs); 0.0006 MiB is 629 B but 600 B
# as MB (MiB vs MB); counting elements instead of bytes differs at every finite cap.


def _named(shapes=SHAPES) -> list[tuple[str, torch.Tensor]]:
    return [(n, torch.zeros(s)) for n, s in shapes]


def _truth(named, cap_mb) -> list[list[str]]:
    from hfstream.gradsync.buckets import plan_buckets

    return [list(b.names) for b in plan_buckets(named, cap_mb)]


WRONG_RULES: list[tuple[str, Callable]] = [
    ("you took the parameters in registration (forward) order. Backward produces the last layer's gradient "
     "first, so DDP plans in *reverse* registration order: the first bucket is the one that fills first",
     lambda s, cap: _rule(s, cap, reverse=False)),
    ("a bucket closes once it *reaches* the cap, not only once it exceeds it: a bucket of exactly the cap "
     "is full",
     lambda s, cap: _rule(s, cap, ge=False)),
    ("you closed a bucket before it would overflow the cap. DDP's rule is the other way round: add the "
     "parameter, then close the bucket if it has reached the cap, so buckets hold at least the cap "
     "(and a parameter larger than the cap is a bucket of its own)",
     lambda s, cap: _rule(s, cap, overflow=True)),
    ("the last bucket, the one that never reached the cap, is missing: append what is left after the loop",
     lambda s, cap: _rule(s, cap, keep_last=False)),
]


def _sizes(named, unit: str = "bytes") -> list[tuple[str, int]]:
    if unit == "numel":
        return [(n, t.numel()) for n, t in named]
    return [(n, t.numel() * t.element_size()) for n, t in named]


def _normalise(plan: Any, where: str) -> list[list[str]]:
    if not isinstance(plan, (list, tuple)) or not all(isinstance(b, (list, tuple)) for b in plan):
        raise Wrong(f"plan_buckets({where}) returned {type(plan).__name__}: return a list of buckets, each a list "
                    f"of parameter names")
    if plan and all(isinstance(b, (list, tuple)) and len(b) == 2 and isinstance(b[1], torch.Tensor) for b in plan):
        raise Wrong("return names, not (name, tensor) pairs: each bucket is a list of parameter names")
    return [list(b) for b in plan]


PLAN_REVEAL = ("cap = bucket_mb * 2**20; for name, p in reversed(list(named_params)): current.append(name); "
               "size += p.numel() * p.element_size(); if size >= cap: buckets.append(current); current, size = [], 0. "
               "After the loop: if current: buckets.append(current)")


@plan_ex.case("parameters in reverse registration order; cap 0 = one per bucket; inf = one bucket",
              hint="walk the parameters in reverse registration order, add each one whole to the open bucket, and "
                   "close the bucket once it holds at least the cap", reveal=PLAN_REVEAL)
def _(learner):
    """Property: the 7 parameters appear in reverse registration order, each in exactly one bucket: one bucket per
    parameter at cap 0, a single bucket at cap inf."""
    named = _named()
    for cap in (0.0, math.inf):
        got = _normalise(learner.plan_buckets(named, cap), f"..., {cap}")
        want = _truth(named, cap)
        if got == want:
            continue
        flat = [n for b in got for n in b]
        if sorted(flat) != sorted(n for n, _ in named):
            dup = sorted({n for n in flat if flat.count(n) > 1})
            if dup:
                raise Wrong(f"{dup[0]} appears in {flat.count(dup[0])} buckets: a parameter is never split or "
                            f"repeated; each name goes in exactly one bucket")
            missing = [n for n, _ in named if n not in flat]
            raise Wrong(f"at cap {cap} MiB the plan leaves out {missing[:3]}: every parameter must be in a bucket "
                        f"(the last bucket, not full, too)")
        if got == _rule(_sizes(named), cap * MiB, reverse=False):
            raise Wrong(WRONG_RULES[0][0], reveal=PLAN_REVEAL)
        raise AssertionError(f"at cap {cap} MiB: got {got}, expected {want}")
    return "7 parameters, caps 0 and inf"


@plan_ex.case("a bucket closes once it reaches the cap (bytes, MiB), never splitting a parameter",
              hint="weigh each parameter by its gradient's bytes and the cap in MiB; a bucket closes once it has "
                   "reached the cap, whole parameters only", reveal=PLAN_REVEAL)
def _(learner):
    """Property: walking the parameters in reverse registration order, a bucket closes as soon as its gradients' bytes
    reach the cap (MiB, 2**20 bytes), whole parameters only, DDP's rule, at 7 caps on a toy model (caps reached
    exactly and overflowed mid-parameter) and 2 on a 2-layer GPT-2."""
    named = _named()
    got = {cap: _normalise(learner.plan_buckets(named, cap), f"..., {cap:.6g}") for cap in CAPS_MB}
    want = {cap: _truth(named, cap) for cap in CAPS_MB}
    if got == want:
        # A real model too: GPT-2's parameters at caps that cut it differently.
        from course.lib import tiny_gpt2

        gpt = list(tiny_gpt2(layers=2, width=64).named_parameters())
        for cap in (1 / 64, 1 / 8):
            mine = _normalise(learner.plan_buckets(gpt, cap), f"gpt2, {cap}")
            assert mine == _truth(gpt, cap), f"on a GPT-2 at cap {cap} MiB the plan differs from DDP's rule"
        return f"{len(CAPS_MB)} caps on a toy model, 2 on a GPT-2 ({len(gpt)} parameters)"
    for cap in CAPS_MB:
        flat = [n for b in got[cap] for n in b]
        dup = sorted({n for n in flat if flat.count(n) > 1})
        if dup:
            raise Wrong(f"at cap {cap * MiB:.0f} B, {dup[0]} appears in more than one bucket: a parameter is "
                        f"never split; it goes whole into the open bucket, which may then exceed the cap")
    for hint, rule in WRONG_RULES:
        if all(got[cap] == rule(_sizes(named), cap * MiB) for cap in CAPS_MB):
            raise Wrong(hint, reveal=PLAN_REVEAL)
    if all(got[cap] == _rule(_sizes(named, "numel"), cap * MiB) for cap in CAPS_MB):
        raise Wrong("you counted elements, not bytes: the cap is in MiB of gradient, so a parameter weighs its "
                    "elements times the bytes of one element", reveal="p.numel() * p.element_size()")
    if all(got[cap] == _rule(_sizes(named), cap * 1e6) for cap in CAPS_MB):
        raise Wrong("bucket_mb is in MiB (2**20 bytes, DDP's bucket_cap_mb), not MB (10**6 bytes)")
    cap = next(c for c in CAPS_MB if got[c] != want[c])
    raise AssertionError(f"at cap {cap * MiB:.0f} bytes: got {got[cap]}, expected {want[cap]}")


# The same model in bf16 (2 bytes an element) and in float64 (8 bytes). One dtype a model: DDP (and
# hfstream) also close a bucket where the dtype changes, a rule this exercise leaves out.
OTHER_DTYPES = (torch.bfloat16, torch.float64)


@plan_ex.case("a parameter weighs its dtype's bytes (a bf16 model, a float64 model), not 4 per element",
              hint="a gradient has its parameter's dtype: weigh each parameter by its elements times the bytes of "
                   "its own element type, whatever the dtype", reveal="p.numel() * p.element_size()",
              after="a bucket closes once it reaches the cap (bytes, MiB), never splitting a parameter")
def _(learner):
    """Property: a parameter weighs its elements times its own dtype's element size, so a bf16 and a float64 model at 3
    caps get DDP's buckets for their bytes."""
    caps = [608 / MiB, 1600 / MiB, 3000 / MiB]
    for dtype in OTHER_DTYPES:
        named = [(n, torch.zeros(s, dtype=dtype)) for n, s in SHAPES]
        got = {cap: _normalise(learner.plan_buckets(named, cap), f"{dtype}, {cap:.6g}") for cap in caps}
        want = {cap: _truth(named, cap) for cap in caps}
        if got == want:
            continue
        as_float32 = [(n, t.numel() * 4) for n, t in named]
        if all(got[cap] == _rule(as_float32, cap * MiB) for cap in caps):
            raise Wrong(f"your plan weighs every element as 4 bytes (float32): a {dtype} gradient takes "
                        f"{named[0][1].element_size()} bytes an element, so its buckets close at other parameters",
                        reveal="p.numel() * p.element_size()")
        cap = next(c for c in caps if got[c] != want[c])
        raise AssertionError(f"with {dtype} parameters at cap {cap * MiB:.0f} bytes: got {got[cap]}, "
                             f"expected {want[cap]}")
    return f"a bf16 and a float64 model at {len(caps)} caps"


# =============================================================================================
# 06.bucketed_sync
# =============================================================================================
bucketed = Exercise("06.bucketed_sync", uses=["BucketedSync"], title="one flat all-reduce per bucket, overlapped")

B_DIM, B_HIDDEN, B_LAYERS = 16, 24, 4


def _plans(model) -> dict[str, list[list[str]]]:
    """Two plans for the check: DDP's at a cap that makes 3 buckets, and the same in forward order
    (its first bucket completes last, so launching in completion order would differ)."""
    named = list(model.named_parameters())
    ddp = _truth(named, 2000 / MiB)
    return {"reverse": ddp, "forward": [list(reversed(b)) for b in reversed(ddp)]}


def _bucketed_rank(rank: int, world_size: int, path: str, with_unused: bool = False) -> dict:
    from course.lib import TinyMLP, random_regression

    mod = load_module(path)
    rec = Recorder()
    facts = {}
    with rec.installed():
        for label in ("reverse", "forward"):
            model = TinyMLP(dim=B_DIM, hidden=B_HIDDEN, layers=B_LAYERS, seed=0)
            ref = TinyMLP(dim=B_DIM, hidden=B_HIDDEN, layers=B_LAYERS, seed=0)
            plan = _plans(model)[label]
            numel = dict((n, p.numel()) for n, p in model.named_parameters())
            sync = mod.BucketedSync(model, plan)
            rec.take()
            opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
            steps = []
            for step in range(2):
                x, y = random_regression(n=8, dim=B_DIM, seed=10 * step + rank)
                loss = F.mse_loss(model(x), y)
                rec.in_backward = True
                try:
                    loss.backward()
                    rec.in_backward = False
                    sync.finish()
                except Exception as exc:
                    rec.in_backward = False
                    calls = rec.take()
                    steps.append({"numels": [c["numel"] for c in calls], "async": [c["async"] for c in calls],
                                  "in_backward": sum(c["in_backward"] for c in calls),
                                  "error": f"{type(exc).__name__}: {exc}".strip().splitlines()[0]})
                    break
                calls = rec.take()
                got = [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]
                local, mean = _reference_grads(ref, F.mse_loss(ref(x), y), rec.real, world_size)
                steps.append({"numels": [c["numel"] for c in calls], "async": [c["async"] for c in calls],
                              "in_backward": sum(c["in_backward"] for c in calls),
                              "result": _classify(got, mean, local, world_size)})
                for p, m in zip(ref.parameters(), mean):
                    p.grad = m.clone()
                opt.step(); ref_opt.step()
                opt.zero_grad(set_to_none=True); ref_opt.zero_grad(set_to_none=True)
            facts[label] = {"buckets": [sum(numel[n] for n in b) for b in plan], "params": len(numel),
                            "steps": steps}
            if hasattr(sync, "close"):
                sync.close()
            if any("error" in s for s in steps):
                break
        unused = _unused_rank(rank, world_size, mod, rec) if with_unused else None
    return {"plans": facts, "unused": unused}


BUCKET_HINT = ("_launch(b) packs bucket b's gradients into one flat tensor and starts one asynchronous all-reduce "
               "of it; the hook counts its bucket down, then launches every complete bucket at the head of the plan")
BUCKET_REVEAL = ("_launch: flat = torch.cat([g.reshape(-1) for g in grads]); "
                 "self.inflight.append((b, flat, dist.all_reduce(flat, async_op=True))). _on_grad_ready: "
                 "self.pending[self.bucket_of[param]] -= 1; while self.next < len(self.buckets) and "
                 "self.pending[self.next] == 0: self._launch(self.next); self.next += 1")
UNFLATTEN_HINT = ("finish() launches what is left in plan order, then for each bucket waits, turns the sum into a "
                  "mean, and writes each parameter's part of the flat tensor back into its .grad; then it resets "
                  "the per-step state")
UNFLATTEN_REVEAL = ("offset = 0; for p in self.buckets[b]: p.grad.copy_(flat[offset:offset + p.numel()].view_as(p)); "
                    "offset += p.numel()")


def _bucketed_facts(learner) -> dict:
    """The real 2-rank run: the two TinyMLP plans, and the unused-parameter model when the
    in-process rehearsal (`_unused_fake`) found nothing that would crash or hang real ranks."""
    try:
        fake = _unused_fake(learner)
    except Exception:
        fake = None
    for rank in (0, 1):
        error = ((fake or {}).get(rank) or {}).get("error", "")
        if RUNAWAY in error:   # before any rank runs it: such a loop would run until memory is exhausted
            raise Wrong(f"a loop that launches buckets (in _on_grad_ready or finish) kept launching: {RUNAWAY}. "
                        f"Each launch moves self.next on by one, so the loop ends after the last bucket")
    try:
        with_unused = fake is not None and _diagnose_unused(fake) is None
    except Exception:
        with_unused = False
    def every_rank(path):
        ranks = run_ranks(_bucketed_rank, path, with_unused, hint=BUCKET_HINT)
        # rank 0's launches (the same on both ranks); every rank's results for the parity cases
        return dict(ranks[0], by_rank=ranks)
    return cached("06.bucketed_sync", learner, every_rank)


LAUNCH_CASE = "one asynchronous all-reduce per bucket, launched in plan order, the first during backward"
PARITY_CASE = "after finish() every .grad is the mean over 2 gloo ranks (2 plans, 2 steps each)"


@bucketed.case(LAUNCH_CASE, hint=BUCKET_HINT, reveal=BUCKET_REVEAL, timeout=150)
def _(learner):
    """Property: on 2 plans for 2 steps, each step launches one asynchronous all-reduce per bucket, of its flat size,
    in plan order, the first during backward; on 6 drawn plans (2 or 3 buckets, gradients out of order, a drawn rank
    that skips, 2 to 4 thread ranks) each bucket leaves with the hook that completes it, on every rank."""
    facts = _bucketed_facts(learner)["plans"]
    for label, f in facts.items():
        want, nparams = f["buckets"], f["params"]
        for i, st in enumerate(f["steps"], 1):
            got = st["numels"]
            if got and not all(st["async"]):
                raise Wrong("a blocking all-reduce returns only once it is done, so nothing overlaps: launch each "
                            "bucket's reduction in its asynchronous form and wait for it in finish()",
                            reveal="dist.all_reduce(flat, async_op=True)")
            if "error" in st and not got:
                raise Wrong(f"your code raised {st['error']} before any all-reduce. Hint: {BUCKET_HINT}")
            if len(got) == nparams and len(want) != nparams:
                raise Wrong(f"{len(got)} all-reduces for {nparams} parameters in {len(want)} buckets: one per "
                            f"parameter, not per bucket. Pack each bucket's gradients into one flat tensor and "
                            f"reduce that once", reveal="flat = torch.cat([g.reshape(-1) for g in grads])")
            if len(got) > len(want):
                raise Wrong(f"step {i}: {len(got)} all-reduces for {len(want)} buckets: each bucket is launched "
                            f"once per step (advance self.next; reset it in finish())")
            if not got and i == 2:
                raise Wrong("step 2 launched nothing: finish() must leave the per-step state (self.next, "
                            "self.pending, self.inflight) as __init__ set it, for the next step",
                            reveal="self.inflight, self.next = [], 0; self.pending = [len(m) for m in self.buckets]")
            if sorted(got) == sorted(want) and got != want:
                raise Wrong(f"the buckets went out in the order they completed ({got} elements), not in plan order "
                            f"({want}). Every rank must launch the same collectives in the same order: a bucket "
                            f"that is complete early waits until every bucket before it in the plan is launched")
            if "error" in st:
                raise Wrong(f"step {i}: your code raised {st['error']}. Hint: {UNFLATTEN_HINT}")
            if got != want:
                raise AssertionError(f"plan {label}, step {i}: all-reduces of {got} elements; the plan's buckets "
                                     f"hold {want}")
    first = facts["reverse"]["steps"][0]
    if first["in_backward"] == 0:
        raise Wrong("you launched every bucket after backward: nothing overlaps. Launch a bucket from the hook "
                    "of its last gradient (when its pending count reaches 0)")
    _check_drawn_on_time(learner)
    return (f"{len(facts['reverse']['buckets'])} buckets -> {len(first['numels'])} all-reduces, "
            f"{first['in_backward']} during backward; every bucket on time in {BUCKET_DRAWS} drawn plans")


@bucketed.case(PARITY_CASE, hint=UNFLATTEN_HINT, reveal=UNFLATTEN_REVEAL, after=LAUNCH_CASE, timeout=150)
def _(learner):
    """Property: after finish() every .grad is the mean over the 2 gloo ranks, on both ranks, for 2 plans of 2 steps
    each."""
    for rank, ranks_facts in enumerate(_bucketed_facts(learner)["by_rank"]):
        _bucketed_parity(rank, ranks_facts["plans"])
    return "parity with the serial all-reduce on both ranks"


def _bucketed_parity(rank: int, facts: dict) -> None:
    at = "" if rank == 0 else f"rank {rank}, "
    for label, f in facts.items():
        for i, st in enumerate(f["steps"], 1):
            if "error" in st:
                raise Wrong(f"{at}your code raised {st['error']}. Hint: {UNFLATTEN_HINT}")
            r = st["result"]
            if r == "mean":
                continue
            if r == "local":
                raise Wrong("the gradients are still this rank's own: the mean lives in the flat tensor you "
                            "reduced, and nothing wrote it back. Once a bucket's reduction is done, copy each "
                            "parameter's slice of it back into its .grad", reveal=UNFLATTEN_REVEAL)
            if r == "sum":
                raise Wrong("the gradients are the sum over ranks: divide the flat tensor by the world size")
            if r == "twice":
                raise Wrong("the gradients were divided by the world size twice")
            if r == "missing":
                raise Wrong("a .grad is None after finish(): write the mean back into every parameter's .grad")
            raise AssertionError(f"{at}plan {label}, step {i}: the gradients differ from the mean over ranks (are the "
                                 f"slices copied back to the right parameters, in the order they were packed?)")


# A parameter without .grad: lesson 05's `Branchy`, whose `expert` rank 1 skips and whose `spare`
# no rank uses, in a plan that puts each of them in a bucket with a used parameter.
UNUSED_PLAN = [["out.bias", "out.weight"], ["expert.weight", "inp.bias"], ["spare", "inp.weight"]]
UNUSED_CASE = ("a parameter without .grad (`expert` unused on rank 1, `spare` on both): same flat sizes on every "
               "rank, and the mean in every .grad")
UNUSED_HINT = ("a parameter backward did not reach has no .grad: it still takes its place in its bucket's flat "
               "tensor (as zeros), and after finish() it holds the mean like every other parameter")
PACK_REVEAL = "grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.buckets[b]]"
UNPACK_REVEAL = "if p.grad is None: p.grad = torch.empty_like(p)   then p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))"
_LEARNER_METHODS = ("_launch", "_on_grad_ready", "finish", "__init__")


def _learner_method(exc: BaseException) -> str | None:
    """The learner's method a crash happened in (the innermost one)."""
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        if frame.name in _LEARNER_METHODS and "/course/checks/" not in frame.filename.replace("\\", "/"):
            return frame.name
    return None


def _unused_fake(learner) -> dict:
    """One step of each rank of `Branchy` (rank 1 skips ``expert``) with lesson 05's stand-in
    all-reduce, in this process: what each rank would launch, without any risk of a hang."""
    memo = _memo(learner)
    if "06.unused-fake" in memo:
        return memo["06.unused-fake"]
    out = {}
    for rank in (0, 1):
        model = Branchy()
        numel = {n: p.numel() for n, p in model.named_parameters()}
        with fake_ranks(2) as log:
            sync = None
            try:
                sync = learner.BucketedSync(model, UNUSED_PLAN)
                log.clear()
                x = torch.randn(4, 3, generator=torch.Generator().manual_seed(rank))
                model(x, use_expert=(rank == 0)).square().mean().backward()
                sync.finish()
                out[rank] = {"numels": [c["numel"] for c in log],
                             "none_after": [n for n, p in model.named_parameters() if p.grad is None]}
            except Exception as exc:
                out[rank] = {"numels": [c["numel"] for c in log], "where": _learner_method(exc),
                             "error": f"{type(exc).__name__}: {exc}".strip().splitlines()[0]}
            finally:
                if sync is not None and hasattr(sync, "close"):
                    sync.close()
        out[rank]["want"] = [sum(numel[n] for n in b) for b in UNUSED_PLAN]
    memo["06.unused-fake"] = out
    return out


def _diagnose_unused(fake: dict) -> Wrong | None:
    for rank in (0, 1):
        f = fake[rank]
        if RUNAWAY in f.get("error", ""):
            return Wrong(f"rank {rank}: a loop that launches buckets kept launching: {RUNAWAY}")
        who = "expert.weight, which rank 1 did not use" if rank == 1 else "spare, which no rank uses"
        launched, want = f["numels"], f["want"]
        if launched != want[:len(launched)] or ("error" not in f and len(launched) != len(want)):
            return Wrong(f"rank {rank} reduced flat tensors of {launched} elements, the plan's buckets hold {want}: a "
                         f"parameter without .grad ({who}) was left out of its bucket's flat tensor. Then the slices "
                         f"land in the wrong parameters, and where one rank used the parameter and the other did not, "
                         f"the ranks reduce tensors of different sizes (gloo fails, or pairs the wrong elements). Pack "
                         f"zeros in its place", reveal=PACK_REVEAL)
        if "error" in f and "NoneType" in f["error"]:
            if f["where"] == "finish" and len(launched) == len(want):
                return Wrong(f"rank {rank}: finish() crashed ({f['error']}) on a parameter with no .grad ({who}): its "
                             f"part of the mean has nowhere to go. Give such a parameter a .grad before writing its "
                             f"slice back", reveal=UNPACK_REVEAL)
            return Wrong(f"rank {rank}: packing a bucket crashed ({f['error']}) on a parameter with no .grad ({who}). "
                         f"It still takes its place in the flat tensor, as zeros, so that every rank reduces a tensor "
                         f"of the same size", reveal=PACK_REVEAL)
        if "error" in f:
            return Wrong(f"rank {rank}, with a parameter that has no .grad ({who}): your code raised {f['error']}. "
                         f"Hint: {UNUSED_HINT}", reveal=PACK_REVEAL)
    if "expert.weight" in fake[1]["none_after"]:
        return Wrong("after finish(), expert.weight has no .grad on rank 1, although rank 0 used it: the mean (rank 0's "
                     "gradient over 2) belongs in every rank's .grad, or rank 1's optimizer skips the parameter and "
                     "the ranks' weights drift apart. Give it a .grad before writing its slice back",
                     reveal=UNPACK_REVEAL)
    return None


def _unused_rank(rank: int, world_size: int, mod, rec) -> dict:
    """Two real steps of `Branchy` under UNUSED_PLAN (rank 1 skips ``expert``); parity per step."""
    model, ref = Branchy(), Branchy()
    sync = mod.BucketedSync(model, UNUSED_PLAN)
    rec.take()
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    names = [n for n, _ in model.named_parameters()]
    results = []
    for step in range(2):
        x = torch.randn(4, 3, generator=torch.Generator().manual_seed(10 * step + rank))
        use = rank == 0
        model(x, use).square().mean().backward()
        sync.finish()
        rec.take()
        got = [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]
        local, mean = _reference_grads(ref, ref(x, use).square().mean(), rec.real, world_size)
        i = names.index("spare")          # unused everywhere: zeros or None are both right (DDP leaves None)
        if got[i] is None:
            got[i] = torch.zeros_like(mean[i])
        results.append(_classify(got, mean, local, world_size))
        for p, m in zip(ref.parameters(), mean):
            p.grad = m.clone()
        opt.step(); ref_opt.step()
        opt.zero_grad(set_to_none=True); ref_opt.zero_grad(set_to_none=True)
    if hasattr(sync, "close"):
        sync.close()
    return {"results": results}


@bucketed.case(UNUSED_CASE, hint=UNUSED_HINT, reveal=PACK_REVEAL, after=[LAUNCH_CASE, PARITY_CASE], timeout=150)
def _(learner):
    """Property: with `expert` unused on rank 1 and `spare` on both, every rank launches the same flat sizes and after
    finish() every .grad holds the mean, on both gloo ranks for 2 steps and on every rank of 6 drawn plans with a
    drawn rank skipping (2 to 4 thread ranks)."""
    problem = _diagnose_unused(_unused_fake(learner))
    if problem is not None:
        raise problem                 # found in this process: the real ranks are not started
    _check_drawn_means(learner)       # thread ranks, every rank read: before the real ranks start too
    for rank, facts in enumerate(_bucketed_facts(learner)["by_rank"]):      # rank 1 is the one that skips
        unused = facts["unused"]
        assert unused is not None, "the real 2-rank run did not include the unused-parameter model"
        who = f"rank {rank}" + (" (which skipped `expert`)" if rank == 1 else "")
        for i, r in enumerate(unused["results"], 1):
            if r == "mean":
                continue
            if r == "missing":
                raise Wrong(f"step {i}, {who}: a parameter has no .grad after finish()", reveal=UNPACK_REVEAL)
            raise AssertionError(f"step {i}, {who}: with `expert` unused on rank 1, the gradients after finish() "
                                 f"differ from the serial mean ({r})")
    return (f"expert unused on rank 1, spare on both: 2 steps, parity with the serial all-reduce; the mean on every "
            f"rank of {BUCKET_DRAWS} drawn plans (2 to 4 ranks, a drawn rank skipping)")


# Drawn cases (course/checks/drawn.py): plans of 2 or 3 buckets, gradients that arrive out of the plan's
# order, a rank (drawn) that skips a parameter, 2 to 4 thread ranks, every rank read. The properties:
# each bucket leaves with the hook that completes it (and every bucket before it in the plan), not a
# hook later; after finish() every rank holds the mean, the rank that skipped a parameter included.
BUCKET_DRAWS = 6


def _drawn_buckets(learner) -> list:
    from course.checks.drawn import draw_cases, run_draws

    def compute():
        return run_draws(draw_cases(7, BUCKET_DRAWS, frozen_every=2, buckets=True),
                         lambda model, d: learner.BucketedSync(model, d.buckets))
    return learner.once("06.bucketed_sync-drawn", compute)


def _drawn_crash(learner, pairs=None) -> None:
    from course.checks.lesson05 import rank_error

    for draw, steps in (pairs if pairs is not None else _drawn_buckets(learner)):
        crashed = rank_error(draw, steps, "BucketedSync(model, buckets)")
        if crashed:
            raise Wrong(f"{crashed} ({draw.describe()}). Hint: {BUCKET_HINT}")


def _check_drawn_on_time(learner, pairs=None) -> None:
    """The end of LAUNCH_CASE: on the drawn plans, every bucket leaves with the hook that completes it."""
    from course.checks.drawn import first_late_launch, raise_smallest

    if pairs is None:       # each drawn case in turn; the first that fails, shrunk
        return raise_smallest(_drawn_buckets(learner), lambda p: _check_drawn_on_time(learner, p),
                              lambda model, d: learner.BucketedSync(model, d.buckets))
    for draw, steps in pairs:
        if any(st.error is not None for st in steps):
            continue          # a crash is named by UNUSED_CASE, after its rehearsal of a parameter without .grad
        late = first_late_launch(draw, steps, draw.buckets)
        if late:
            raise Wrong(f"a bucket left a hook late: {late} ({draw.describe()}). A bucket leaves with the hook that "
                        f"completes it: count the gradient down first, then launch every complete bucket at the head "
                        f"of the plan, before the hook returns", reveal=BUCKET_REVEAL)


def _check_drawn_means(learner, pairs=None) -> None:
    """The end of UNUSED_CASE: on the drawn plans, every rank holds the mean, the one that skipped included."""
    from course.checks.drawn import first_wrong_grad, raise_smallest

    if pairs is None:
        return raise_smallest(_drawn_buckets(learner), lambda p: _check_drawn_means(learner, p),
                              lambda model, d: learner.BucketedSync(model, d.buckets))
    _drawn_crash(learner, pairs)
    for draw, steps in pairs:
        wrong = first_wrong_grad(draw, steps)
        if wrong:
            raise Wrong(f"{wrong} ({draw.describe()}). A parameter a rank did not use adds zeros to its bucket's "
                        f"sum and receives the mean like every other parameter: write its slice of the reduced "
                        f"flat tensor back into its .grad on every rank", reveal=UNPACK_REVEAL)


# =============================================================================================
# The sweep: step time against the bucket cap, on a link with latency and bandwidth
# =============================================================================================
SWEEP_CAPS = (0.0, 1 / 8, 1 / 2, 1.0, 25.0)
DDP_DEFAULT = "DDP default"


def _sweep_step(model, ids, opt, rec, sync, world_size) -> dict:
    rec.take()
    t0 = time.perf_counter()
    loss = model(input_ids=ids, labels=ids).loss
    t1 = time.perf_counter()
    rec.in_backward = True
    loss.backward()
    rec.in_backward = False
    t2 = time.perf_counter()
    sync.finish()
    t3 = time.perf_counter()
    opt.step()
    opt.zero_grad(set_to_none=True)
    t4 = time.perf_counter()
    calls = rec.take()
    from hfstream.gradsync import union_length

    return {"forward_ms": (t1 - t0) * 1e3, "backward_ms": (t2 - t1) * 1e3, "exposed_comm_ms": (t3 - t2) * 1e3,
            "optimizer_ms": (t4 - t3) * 1e3, "step_ms": (t4 - t0) * 1e3,
            "comm_busy_ms": union_length([(c["launch"], c["done"] or t3) for c in calls]) * 1e3,
            "collectives": len(calls), "launched_in_backward": sum(c["in_backward"] for c in calls)}


def _sweep_rank(rank: int, world_size: int, path: str | None, plans: dict | None, caps: list,
                steps: int, loopback_steps: int, bandwidth_ratio: float, latency_ratio: float) -> dict:
    import transformers

    from course.lib import tiny_gpt2
    from hfstream.gradsync import GradSync
    from hfstream.testing.link import SimulatedLink, ring_allreduce_bytes

    transformers.logging.set_verbosity_error()
    gen = torch.Generator().manual_seed(100 + rank)
    ids = torch.randint(0, 257, (8, 64), generator=gen)
    probe = tiny_gpt2(layers=4, width=128)
    bwd = []
    for _ in range(8):
        loss = probe(input_ids=ids, labels=ids).loss
        t = time.perf_counter()
        loss.backward()
        bwd.append(time.perf_counter() - t)
        probe.zero_grad(set_to_none=True)
    agreed = torch.tensor([min(bwd[2:])])
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    bwd_s = agreed.item()
    named = list(probe.named_parameters())
    grad_bytes = sum(p.numel() * p.element_size() for _, p in named)
    # The link: all gradients in one transfer take bandwidth_ratio x backward; one collective per
    # parameter pays latency_ratio x backward in fixed costs.
    rate_mbit = ring_allreduce_bytes(grad_bytes, world_size) * 8 / (bandwidth_ratio * bwd_s) / 1e6
    latency_ms = latency_ratio * bwd_s * 1e3 / len(named)
    link = SimulatedLink(rate_mbit=rate_mbit, latency_ms=latency_ms)
    rec = Recorder()
    sessions = []
    mod = load_module(path) if path else None
    with rec.installed():
        for label in caps:
            model = tiny_gpt2(layers=4, width=128)
            if mod is not None:
                sync = mod.BucketedSync(model, plans[str(label)])
            elif label == DDP_DEFAULT:
                sync = GradSync(model, bucket_mb=25.0, first_bucket_mb=1.0)
            else:
                sync = GradSync(model, bucket_mb=float(label))
            sessions.append((label, model, torch.optim.SGD(model.parameters(), lr=1e-3), sync))
        rec.take()

    def sweep(phase_steps):
        records = {str(label): [] for label, *_ in sessions}
        for i in range(phase_steps + 1):     # round-robin: a slow moment of the machine hits every cap
            for label, model, opt, sync in sessions:
                dist.barrier()
                parts = _sweep_step(model, ids, opt, rec, sync, world_size)
                if i:                        # the first round warms up
                    records[str(label)].append(parts)
        return records

    # 1. The real thing: gloo over this machine's loopback, nothing simulated (fewer steps).
    with rec.installed():
        loopback = sweep(loopback_steps)
    # 2. The simulated link, installed under the recorder (it sees the link's completion times).
    with link.installed(), rec.installed():
        simulated = sweep(steps)
    for _, _, _, sync in sessions:
        if hasattr(sync, "close"):
            sync.close()
    return {"records": {"loopback": loopback, "simulated": simulated},
            "rate_mbit": rate_mbit, "latency_ms": latency_ms, "backward_ms": bwd_s * 1e3,
            "params": len(named), "grad_mib": grad_bytes / MiB}


def measure_sweep(namespace: dict, caps=SWEEP_CAPS, steps: int = 4, loopback_steps: int = 3,
                  bandwidth_ratio: float = 1.0, latency_ratio: float = 1.0) -> dict:
    """Step time of a tiny GPT-2 on 2 gloo ranks for each bucket cap, plus DDP's default plan:
    first over the real loopback, then over a simulated link sized from this machine's backward.

    Uses the notebook's `plan_buckets` and `BucketedSync` once they are written (else hfstream's
    planner and ``GradSync``). Returns, per cap (a string; ``"DDP default"`` for 25 MiB with a
    1 MiB first bucket), the median parts of a step on the simulated link (``by_cap``) and on
    loopback (``loopback``), the ceiling, the number of buckets and ``tail_floor_ms``: the least
    time the last bucket (launched when backward ends) needs on the simulated link.
    """
    from course.lib import tiny_gpt2
    from hfstream.gradsync.buckets import plan_buckets as library_plan
    from hfstream.testing import run_on_ranks

    labels = [*caps, DDP_DEFAULT]
    named = list(tiny_gpt2(layers=4, width=128).named_parameters())
    planner = namespace.get("plan_buckets")
    mine_plan = planner is not None and not is_stub(planner)
    cls = namespace.get("BucketedSync")
    path, plans = None, None
    if cls is not None and not is_stub(cls):
        path = Learner(namespace, get_exercise("06.bucketed_sync")).module_file()
        plans = {}
        for label in labels:
            if label == DDP_DEFAULT:
                plans[label] = [list(b.names) for b in library_plan(named, 25.0, first_bucket_mb=1.0)]
            elif mine_plan:
                plans[str(label)] = [list(b) for b in planner(named, label)]
            else:
                plans[str(label)] = [list(b.names) for b in library_plan(named, label)]
    who = ("your BucketedSync" if path else "hfstream's GradSync (BucketedSync is not written yet)") + \
          (" with your plan_buckets" if path and mine_plan else " with hfstream's planner")
    out = run_on_ranks(_sweep_rank, 2, path, plans, labels, steps, loopback_steps, bandwidth_ratio, latency_ratio,
                       timeout=150, pg_timeout_s=60)
    from hfstream.testing.link import SimulatedLink

    link = SimulatedLink(rate_mbit=out[0]["rate_mbit"], latency_ms=out[0]["latency_ms"])
    sizes = {n: p.numel() * p.element_size() for n, p in named}
    phases = {"loopback": {}, "simulated": {}}
    for phase, n_steps in (("loopback", loopback_steps), ("simulated", steps)):
        for label in labels:
            key = str(label)
            per_step = []
            for s in range(n_steps):
                rows = [r["records"][phase][key][s] for r in out]
                row = {k: statistics.fmean(x[k] for x in rows) for k in rows[0]}
                row["step_ms"] = max(x["step_ms"] for x in rows)
                per_step.append(row)
            med = {k: statistics.median(s[k] for s in per_step) for k in per_step[0]}
            med["ceiling_ms"] = statistics.median(
                s["forward_ms"] + max(s["backward_ms"], s["comm_busy_ms"]) + s["optimizer_ms"] for s in per_step)
            if label == DDP_DEFAULT:
                plan = [list(b.names) for b in library_plan(named, 25.0, first_bucket_mb=1.0)]
            else:
                plan = plans[key] if plans else [list(b.names) for b in library_plan(named, label)]
            med["buckets"] = len(plan)
            med["tail_floor_ms"] = link.transfer_s(sum(sizes[n] for n in plan[-1]), 2) * 1e3
            phases[phase][key] = med
    return {"who": who, "by_cap": phases["simulated"], "loopback": phases["loopback"],
            "labels": [str(x) for x in labels], "rate_mbit": out[0]["rate_mbit"],
            "latency_ms": out[0]["latency_ms"], "backward_ms": out[0]["backward_ms"], "params": out[0]["params"],
            "grad_mib": out[0]["grad_mib"], "bandwidth_ratio": bandwidth_ratio, "latency_ratio": latency_ratio}


def _cap_label(label: str) -> str:
    if label == DDP_DEFAULT:
        return "25\n(first 1)"
    v = float(label)
    if v == 0:
        return "0\n(per param)"
    if v < 1:
        return f"1/{round(1 / v)}"
    return f"{v:g}"


def sweep_figure(sweep: dict, path) -> Any:
    """Step time and ceiling against the bucket cap; DDP's default marked, the best cap labelled."""
    from pathlib import Path

    from matplotlib.figure import Figure

    by = sweep["by_cap"]
    caps = [lb for lb in sweep["labels"] if lb != DDP_DEFAULT]
    xs = list(range(len(caps)))
    fig = Figure(figsize=(7.0, 3.8))
    ax = fig.subplots()
    ax.plot(xs, [by[c]["step_ms"] for c in caps], marker="o", color="#4c72b0", label="measured step, simulated link")
    ax.plot(xs, [by[c]["ceiling_ms"] for c in caps], linestyle="--", color="#55a868",
            label="ceiling on the simulated link: fwd + max(bwd, comm busy) + opt")
    if sweep.get("loopback"):
        ax.plot(xs, [sweep["loopback"][c]["step_ms"] for c in caps], marker="s", markersize=3, color="#8c8c8c",
                label="measured step, real loopback (nothing simulated)")
    for x, c in zip(xs, caps):
        ax.annotate(f"{by[c]['buckets']:.0f}", (x, by[c]["step_ms"]), textcoords="offset points", xytext=(0, 6),
                    ha="center", fontsize=7, color="#4c72b0")
    ddp = by[DDP_DEFAULT]
    x_ddp = caps.index("25.0") if "25.0" in caps else len(caps) - 1
    ax.plot([x_ddp], [ddp["step_ms"]], marker="*", markersize=14, color="#c44e52", linestyle="none",
            label=f"DDP default: 25 MiB, first bucket 1 MiB ({ddp['buckets']:.0f} buckets)")
    best = min(caps, key=lambda c: by[c]["step_ms"])
    ax.axhline(by[best]["step_ms"], color="#999999", linewidth=0.8, linestyle=":")
    ax.annotate(f"best: {by[best]['step_ms']:.0f} ms", (caps.index(best), by[best]["step_ms"]),
                textcoords="offset points", xytext=(0, -16), ha="center", fontsize=8,
                bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.85, "pad": 1})
    ax.set_xticks(xs, [_cap_label(c) for c in caps], fontsize=8)
    ax.set_xlabel("bucket cap (MiB); number above a point = buckets")
    ax.set_ylabel("ms per step (2 ranks)")
    ax.set_title(f"bucket cap sweep, tiny GPT-2 ({sweep['grad_mib']:.1f} MiB of gradients), 2 gloo ranks; SIMULATED link "
                 f"{sweep['rate_mbit']:.0f} Mbit/s\n+ {sweep['latency_ms']:.2f} ms per collective, both sized from this "
                 f"machine's backward (timer-delayed completion: no contention, no NIC)", fontsize=8)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return Path(path)
