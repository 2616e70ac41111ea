"""GradSync: bucketed gradient reduction, launched from gradient hooks while backward still runs.

The idea is PyTorch DDP's reducer (Li et al., "PyTorch Distributed: Experiences on Accelerating
Data Parallel Training", VLDB 2020, section 3.2): backward produces gradients roughly in reverse
registration order, so group them into buckets (`buckets.py`) and launch each bucket's reduction
*asynchronously* the moment its last gradient exists; only the tail of the communication is left
to wait for at the end. Unlike DDP this hooks the module in place: there is no wrapper, so
``state_dict`` keys, ``save_pretrained`` and ``unwrap_model`` see the model exactly as before.

Where gradients leave and where they come back:

    _on_grad_ready   a parameter's gradient is accumulated (``register_post_accumulate_grad_hook``)
    _launch          every complete bucket is packed (gradient / world size into its flat buffer)
                     and reduced with ``async_op=True`` -- in plan order only
    finish()         launches what is left, then waits for each bucket in turn and writes its
                     result back while the later buckets are still on the wire

This file is the lifecycle every mode shares. What differs by mode -- how a bucket is packed,
which collective reduces it, where the result goes -- is a `reduction.Reduction` chosen once in
``__init__``: `reduction.AllReduce` for ``"overlap"``/``"serial"``, `sharded.ShardedReduction`
for ``"sharded"`` (docs/design.md sections 2 and 7). Two rules keep every rank's collectives
matched, which is what stops a rank from hanging: buckets launch in the same (plan) order on
every rank, and every bucket launches every synchronised step, even with no gradient here.

    sync = GradSync(model)                         # broadcasts rank 0's weights, plans, hooks
    for k, batch in enumerate(micro_batches):
        with sync.no_sync() if k < len(micro_batches) - 1 else contextlib.nullcontext():
            model(**batch).loss.backward()         # the last one launches buckets as it goes
    sync.finish()                                  # .grad is now the mean over ranks
    optimizer.step(); optimizer.zero_grad()

Beside this core: `planning` (which buckets, when they change), `bucket_state` (a bucket's
phase), `stats`, `faults` (bounded waits), `registry` (one GradSync per model), `broadcast`
(rank 0's weights), `comm_streams`, `options`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from typing import Iterator

import torch
import torch.distributed as dist

from .. import streams
from . import broadcast, faults, registry
from .sharded import optim as shard_optim
from .agreement import any_rank
from .broadcast import broadcast_from_rank0
from .bucket_state import BucketState, Phase
from .buckets import Bucket
from .comm_streams import CommStreams
from .eager import ModelHook, eager_hook
from .options import COMM_DTYPES, DEFAULT_BUCKET_MB, DEFAULT_TIMEOUT_S, Mode, check_arguments, comm_dtype_name
from .overlap_check import OverlapCheck
from .reduction import AllReduce, Reduction, Wiring
from .sharded.reduction import ShardedReduction
from .stats import StatsRecorder, SyncStats
from .planning import Planner
from .tune import BucketTuner, TuningResult

logger = logging.getLogger(__name__)


def _tensors(output) -> Iterator[torch.Tensor]:
    """The tensors of a forward's output (a tensor, or tuples, lists and dicts of them: ModelOutput)."""
    if isinstance(output, torch.Tensor):
        yield output
    elif isinstance(output, (tuple, list)):
        for o in output:
            yield from _tensors(o)
    elif isinstance(output, dict):
        for o in output.values():
            yield from _tensors(o)


def check_no_sparse_gradients(model: torch.nn.Module, hooked) -> None:
    """Refuse, before any forward, a trainable embedding that makes sparse gradients (``sparse=True``)."""
    trainable = {id(p) for _, p in hooked}
    for name, module in model.named_modules():
        if getattr(module, "sparse", False) is True and any(id(p) in trainable for p in module.parameters(recurse=False)):
            raise ValueError(
                f"GradSync: {name or type(module).__name__} ({type(module).__name__}(sparse=True)) makes sparse "
                f"gradients, which hfstream's buckets cannot carry. Use grad_sync='native' (DDP reduces sparse "
                f"gradients), or build the embedding with sparse=False")


