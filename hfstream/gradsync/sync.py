"""GradSync: bucketed gradient all-reduce, launched from gradient hooks while backward still runs.

The idea is PyTorch DDP's reducer (Li et al., "PyTorch Distributed: Experiences on Accelerating
Data Parallel Training", VLDB 2020, section 3.2): backward produces gradients roughly in reverse
registration order, so group them into buckets (see `buckets.py`) and launch each bucket's
all-reduce *asynchronously* the moment its last gradient exists. The reduction of the last
layers' gradients then runs while backward computes the first layers' gradients, and only the
tail of the communication is left to wait for at the end. Unlike DDP this hooks the module in
place: there is no wrapper, so ``state_dict`` keys, ``save_pretrained`` and ``unwrap_model``
see the model exactly as before.

Where gradients leave and where they come back:

    _on_grad_ready   a parameter's gradient is accumulated (``register_post_accumulate_grad_hook``)
    _launch          every bucket that is complete is copied into its flat buffer, scaled by
                     1/world_size, and all-reduced with ``async_op=True`` -- in plan order only
    finish()         launches what is left, then waits for each bucket in turn and copies its
                     mean back into ``.grad`` while the later buckets are still on the wire

Two rules keep every rank's collectives matched, which is what stops a rank from hanging:
buckets are launched in the same (plan) order on every rank, even if a later bucket is complete
first; and every bucket is launched every synchronised step, even if a parameter got no
gradient on this rank (it then contributes what its ``.grad`` holds, or zeros).

    sync = GradSync(model, bucket_mb=25.0)        # broadcasts rank 0's weights, plans, hooks
                                                   # (bucket_mb="auto": tuned in the first steps, tune.py)
    for k, batch in enumerate(micro_batches):
        with sync.no_sync() if k < len(micro_batches) - 1 else contextlib.nullcontext():
            model(**batch).loss.backward()         # the last one launches buckets as it goes
    sync.finish()                                  # .grad is now the mean over ranks
    optimizer.step(); optimizer.zero_grad()
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import logging
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.distributed as dist
from torch.utils.weak import WeakIdKeyDictionary

from .. import streams
from .buckets import DDP_BUCKET_MB, Bucket, bucket_cap_bytes, plan_buckets
from .tune import CANDIDATES_MB, BucketTuner, TuningResult, distinct_candidates, log_choice

logger = logging.getLogger(__name__)

MODES = ("overlap", "serial")
STREAM_PRIORITIES = ("high", "normal")
COMM_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}
_BROADCAST_MB = 64.0   # chunk size of the coalesced broadcast at construction
DEFAULT_TIMEOUT_S = 1800.0       # torch's default process-group timeout

# Which GradSync hooks a parameter, so that a second one on the same model is refused instead of
# reducing every gradient twice. Keyed weakly by tensor identity (tensors compare elementwise),
# with weak values: it keeps nothing alive and changes nothing the model pickles or saves.
_OWNERS: WeakIdKeyDictionary = WeakIdKeyDictionary()


@dataclass
class SyncStats:
    """The last synchronised step's communication, as the step report and the timeline read it.

    Args:
        comm_busy_ms: time at least one reduction was in flight (union of the bucket spans).
        exposed_comm_ms: time ``finish()`` kept the caller waiting, from entering it until every
            reduction had completed (launching leftover buckets included; the buckets that
            complete earlier are copied back while the later ones are still in flight).
            On an accelerator: the time the compute stream stalled waiting, from events.
        num_collectives: all-reduces launched in that step (one per bucket).
        bucket_spans: ``(bucket index, launch time, finish time)`` in ``time.perf_counter()``
            seconds, in launch order. On an accelerator the span's length comes from device
            events and is placed at the host time the first bucket was launched.
    """

    comm_busy_ms: float = 0.0
    exposed_comm_ms: float = 0.0
    num_collectives: int = 0
    bucket_spans: list[tuple[int, float, float]] = field(default_factory=list)


class _BucketState:
    """One bucket at run time: its parameters, flat buffer, in-flight work and readiness."""

    def __init__(self, plan: Bucket, params: list[torch.nn.Parameter], wire_dtype: torch.dtype):
        self.plan, self.params, self.wire_dtype = plan, params, wire_dtype
        self.buffer: torch.Tensor | None = None   # allocated at first launch, then reused
        self.views: list[torch.Tensor] = []       # each parameter's slice of it, in its shape
        self.flags: torch.Tensor | None = None    # one "used" flag per parameter, after the gradients
        self.reset()

    def allocate(self) -> None:
        self.buffer = torch.empty(self.plan.numel + len(self.params), dtype=self.wire_dtype, device=self.plan.device)
        self.views, offset = [], 0
        for p in self.params:
            self.views.append(self.buffer[offset:offset + p.numel()].view(p.shape))
            offset += p.numel()
        self.flags = self.buffer[offset:]

    def reset(self) -> None:
        n = len(self.params)
        self.used = [False] * n    # got a gradient since the last finish() (no_sync steps too)
        self.ready = [False] * n   # got one in the current synchronised backward
        self.pending = n
        self.work = self.done = None
        self.launch_time = self.end_time = self.start_event = self.end_event = None


def union_length(spans: list[tuple[float, float]]) -> float:
    """Length of the union of ``[start, end]`` intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def _parse_comm_dtype(comm_dtype) -> torch.dtype | None:
    if comm_dtype is None or comm_dtype in (torch.bfloat16, torch.float16):
        return comm_dtype
    if isinstance(comm_dtype, str) and comm_dtype.lower() in COMM_DTYPES:
        return COMM_DTYPES[comm_dtype.lower()]
    raise ValueError(
        f"comm_dtype={comm_dtype!r} is not valid; accepted values: None (the gradients' own dtype), "
        f"'bf16' or torch.bfloat16, 'fp16' or torch.float16"
    )


