"""Lesson 10 checks: a reduce-scatter built by hand, a sharded clipped step, the all-gather waited
for by forward pre-hooks; and the measurements behind the lesson's figures.

The three exercises are graded in one process: `in_threads` runs each rank in a thread with
``torch.distributed``'s collectives replaced by an exchange between the threads (`ThreadWorld`).
It follows the documented semantics (a collective reads its input when it is launched and
writes its output when it is waited for; every rank must launch the same collectives in the
same order) and it logs what each rank launched, waited for and sent, in bytes. That is what
lets a check name the mistake: which slice a rank kept, whether the norm was all-reduced,
whether a layer waited for another layer's gather. A check takes milliseconds, so a learner can
iterate, and a hang becomes an error after a few seconds instead of a process-group timeout.

The measurements use real gloo processes (`hfstream.testing.run_on_ranks`): once on the bare
loopback, and once on `WireLink`, a *simulated* link that delays the completion of every
collective and point-to-point transfer to what its bytes would take at a given bandwidth.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import math
import statistics
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from course.grading import Exercise, Learner, Wrong, get_exercise, is_stub
from hfstream.timeline import cross_step_limit

MiB = 2**20


# =============================================================================================
# Ranks as threads: a fake torch.distributed that logs every transfer
# =============================================================================================
class _Op:
    """One launched operation of one rank: a collective (matched by launch order) or a p2p transfer."""

    def __init__(self, world, rank, kind, finish, sent_bytes, tensor=None):
        self.world, self.rank, self.kind, self.finish = world, rank, kind, finish
        self.sent_bytes, self.tensor = sent_bytes, tensor
        self.id = world.next_id()
        self.done = False

    def complete(self):
        if not self.done:
            self.finish()
            self.done = True
            self.world.note(self.rank, "done", self)


class _FakeWork:
    def __init__(self, op: _Op):
        self._op = op

    def wait(self, timeout=None) -> bool:
        self._op.world.note(self._op.rank, "wait", self._op)
        self._op.complete()
        return True

    def is_completed(self) -> bool:
        return self._op.done

    def is_success(self) -> bool:
        return self._op.done

    def get_future(self):
        self.wait()
        fut = torch.futures.Future()
        fut.set_result([self._op.tensor])
        return fut


class _P2POp:
    """Stands in for ``dist.P2POp`` (whose constructor needs a real process group)."""

    def __init__(self, op, tensor, peer=None, group=None, tag=0, group_peer=None):
        self.op, self.tensor, self.peer, self.group, self.tag = op, tensor, peer, group, tag


class ThreadWorld:
    """``world_size`` ranks in one process, one thread each; see the module docstring.

    Args:
        world_size: number of ranks.
        refuse: ``{name of a torch.distributed function: why}``: calling it raises (and is logged).
        timeout_s: how long a rank waits for its peers before it raises (instead of hanging).
    """

    PATCHED = ("get_rank", "get_world_size", "is_initialized", "is_available", "get_backend", "barrier",
               "all_reduce", "all_to_all_single", "all_gather_single", "all_gather_into_tensor", "all_gather",
               "reduce_scatter_single", "reduce_scatter_tensor", "reduce_scatter", "broadcast",
               "isend", "irecv", "send", "recv", "batch_isend_irecv", "P2POp")

    def __init__(self, world_size: int, refuse: dict[str, str] | None = None, timeout_s: float = 8.0):
        self.n = world_size
        self.refuse = dict(refuse or {})
        self.timeout_s = timeout_s
        self.local = threading.local()
        self.cv = threading.Condition()
        self.slots: dict[int, dict[int, tuple]] = {}
        self.mail: dict[tuple[int, int, int], collections.deque] = collections.defaultdict(collections.deque)
        self.seq = [0] * world_size
        self.log: list[dict] = []
        self._ids = 0
        self._taken = [0] * world_size

    # -- bookkeeping ------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.local.rank

    def next_id(self) -> int:
        with self.cv:
            self._ids += 1
            return self._ids

    def note(self, rank, event, op=None, **extra) -> None:
        with self.cv:
            entry = {"rank": rank, "event": event, "order": len(self.log), **extra}
            if op is not None:
                entry.update(op=op.id, kind=op.kind, bytes=op.sent_bytes,
                             ptr=None if op.tensor is None else op.tensor.data_ptr())
            self.log.append(entry)

    def take(self, rank: int) -> list[dict]:
        """This rank's log entries since the last `take` for it."""
        with self.cv:
            out = [e for e in self.log[self._taken[rank]:] if e["rank"] == rank]
            self._taken[rank] = len(self.log)
        return out

    def _wait_for(self, predicate, what: str):
        if not self.cv.wait_for(predicate, timeout=self.timeout_s):
            raise RuntimeError(f"rank {self.rank} waited {self.timeout_s:.0f} s for {what}: every rank must make the "
                               f"same calls in the same order (a hang on a real process group)")

    # -- collectives ------------------------------------------------------------------------------
    def _collective(self, kind: str, payload, finish: Callable[[list], None], sent_bytes: float, tensor, async_op):
        me = self.rank
        with self.cv:
            seq = self.seq[me]
            self.seq[me] += 1
            self.slots.setdefault(seq, {})[me] = (kind, payload)
            self.cv.notify_all()

        def complete():
            with self.cv:
                self._wait_for(lambda: len(self.slots[seq]) == self.n,
                               f"the other ranks to launch collective #{seq + 1} ({kind})")
                got = self.slots[seq]
            kinds = {r: k for r, (k, _) in got.items()}
            if len(set(kinds.values())) > 1:
                raise RuntimeError(f"collective #{seq + 1}: " + ", ".join(f"rank {r} called {k}" for r, k in
                                                                          sorted(kinds.items()))
                                   + ": every rank must launch the same collectives in the same order")
            finish([got[r][1] for r in range(self.n)])

        op = _Op(self, me, kind, complete, sent_bytes, tensor)
        self.note(me, "launch", op, async_op=bool(async_op))
        if async_op:
            return _FakeWork(op)
        op.complete()
        return None

    @staticmethod
    def _same_numel(payloads, kind):
        sizes = {p.numel() for p in payloads}
        if len(sizes) > 1:
            raise RuntimeError(f"{kind}: the ranks passed tensors of different sizes {sorted(sizes)}")

    def all_reduce(self, tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        self._refused("all_reduce")
        ops = {dist.ReduceOp.SUM: lambda xs: torch.stack(xs).sum(0), dist.ReduceOp.MAX: lambda xs: torch.stack(xs).amax(0),
               dist.ReduceOp.MIN: lambda xs: torch.stack(xs).amin(0), dist.ReduceOp.PRODUCT: lambda xs: torch.stack(xs).prod(0)}
        if op not in ops:
            raise RuntimeError(f"all_reduce: gloo does not support {op}; use ReduceOp.SUM (and divide)")
        nbytes = tensor.numel() * tensor.element_size()

        def finish(payloads):
            self._same_numel(payloads, "all_reduce")
            tensor.copy_(ops[op]([p.reshape(tensor.shape) for p in payloads]))

        return self._collective("all_reduce", tensor.detach().clone(), finish, 2 * (self.n - 1) / self.n * nbytes,
                                tensor, async_op)

    def all_to_all_single(self, output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                          async_op=False):
        n, me = self.n, self.rank
        if output_split_sizes is None and input_split_sizes is None:
            if input.numel() % n or output.numel() != input.numel():
                raise RuntimeError(f"all_to_all_single: input ({input.numel()} elements) and output "
                                   f"({output.numel()}) must be the same size, a multiple of the world size {n}")
            chunks = list(input.detach().reshape(-1).clone().split(input.numel() // n))
        else:
            rows = list(input_split_sizes or [input.shape[0] // n] * n)
            chunks = [c.reshape(-1) for c in input.detach().clone().split(rows)]
        sent = sum(c.numel() for j, c in enumerate(chunks) if j != me) * input.element_size()

        def finish(payloads):
            mine = torch.cat([p[me] for p in payloads])
            if mine.numel() != output.numel():
                raise RuntimeError(f"all_to_all_single: output has {output.numel()} elements, the ranks sent "
                                   f"{mine.numel()} to rank {me}")
            output.copy_(mine.reshape(output.shape))

        return self._collective("all_to_all_single", chunks, finish, sent, output, async_op)

    def all_gather_into_tensor(self, output_tensor, input_tensor, group=None, async_op=False):
        if output_tensor.numel() != self.n * input_tensor.numel():
            raise RuntimeError(f"all_gather: the output has {output_tensor.numel()} elements, it needs world size x "
                               f"input = {self.n} x {input_tensor.numel()}")
        nbytes = input_tensor.numel() * input_tensor.element_size()

        def finish(payloads):
            self._same_numel(payloads, "all_gather")
            output_tensor.copy_(torch.cat([p.reshape(-1) for p in payloads]).reshape(output_tensor.shape))

        return self._collective("all_gather", input_tensor.detach().clone(), finish, (self.n - 1) * nbytes,
                                output_tensor, async_op)

    def all_gather(self, tensor_list, tensor, group=None, async_op=False):
        if len(tensor_list) != self.n:
            raise RuntimeError(f"all_gather: tensor_list has {len(tensor_list)} tensors, the world size is {self.n}")
        nbytes = tensor.numel() * tensor.element_size()

        def finish(payloads):
            for out, p in zip(tensor_list, payloads):
                out.copy_(p.reshape(out.shape))

        return self._collective("all_gather", tensor.detach().clone(), finish, (self.n - 1) * nbytes, tensor_list[0],
                                async_op)

    def broadcast(self, tensor, src=0, group=None, async_op=False, group_src=None):
        nbytes = tensor.numel() * tensor.element_size()

        def finish(payloads):
            tensor.copy_(payloads[src].reshape(tensor.shape))

        return self._collective("broadcast", tensor.detach().clone(), finish, nbytes if self.rank == src else 0,
                                tensor, async_op)

    def barrier(self, group=None, async_op=False, device_ids=None, timeout=None):
        return self._collective("barrier", None, lambda payloads: None, 0, None, async_op)

    def _refused(self, name):
        if name in self.refuse:
            self.note(self.rank, "refused", name=name)
            raise RuntimeError(f"dist.{name} is not allowed here: {self.refuse[name]}")

    def _refuser(self, name):
        def refused(*args, **kwargs):
            self._refused(name)
            raise RuntimeError(f"dist.{name} is not supported by the course's thread ranks")
        return refused

    # -- point to point ---------------------------------------------------------------------------
    def _peer(self, peer, what):
        if not isinstance(peer, int) or not 0 <= peer < self.n or peer == self.rank:
            raise RuntimeError(f"{what}: rank {self.rank} named peer {peer!r}; a peer is another rank, "
                               f"0 <= peer < world size {self.n}")
        return peer

    def isend(self, tensor, dst=None, group=None, tag=0, group_dst=None):
        dst = self._peer(dst if dst is not None else group_dst, "isend")
        me = self.rank
        op = _Op(self, me, "send", lambda: None, tensor.numel() * tensor.element_size(), tensor)
        with self.cv:
            self.mail[(me, dst, tag)].append(tensor.detach().clone())
            self.cv.notify_all()
        self.note(me, "launch", op, async_op=True, peer=dst)
        return _FakeWork(op)

    def irecv(self, tensor, src=None, group=None, tag=0, group_src=None):
        me = self.rank
        src = src if src is not None else group_src
        if src is not None:
            self._peer(src, "irecv")
        box = {}

        def finish():
            with self.cv:
                keys = [(src, me, tag)] if src is not None else [(s, me, tag) for s in range(self.n) if s != me]
                self._wait_for(lambda: any(self.mail[k] for k in keys), f"a message from rank {src} (tag {tag})")
                key = next(k for k in keys if self.mail[k])
                got = self.mail[key].popleft()
            if got.numel() != tensor.numel():
                raise RuntimeError(f"irecv: rank {me} posted a buffer of {tensor.numel()} elements, rank {key[0]} "
                                   f"sent {got.numel()}")
            tensor.copy_(got.reshape(tensor.shape))
            box["src"] = key[0]

        op = _Op(self, me, "recv", finish, 0, tensor)
        self.note(me, "launch", op, async_op=True, peer=src)
        work = _FakeWork(op)
        work.source = box
        return work

    def send(self, tensor, dst=None, group=None, tag=0, group_dst=None):
        self.isend(tensor, dst, group, tag, group_dst).wait()

    def recv(self, tensor, src=None, group=None, tag=0, group_src=None):
        work = self.irecv(tensor, src, group, tag, group_src)
        work.wait()
        return work.source.get("src", src)

    def batch_isend_irecv(self, p2p_op_list):
        return [op.op(op.tensor, op.peer, tag=op.tag) for op in p2p_op_list]

    # -- installing -------------------------------------------------------------------------------
    def functions(self) -> dict[str, Any]:
        fns = {
            "get_rank": lambda group=None: self.rank,
            "get_world_size": lambda group=None: self.n,
            "is_initialized": lambda: True,
            "is_available": lambda: True,
            "get_backend": lambda group=None: "gloo",
            "barrier": self.barrier, "all_reduce": self.all_reduce, "all_to_all_single": self.all_to_all_single,
            "all_gather_single": self.all_gather_into_tensor, "all_gather_into_tensor": self.all_gather_into_tensor,
            "all_gather": self.all_gather, "broadcast": self.broadcast,
            "isend": self.isend, "irecv": self.irecv, "send": self.send, "recv": self.recv,
            "batch_isend_irecv": self.batch_isend_irecv, "P2POp": _P2POp,
        }
        for name in ("reduce_scatter_single", "reduce_scatter_tensor", "reduce_scatter"):
            fns[name] = self._refuser(name)     # not built here: an exercise that allows them would need them
        return fns

    @contextlib.contextmanager
    def installed(self):
        saved = [(mod, name, getattr(mod, name)) for mod in (dist, c10d) for name in self.PATCHED if hasattr(mod, name)]
        fns = self.functions()
        for mod, name, _ in saved:
            setattr(mod, name, fns[name])
        try:
            yield self
        finally:
            for mod, name, fn in saved:
                setattr(mod, name, fn)


def in_threads(fn: Callable, world_size: int = 2, refuse: dict[str, str] | None = None,
               timeout_s: float = 30.0) -> tuple[list, list, ThreadWorld]:
    """Run ``fn(rank, world_size, world)`` on every rank (a thread each); returns (results, errors, world).

    ``errors[r]`` is the exception rank r raised (its traceback attached), or None.
    """
    world = ThreadWorld(world_size, refuse)
    results, errors = [None] * world_size, [None] * world_size

    def body(rank):
        world.local.rank = rank
        try:
            results[rank] = fn(rank, world_size, world)
        except BaseException as exc:  # reported to the check, which names it for the learner
            errors[rank] = exc

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
    return results, errors, world


def _your_line(exc: BaseException) -> str:
    """`` (in your code: `line`)`` for the learner's frame of a traceback, or ""."""
    for fr in reversed(traceback.extract_tb(exc.__traceback__)):
        name = fr.filename.replace("\\", "/")
        if "/course/" not in name and "site-packages" not in name and "/torch/" not in name:
            return f" (in your code: `{(fr.line or '').strip()}`)"
    return ""


def raise_rank_error(errors: list, world: ThreadWorld, hint: str, reveal: str | None = None,
                     where: str = "") -> None:
    """A `Wrong` for the first rank that raised: a refused primitive by name, else the error and the hint."""
    refused = [e["name"] for e in world.log if e["event"] == "refused"]
    if refused:
        raise Wrong(REFUSED[refused[0]], reveal=reveal)
    for r, exc in enumerate(errors):
        if exc is not None:
            text = str(exc).strip().splitlines()
            raise Wrong(f"{where}rank {r} raised {type(exc).__name__}: {text[-1] if text else ''}{_your_line(exc)}. "
                        f"Hint: {hint}", reveal=reveal)


def _once(learner: Learner, key: str, compute: Callable[[], Any]):
    """``compute()`` once per check call (one `Learner`); later cases reuse its facts or its failure.
    A re-run of the check runs the learner's code again."""
    memo = learner.__dict__.setdefault("_lesson_facts", {})
    if key not in memo:
        try:
            memo[key] = ("ok", compute())
        except Wrong as exc:
            memo[key] = ("wrong", exc)
    kind, value = memo[key]
    if kind == "wrong":
        raise Wrong(str(value), reveal=value.reveal)
    return value


def _unwaited(entries: list[dict]) -> list[dict]:
    waited = {e["op"] for e in entries if e["event"] == "wait"}
    return [e for e in entries if e["event"] == "launch" and e.get("async_op") and e["op"] not in waited
            and e["kind"] != "send"]


def _close(a: torch.Tensor, b: torch.Tensor, rtol: float = 1e-5) -> bool:
    a, b = a.detach().reshape(-1).double(), b.detach().reshape(-1).double()
    return a.shape == b.shape and bool(torch.allclose(a, b, rtol=rtol, atol=1e-6))


# =============================================================================================
# 10.reduce_scatter
# =============================================================================================
rs_ex = Exercise("10.reduce_scatter", uses=["reduce_scatter_mean"], title="a reduce-scatter from all-to-all")

REFUSED = {
    "all_reduce": "you called dist.all_reduce: that is the whole all-reduce (reduce-scatter *and* all-gather), "
                  "twice the bytes, and what this exercise takes apart. Build the first half alone: each rank sends "
                  "slice j of its tensor to rank j (dist.all_to_all_single, or dist.isend/dist.irecv) and adds "
                  "up what it receives",
    "reduce_scatter_single": "dist.reduce_scatter_single is the primitive you are building (and on gloo it costs a "
                             "whole all-reduce, docs/design.md section 7): build it from dist.all_to_all_single or "
                             "dist.isend/dist.irecv",
}
REFUSED["reduce_scatter_tensor"] = REFUSED["reduce_scatter"] = REFUSED["reduce_scatter_single"]
RS_REFUSE = {name: REFUSED[name] for name in ("all_reduce", "reduce_scatter_single", "reduce_scatter_tensor",
                                              "reduce_scatter")}
RS_SIZES = (3, 1000)       # elements per rank's slice
RS_WORLDS = (2, 4)
RS_HINT = ("every rank must end with the mean of the slice it owns: send each peer the slice that peer owns, add up "
           "what the ranks send you for yours, and divide by N exactly once")
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


def _rs_facts(learner) -> dict:
    def compute():
        facts = {}
        for n in RS_WORLDS:
            results, errors, world = in_threads(functools.partial(_rs_rank, fn=learner.reduce_scatter_mean), n,
                                                refuse=RS_REFUSE)
            if any(errors):
                raise_rank_error(errors, world, RS_HINT, RS_REVEAL, where=f"{n} ranks: ")
            facts[n] = results
        return facts
    return _once(learner, "10.reduce_scatter", compute)


def _rs_diagnose(got: torch.Tensor | None, rank: int, n: int, size: int, log: list[dict]) -> str | None:
    """None when ``got`` is this rank's mean slice; else what the learner's result is instead."""
    inputs = [rs_input(r, n, size) for r in range(n)]
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
    if n == 2 and (_close(g, chunk(1 - rank, rank)) or _close(g, chunk(1 - rank, rank) / n)):
        return ("that is only what the other rank sent: the mean needs your own contribution to slice `rank` "
                "too")
    return "the result is not this rank's slice of the mean"


@rs_ex.case("each rank ends with the mean of its own slice (2 and 4 ranks, S = 3 and 1000)", hint=RS_HINT,
            reveal=RS_REVEAL, timeout=60)
def _(learner):
    facts = _rs_facts(learner)
    for n, results in facts.items():
        for rank, per_size in enumerate(results):
            for item in per_size:
                why = _rs_diagnose(item["got"], rank, n, item["size"], item["log"])
                if why:
                    raise Wrong(f"{n} ranks, rank {rank}, S = {item['size']}: {why}", reveal=RS_REVEAL)
    return "the mean slice on every rank"


@rs_ex.case("it sends each peer only that peer's slice: (N-1)/N of the tensor, half an all-reduce's bytes",
            hint="send rank j only slice j (S elements), not the whole tensor", timeout=60,
            after="each rank ends with the mean of its own slice (2 and 4 ranks, S = 3 and 1000)")
def _(learner):
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
                            reveal="each peer j needs only flat[j*S:(j+1)*S]")
            if sent < 0.99 * want:
                raise AssertionError(f"{n} ranks: rank {rank} sent {sent:.0f} bytes, fewer than the "
                                     f"{want:.0f} every peer's slice takes")
    return "2 ranks: 0.50 x the tensor, 4 ranks: 0.75 x (an all-reduce: 1.00 x and 1.50 x)"


def learner_reduce_scatter(namespace: dict) -> str | None:
    """The learner's reduce_scatter_mean written to a file for gloo ranks; None while it is a stub."""
    fn = namespace.get("reduce_scatter_mean")
    if fn is None or is_stub(fn):
        return None
    return Learner(namespace, get_exercise("10.reduce_scatter")).module_file()


# =============================================================================================
# 10.sharded_step
# =============================================================================================
step_ex = Exercise("10.sharded_step", uses=["sharded_sgd_step"], title="a sharded, clipped optimizer step")

STEP_SIZE = 5
STEP_LR = 0.5
STEP_WORLDS = (2, 4)
STEP_NORMS = (1.0, 100.0)           # clipping active, then inactive (a coefficient above 1 would scale up)
STEP_HINT = ("the whole gradient's norm from the ranks' pieces: each rank computes what it can from its own slice, "
             "one collective combines them, and every rank ends with the same number")
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
            results, errors, world = in_threads(functools.partial(_step_rank, fn=learner.sharded_sgd_step), n)
            if any(errors):
                raise_rank_error(errors, world, STEP_HINT, STEP_REVEAL, where=f"{n} ranks: ")
            facts[n] = results
        return facts
    return _once(learner, "10.sharded_step", compute)


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


def _near(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-6)


@step_ex.case("it returns the whole gradient's 2-norm, the same number on every rank (2 and 4 ranks)",
              hint=STEP_HINT, reveal=STEP_REVEAL, timeout=60)
def _(learner):
    facts = _step_facts(learner)
    for n, results in facts.items():
        slices = step_slices(n)
        truth = math.sqrt(sum(float(s.double().pow(2).sum()) for s in slices))
        local = [float(s.norm()) for s in slices]
        for rank, runs in enumerate(results):
            got = _as_float(runs[0]["norm"], n, rank)
            if _near(got, truth):
                continue
            _, buf = step_inputs(rank, n)
            if _near(got, local[rank]):
                raise Wrong(f"{n} ranks: rank {rank} returned {got:.4f}, the norm of its own slice (the local "
                            f"norm); the whole gradient's is {truth:.4f}. Clipped with the local norm, every rank "
                            f"scales its slice by a different coefficient and the step is not the unsharded one: "
                            f"combine the ranks' parts with one all-reduce", reveal=STEP_REVEAL)
            if _near(got, float(buf.norm())):
                raise Wrong(f"{n} ranks: rank {rank} took the norm of the whole buffer, slices it does not own "
                            f"included: those hold this rank's own unreduced gradients, not the mean. Use slice "
                            f"`rank` only, and combine the ranks' parts", reveal=STEP_REVEAL)
            if _near(got, sum(local)):
                raise Wrong(f"{n} ranks: {got:.4f} is the sum of the ranks' norms; norms do not add, squares do: "
                            f"all-reduce the sum of squares and take the square root of the total",
                            reveal=STEP_REVEAL)
            if _near(got, truth ** 2):
                raise Wrong(f"{n} ranks: {got:.4f} is the squared norm: take the square root of the all-reduced sum "
                            f"of squares", reveal=STEP_REVEAL)
            if _near(got, truth / n) or _near(got, math.sqrt(truth ** 2 / n)):
                raise Wrong(f"{n} ranks: {got:.4f} is the norm divided by N (or the mean of the squares): the slices "
                            f"are disjoint pieces of one gradient, so their squares add up, with no averaging",
                            reveal=STEP_REVEAL)
            raise AssertionError(f"{n} ranks: rank {rank} returned {got:.4f}, the whole gradient's norm is "
                                 f"{truth:.4f}")
    return "the global norm on every rank"


@step_ex.case("each rank steps only its own slice, by -lr x the gradient clipped with the global norm",
              hint=("clip as clip_grad_norm_ does, with the same coefficient on every rank; change only the slice "
                    "this rank owns"), reveal=STEP_REVEAL, timeout=60,
              after="it returns the whole gradient's 2-norm, the same number on every rank (2 and 4 ranks)")
def _(learner):
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
                                f"{raw:.1f}. Clipping only shrinks: the coefficient is min(1, max_norm / "
                                f"(norm + 1e-6))", reveal=STEP_REVEAL)
                if coef < 1 and _close(got[mine], p0 - STEP_LR * g, rtol=1e-4):
                    raise Wrong(f"max_norm={mx:g}, norm {truth:.2f}: the step is not clipped: scale the gradient "
                                f"by max_norm / (norm + 1e-6) when the norm exceeds max_norm", reveal=STEP_REVEAL)
                if _close(got[mine], p0 + STEP_LR * coef * g, rtol=1e-4):
                    raise Wrong("the step went uphill: SGD subtracts lr x gradient", reveal=STEP_REVEAL)
                if _close(got[mine], p0):
                    raise Wrong(f"{n} ranks: rank {rank}'s own slice did not change: update flat_params in place "
                                f"(its slice is a view: flat_params[a:b].add_(...))", reveal=STEP_REVEAL)
                raise AssertionError(f"{n} ranks, rank {rank}, max_norm={mx:g}: the slice after the step differs from "
                                     f"-lr x the clipped gradient")
    return "2 and 4 ranks, clipping active and inactive"


# =============================================================================================
# 10.gather_hook
# =============================================================================================
gather_ex = Exercise("10.gather_hook", uses=["ParamGather"], title="the all-gather, waited for by forward pre-hooks")

G_DIM, G_HIDDEN, G_LAYERS = 6, 10, 4
GATHER_HINT = ("launch() starts every layer's gather, in the order the forward needs them; just before layer i runs, "
               "a hook makes it current: wait for its gather, then copy the gathered values into its parameters")
GATHER_REVEAL = ("__init__: self.handles = [m.register_forward_pre_hook(lambda mod, args, i=i: self.wait_for(i)) "
                 "for i, m in enumerate(self.layers)]; launch: self.works = [dist.all_gather_single(f, m, "
                 "async_op=True) for f, m in zip(self.full, self.mine)]; wait_for(i): work = self.works[i]; if "
                 "work: work.wait(); self.works[i] = None; copy each view into its parameter under torch.no_grad()")


def _gather_models():
    from course.lib import TinyMLP

    return TinyMLP(dim=G_DIM, hidden=G_HIDDEN, layers=G_LAYERS, seed=0), [
        TinyMLP(dim=G_DIM, hidden=G_HIDDEN, layers=G_LAYERS, seed=s) for s in (1, 2)]


def _gather_rank(rank, world_size, world, cls):
    from course.lib import random_regression

    model, targets = _gather_models()
    layers = list(model.layers)
    g = cls(model)
    full_ptr = {t.data_ptr(): i for i, t in enumerate(getattr(g, "full", []))}
    for i, m in enumerate(layers):
        m.register_forward_pre_hook(lambda mod, args, i=i: world.note(rank, "forward", layer=i))
    world.take(rank)
    x, _ = random_regression(n=4, dim=G_DIM, seed=3)
    steps = []
    for target in targets:
        # What the sharded step left on this rank: its own slice of every layer's updated values.
        for i, (m, t) in enumerate(zip(layers, target.layers)):
            flat = torch.cat([p.detach().reshape(-1) for p in t.parameters()])
            size = g.mine[i].numel()
            padded = torch.zeros(size * world_size)
            padded[:flat.numel()] = flat
            g.mine[i].copy_(padded[rank * size:(rank + 1) * size])
        world.note(rank, "step")
        g.launch()
        with torch.no_grad():
            out = model(x)
            again = model(x)          # a forward with nothing in flight (an evaluation, say) runs as it is
        stale = [i for i, (m, t) in enumerate(zip(layers, target.layers))
                 if not all(torch.equal(a, b) for a, b in zip(m.parameters(), t.parameters()))]
        steps.append({"right": _close(out, target(x)), "again": _close(again, target(x)), "stale": stale,
                      "log": world.take(rank)})
    return {"steps": steps, "layers": len(layers), "ptr": full_ptr}


def _gather_facts(learner) -> dict:
    def compute():
        cls = learner.ParamGather
        results, errors, world = in_threads(functools.partial(_gather_rank, cls=cls), 2)
        if any(errors):
            raise_rank_error(errors, world, GATHER_HINT, GATHER_REVEAL)
        return results
    return _once(learner, "10.gather_hook", compute)


def _gather_layer(entry: dict, ptr: dict) -> int | None:
    return ptr.get(entry.get("ptr"))


@gather_ex.case("after launch() and a forward, every layer computes with the gathered values (2 ranks, 2 steps)",
                hint=GATHER_HINT, reveal=GATHER_REVEAL, timeout=60)
def _(learner):
    results = _gather_facts(learner)
    for rank, res in enumerate(results):
        for s, st in enumerate(res["steps"], 1):
            gathers = [e for e in st["log"] if e["event"] == "launch" and e["kind"] == "all_gather"]
            waited = {e["op"] for e in st["log"] if e["event"] == "wait"}
            if not gathers:
                raise Wrong(f"step {s}: launch() started no all-gather: each layer's updated slices are on "
                            f"different ranks until an all-gather brings them together", reveal=GATHER_REVEAL)
            if st["right"] and st["again"] and not st["stale"]:
                continue
            if st["stale"]:
                i = st["stale"][0]
                if not any(e["op"] in waited for e in gathers):
                    raise Wrong(f"step {s}: layer {i} ran with values that never arrived: an all-gather's output is "
                                f"only there once its work is waited for. Wait in the layer's pre-hook, then copy",
                                reveal=GATHER_REVEAL)
                raise Wrong(f"step {s}: rank {rank}'s layer {i} still holds its old parameters after the forward: "
                            f"once its gather is waited for, copy self.views[{i}] into the layer's parameters "
                            f"(under torch.no_grad())", reveal=GATHER_REVEAL)
            if st["right"] and not st["again"]:
                raise Wrong("a second forward with no gather in flight gave a different result: wait_for(i) must do "
                            "nothing when layer i has no pending gather (forget a work once it is waited for)",
                            reveal=GATHER_REVEAL)
            raise AssertionError(f"step {s}: the forward's output differs from the model with the updated values")
    return "2 steps, the updated parameters on both ranks"


@gather_ex.case("the gathers go out in forward order, and layer i waits for its own gather only, as it starts",
                hint="launch everything in launch(), first layer first; wait in each layer's own pre-hook",
                reveal=GATHER_REVEAL, timeout=60,
                after="after launch() and a forward, every layer computes with the gathered values (2 ranks, 2 steps)")
def _(learner):
    results = _gather_facts(learner)
    res = results[0]
    n_layers, ptr = res["layers"], res["ptr"]
    for s, st in enumerate(res["steps"], 1):
        log = st["log"]
        launches = [e for e in log if e["event"] == "launch" and e["kind"] == "all_gather"]
        first_forward = next(e["order"] for e in log if e["event"] == "forward")
        if any(e["order"] > first_forward for e in launches):
            raise Wrong("a gather was launched during the forward, in a pre-hook: it then starts only when its "
                        "layer is about to run, and the layer waits for the whole transfer. Launch every gather in "
                        "launch(), right after the step, so they travel while the earlier layers compute",
                        reveal=GATHER_REVEAL)
        order = [_gather_layer(e, ptr) for e in launches]
        if len(order) != n_layers or None in order:
            raise Wrong(f"{len(order)} all-gathers for {n_layers} layers: gather each layer's self.mine[i] into "
                        f"its self.full[i], one collective per layer", reveal=GATHER_REVEAL)
        if order != list(range(n_layers)):
            raise Wrong(f"the gathers went out in the order {order}: a link carries one transfer after the other, "
                        f"so the first layer's parameters arrive last and the forward waits for all of them. "
                        f"Launch in forward order: layer 0 first", reveal=GATHER_REVEAL)
        op_layer = {e["op"]: _gather_layer(e, ptr) for e in launches}
        seen: set[int] = set()
        for e in log:
            if e["event"] == "wait" and e["op"] in op_layer:
                seen.add(op_layer[e["op"]])
            if e["event"] == "forward" and not any(x["event"] == "forward" and x["layer"] == e["layer"]
                                                   and x["order"] < e["order"] for x in log):
                early = sorted(i for i in seen if i > e["layer"])
                if early:
                    which = "every gather" if len(early) == n_layers - 1 - e["layer"] else f"the gathers of layers {early}"
                    raise Wrong(f"step {s}: when layer {e['layer']} started, you had already waited for {which} of "
                                f"the layers after it: the forward then waits for all the parameters before it "
                                f"computes anything, and nothing overlaps. Wait in layer i's pre-hook for gather i "
                                f"only", reveal=GATHER_REVEAL)
                if e["layer"] not in seen:
                    raise AssertionError(f"layer {e['layer']} started before its gather was waited for")
    return f"{n_layers} gathers in forward order; layer i waited only for gather i"


# =============================================================================================
# The simulated link, and the reduce-scatter measured on it and on the bare loopback
# =============================================================================================
class WireLink:
    """A simulated full-duplex link of ``rate_mbit`` per rank, in wall-clock time (bandwidth only).

    Every collective and point-to-point transfer still runs for real (on the loopback); its work
    completes no earlier than the bytes this rank sends (or receives) would take on the link,
    queued after the transfers before it: all-reduce 2(N-1)/N x bytes, reduce-scatter and
    all-to-all (N-1)/N x bytes, all-gather (N-1)/N x the gathered bytes, isend/irecv the tensor.
    Not modelled: per-message latency (a ring's 2(N-1) steps each pay one), congestion, a
    switch, and the CPU a real NIC would save.

    Args:
        rate_mbit: the link's bandwidth in Mbit/s.
    """

    def __init__(self, rate_mbit: float):
        if rate_mbit <= 0:
            raise ValueError(f"rate_mbit must be > 0, got {rate_mbit}")
        self.rate_mbit = float(rate_mbit)
        self._free = {"tx": 0.0, "rx": 0.0}
        self._lock = threading.Lock()
        self._timer = None
        self.events: list[dict] = []      # kind, bytes, launch, done (simulated), for the timeline

    def seconds(self, wire_bytes: float) -> float:
        return wire_bytes * 8 / (self.rate_mbit * 1e6)

    def book(self, kind: str, tx: float, rx: float, nbytes: float) -> float:
        now = time.perf_counter()
        with self._lock:
            done = now
            for side, b in (("tx", tx), ("rx", rx)):
                if b:
                    start = max(now, self._free[side])
                    self._free[side] = start + self.seconds(b)
                    done = max(done, self._free[side])
            self.events.append({"kind": kind, "bytes": nbytes, "launch": now, "done": done,
                                "start": done - self.seconds(max(tx, rx))})
        return done

    def _wrap(self, kind: str, real: Callable, wire: Callable[..., tuple[float, float, float]]):
        from hfstream.tools.bench.link import _DelayedWork, _sleep_until, _Timer

        def call(*args, **kwargs):
            tx, rx, nbytes = wire(*args, **kwargs)
            done_at = self.book(kind, tx, rx, nbytes)
            async_op = kwargs.pop("async_op", None)
            if kind in ("send", "recv"):
                work = real(*args, **kwargs)
            else:
                work = real(*args, **kwargs, async_op=True)
            if async_op is False or (async_op is None and kind not in ("send", "recv")):
                work.wait()
                _sleep_until(done_at)
                return None
            if self._timer is None:
                self._timer = _Timer()
            delayed = torch.futures.Future()

            def on_real_done(fut, delayed=delayed, done_at=done_at):
                try:
                    value = fut.value()
                except Exception as exc:
                    delayed.set_exception(exc)
                    return
                self._timer.call_at(done_at, lambda: delayed.set_result(value))

            try:
                work.get_future().add_done_callback(on_real_done)
            except Exception:                 # p2p works have no future on gloo
                self._timer.call_at(done_at, lambda: delayed.set_result(None))
            return _DelayedWork(work, delayed, done_at)

        return call

    @contextlib.contextmanager
    def installed(self):
        """Inside the block: ``dist.all_reduce``, ``all_to_all_single``, ``all_gather_single`` (and
        ``_into_tensor``), ``isend``/``irecv``, and hfstream's all-gather, go through the link."""
        from hfstream.gradsync import collectives

        n = dist.get_world_size()
        size = lambda t: t.numel() * t.element_size()          # noqa: E731

        def ar(tensor, *a, **k):
            b = 2 * (n - 1) / n * size(tensor)
            return b, b, size(tensor)

        def a2a(output, input, *a, **k):
            b = (n - 1) / n * size(input)
            return b, b, size(input)

        def ag(output, input, *a, **k):
            b = (n - 1) / n * size(output)
            return b, b, size(output)

        def tx(tensor, *a, **k):
            return size(tensor), 0.0, size(tensor)

        def rx(tensor, *a, **k):
            return 0.0, size(tensor), size(tensor)

        names = {"all_reduce": ("all_reduce", ar), "all_to_all_single": ("all_to_all", a2a),
                 "all_gather_single": ("all_gather", ag), "all_gather_into_tensor": ("all_gather", ag),
                 "isend": ("send", tx), "irecv": ("recv", rx)}
        saved = [(mod, name, getattr(mod, name)) for mod in (dist, c10d) for name in names if hasattr(mod, name)]
        saved_gather = collectives.launch_all_gather
        for mod, name, fn in saved:
            kind, wire = names[name]
            setattr(mod, name, self._wrap(kind, fn, wire))
        gather = self._wrap("all_gather", lambda out, mine, group=None, async_op=True:
                            saved_gather(out, mine, group), ag)
        collectives.launch_all_gather = lambda out, mine, group: gather(out, mine, group, async_op=True)
        try:
            yield self
        finally:
            for mod, name, fn in saved:
                setattr(mod, name, fn)
            collectives.launch_all_gather = saved_gather


class _PreallocatedReduceScatter:
    """hfstream's gloo reduce-scatter (all-to-all + local sum) into buffers allocated once, as
    `GradSync(mode="sharded")` keeps them; also what the measurement uses while yours is a stub."""

    def __init__(self):
        self.buffers = {}

    def __call__(self, flat: torch.Tensor) -> torch.Tensor:
        from hfstream.gradsync import collectives

        n = dist.get_world_size()
        if flat.numel() not in self.buffers:
            self.buffers[flat.numel()] = (torch.empty_like(flat), torch.empty(flat.numel() // n, dtype=flat.dtype))
        received, out = self.buffers[flat.numel()]
        collectives.launch_reduce_scatter(flat, received, None, local_sum=True).wait()
        collectives.sum_received(received, out, n)
        return out.div_(n)


def _time(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _rs_measure_rank(rank, world_size, path, real_mib, sim_mib, rate_mbit, reps):
    from course.grading import load_module

    library = _PreallocatedReduceScatter()
    rs = load_module(path).reduce_scatter_mean if path else library
    out = {}
    for label, mib, link in (("loopback", real_mib, None), ("simulated", sim_mib, WireLink(rate_mbit))):
        flat = torch.randn(int(mib * MiB / 4) // world_size * world_size)
        buf = flat.clone()
        fns = {"all_reduce_ms": lambda: dist.all_reduce(buf.copy_(flat)), "reduce_scatter_ms": lambda: rs(flat),
               "preallocated_ms": lambda: library(flat)}
        with link.installed() if link else contextlib.nullcontext():
            for fn in fns.values():
                fn()                                             # warm-up: connections, buffers
            best = collections.defaultdict(list)
            for _ in range(2):                                   # alternate: a busy moment hits them all
                for key, fn in fns.items():
                    best[key].append(_time(fn, reps))
        out[label] = {key: min(v) for key, v in best.items()} | {"mib": mib}
    link = WireLink(rate_mbit)
    out["predicted"] = {"all_reduce_ms": link.seconds(2 * (world_size - 1) / world_size * sim_mib * MiB) * 1e3,
                        "reduce_scatter_ms": link.seconds((world_size - 1) / world_size * sim_mib * MiB) * 1e3}
    return out


def measure_reduce_scatter(namespace: dict, real_mib: float = 16.0, sim_mib: float = 4.0, rate_mbit: float = 1000.0,
                           reps: int = 3) -> dict:
    """The learner's reduce_scatter_mean against dist.all_reduce on 2 gloo ranks: on the bare loopback
    (real, unsimulated) and on a simulated ``rate_mbit`` link (`WireLink`)."""
    from hfstream.testing import run_on_ranks

    path = learner_reduce_scatter(namespace)
    out = run_on_ranks(_rs_measure_rank, 2, path, real_mib, sim_mib, rate_mbit, reps, timeout=120, pg_timeout_s=60)
    res = {k: {m: max(r[k][m] for r in out) for m in out[0][k]} for k in out[0]}
    res["who"] = "your reduce_scatter_mean" if path else "hfstream's reduce-scatter (yours is not written yet)"
    res["rate_mbit"] = rate_mbit
    return res


def rs_figure(m: dict, path) -> Path:
    """Two panels: the simulated link (with what its byte model predicts), and the real loopback."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.8, 3.4))
    left, right = fig.subplots(1, 2)
    sim, real, pred = m["simulated"], m["loopback"], m["predicted"]
    yours = m["who"].startswith("your")
    mine = "reduce-scatter\n(yours)" if yours else "reduce-scatter\n(hfstream's)"
    panels = ((left, sim, ["all_reduce_ms", "reduce_scatter_ms"],
               f"SIMULATED link: {m['rate_mbit']:.0f} Mbit/s, bandwidth only\n{sim['mib']:g} MiB, 2 gloo ranks; "
               f"black ticks: bytes / bandwidth"),
              (right, real, ["all_reduce_ms", "reduce_scatter_ms"] + (["preallocated_ms"] if yours else []),
               f"REAL loopback, not shaped, not simulated\n{real['mib']:g} MiB, 2 gloo ranks on this machine"))
    labels = {"all_reduce_ms": "all_reduce", "reduce_scatter_ms": mine,
              "preallocated_ms": "hfstream's\n(buffers reused)"}
    colors = {"all_reduce_ms": "#c44e52", "reduce_scatter_ms": "#4c72b0", "preallocated_ms": "#8172b2"}
    for ax, data, keys, title in panels:
        vals = [data[k] for k in keys]
        bars = ax.bar([labels[k] for k in keys], vals, color=[colors[k] for k in keys])
        ax.bar_label(bars, fmt="%.1f ms", fontsize=8)
        ax.set_title(title, fontsize=8)
        ax.set_ylabel("ms (median)")
        ax.tick_params(axis="x", labelsize=7)
        ax.set_ylim(0, max(vals) * 1.25)
    left.scatter([0, 1], [pred["all_reduce_ms"], pred["reduce_scatter_ms"]], marker="_", s=700, color="black",
                 zorder=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return Path(path)


# =============================================================================================
# The last figure: DDP's best vs overlap vs sharded vs the cross-step limit, measured
# =============================================================================================
def _block_names(model) -> dict[int, str]:
    """Modules to time in the forward: embeddings, each block, the final norm (GPT-2)."""
    out = {}
    for name, m in model.named_modules():
        if name in ("transformer.wte", "transformer.ln_f") or (name.startswith("transformer.h.") and name.count(".") == 2):
            out[id(m)] = name.replace("transformer.", "")
    return out


def _compute_step(model, ids, opt) -> tuple[float, float, float]:
    """One step with no communication at all: (forward, backward, clip + AdamW) in seconds."""
    t0 = time.perf_counter()
    loss = model(input_ids=ids, labels=ids).loss
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return t1 - t0, t2 - t1, time.perf_counter() - t2


def _modes_rank(rank, world_size, steps, rounds, comm_ratio, bucket_mb, layers, width):
    import transformers

    from course.lib import tiny_gpt2
    from hfstream.gradsync import GradSync

    transformers.logging.set_verbosity_error()
    ids = torch.randint(0, 257, (4, 64), generator=torch.Generator().manual_seed(100 + rank))

    def build():
        model = tiny_gpt2(layers=layers, width=width)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, foreach=True)

    # Size the link from a first look at the compute: one all-reduce of every gradient takes
    # comm_ratio x (forward + backward). The parts the formulas use are measured again below,
    # in the same rounds as the modes, so that a busy moment of the machine hits them all.
    model, opt = build()
    probe = [_compute_step(model, ids, opt) for _ in range(4)][1:]
    agreed = torch.tensor([statistics.median(p[0] + p[1] for p in probe)])
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    comm = comm_ratio * agreed.item()
    link = WireLink(2 * (world_size - 1) / world_size * grad_bytes * 8 / comm / 1e6)
    runs = {"compute": (model, opt, None)}
    for mode in ("overlap", "sharded"):
        model, opt = build()
        sync = GradSync(model, mode=mode, bucket_mb=bucket_mb)
        if mode == "sharded":
            opt = sync.shard_optimizer(opt)
        runs[mode] = (model, opt, sync)
    timeline = None
    steps_ms, parts = collections.defaultdict(list), collections.defaultdict(list)
    with link.installed():
        for round_ in range(rounds):                # blocks of consecutive steps, the modes taking turns
            for mode, (model, opt, sync) in runs.items():
                dist.barrier()
                if sync is None:
                    for _ in range(steps):
                        for k, v in zip(("forward", "backward", "optimizer"), _compute_step(model, ids, opt)):
                            parts[k].append(v * 1e3)
                    continue
                sync.wait_for_params()
                starts, marks = [], []
                record = mode == "sharded" and round_ == rounds - 1
                hooks = []
                if record:
                    names = _block_names(model)
                    for m in model.modules():
                        if id(m) in names:
                            hooks.append(m.register_forward_pre_hook(
                                lambda mod, args, name=names[id(m)]: marks.append((name, time.perf_counter()))))
                for i in range(steps + 2):
                    starts.append(time.perf_counter())
                    if record and i == steps:
                        link.events.clear()
                        marks.clear()
                    loss = model(input_ids=ids, labels=ids).loss
                    if record and i == steps:
                        marks.append(("backward", time.perf_counter()))
                    if record and i == steps + 1:
                        marks.append(("next forward end", time.perf_counter()))
                    loss.backward()
                    sync.finish()
                    sync.clip_grad_norm_(1.0)           # the global norm in "sharded", clip_grad_norm_ otherwise
                    if record and i == steps:
                        marks.append(("optimizer", time.perf_counter()))
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    if record and i == steps:
                        marks.append(("step end", time.perf_counter()))
                if record:
                    # The step recorded, up to the end of the next step's forward that waits for its gathers.
                    t0 = starts[steps]
                    timeline = {"marks": [(n, t - t0) for n, t in marks],
                                "transfers": [{**e, "launch": e["launch"] - t0, "start": e["start"] - t0,
                                               "done": e["done"] - t0} for e in link.events],
                                "next_step": starts[steps + 1] - t0}
                    for h in hooks:
                        h.remove()
                steps_ms[mode] += [(b - a) * 1e3 for a, b in zip(starts[1:-1], starts[2:])]
        for _, _, sync in runs.values():
            if sync is not None:
                sync.close()
    return {"parts": dict(parts), "comm_ms": comm * 1e3, "rate_mbit": link.rate_mbit, "grad_mib": grad_bytes / MiB,
            "steps_ms": dict(steps_ms), "timeline": timeline, "buckets": len(runs["sharded"][2].buckets)}


def measure_modes(steps: int = 3, rounds: int = 2, comm_ratio: float = 1.0, bucket_mb: float = 0.25,
                  layers: int = 4, width: int = 128) -> dict:
    """A tiny GPT-2 on 2 gloo ranks on a simulated link (`WireLink`) sized so that one all-reduce of
    every gradient takes about ``comm_ratio`` x (forward + backward): GradSync ``"overlap"`` and
    ``"sharded"`` measured; DDP's ceiling and the cross-step limit computed from forward, backward
    and optimizer measured without communication in the same rounds, and the link's all-reduce time."""
    from hfstream.testing import run_on_ranks

    out = run_on_ranks(_modes_rank, 2, steps, rounds, comm_ratio, bucket_mb, layers, width, timeout=150,
                       pg_timeout_s=60)
    n = len(out)
    f, b, o = (max(statistics.median(r["parts"][k]) for r in out) for k in ("forward", "backward", "optimizer"))
    c = out[0]["comm_ms"]
    step = {mode: statistics.median(max(x) for x in zip(*(r["steps_ms"][mode] for r in out)))
            for mode in out[0]["steps_ms"]}
    return {**{k: out[0][k] for k in ("comm_ms", "rate_mbit", "grad_mib", "timeline", "buckets")},
            "forward_ms": f, "backward_ms": b, "optimizer_ms": o, "world_size": n,
            "overlap_ms": step["overlap"], "sharded_ms": step["sharded"],
            "ddp_ceiling_ms": f + max(b, c) + o, "limit_ms": cross_step_limit(f, b, o / n, c)}


def modes_figure(m: dict, path) -> Path:
    """Four bars: DDP's ceiling and the cross-step limit (computed, light), overlap and sharded (measured)."""
    from matplotlib.figure import Figure

    bars = [("DDP's best\nfwd + max(bwd, comm) + opt", m["ddp_ceiling_ms"], "computed"),
            ("overlap", m["overlap_ms"], "measured"), ("sharded", m["sharded_ms"], "measured"),
            ("cross-step limit\nmax(fwd + bwd + opt/N, comm)", m["limit_ms"], "computed")]
    fig = Figure(figsize=(6.8, 3.5))
    ax = fig.subplots()
    style = {"computed": dict(color="#c9d6ea", edgecolor="#4c72b0", hatch="//"), "measured": dict(color="#4c72b0")}
    for kind in ("computed", "measured"):
        xs = [i for i, bar in enumerate(bars) if bar[2] == kind]
        drawn = ax.bar(xs, [bars[i][1] for i in xs], label=kind, **style[kind])
        ax.bar_label(drawn, fmt="%.1f ms", fontsize=8)
    ax.set_xticks(range(len(bars)), [bar[0] for bar in bars], fontsize=7)
    ax.set_ylim(0, max(bar[1] for bar in bars) * 1.18)
    ax.set_ylabel("ms per step (2 ranks)")
    ratio = m["comm_ms"] / (m["forward_ms"] + m["backward_ms"])
    ax.set_title(f"tiny GPT-2, 2 gloo ranks, SIMULATED {m['rate_mbit']:.0f} Mbit/s link: an all-reduce of all "
                 f"gradients\n= {m['comm_ms']:.0f} ms = {ratio:.2f} x (forward + backward); medians of a few steps",
                 fontsize=8)
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return Path(path)


def timeline_figure(m: dict, path) -> Path:
    """One sharded step on rank 0: compute phases and module starts above, transfers on the link below."""
    from matplotlib.figure import Figure

    tl = m["timeline"]
    fig = Figure(figsize=(7.6, 3.4))
    ax = fig.subplots()
    marks = tl["marks"]
    at = {n: t for n, t in marks if n in ("backward", "optimizer", "step end", "next forward end")}
    nxt = tl["next_step"]
    phases = [("forward", 0.0, at["backward"]), ("backward", at["backward"], at["optimizer"]),
              ("clip+step", at["optimizer"], at["step end"]), ("next forward", nxt, at["next forward end"])]
    colors = {"forward": "#55a868", "backward": "#4c72b0", "clip+step": "#8172b2", "next forward": "#8fd19e"}
    for name, a, b in phases:
        ax.barh(2, (b - a) * 1e3, left=a * 1e3, color=colors[name], height=0.6)
        ax.text((a + b) / 2 * 1e3, 2, name, ha="center", va="center", fontsize=7)
    for n, t in marks:
        if n not in at and (t <= at["backward"] or nxt <= t <= at["next forward end"]):
            ax.plot([t * 1e3, t * 1e3], [1.65, 2.35], color="black", linewidth=0.6)
    end = at["next forward end"]
    kinds = {"all_to_all": (1, "#dd8452", "reduce-scatter"), "all_gather": (0, "#c44e52", "all-gather"),
             "all_reduce": (1, "#999999", "all-reduce (norm)")}
    shown = set()
    for e in tl["transfers"]:
        row, color, label = kinds.get(e["kind"], (1, "#999999", e["kind"]))
        if e["bytes"] < 64 or e["launch"] > end:   # the clip's one-scalar all-reduce; the next backward's
            continue
        ax.barh(row, max((e["done"] - e["start"]) * 1e3, 0.2), left=e["start"] * 1e3, color=color, height=0.5,
                edgecolor="white", linewidth=0.5, label=None if label in shown else label)
        shown.add(label)
    ax.set_yticks([0, 1, 2], ["all-gathers\n(link)", "reduce-scatters\n(link)", "compute\n(rank 0)"], fontsize=7)
    ax.set_xlabel("ms from the start of the step (ticks on the forward: a block starts)")
    ax.set_title("one sharded step on a SIMULATED link: the gathers launched after the step travel under the "
                 "next forward", fontsize=8)
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return Path(path)


# =============================================================================================
# The Trainer: StreamTrainer(grad_sync="sharded"), 2 processes
# =============================================================================================
def _trainer_rank(rank, world_size, out_dir, grad_sync):
    import datasets
    import transformers

    from course.lib import tiny_gpt2
    from hfstream import StreamTrainer, StreamTrainingArguments

    transformers.logging.set_verbosity_error()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 257, (64, 32), generator=g)
    data = datasets.Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
    args = StreamTrainingArguments(output_dir=out_dir, grad_sync=grad_sync, max_steps=8, per_device_train_batch_size=4,
                                   learning_rate=1e-3, max_grad_norm=1.0, logging_steps=4, save_strategy="no",
                                   report_to=[], seed=0, use_cpu=True, disable_tqdm=True, dataloader_num_workers=0,
                                   prefetch_depth=0, lr_scheduler_type="constant")
    trainer = StreamTrainer(model=tiny_gpt2(layers=2, width=64), args=args, train_dataset=data)
    trainer.remove_callback(transformers.PrinterCallback)     # the notebook prints what matters
    trainer.train()
    state = trainer.optimizer.state
    state_numel = sum(v.numel() for s in state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim())
    return {"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
            "params": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
            "mode": getattr(trainer, "grad_sync_mode", grad_sync), "state_numel": state_numel,
            "model_numel": sum(p.numel() for p in trainer.model.parameters())}


def train_sharded(out_dir: str, grad_sync: str = "sharded") -> dict:
    """`StreamTrainer(grad_sync=...)` for 8 steps on 2 gloo processes; losses, replica agreement, optimizer state."""
    from hfstream.testing import run_on_ranks

    ranks = run_on_ranks(_trainer_rank, 2, out_dir, grad_sync, init_process_group=False, timeout=240)
    diff = max(float((ranks[0]["params"][k] - ranks[1]["params"][k]).abs().max()) for k in ranks[0]["params"])
    return {"losses": ranks[0]["losses"], "max_rank_difference": diff, "mode": ranks[0]["mode"],
            "state_numel": [r["state_numel"] for r in ranks], "model_numel": ranks[0]["model_numel"]}


# =============================================================================================
# On an accelerator: a torch.profiler trace of one sharded step
# =============================================================================================
def _profile_rank(rank, world_size, device, out_dir):
    import transformers

    from course.lib import tiny_gpt2
    from hfstream.gradsync import GradSync

    transformers.logging.set_verbosity_error()
    dev = torch.device(device)
    if dev.type != "cpu" and hasattr(torch, "accelerator"):
        torch.accelerator.set_device_index(0)
    model = tiny_gpt2(layers=4, width=128).to(dev)
    ids = torch.randint(0, 257, (8, 64), generator=torch.Generator().manual_seed(rank)).to(dev)
    sync = GradSync(model, mode="sharded", bucket_mb=0.25)
    opt = sync.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))

    def step(label):
        with torch.profiler.record_function(f"{label}: forward"):
            loss = model(input_ids=ids, labels=ids).loss
        with torch.profiler.record_function(f"{label}: backward"):
            loss.backward()
            sync.finish()
        with torch.profiler.record_function(f"{label}: clip + optimizer step"):
            sync.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)

    for i in range(3):
        step(f"warm-up {i}")
    activities = list(torch.profiler.supported_activities()) if rank == 0 else [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities) as prof:
        step("step")
        with torch.profiler.record_function("next step: forward"):
            model(input_ids=ids, labels=ids)
        if dev.type != "cpu":
            torch.accelerator.synchronize()
    sync.close()
    if rank != 0:
        return None
    path = Path(out_dir) / "sharded_step_rank0.json"
    prof.export_chrome_trace(str(path))
    spans = {}
    gathers = []
    for e in prof.events():
        name = e.name
        start, end = e.time_range.start / 1e3, e.time_range.end / 1e3
        if name in ("step: forward", "step: backward", "step: clip + optimizer step", "next step: forward"):
            spans[name] = (start, end)
        elif "all_gather" in name.lower() or "allgather" in name.lower():
            gathers.append((start, end, name))
    t0 = spans["step: forward"][0]
    step_end = spans["step: clip + optimizer step"][1]
    nxt = spans["next step: forward"]
    after = sorted(g for g in gathers if g[0] >= step_end - 1e-3)
    lines = [f"rank 0, ms from the step's start: forward {spans['step: forward'][0] - t0:.1f}-"
             f"{spans['step: forward'][1] - t0:.1f}, backward ...-{spans['step: backward'][1] - t0:.1f}, step ends "
             f"{step_end - t0:.1f}, next forward {nxt[0] - t0:.1f}-{nxt[1] - t0:.1f}"]
    if after:
        names = sorted({g[2] for g in after})
        lines.append(f"{len(after)} all-gather events after the step ({', '.join(names[:3])}): first starts "
                     f"{after[0][0] - t0:.1f}, last ends {max(g[1] for g in after) - t0:.1f}; "
                     f"{sum(g[1] > nxt[0] for g in after)} of them end after the next forward has begun")
    else:
        lines.append(f"no all-gather event after the step among {len(gathers)} all-gather events in the trace")
    return {"summary": "\n".join(lines), "trace": str(path)}


def profile_sharded_step(device: str, out_dir: str) -> dict:
    """One sharded step (and the next forward) of a tiny GPT-2 on 2 gloo ranks on ``device``, rank 0
    under ``torch.profiler``; returns a summary of where the all-gathers ran and the trace's path."""
    from hfstream.testing import RankFailure, run_on_ranks

    try:
        return run_on_ranks(_profile_rank, 2, device, out_dir, timeout=180, pg_timeout_s=60)[0]
    except RankFailure as exc:
        # Two ranks on one device need gloo to carry device tensors, which not every build does.
        last = [ln.strip() for ln in str(exc).splitlines() if ln.strip()][-1]
        return {"summary": f"the 2-rank sharded step on {device} did not run here (gloo with {device} tensors): "
                           f"{last}", "trace": None}