class GradSync:
    """Average gradients over data-parallel ranks, overlapping the reduction with backward.

    Args:
        model: the module to hook, in place (no wrapper).
        bucket_mb: cap in MiB, DDP's ``bucket_cap_mb`` rule (a bucket is filled until it reaches the
            cap; a parameter is never split); 0 = one parameter each, ``inf`` = one bucket,
            ``"auto"`` (default) = tuned online, the same on every rank (`planning`).
        mode: ``"overlap"`` (launched from the hooks), ``"serial"`` (all in ``finish()``: the
            baseline), ``"sharded"`` (reduce-scatter; all-gather after the step of the optimizer
            `shard_optimizer` returns; docs/design.md section 7).
        process_group: the data-parallel group; None = the default group.
        comm_dtype: None, or ``"bf16"``/``"fp16"`` on the wire: each rank divides by the world size in
            the gradient's precision, the sum runs in ``comm_dtype``, the mean is cast back.
        comm_stream_priority: of the side stream collectives are issued on (`comm_streams`).
        first_bucket_mb: cap of the bucket backward fills first; None = ``bucket_mb``.
        last_bucket_mb: cap of the buckets backward fills last (its last ``bucket_mb`` worth),
            whose reduction is what is left after backward (`buckets`); None = the mode's
            default: 1 MiB in sharded mode, not cut otherwise (as DDP).
        timeout: seconds a wait may take before it raises, naming what did not complete (default
            1800, torch's; the Trainer passes ``ddp_timeout``; `faults`).
        broadcast_buffers: copy rank 0's buffers before a training forward that follows a
            synchronised one (DDP's option and rule, ``require_forward_param_sync``: the first
            micro-batch of each step); off by default here: they are broadcast once, at construction
            (the Trainer passes DDP's default, True, when ``ddp_broadcast_buffers`` is unset).

    A parameter whose hook did not fire still travels in its bucket (its ``.grad`` from
    ``no_sync()`` steps, or zeros), so every rank launches the same collectives; one frozen after
    construction is ready from the forward on and keeps ``.grad`` None. Construct GradSync after
    the model has its final device and dtype; a gradient that arrives after its bucket was
    launched raises (call ``finish()`` after each synchronised backward; use
    ``checkpoint(..., use_reentrant=False)``).

    Attributes:
        buckets: the plan, a list of `Bucket` (index, names, numel, nbytes, dtype, device).
        bucket_mb: the cap in use; under ``"auto"`` the string while tuning, then the chosen cap.
        reduction: the mode's strategy (`reduction.AllReduce` or `sharded.ShardedReduction`).
        require_backward_grad_sync: False makes the hooks only note that a gradient arrived, as
            under ``no_sync()`` (DDP's and Accelerate's name).
        world_size: ranks in the group; 1 (or no process group) means GradSync does nothing.
        notes: what was given up and why (e.g. "overlap lost ..."), each also logged once.
        closed: True after `close()`.
        follow_forwards: True (default): a training forward with gradients enabled takes part (the buffer
            broadcast before it, the promise of a synchronised backward after it), as a forward through
            DDP's wrapper does. The Trainer clears it outside its training step, so a probe forward that
            user code runs on one rank (a callback) issues no collective, as one that bypasses DDP's
            wrapper issues none.
        after_backward: None (default: the caller calls `finish()`), or a function GradSync calls at
            the end of every synchronised backward in which every parameter got its gradient, from
            the autograd engine's final callback (DDP's ``finalize_backward``): the Trainer finishes
            there, so code that runs between two backwards of one step reads the mean gradient.
    """

    def __init__(self, model: torch.nn.Module, bucket_mb: float | str = DEFAULT_BUCKET_MB, mode: str = "overlap",
                 process_group: dist.ProcessGroup | None = None, comm_dtype: str | torch.dtype | None = None,
                 comm_stream_priority: str = "high", first_bucket_mb: float | None = None,
                 timeout: float | None = None, broadcast_buffers: bool = False,
                 last_bucket_mb: float | None = None):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        check_arguments(mode, bucket_mb, first_bucket_mb, comm_stream_priority, timeout, last_bucket_mb)
        if not isinstance(broadcast_buffers, bool):
            raise TypeError(f"broadcast_buffers must be True or False, got {broadcast_buffers!r}")
        wire = comm_dtype_name(comm_dtype)
        self.model, self.mode = model, Mode(mode)
        self._bucket_mb = bucket_mb if bucket_mb == "auto" else float(bucket_mb)   # as asked (`cap_mb`: in use)
        self.timeout_s = float(timeout) if timeout is not None else DEFAULT_TIMEOUT_S
        self.first_bucket_mb = first_bucket_mb
        self.comm_dtype = COMM_DTYPES[wire] if wire is not None else None
        self.comm_stream_priority = comm_stream_priority
        self.broadcast_buffers = broadcast_buffers
        self.require_backward_grad_sync = True
        # DDP's require_forward_param_sync: whether the last training forward was a synchronised one
        # (True before the first); the buffers are broadcast before the forward that follows it.
        self._forward_param_sync = True
        self.follow_forwards = True
        self.after_backward = None
        self._end_queued = False   # after_backward is queued for this backward's end

        self._hooked = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        check_no_sparse_gradients(model, self._hooked)
        registry.claim(self, [p for _, p in self._hooked])   # raises if another GradSync hooks this model
        if process_group is None and dist.is_available() and dist.is_initialized():
            process_group = dist.group.WORLD
        if process_group is not None and dist.get_rank(process_group) < 0:
            raise ValueError("process_group does not contain this rank; construct GradSync only on its members")
        self.process_group = process_group
        self.world_size = 1 if process_group is None else dist.get_world_size(process_group)
        self._active = self.world_size > 1
        self.closed = False
        self.notes: list[str] = []              # what was given up, and why (said once, in the log too)
        self._handles: list = []
        self._states: list[BucketState] = []
        self._where: list[tuple[BucketState, int]] = []   # per hooked parameter: its bucket and slot
        self._comm_streams = CommStreams(comm_stream_priority)   # device -> side stream (accelerators)
        self._lock = threading.Lock()   # hooks may run on several autograd device threads
        self._recorder = StatsRecorder()
        self._wiring = Wiring(model, self._hooked, process_group, self.world_size, self.rank, self.timeout_s,
                              self._recorder, self._comm_streams, self._say)
        self.reduction: Reduction = (ShardedReduction(self._wiring) if self.mode is Mode.SHARDED
                                     else AllReduce(self._wiring, serial=self.mode is Mode.SERIAL))
        self.last_bucket_mb = self.reduction.last_bucket_mb if last_bucket_mb is None else last_bucket_mb
        self._planner = Planner(self._hooked, bucket_mb, first_bucket_mb, process_group if self._active else None,
                                tune_whole_step=self.reduction.tune_whole_step, last_bucket_mb=self.last_bucket_mb)
        self._steps = 0                         # synchronised steps finished
        self._overlap = OverlapCheck(self.mode)     # says once when reductions could not overlap backward
        self.buckets: list[Bucket] = self._planner.plan()
        self._reset_step()
        # The buffer broadcast's group (`buffer_group`): the gradients' own, or one of its own under sharded.
        self._buffer_group = process_group
        if self._active:
            broadcast_from_rank0(model, process_group)
            if self.mode is Mode.SHARDED and broadcast_buffers and any(True for _ in model.buffers()):
                self._buffer_group = broadcast.buffer_group(process_group, self._say)
            self._build_states(previous=None)
            for i, (_, p) in enumerate(self._hooked):
                # The hook knows the parameter's position only: _where maps it to its current
                # bucket, so re-planning (bucket_mb="auto") needs no new hooks.
                self._handles.append(p.register_post_accumulate_grad_hook(ModelHook(functools.partial(self._on_grad_ready, i))))
            # Never traced by torch.compile: it keeps Python state a compiled graph would freeze.
            self._handles.append(model.register_forward_pre_hook(eager_hook(self._on_forward)))
            self._handles.append(model.register_forward_hook(eager_hook(self._on_forward_output)))
            self._comm_streams.hint_nccl_priority(process_group)

    # -- what other modules may read -----------------------------------------------------------------
    @property
    def bucket_mb(self) -> float | str:
        """The cap asked for: MiB, or ``"auto"``. What is in use now is `cap_mb`; tuning, `tuning`."""
        return self._bucket_mb

    @property
    def cap_mb(self) -> float:
        """The cap of the buckets in use now, in MiB: under ``"auto"`` the candidate being tried, then the choice."""
        return self._planner.planned_mb

    @property
    def tuning(self) -> BucketTuner | None:
        """The tuner while ``bucket_mb="auto"`` is still trying caps; None otherwise."""
        return self._planner.tuning

    @property
    def tuning_result(self) -> TuningResult | None:
        """What ``bucket_mb="auto"`` chose, once it has."""
        return self._planner.tuning_result

    @property
    def broken(self) -> bool:
        """True once a collective failed to complete: it may still be in flight."""
        return bool(self._wiring.abandoned)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.process_group) if self.process_group is not None else 0

    @property
    def hooked_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """``(name, parameter)`` of every parameter GradSync averages, in registration order."""
        return list(self._hooked)

    @property
    def bucket_states(self) -> list[BucketState]:
        """The buckets at run time (buffers, phase), in plan order; empty with one process."""
        return list(self._states)

    def plan_for(self, bucket_mb: float) -> list[Bucket]:
        """The buckets GradSync would plan at cap ``bucket_mb`` now (same order and rules; nothing changes)."""
        return self._planner.plan(bucket_mb)

    def agree(self, *flags: bool) -> list[bool]:
        """Each flag OR-ed over the ranks (`agreement.any_rank`): a collective, at the same point on every rank."""
        return any_rank(flags, self.process_group if self._active else None, self._planner.device)

    def keep_plan(self) -> None:
        """Never re-plan in the order gradients arrive (the plan stays in registration order)."""
        self._planner.arrival.done = True

    def _say(self, note: str) -> None:
        if note not in self.notes:
            self.notes.append(note)
            logger.warning(note)

    # -- the plan ---------------------------------------------------------------------------------
    def _build_states(self, previous: list[BucketState] | None) -> None:
        """Run-time state for ``self.buckets``; points every parameter's hook at its bucket."""
        index = {id(p): i for i, (_, p) in enumerate(self._hooked)}
        by_name = dict(self._hooked)
        self._states, self._where = [], [None] * len(self._hooked)
        for plan in self.buckets:
            wire = self.comm_dtype if (self.comm_dtype is not None and plan.dtype.is_floating_point) else plan.dtype
            st = BucketState(plan, [by_name[n] for n in plan.names], wire)
            self._states.append(st)
            for slot, p in enumerate(st.params):
                self._where[index[id(p)]] = (st, slot)
            self._comm_streams.add(plan.device)
        self.reduction.planned(self._states, previous)

    def _replan(self, plan: list[Bucket]) -> None:
        # Only between steps (nothing in flight, every result written back) and to the same plan on
        # every rank. The hooks find the new buckets through _where; the old buffers are released.
        if [b.names for b in plan] != [b.names for b in self.buckets]:
            previous, self.buckets = self._states, plan
            self.reduction.release(previous)
            self._build_states(previous)
            self._reset_step()
            logger.info("GradSync: buckets re-planned (%d buckets, cap %s MiB)", len(plan), self._planner.planned_mb)

    # -- where gradients leave -------------------------------------------------------------------
    def _on_forward(self, module: torch.nn.Module, _args) -> None:
        if not (module.training and torch.is_grad_enabled() and self.follow_forwards):
            return
        self.reduction.forward_started()
        if self.require_backward_grad_sync:
            self._end_queued = False   # a backward that raised left its queued end unrun
            self._overlap.forward_time = time.perf_counter()
            # A synchronised forward promises a synchronised backward. If this rank's backward then
            # fires no hook (no parameter used on its batch), finish() must still launch every
            # bucket, or the peers wait for it until the timeout. DDP's forward prepares its
            # reducer the same way.
            with self._lock:
                self._sync_pending = True
                for i, (_, p) in enumerate(self._hooked):
                    if not p.requires_grad:   # frozen since: no hook will fire, its bucket need not wait
                        st, slot = self._where[i]
                        self._mark_ready(st, slot)
        if self.broadcast_buffers and self._forward_param_sync:
            broadcast_from_rank0(self.model, self._buffer_group, buffers_only=True)
        self._forward_param_sync = self.require_backward_grad_sync

    def _on_forward_output(self, module: torch.nn.Module, _args, output) -> None:
        # [Note: a backward's end] ``after_backward`` runs when the backward of this forward's output
        # ends, whether or not every parameter got a gradient in it (an MoE expert no token reached
        # on this rank): code after the backward then reads the mean, as after DDP's backward with
        # find_unused_parameters. The output's gradient arrives in the outermost graph task, so the
        # callback is not run by a nested one (reentrant checkpointing) while backward goes on.
        if not (self.after_backward is not None and module.training and torch.is_grad_enabled()
                and self.follow_forwards and self.require_backward_grad_sync):
            return
        for t in _tensors(output):
            if t.requires_grad:
                t.register_hook(self._output_grad)

    def _output_grad(self, _grad: torch.Tensor) -> None:
        self._queue_backward_end()

    def _on_grad_ready(self, i: int, param: torch.Tensor) -> None:
        with self._lock:
            st, slot = self._where[i]
            self.reduction.grad_ready(st, slot)
            if st.phase is Phase.REDUCING:
                # finish() would overwrite this contribution with the mean computed without it.
                raise RuntimeError(
                    f"GradSync: parameter {st.plan.names[slot]!r} received another gradient after its bucket "
                    f"{st.plan.index} was launched. Call finish() after every synchronised backward, run earlier "
                    f"backward passes under no_sync(), and use checkpoint(..., use_reentrant=False)")
            st.used[slot] = True
            if not self.require_backward_grad_sync:
                return   # accumulation micro-step: the gradient just accumulates locally
            self._sync_pending = True
            self._planner.gradient_arrived(i, param, first_of_step=self._overlap.hook())
            if not self._mark_ready(st, slot) or not self.reduction.launch_from_hooks:
                return
            # Launch in plan order only: collectives are matched by the order they are issued, so a
            # bucket that completes early waits for the ones before it (they complete soon after).
            states, t0 = self._states, time.perf_counter()
            while self._next < len(states) and states[self._next].pending == 0:
                self._launch(states[self._next])
            self._overlap.launching_s += time.perf_counter() - t0

    def _mark_ready(self, st: BucketState, slot: int) -> bool:
        """``st.mark_ready``; once every parameter is ready, ``after_backward`` is queued for backward's end."""
        if not st.mark_ready(slot):
            return False
        self._unready -= 1
        if self._unready == 0:
            self._queue_backward_end()
        return True

    def _queue_backward_end(self) -> None:
        """Run ``after_backward`` once this backward is over (once, however many ask)."""
        if self._end_queued or self.after_backward is None or torch._C._current_graph_task_id() == -1:
            return
        # DDP queues its finalize_backward the same way: run by the engine once this backward
        # (the graph task the hook fired in) is done, before backward() returns.
        self._end_queued = True
        torch.autograd.Variable._execution_engine.queue_callback(self._backward_ended)

    def _backward_ended(self) -> None:
        self._end_queued = False
        if self.after_backward is not None:
            self.after_backward()

    def _launch(self, st: BucketState) -> None:
        device = st.plan.device
        self.reduction.prepare(st)
        stream = self._comm_streams.get(device)
        if stream is not None:
            # The gradients were written on the compute stream; the side stream must not read earlier.
            stream.wait_stream(streams.current_stream(device))
        with streams.use_stream(stream) if stream is not None else contextlib.nullcontext():
            self.reduction.pack(st, stream)
            self._recorder.launched(st, stream)
            st.work = self.reduction.launch(st)
            st.move(Phase.REDUCING)
            st.done = st.work.get_future().then(functools.partial(self._recorder.completed, st))
        self._launch_order.append(st.plan.index)
        self._next += 1

    # -- where gradients come back ---------------------------------------------------------------
    @torch.no_grad()
    def finish(self) -> None:
        """Launch the buckets not launched yet, wait for all, write the result back.

        ``.grad`` is then the mean over ranks (mode="sharded": each rank holds its slices' mean;
        see `shard_optimizer`). A no-op when no synchronised backward ran since the last call.

        Raises:
            RuntimeError: when a reduction did not complete within ``timeout`` (a peer died,
                stopped or skipped the step), naming the buckets and parameters.
        """
        if not self._active or not self._sync_pending:
            return
        t_enter, waits = self._recorder.finish_entered(self._comm_streams)
        with self._lock:
            while self._next < len(self._states):
                self._launch(self._states[self._next])
        t_done = [t_enter]

        def write_back(st: BucketState) -> None:
            t_done[0] = time.perf_counter()
            self.reduction.reduced(st)
            st.move(Phase.COLLECTING)

        failed, error = faults.wait_in_order(self._states, self.timeout_s,
                                             faults.backend_enforces_timeout(self.process_group), write_back)
        self.reduction.all_reduced(ok=not failed)
        if failed:
            report = self.pending_report()
            # A collective that did not complete may still read or write its buffer (gloo's thread
            # waits on the peer): keep the buffers and the works alive for the life of this
            # process, or freeing them under it blocks the process at exit.
            self._wiring.abandoned.extend((st.buffer, st.work) for st in self._states if st.work is not None)
            self._reset_step()
            raise RuntimeError(faults.failure_message(self.rank, failed, self.timeout_s, error, report)) from error
        for st in self._states:
            st.done.wait()
        for d, stream in self._comm_streams.items():
            # work.wait() already ordered the compute stream after each collective; this also
            # orders it after the packing, so the next step's writes to .grad cannot race it.
            streams.current_stream(d).wait_stream(stream)
        self._recorder.finish_left([self._states[i] for i in self._launch_order], t_enter, t_done[0], waits)
        self._steps += 1
        if self._planner.arrival.done and self.reduction.launch_from_hooks:   # OverlapCheck says it once
            note = self._overlap.step_done(self._steps, self.buckets, self._recorder.launched_in_backward, t_enter)
            if note:
                self._say(note)
        self._reset_step()
        plan, _ = self._planner.step_finished()
        if plan is not None:
            self._replan(plan)

    finish_gradient_synchronization = finish   # the name Accelerate/DDP users know

    @property
    def sync_pending(self) -> bool:
        """Whether a synchronised forward or backward ran since the last `finish()` (finish() has work)."""
        return self._active and self._sync_pending

    # -- what happened, what is pending ----------------------------------------------------------
    @property
    def stats(self) -> SyncStats:
        """The last synchronised step's `SyncStats` (on an accelerator, reading waits for its events)."""
        return self._recorder.stats

    def stats_deferred(self):
        """A function that returns the last step's `SyncStats` when called, later (never makes the host wait now)."""
        return self._recorder.deferred()

    def pending_report(self) -> str:
        """What the current synchronised step still waits for, on this rank ("" when nothing); thread-safe."""
        if not self._active or not self._sync_pending:
            return ""
        return faults.pending_report(self.rank, self._states, self._launch_order,
                                     serial=not self.reduction.launch_from_hooks)

    # -- mode="sharded": the optimizer, clipping, complete parameters (`sharded`) --------------------
    def shard_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Make ``optimizer`` (over the model's parameters) hold and step this rank's slices; returns it.

        Converted in place (class, groups, hyperparameters and any state it has stay); its ``step()``
        launches the all-gathers. One sharded by a closed GradSync of the model is re-cut (`sharded.optim`).
        """
        return self.reduction.shard_optimizer(optimizer, self.mode)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                        foreach: bool | None = None) -> torch.Tensor:
        """After `finish()`: ``torch.nn.utils.clip_grad_norm_`` on the whole mean gradient; returns the norm."""
        norm_type = shard_optim.check_norm_type(norm_type)
        return self.reduction.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite, foreach)

    @property
    def accumulate(self) -> bool:
        """Whether the next synchronised backward adds its mean to the one held (FGM, SAM, sync_each_batch).

        ``.grad`` accumulates by itself under ``"overlap"``/``"serial"``; under ``"sharded"`` the
        slices hold the mean, and this says whether a further backward adds to them or replaces them.
        """
        return self.reduction.accumulate

    @accumulate.setter
    def accumulate(self, value: bool) -> None:
        self.reduction.accumulate = bool(value)

    def gather_gradients(self) -> None:
        """After `finish()`: every hooked parameter's ``.grad`` holds the whole mean gradient.

        ``mode="sharded"``: gathered from every rank's slices (a collective, every rank calls it);
        otherwise nothing to do (``.grad`` is whole already).
        """
        self.reduction.gather_gradients()

    def scatter_gradients(self) -> None:
        """After `gather_gradients()` and code that changed ``.grad``: the slices take ``.grad`` as it is now.

        ``mode="sharded"`` only (no collective); otherwise nothing to do.
        """
        self.reduction.scatter_gradients()

    def grad_norms(self) -> dict[str, torch.Tensor]:
        """After `finish()`: each parameter's mean-gradient 2-norm, by name (under sharded: one small all-reduce)."""
        return self.reduction.grad_norms()

    def optimizer_state_dict(self, keep: bool = True) -> dict | None:
        """``mode="sharded"``: the unsharded optimizer's layout-free ``state_dict()`` (a collective; `sharded.state`)."""
        return self.reduction.optimizer_state_dict(keep)

    def wait_for_params(self) -> None:
        """``mode="sharded"``: wait for the all-gathers since the last step (forwards and ``state_dict`` do by themselves)."""
        self.reduction.wait_for_params()

    @property
    def params_pending(self) -> list[int]:
        """Buckets whose updated parameters have not reached the model yet (``mode="sharded"``)."""
        return self.reduction.params_pending

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
        self._sync_pending = False      # a synchronised forward or hook since the last finish()
        self._unready = len(self._hooked)   # parameters not ready in this synchronised backward
        self._overlap.reset()

    def close(self) -> None:
        """Remove every hook and release the buffers; a new GradSync may then hook the model.

        Reductions still in flight are abandoned, not waited for (call ``finish()`` first).
        """
        self.reduction.close()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        registry.release(self, [p for _, p in self._hooked])
        self._reset_step()
        self.reduction.release(self._states)
        self._active = False
        self.closed = True
        # Let go of the group (the bucket tuner holds it too): a gloo group keeps its worker threads
        # until its last reference is gone, and threads still alive when the interpreter's teardown
        # begins can abort the process (see hfstream.trainer.clean_exit).
        self.process_group, self._wiring.group, self._buffer_group = None, None, None
        self._planner.close()

    def __enter__(self) -> "GradSync":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"GradSync(mode={self.mode!r}, world_size={self.world_size}, buckets={len(self.buckets)}, "
                f"bucket_mb={self.bucket_mb!r}, comm_dtype={self.comm_dtype}, active={self._active})")