class GradSync:
    """Average gradients over data-parallel ranks, overlapping the all-reduce with backward.

    Args:
        model: the module to hook, in place (no wrapper).
        bucket_mb: bucket cap in MiB, with DDP's meaning (``bucket_cap_mb``): a bucket is filled
            until it *reaches* the cap, so buckets hold at least the cap except the last one;
            a parameter is never split. 0 = one parameter per bucket, ``float('inf')`` = one
            bucket per (dtype, device). ``"auto"`` = tuned online: the first synchronised steps
            try caps from 0.25 MiB up to 32 MiB (those that cut this model differently), a
            warm-up and two scored steps each, stop once a cap is clearly slower than the best,
            and keep the fastest for the rest of training, the same on every rank (see
            `hfstream.gradsync.tune`; ``tuning`` shows the progress, ``tuning_result`` the choice).
        mode: ``"overlap"`` launches each bucket from the gradient hooks as soon as it is
            complete; ``"serial"`` communicates nothing during backward and reduces every bucket
            in ``finish()`` (the baseline that shows what overlap buys).
        process_group: the data-parallel group; None = the default group.
        comm_dtype: None sends gradients in their own dtype; ``"bf16"``/``"fp16"`` (or the torch
            dtypes) compress floating-point buckets on the wire. Each rank scales its gradient
            by 1/world_size in the gradient's own precision (fp32 for fp32 gradients), casts,
            the sum runs in ``comm_dtype``, and the result is cast back into ``.grad``. The mean
            then differs from the uncompressed one by a few roundings of ``comm_dtype`` (unit
            roundoff 2**-8 for bf16, 2**-11 for fp16; the tests allow 2**-6 and 2**-9 of each
            tensor's largest entry). Scaling before the cast keeps every partial sum within
            the largest single-rank gradient, so fp16 overflows only where a rank's own
            gradient would.
        comm_stream_priority: ``"high"`` or ``"normal"``: priority of the side stream on which
            an accelerator packs buckets and issues the collectives, so that packing is not
            queued behind backward kernels. NCCL runs its kernels on the process group's own
            stream, whose priority is fixed when the group is created
            (``ProcessGroupNCCL.Options(is_high_priority_stream=True)`` as ``pg_options``);
            GradSync does not create communicators of its own. No effect on CPU/gloo.
        first_bucket_mb: cap of the first bucket, the one holding the gradients backward
            produces first; None (default) = ``bucket_mb``. A smaller first bucket starts the
            first reduction earlier: DDP uses 1 MiB (``_DEFAULT_FIRST_BUCKET_BYTES``) when
            ``bucket_cap_mb`` is not given. It is off by default because on the CPU benchmark a
            1 MiB first bucket made steps slower at 25 MiB and changed nothing at 2 MiB (see
            docs/benchmarks.md); under ``bucket_mb="auto"`` it applies to every candidate.
        timeout: seconds ``finish()`` waits for the reductions before it raises, naming the
            buckets and parameters that did not complete (default 1800, torch's own default;
            the Trainer passes ``ddp_timeout``). Needed because on gloo a plain ``Work.wait()``
            on a peer that is alive but stopped (SIGSTOP, a debugger, a stuck data loader)
            never returns: measured, a stock 2-rank run with ``ddp_timeout=20`` still waited
            150 s later. NCCL enforces the group's timeout with its own watchdog, so there
            ``finish()`` keeps the non-blocking wait.

    Parameters without a gradient: a parameter whose hook did not fire in the synchronised
    backward still travels in its bucket, so all ranks launch the same collectives and none
    hangs. It contributes its current ``.grad`` (what accumulated under ``no_sync()``) or zeros.
    Its bucket cannot complete before ``finish()``, so it -- and, to keep the launch order equal
    on every rank, every later bucket -- is launched from ``finish()``. Each bucket also carries
    one "used" flag per parameter: after the reduction, a parameter that *no* rank used since the
    last ``finish()`` keeps its ``.grad`` untouched (None stays None, so the optimizer skips it,
    as it would without data parallelism); one that some rank used gets the mean, with zeros for
    the ranks that did not use it. Both match ``DistributedDataParallel(find_unused_parameters=True)``.

    Limits: construct GradSync after the model has its final device, dtype and frozen
    parameters (the plan and the hooks are made then; ``close()`` and construct again after a
    change). Buffers are broadcast once, at construction: unlike DDP's ``broadcast_buffers=True``
    they are not re-synchronised before every forward, so BatchNorm running statistics stay
    per rank (transformers rarely carry such buffers). A gradient that arrives after its bucket
    was launched (a second backward before ``finish()``; reentrant activation checkpointing with a
    parameter used in several checkpointed segments) raises instead of being lost: call
    ``finish()`` after each synchronised backward and use ``checkpoint(..., use_reentrant=False)``,
    which works in any hook order. Sparse gradients are not supported.

    Attributes:
        buckets: the plan, a list of `Bucket` (index, names, numel, nbytes, dtype, device).
        bucket_mb: the cap in use: the number given; under ``"auto"``, the string ``"auto"``
            while tuning and the chosen cap once tuning is over (25.0 with a single process,
            where nothing is tuned).
        tuning: while ``bucket_mb="auto"`` is being tuned, the `BucketTuner` (its step, the
            candidate on trial, the scores so far); None otherwise.
        tuning_result: once tuning is over, the `TuningResult` (chosen cap, score per candidate,
            steps taken); None without ``"auto"``.
        require_backward_grad_sync: False makes the hooks only record that a gradient arrived,
            as under ``no_sync()`` (the name DDP and Accelerate use).
        world_size: ranks in the group; 1 (or no process group) means GradSync does nothing.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        bucket_mb: float | str = DDP_BUCKET_MB,
        mode: str = "overlap",
        process_group: dist.ProcessGroup | None = None,
        comm_dtype: str | torch.dtype | None = None,
        comm_stream_priority: str = "high",
        first_bucket_mb: float | None = None,
        timeout: float | None = None,
    ):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if mode not in MODES:
            raise ValueError(f"mode={mode!r} is not valid; accepted values: 'overlap' (reduce during backward), "
                             f"'serial' (reduce everything in finish())")
        auto = isinstance(bucket_mb, str) and bucket_mb == "auto"
        if not auto:
            try:
                bucket_cap_bytes(bucket_mb)
            except ValueError as exc:
                raise ValueError(f"{exc}, or 'auto' (tuned online in the first steps)") from None
        if first_bucket_mb is not None:
            bucket_cap_bytes(first_bucket_mb, "first_bucket_mb")
        if comm_stream_priority not in STREAM_PRIORITIES:
            raise ValueError(f"comm_stream_priority={comm_stream_priority!r} is not valid; accepted values: "
                             f"'high', 'normal'")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0):
            raise ValueError(f"timeout={timeout!r} is not valid; give seconds > 0 (the Trainer passes ddp_timeout), "
                             f"or None for {DEFAULT_TIMEOUT_S:.0f} s")
        self.model, self.mode = model, mode
        self.timeout_s = float(timeout) if timeout is not None else DEFAULT_TIMEOUT_S
        self.first_bucket_mb = first_bucket_mb
        self._owned: list[torch.Tensor] = []
        self.comm_dtype = _parse_comm_dtype(comm_dtype)
        self.comm_stream_priority = comm_stream_priority
        self.require_backward_grad_sync = True

        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        for _, p in named:
            owner = _OWNERS.get(p)
            if owner is not None and owner() is not None:
                raise RuntimeError(
                    f"this model is already hooked by {owner()!r}; call close() on it (or leave its "
                    f"`with` block) before constructing another GradSync, or every gradient is reduced twice"
                )
        self._named = named

        if process_group is None and dist.is_available() and dist.is_initialized():
            process_group = dist.group.WORLD
        if process_group is not None and dist.get_rank(process_group) < 0:
            raise ValueError("process_group does not contain this rank; construct GradSync only on its members")
        self.process_group = process_group
        self.world_size = 1 if process_group is None else dist.get_world_size(process_group)
        self._active = self.world_size > 1
        self._handles: list = []
        self._states: list[_BucketState] = []
        self._where: list[tuple[_BucketState, int]] = []   # per hooked parameter: its bucket and slot
        self._streams: dict[torch.device, object] = {}
        self._lock = threading.Lock()   # hooks may run on several autograd device threads
        self._stats = SyncStats()
        self._pending_stats = None       # device events of the last step, resolved when read
        self._tuner: BucketTuner | None = None
        self.tuning_result: TuningResult | None = None
        self._score_start = None         # first synchronised hook of the step: (host time, event or None)

        self.bucket_mb: float | str
        if auto and self._active:
            # Every rank prunes the same candidates from the same model, so all agree on the
            # schedule without talking; only the final choice needs a collective (tune.py).
            caps, counts = distinct_candidates(self._plan_for, CANDIDATES_MB)
            self._tuner = BucketTuner(caps, counts, agree=self._slowest_rank)
            self.bucket_mb, self._planned_mb = "auto", self._tuner.current_mb
        else:
            self.bucket_mb = self._planned_mb = DDP_BUCKET_MB if auto else float(bucket_mb)
        self.buckets: list[Bucket] = self._plan_for(self._planned_mb)
        self._reset_step()
        if self._active:
            self._broadcast_from_rank0()
            self._build_states()
            for i, (_, p) in enumerate(named):
                # The hook knows the parameter's position only: _where maps it to its current
                # bucket, so re-planning (bucket_mb="auto") needs no new hooks.
                self._handles.append(p.register_post_accumulate_grad_hook(functools.partial(self._on_grad_ready, i)))
            self._hint_nccl_priority()
        self._owned = [p for _, p in named]
        for p in self._owned:
            _OWNERS[p] = weakref.ref(self)

    @property
    def tuning(self) -> BucketTuner | None:
        """The tuner while ``bucket_mb="auto"`` is still trying caps; None otherwise."""
        return self._tuner

    def _plan_for(self, cap_mb: float) -> list[Bucket]:
        return plan_buckets(self._named, cap_mb, self.first_bucket_mb)

    def _build_states(self) -> None:
        """Run-time state for ``self.buckets``; points every parameter's hook at its bucket."""
        index = {id(p): i for i, (_, p) in enumerate(self._named)}
        by_name = dict(self._named)
        self._states = []
        self._where = [None] * len(self._named)
        for plan in self.buckets:
            wire = self.comm_dtype if (self.comm_dtype is not None and plan.dtype.is_floating_point) else plan.dtype
            st = _BucketState(plan, [by_name[n] for n in plan.names], wire)
            self._states.append(st)
            for slot, p in enumerate(st.params):
                self._where[index[id(p)]] = (st, slot)
            if streams.is_accelerator(plan.device) and plan.device not in self._streams:
                self._streams[plan.device] = streams.new_stream(plan.device, self.comm_stream_priority)

    # -- construction ----------------------------------------------------------------------------
    @torch.no_grad()
    def _broadcast_from_rank0(self) -> None:
        # Every rank must start from the same weights: averaging gradients of different models
        # averages nonsense. Coalesced into a few flat chunks instead of one collective per tensor.
        tensors = [*self.model.named_parameters(), *self.model.named_buffers()]
        by_name = dict(tensors)
        src = dist.get_global_rank(self.process_group, 0)
        for chunk in plan_buckets(tensors, _BROADCAST_MB):
            members = [by_name[n] for n in chunk.names]
            flat = torch.cat([t.detach().reshape(-1) for t in members])
            dist.broadcast(flat, src=src, group=self.process_group)
            offset = 0
            for t in members:
                t.copy_(flat[offset:offset + t.numel()].view(t.shape))
                offset += t.numel()

    def _hint_nccl_priority(self) -> None:
        if self.comm_stream_priority != "high" or not self._streams:
            return
        try:
            if "nccl" not in str(dist.get_backend(self.process_group)):
                return
            device = next(iter(self._streams))
            high = self.process_group._get_backend(device).options.is_high_priority_stream
        except Exception:   # private accessor: a hint is not worth an error
            return
        if not high:
            logger.info("GradSync: NCCL kernels run on the process group's own stream at normal priority; "
                        "create the group with pg_options=ProcessGroupNCCL.Options(is_high_priority_stream=True) "
                        "to raise it (GradSync packs buckets on a high-priority stream either way)")

    # -- where gradients leave -------------------------------------------------------------------
    def _on_grad_ready(self, i: int, param: torch.Tensor) -> None:
        with self._lock:
            st, slot = self._where[i]
            if st.work is not None:
                # finish() would overwrite this contribution with the mean computed without it.
                raise RuntimeError(
                    f"GradSync: parameter {st.plan.names[slot]!r} received another gradient after its bucket "
                    f"{st.plan.index} was launched. Call finish() after every synchronised backward, run earlier "
                    f"backward passes under no_sync(), and use checkpoint(..., use_reentrant=False)"
                )
            st.used[slot] = True
            if not self.require_backward_grad_sync:
                return   # accumulation micro-step: the gradient just accumulates locally
            if not self._sync_pending:
                self._sync_pending = True
                if self._tuner is not None:
                    self._mark_score_start(param)
            if self.mode == "serial" or st.ready[slot]:
                return
            st.ready[slot] = True
            st.pending -= 1
            # Launch in plan order only: collectives are matched by the order they are issued, so a
            # bucket that completes early waits for the ones before it (they complete soon after).
            states = self._states
            while self._next < len(states) and states[self._next].pending == 0:
                self._launch(states[self._next])

    def _launch(self, st: _BucketState) -> None:
        device = st.plan.device
        stream = self._streams.get(device)
        if st.buffer is None:
            st.allocate()
        if stream is not None:
            # The gradients were written on the compute stream; the side stream must not read earlier.
            stream.wait_stream(streams.current_stream(device))
        with streams.use_stream(stream) if stream is not None else contextlib.nullcontext():
            self._pack(st, stream)
            if stream is not None:
                st.start_event = streams.new_event(device, enable_timing=True)
                st.start_event.record(stream)
            st.launch_time = time.perf_counter()
            st.work = dist.all_reduce(st.buffer, op=dist.ReduceOp.SUM, group=self.process_group, async_op=True)
            st.done = st.work.get_future().then(functools.partial(self._mark_done, st))
        self._launch_order.append(st.plan.index)
        self._next += 1

    @torch.no_grad()
    def _pack(self, st: _BucketState, stream) -> None:
        world_size = self.world_size
        for slot, (p, dst) in enumerate(zip(st.params, st.views)):
            grad = p.grad
            if grad is None:
                dst.zero_()   # no gradient on this rank: it contributes zeros to the mean
                continue
            if grad.is_sparse:
                raise RuntimeError(f"GradSync does not support sparse gradients ({st.plan.names[slot]!r})")
            if stream is not None:
                streams.record_stream(grad, stream)   # keep its memory until the side stream has read it
            # Divide before the sum, in the gradient's precision (fp32 for fp32 grads): sum(g_r / N)
            # is the mean, and partial sums on a compressed wire stay within max_r |g_r|. One op per
            # parameter that scales while it copies: on CPU it measured faster than one fused copy
            # (torch._foreach_copy_ or torch.cat) followed by a pass that scales the bucket.
            torch.div(grad, world_size, out=dst)
        if all(st.used):
            st.flags.fill_(1)
        else:
            st.flags.copy_(torch.tensor([float(u) for u in st.used], dtype=st.flags.dtype))

    def _mark_done(self, st: _BucketState, _fut) -> None:
        # Runs when the work completes (gloo: on its thread). On an accelerator the current stream
        # here is synchronised with the collective, so an event recorded on it marks its end.
        if st.start_event is not None:
            st.end_event = streams.new_event(st.plan.device, enable_timing=True)
            st.end_event.record(streams.current_stream(st.plan.device))
        else:
            st.end_time = time.perf_counter()

    # -- where gradients come back ---------------------------------------------------------------
    @torch.no_grad()
    def finish(self) -> None:
        """Launch the buckets not launched yet, wait for all, write the mean into ``.grad``.

        A no-op when no synchronised backward ran since the last call (before the first
        backward, twice in a row, or after a backward under ``no_sync()``).

        Raises:
            RuntimeError: when a reduction did not complete (typically a peer rank skipped the
                step and the process group's timeout expired), naming the buckets and parameters.
        """
        if not self._active or not self._sync_pending:
            return
        t_enter = time.perf_counter()
        waits = {}   # per device: (event before, event after) the compute stream waits for comm
        for d in self._streams:
            waits[d] = (streams.new_event(d, enable_timing=True), streams.new_event(d, enable_timing=True))
            waits[d][0].record(streams.current_stream(d))
        with self._lock:
            while self._next < len(self._states):
                self._launch(self._states[self._next])
        # Wait for the buckets in launch order and write each one back as soon as it is reduced:
        # copying bucket k back overlaps the reductions still on the wire, so only the last
        # bucket's copy is left after the last reduction.
        failed, error, t_done = [], None, t_enter
        deadline = None if self._backend_enforces_timeout() else time.monotonic() + self.timeout_s
        for st in self._states:
            try:
                if failed:
                    raise RuntimeError("not waited for: an earlier bucket failed")
                if deadline is None:
                    st.work.wait()
                else:
                    left = datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001))
                    if st.work.wait(timeout=left) is False:
                        raise RuntimeError(f"no result within timeout={self.timeout_s:.0f} s")
            except Exception as exc:   # a timeout, or a peer that died (connection closed)
                failed.append(st)
                error = error or exc
                continue
            if not failed:
                t_done = time.perf_counter()
                self._unpack(st)
        if failed:
            report = self.pending_report()
            self._reset_step()
            names = [n for st in failed for n in st.plan.names]
            shown = ", ".join(names[:8]) + (f", ... ({len(names)} in all)" if len(names) > 8 else "")
            raise RuntimeError(
                f"GradSync.finish() on rank {self.rank}: the all-reduce of bucket(s) {[st.plan.index for st in failed]} "
                f"did not complete (parameters: {shown}). A peer rank died, stopped, or did not launch the same "
                f"buckets in the same order within timeout={self.timeout_s:.0f} s: every rank must run the same "
                f"synchronised backward (outside no_sync()) and call finish(); .grad holds partial results. "
                f"Underlying error: {error}\n{report}"
            ) from error
        for st in self._states:
            st.done.wait()
        for d, stream in self._streams.items():
            # work.wait() already ordered the compute stream after each collective; this also
            # orders it after the packing, so the next step's writes to .grad cannot race it.
            streams.current_stream(d).wait_stream(stream)
            waits[d][1].record(streams.current_stream(d))
        self._record_stats(t_enter, t_done, waits)
        self._reset_step()
        if self._tuner is not None:
            self._tune_step()

    finish_gradient_synchronization = finish   # the name Accelerate/DDP users know

    @property
    def rank(self) -> int:
        return dist.get_rank(self.process_group) if self.process_group is not None else 0

    def _backend_enforces_timeout(self) -> bool:
        try:
            return "nccl" in str(dist.get_backend(self.process_group)).lower()
        except Exception:
            return False

    def pending_report(self) -> str:
        """What the current synchronised step still waits for, on this rank ("" when nothing).

        Buckets whose gradients are not all ready (with the parameters whose hook never fired),
        and buckets launched whose reduction has not completed. Safe to call from another
        thread (the Trainer's watchdog does).
        """
        if not self._active or not self._sync_pending:
            return ""
        lines = []
        for st in list(self._states):
            if st.work is None:
                waiting = [n for n, r in zip(st.plan.names, st.ready) if not r]
                if self.mode == "serial":
                    lines.append(f"  bucket {st.plan.index}: not launched (serial mode launches in finish())")
                else:
                    shown = ", ".join(waiting[:6]) + (f", ... ({len(waiting)} in all)" if len(waiting) > 6 else "")
                    lines.append(f"  bucket {st.plan.index}: never became ready; no gradient yet for {shown}")
            elif not st.work.is_completed():
                age = time.perf_counter() - st.launch_time if st.launch_time else float("nan")
                lines.append(f"  bucket {st.plan.index}: launched {age:.1f} s ago, reduction not complete "
                             f"(a peer has not launched it, or cannot)")
        if not lines:
            return ""
        return f"GradSync rank {self.rank}, launched so far {self._launch_order}:\n" + "\n".join(lines)

    def _unpack(self, st: _BucketState) -> None:
        used_anywhere = None
        if not all(st.used):
            # Only a bucket with a parameter unused here needs the flags on the host (a device sync).
            used_anywhere = (st.flags > 0).tolist()
        # Read .grad now, not at launch: zero_grad(set_to_none=...) may have replaced it.
        grads, means = [], []
        for slot, (p, mean) in enumerate(zip(st.params, st.views)):
            if used_anywhere is not None and not used_anywhere[slot]:
                continue   # no rank used it: leave .grad untouched (None stays None), as DDP does
            if p.grad is None:
                p.grad = torch.empty_like(p)
            grads.append(p.grad)
            means.append(mean)
        if grads:
            torch._foreach_copy_(grads, means)   # one fused copy per bucket; casts back from a compressed wire

    # -- bucket_mb="auto" -------------------------------------------------------------------------
    def _mark_score_start(self, param: torch.Tensor) -> None:
        event = None
        if streams.is_accelerator(param.device):
            event = streams.new_event(param.device, enable_timing=True)
            event.record(streams.current_stream(param.device))
        self._score_start = (time.perf_counter(), event, param.device)

    def _step_score_ms(self) -> float:
        """This step's tuning score: first synchronised gradient hook to the end of finish()."""
        start, event, device = self._score_start
        self._score_start = None
        if event is None:
            return (time.perf_counter() - start) * 1e3
        end = streams.new_event(device, enable_timing=True)
        end.record(streams.current_stream(device))
        end.synchronize()   # tuning steps only: the score must be known before the next step
        return event.elapsed_time(end)

    def _tune_step(self) -> None:
        """Between steps, on every rank alike: score the step, then move to the next cap or decide."""
        tuner = self._tuner
        tuner.observe(self._step_score_ms())
        if tuner.done:
            result = tuner.decide(broadcast=self._rank0_pick)
            self._tuner, self.tuning_result, self.bucket_mb = None, result, result.bucket_mb
            self._replan(result.bucket_mb)
            log_choice(result)
        elif tuner.current_mb != self._planned_mb:
            self._replan(tuner.current_mb)

    def _slowest_rank(self, score_ms: float) -> float:
        # On the gradients' device: the one device every backend of this group serves.
        t = torch.tensor([score_ms], dtype=torch.float64, device=self.buckets[0].device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.process_group)
        return t.item()

    def _rank0_pick(self, index: int) -> int:
        t = torch.tensor([index], dtype=torch.int64, device=self.buckets[0].device)
        dist.broadcast(t, src=dist.get_global_rank(self.process_group, 0), group=self.process_group)
        return int(t.item())

    def _replan(self, cap_mb: float) -> None:
        # Only between steps (nothing in flight, every mean written back) and to the same cap on
        # every rank. The hooks find the new buckets through _where; the old buffers are released.
        self._planned_mb = cap_mb
        plan = self._plan_for(cap_mb)
        if [b.names for b in plan] != [b.names for b in self.buckets]:
            self.buckets = plan
            self._build_states()
            self._reset_step()

    def _record_stats(self, t_enter: float, t_done: float, waits: dict) -> None:
        order = [self._states[i] for i in self._launch_order]
        self._pending_stats = ([(st.plan.index, st.plan.device, st.launch_time, st.end_time, st.start_event,
                                 st.end_event) for st in order], (t_done - t_enter) * 1e3, waits)
        if not self._streams:
            self._resolve_stats()   # host times only: nothing to wait for

    @property
    def stats(self) -> SyncStats:
        """The last synchronised step's `SyncStats` (on an accelerator, reading waits for its events)."""
        self._resolve_stats()
        return self._stats

    def _resolve_stats(self) -> None:
        if self._pending_stats is not None:
            launches, host_exposed_ms, waits = self._pending_stats
            self._pending_stats = None
            # Device spans are measured from the device's first start event and placed at the host
            # time of that first launch: lengths and gaps are device times, the anchor is the host's.
            anchors: dict[torch.device, tuple[float, object]] = {}
            spans = []
            for index, device, launched, ended, start, end in launches:
                if start is None:
                    spans.append((index, launched, ended))
                    continue
                end.synchronize()   # elapsed_time needs both events completed
                t0, ref = anchors.setdefault(device, (launched, start))
                spans.append((index, t0 + ref.elapsed_time(start) / 1e3, t0 + ref.elapsed_time(end) / 1e3))
            exposed = host_exposed_ms
            if waits:   # what the compute stream(s) spent waiting, not what the host spent queueing
                for _, after in waits.values():
                    after.synchronize()
                exposed = max(before.elapsed_time(after) for before, after in waits.values())
            self._stats = SyncStats(
                comm_busy_ms=union_length([(a, b) for _, a, b in spans]) * 1e3,
                exposed_comm_ms=exposed,
                num_collectives=len(spans),
                bucket_spans=spans,
            )

    # -- control ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Skip communication for backward passes inside the block; gradients accumulate locally."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def _reset_step(self) -> None:
        for st in self._states:
            st.reset()
        self._next = 0                  # next bucket to launch, in plan order
        self._launch_order: list[int] = []
        self._sync_pending = False      # a hook fired outside no_sync() since the last finish()

    def close(self) -> None:
        """Remove every hook and release the buffers; a new GradSync may then hook the model.

        Reductions still in flight are abandoned, not waited for (call ``finish()`` first).
        """
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for p in self._owned:
            owner = _OWNERS.get(p)
            if owner is not None and owner() is self:
                del _OWNERS[p]
        self._owned = []
        self._reset_step()
        for st in self._states:
            st.buffer, st.views, st.flags = None, [], None
        self._active = False

    def __enter__(self) -> "GradSync":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"GradSync(mode={self.mode!r}, world_size={self.world_size}, buckets={len(self.buckets)}, "
                f"bucket_mb={self.bucket_mb!r}, comm_dtype={self.comm_dtype}, active={self._active})")
