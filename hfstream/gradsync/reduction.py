"""The seam between GradSync's lifecycle and the collective a mode uses: one strategy per mode.

`GradSync` (sync.py) owns what every mode shares: the hooks, the plan and its re-plans, the launch
order, bounded waits, statistics. How a ready bucket's gradients are combined across ranks is a
`Reduction`, chosen once in ``GradSync.__init__``:

    AllReduce           mode="overlap" (launched from the hooks) and "serial" (from finish()):
                        every rank ends with the whole mean gradient in ``.grad``
    ShardedReduction    mode="sharded" (`sharded.reduction`): reduce-scatter, so each rank ends with the
                        mean of its slice; it also shards the optimizer and all-gathers the
                        updated parameters after the step

GradSync calls a strategy at these points of a bucket's life, and nowhere else:

    planned(states, previous)   the buckets were (re)planned, between steps
    forward_started()           a training forward begins
    grad_ready(st, slot)        a parameter's gradient was accumulated (before it counts)
    prepare(st)                 the bucket is complete and about to be packed (compute stream)
    pack(st, stream)            gradients / N into the bucket's buffer (on the side stream, if any)
    launch(st) -> Work          the asynchronous collective
    reduced(st)                 it completed: write the result where the optimizer reads it
    all_reduced(ok)             every bucket of the step completed (ok) or the wait failed: finish
                                what needs them all
    close()

What a strategy needs of GradSync comes in one `Wiring`, never through GradSync's attributes.
The rest of the public surface (`clip_grad_norm_`, `shard_optimizer`, `wait_for_params`, ...)
has a whole-gradient meaning here and a sharded one in `sharded`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from .. import streams
from .bucket_state import BucketState
from .stats import StatsRecorder


@dataclass
class Wiring:
    """What GradSync shares with its strategy.

    Args:
        model: the hooked module.
        hooked: ``(name, parameter)`` of every parameter GradSync hooks, in registration order.
        group, world_size, rank: the data-parallel group.
        timeout_s: how long a wait may take before it raises.
        recorder: where communication timings go (`stats`).
        comm_streams: device -> the side stream collectives are issued on (accelerators only).
        note: says a note once (GradSync's ``notes`` and the log).
        abandoned: ``(buffer, work)`` of collectives that never completed: kept alive for good.
    """

    model: torch.nn.Module
    hooked: list[tuple[str, torch.nn.Parameter]]
    group: object
    world_size: int
    rank: int
    timeout_s: float
    recorder: StatsRecorder
    comm_streams: dict
    note: Callable[[str], None]
    abandoned: list = field(default_factory=list)


class Reduction:
    """The whole-gradient strategy's defaults; `AllReduce` and `sharded.ShardedReduction` implement it."""

    launch_from_hooks = True   # False: every bucket waits for finish() (mode="serial")
    accumulate = False         # sharded: a further backward adds its mean to the slices' (.grad does by itself)
    tune_whole_step = False    # bucket_mb="auto" scores whole steps: the cap changes forward and step too
    last_bucket_mb = None      # GradSync's default last_bucket_mb: None = no separate last bucket

    def __init__(self, wiring: Wiring):
        self.wiring = wiring
        self.states: list[BucketState] = []   # the current plan's buckets (set by `planned`)

    # -- the lifecycle -----------------------------------------------------------------------------
    def planned(self, states: list[BucketState], previous: list[BucketState] | None) -> None:
        self.states = states

    def forward_started(self) -> None:
        pass

    def grad_ready(self, st: BucketState, slot: int) -> None:
        pass

    def prepare(self, st: BucketState) -> None:
        pass

    def pack(self, st: BucketState, stream) -> None:
        raise NotImplementedError

    def launch(self, st: BucketState):
        raise NotImplementedError

    def reduced(self, st: BucketState) -> None:
        raise NotImplementedError

    def all_reduced(self, ok: bool) -> None:
        pass

    def close(self) -> None:
        pass

    def release(self, states: list[BucketState]) -> None:
        """Drop ``states``' wire buffers: at a re-plan, before the new plan allocates its own, and at close.

        After ``finish()`` every reduction has completed and its result is in ``.grad`` (or,
        sharded, in the shard's ``grad``), so the buffers the gradients travelled in (model-sized,
        padded) are not read again. Without this the old plan's and the new plan's wire buffers
        are both alive while the new one is built. Sharded: the shard's ``gathered`` (the
        parameters' storage), ``grad`` and ``master`` stay, the new shard copies the parameters
        from them and the optimizer state moves over.
        """
        for st in states:
            st.buffer, st.views = None, []

    # -- what the public API means with whole gradients ---------------------------------------------
    def shard_optimizer(self, optimizer, mode: str):
        raise ValueError(f"shard_optimizer() needs GradSync(model, mode='sharded'); this GradSync has "
                         f"mode={mode!r}, which all-reduces full gradients: step the optimizer as it is")

    def clip_grad_norm_(self, max_norm, norm_type, error_if_nonfinite, foreach) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_([p for _, p in self.wiring.hooked], max_norm, norm_type,
                                              error_if_nonfinite, foreach)

    def grad_norms(self) -> dict[str, torch.Tensor]:
        return {n: torch.linalg.vector_norm(p.grad) for n, p in self.wiring.hooked if p.grad is not None}

    def optimizer_state_dict(self, keep: bool = True) -> dict | None:
        raise RuntimeError("optimizer_state_dict() needs GradSync(mode='sharded') with several processes and "
                           "sync.shard_optimizer(optimizer) called; otherwise use optimizer.state_dict()")

    def wait_for_params(self) -> None:
        pass

    def gather_gradients(self) -> None:
        pass   # .grad is whole already

    def scatter_gradients(self) -> None:
        pass

    @property
    def params_pending(self) -> list[int]:
        return []


class AllReduce(Reduction):
    """``mode="overlap"``/``"serial"``: each bucket all-reduced in one flat buffer, the mean back in ``.grad``.

    A "used" flag per parameter travels at the end of the buffer: one that no rank used keeps
    ``.grad`` untouched (None stays None), one that some rank used gets the mean, as
    ``DistributedDataParallel(find_unused_parameters=True)``.
    """

    def __init__(self, wiring: Wiring, serial: bool):
        super().__init__(wiring)
        self.launch_from_hooks = not serial
        self._flagged: list[BucketState] = []   # completed buckets whose used flags are not read yet

    @staticmethod
    def _allocate(st: BucketState) -> None:
        st.buffer = torch.empty(st.plan.numel + len(st.params), dtype=st.wire_dtype, device=st.plan.device)
        st.views, offset = [], 0
        for p in st.params:
            st.views.append(st.buffer[offset:offset + p.numel()].view(p.shape))
            offset += p.numel()
        # DDP's gradient_as_bucket_view: where the wire has the gradient's dtype and layout, the
        # parameter's .grad becomes its slice of the buffer once packed, so the mean arrives in
        # .grad without a copy and the gradient is held once, not twice.
        st.as_view = [st.wire_dtype == p.dtype and p.is_contiguous() for p in st.params]

    @torch.no_grad()
    def pack(self, st: BucketState, stream) -> None:
        if st.buffer is None:
            self._allocate(st)
        world_size, as_view = self.wiring.world_size, st.as_view
        for slot, (p, dst) in enumerate(zip(st.params, st.views)):
            grad = p.grad
            if grad is None:
                st.used[slot] = False   # a gradient zeroed away (zero_grad after a diagnostic backward) is none
                dst.zero_()             # no gradient on this rank: it contributes zeros to the mean
                continue
            check_dense(grad, st, slot)
            if stream is not None:
                streams.record_stream(grad, stream)   # keep its memory until the side stream has read it
            if not st.used[slot] and grad.data_ptr() == dst.data_ptr():
                p.grad = grad = grad.clone()   # an old gradient, not this step's: it must stay as it is
            # Divide before the sum, in the gradient's precision: sum(g_r / N) is the mean, and
            # partial sums on a compressed wire stay within max_r |g_r|. One op per parameter that
            # scales while it copies (measured faster on CPU than a fused copy and a scaling pass).
            torch.div(grad, world_size, out=dst)
            if st.used[slot] and as_view[slot]:
                p.grad = dst   # the buffer holds it now; the separate gradient is freed
        write_used_flags(st.buffer[st.plan.numel:], st.used)

    def launch(self, st: BucketState):
        return dist.all_reduce(st.buffer, op=dist.ReduceOp.SUM, group=self.wiring.group, async_op=True)

    @torch.no_grad()
    def reduced(self, st: BucketState) -> None:
        if not all(st.used):
            # A bucket with a parameter unused here needs its flags on the host, a device sync:
            # such buckets wait for all_reduced(), which reads all their flags in one host read a
            # step (DDP reads its used map once per step too).
            self._flagged.append(st)
            return
        self._write_back(st, None)

    @torch.no_grad()
    def all_reduced(self, ok: bool) -> None:
        flagged, self._flagged = self._flagged, []
        if not ok or not flagged:
            return
        flags = torch.cat([st.buffer[st.plan.numel:] > 0 for st in flagged]).tolist()
        at = 0
        for st in flagged:
            self._write_back(st, flags[at:at + len(st.params)])
            at += len(st.params)

    def _write_back(self, st: BucketState, used_anywhere: list[bool] | None) -> None:
        # Read .grad now, not at launch: zero_grad(set_to_none=...) may have replaced it.
        grads, means = [], []
        for slot, (p, mean) in enumerate(zip(st.params, st.views)):
            if used_anywhere is not None and not used_anywhere[slot]:
                continue   # no rank used it: leave .grad untouched (None stays None), as DDP does
            if p.grad is not None and p.grad.data_ptr() == mean.data_ptr():
                continue   # .grad is the bucket's view: the mean is there already
            if p.grad is None and st.as_view[slot]:
                p.grad = mean
                continue
            if p.grad is None:
                p.grad = torch.empty_like(p)
            grads.append(p.grad)
            means.append(mean)
        if grads:
            torch._foreach_copy_(grads, means)   # one fused copy per bucket; casts back from a compressed wire


def write_used_flags(flags: torch.Tensor, used: list[bool]) -> None:
    """Each parameter's "used here" flag (1 or 0) into the tail of its bucket's buffer, without a host wait.

    On an accelerator the flags come from pinned host memory with ``non_blocking=True``: a copy
    from pageable memory is synchronous, so every bucket with a parameter unused on this rank
    would make the host wait for the stream. The pinned block comes from the caching host
    allocator, which does not hand it out again until the copy has completed (PyTorch docs:
    "CUDA semantics", pinned memory buffers).
    """
    if all(used):
        flags.fill_(1)
        return
    on_device = streams.is_accelerator(flags.device)
    host = torch.tensor([float(u) for u in used], dtype=flags.dtype, pin_memory=on_device)
    flags.copy_(host, non_blocking=on_device)


def check_dense(grad: torch.Tensor, st: BucketState, slot: int) -> None:
    if grad.is_sparse:
        raise RuntimeError(f"GradSync does not support sparse gradients ({st.plan.names[slot]!r})")
