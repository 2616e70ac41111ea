"""Ranks as threads: a fake ``torch.distributed`` that logs every launch, wait and byte sent.

Lesson 10's three exercises are graded in one process: `in_threads` runs each rank in a thread with
``torch.distributed``'s collectives replaced by an exchange between the threads (`ThreadWorld`).
It follows the documented semantics (a collective reads its input when it is launched and
writes its output when it is waited for, and until then the output holds garbage; every rank
must launch the same collectives in the same order) and it logs what each rank launched,
waited for and sent, in bytes. That is what lets a check name the mistake: which slice a rank
kept, whether the norm was all-reduced, whether a layer waited for another layer's gather. A
check takes milliseconds, so a learner can iterate, and a hang becomes an error after a few
seconds instead of a process-group timeout.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from course.grading import Wrong

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


class PeerFailed(RuntimeError):
    """A rank stopped waiting because a peer it waited for had raised (`ThreadWorld.fail_fast`)."""


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


def _garbage(output: torch.Tensor, async_op) -> None:
    """What an output holds between the launch of an asynchronous collective and its wait: not the
    result (on a real process group, whatever the transfer has written so far). NaN here, so that a
    read before the wait shows, and a check can say so."""
    if async_op and output.is_floating_point():
        output.fill_(float("nan"))


class ThreadWorld:
    """``world_size`` ranks in one process, one thread each; see the module docstring.

    Args:
        world_size: number of ranks.
        refuse: ``{name of a torch.distributed function: why}``: calling it raises (and is logged).
        timeout_s: how long a rank waits for its peers before it raises (instead of hanging).
        fail_fast: a rank that waits for a peer which has failed (`fail`) stops waiting at once and raises,
            instead of waiting out ``timeout_s``.
    """

    PATCHED = ("get_rank", "get_world_size", "is_initialized", "is_available", "get_backend", "barrier",
               "all_reduce", "all_to_all_single", "all_gather_single", "all_gather_into_tensor", "all_gather",
               "reduce_scatter_single", "reduce_scatter_tensor", "reduce_scatter", "broadcast",
               "isend", "irecv", "send", "recv", "batch_isend_irecv", "P2POp")

    def __init__(self, world_size: int, refuse: dict[str, str] | None = None, timeout_s: float = 8.0,
                 fail_fast: bool = False):
        self.n = world_size
        self.fail_fast = fail_fast
        self.failed: set[int] = set()       # ranks that raised (`fail`), for fail_fast
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
            entry = {"rank": rank, "event": event, "order": len(self.log), "t": time.perf_counter(), **extra}
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

    def fail(self, rank: int) -> None:
        """Rank ``rank`` raised: with fail_fast, its peers stop waiting for it."""
        with self.cv:
            self.failed.add(rank)
            self.cv.notify_all()

    def _wait_for(self, predicate, what: str):
        gone = lambda: self.fail_fast and bool(self.failed - {self.rank})      # noqa: E731
        if self.cv.wait_for(lambda: predicate() or gone(), timeout=self.timeout_s) and not predicate():
            raise PeerFailed(f"rank {self.rank} stopped waiting for {what}: rank {min(self.failed - {self.rank})} "
                             f"raised")
        if not predicate():
            raise RuntimeError(f"rank {self.rank} waited {self.timeout_s:.0f} s for {what}: every rank must make the "
                               f"same calls in the same order (a hang on a real process group)")

    # -- collectives ------------------------------------------------------------------------------
    def _collective(self, kind: str, payload, finish: Callable[[list], None], sent_bytes: float, tensor, async_op,
                    src=None):
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
            with torch.no_grad():       # a real process group writes into a parameter outside autograd too
                finish([got[r][1] for r in range(self.n)])

        op = _Op(self, me, kind, complete, sent_bytes, tensor)
        self.note(me, "launch", op, async_op=bool(async_op), src_ptr=None if src is None else src.data_ptr())
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

        _garbage(output, async_op)
        return self._collective("all_to_all_single", chunks, finish, sent, output, async_op, src=input)

    def all_gather_into_tensor(self, output_tensor, input_tensor, group=None, async_op=False):
        if output_tensor.numel() != self.n * input_tensor.numel():
            raise RuntimeError(f"all_gather: the output has {output_tensor.numel()} elements, it needs world size x "
                               f"input = {self.n} x {input_tensor.numel()}")
        nbytes = input_tensor.numel() * input_tensor.element_size()

        def finish(payloads):
            self._same_numel(payloads, "all_gather")
            output_tensor.copy_(torch.cat([p.reshape(-1) for p in payloads]).reshape(output_tensor.shape))

        payload = input_tensor.detach().clone()
        _garbage(output_tensor, async_op)
        return self._collective("all_gather", payload, finish, (self.n - 1) * nbytes, output_tensor, async_op,
                                src=input_tensor)

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


def run_ranks(fn: Callable, world_size: int, hint: str, reveal: str | None = None,
              refuse: dict[str, str] | None = None, where: str = "") -> list:
    """`in_threads`, then `raise_rank_error` if a rank raised: every rank's result."""
    results, errors, world = in_threads(fn, world_size, refuse)
    if any(errors):
        raise_rank_error(errors, world, hint, reveal, where=where)
    return results


def _unwaited(entries: list[dict]) -> list[dict]:
    waited = {e["op"] for e in entries if e["event"] == "wait"}
    return [e for e in entries if e["event"] == "launch" and e.get("async_op") and e["op"] not in waited
            and e["kind"] != "send"]


def _close(a: torch.Tensor, b: torch.Tensor, rtol: float = 1e-5) -> bool:
    a, b = a.detach().reshape(-1).double(), b.detach().reshape(-1).double()
    return a.shape == b.shape and bool(torch.allclose(a, b, rtol=rtol, atol=1e-6))



# Primitives an exercise refuses, and why (named when a rank calls one).
REFUSED = {
    "all_reduce": "you called dist.all_reduce: that is the whole all-reduce (reduce-scatter *and* all-gather), "
                  "twice the bytes, and what this exercise takes apart: a rank needs only its own slice of the "
                  "result, and the exercise names the primitives that can move just that",
    "reduce_scatter_single": "dist.reduce_scatter_single is the primitive you are building (and on gloo it costs a "
                             "whole all-reduce, docs/design.md section 7): the exercise names the primitives "
                             "allowed",
}
REFUSED["reduce_scatter_tensor"] = REFUSED["reduce_scatter"] = REFUSED["reduce_scatter_single"]
