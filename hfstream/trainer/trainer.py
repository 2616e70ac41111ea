"""`StreamTrainerMixin`: the Trainer behaviour of hfstream, in a few well-named overrides.

Where data enters, moves to the device, where gradients leave and come back:
    get_train_dataloader  the loader Accelerate prepared, with device placement handed to the
                          prefetcher (so set_epoch, skip_first_batches, resumption keep working)
    get_batch_samples     pulls batches through a `StreamPrefetcher` that stays ``prefetch_depth``
                          batches ahead, across gradient-accumulation boundaries; Accelerate's
                          end_of_dataloader/remainder still follow the loop, not the prefetcher
    _wrap_model           under grad_sync "overlap"/"serial": Accelerate prepares the model for
                          autocast and placement but not for DDP, and `GradSync` hooks it in place
    training_step         tells GradSync whether this micro-step syncs; after the syncing
                          micro-step's backward, `finish()` waits for the reductions, so clipping
                          and the optimizer always see fully averaged gradients
Around them:
    train                 refuses what would fail late; watches every phase for a stopped peer;
                          at the end closes what it opened (prefetcher, GradSync, hooks), so a
                          second train() or a second trainer on the same model starts clean
    _maybe_log_save_evaluate  the optimizer step is over: close its timeline record
    prediction_step       evaluation during training is progress too (the watchdog)
    log                   adds the step breakdown to what the reporters get, not to the state

`StreamTrainer` is this mixin over `transformers.Trainer`; an existing subclass adopts it with
``class MyTrainer(StreamTrainerMixin, TheirTrainer)``.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import math
import os
import time
from typing import Any

import torch
from accelerate.utils import gather_object
from transformers import Trainer

from .args import StreamTrainingArguments
from .combined_args import default_stream_args
from .clean_exit import release_at_exit
from ..gradsync.eager import ModelHook
from ..gradsync.options import Mode
from .data_parallel import gradient_group, model_is_tensor_parallel, resolve_grad_sync
from ..log import notice, show_hfstream_logs
from .loader_state import LoaderView, restore_loader_state, tag_loader_state
from ..report.fields import KEYS as REPORT_KEYS
from ..report.timeline import StepTimeline, StreamReport, combine_ranks

logger = logging.getLogger(__name__)

def _synchronising(training_step):
    """``training_step`` run inside `StreamTrainerMixin._stream_training_step` (the synchronising window)."""
    @functools.wraps(training_step)
    def step(self, model, inputs, *args, **kwargs):
        return self._stream_training_step(training_step, model, inputs, *args, **kwargs)
    step._hfstream_window = True
    return step


class StreamTrainerMixin:
    """Prefetching, overlapped gradient sync and the step report for any `Trainer` subclass.

    Put it first in the bases: ``class MyTrainer(StreamTrainerMixin, Trainer)``. Needs
    `StreamTrainingArguments`; with ``prefetch_depth=0, grad_sync="native"`` it trains exactly
    like the class it is mixed into.
    """

    TIMELINE_STEPS = 4   # steps of spans each rank keeps in the report, for the timeline figure

    def __init__(self, *args: Any, **kwargs: Any):
        args, kwargs = default_stream_args(type(self), StreamTrainerMixin, args, kwargs)
        super().__init__(*args, **kwargs)
        if not isinstance(self.args, StreamTrainingArguments):
            given = type(self.args)
            fix = ("replace TrainingArguments with hfstream.StreamTrainingArguments (same fields, plus hfstream's)"
                   if given.__name__ == "TrainingArguments" else
                   f"build them with hfstream.stream_arguments({given.__name__})(...), which is {given.__name__} "
                   f"plus hfstream's fields")
            raise TypeError(f"{type(self).__name__} needs hfstream's arguments, got {given.__name__}: {fix}.")
        show_hfstream_logs(self.args.get_process_log_level())
        self.grad_sync_mode = resolve_grad_sync(self.args, self.accelerator, self._model_is_tensor_parallel())
        self._grad_group = None   # the gradient collectives' process group, once created (NCCL only)
        self.grad_sync = None                    # a GradSync once training prepared the model
        self._prefetcher = None
        self._prefetch_source = None
        self._prefetch_iter = None
        self._loader_view = LoaderView()
        self._timeline = (StepTimeline(self.args.device, rank=self.args.process_index)
                          if self.args.stream_report else None)
        self._last_logged_step = 0
        self._report = StreamReport()
        self._forward_hook = None
        self._watchdog = None
        self._loader_collectives = False   # the train loader broadcasts batches (DataLoaderDispatcher)
        self._notes: list[str] = []        # what was given up this run, and why (logged once each)
        self._reads_before_forward: list[str] | None = None   # sharded: what compute_loss reads first (once seen)
        # What set the optimizer, in the user's terms (an error names it): optimizers=, or optim=.
        self._optimizer_origin = (f"optimizers=({type(self.optimizer).__name__}(...), ...)" if self.optimizer is not None
                                  else f"optimizer_cls_and_kwargs=({self.optimizer_cls_and_kwargs[0].__name__}, ...)"
                                  if getattr(self, "optimizer_cls_and_kwargs", None) is not None
                                  else f"optim={getattr(self.args.optim, 'value', self.args.optim)!r}")
        self._in_training_step = False   # inside the outermost training_step call (its window)
        self._backwards = 0              # synchronising backwards finished in the current window
        self._whole_in_window = False    # sharded: .grad holds the whole mean gradient in this window
        # The first class (other than this mixin and Trainer) whose training_step runs: user code
        # that may read .grad or run several backwards (None: the Trainer's own step only).
        self._user_training_step = _own_training_step(type(self))
        self._reads_gradients: bool | None = None   # sharded: whether that step reads .grad (first step watched)
        self._gradient_reads = None                 # the first step's watch, while it runs
        self._step_began = True   # sharded: the next synchronising backward is an optimizer step's first
        from .sharded import CallbackGuard

        CallbackGuard(self.callback_handler, lambda: self.grad_sync if self._zero1_optimizer else None,
                      self._note).install()
        # save_async (the checkpoint section below): the save in flight, the staging run dir while the
        # stock save runs into it, the host buffers snapshots reuse, and the seconds the saves cost:
        # ``exposed_s`` is what the training thread spent on them (the whole save when blocking; snapshot,
        # waits and renames when async), ``write_s`` what the writer spent behind training, ``drain_s`` the
        # wait for the last write at the end of train() (no step left to hide it behind).
        self._save_in_flight = None
        self._staging_run_dir: str | None = None
        self._snapshot_buffers = None
        self._save_group = None           # save_async: the gloo group its flags are OR-ed over (world > 1)
        self._snapshot_copied = None   # what ends the last snapshot's copies (a CUDA event, `HostCopies`), until waited
        self._snapshot_waits_at_step_start = False   # the next step may change what they copy before its optimizer step
        self.save_times = {"saves": 0, "exposed_s": 0.0, "snapshot_s": 0.0, "wait_s": 0.0, "commit_s": 0.0,
                           "write_s": 0.0, "drain_s": 0.0, "copy_wait_s": 0.0, "held_bytes": 0, "new_bytes": 0}
        self._save_exposed_logged = 0.0   # exposed_s already in a log line

    # -- before training: refuse what would fail late or hang ----------------------------------------
    def train(self, resume_from_checkpoint=None, *args: Any, **kwargs: Any):
        """`Trainer.train`, after checking what would otherwise fail deep inside it.

        Refuses a model with no trainable parameter and a truncated or corrupt checkpoint (see
        `hfstream.trainer.checkpoint`) with errors that say what to do instead.
        """
        model = self.model
        if model is not None and not any(p.requires_grad for p in model.parameters()):
            raise ValueError(
                "the model has no trainable parameters (every requires_grad is False): train() would have nothing "
                "to update. Unfreeze what should learn (e.g. model.requires_grad_(True), or a PEFT adapter), or "
                "call evaluate()/predict() instead."
            )
        if resume_from_checkpoint:
            from transformers.trainer_utils import get_last_checkpoint

            from .checkpoint import check_checkpoint

            path = resume_from_checkpoint
            if resume_from_checkpoint is True:
                # Where to resume decides every later collective (the first step, the data skipped): the
                # ranks take the main process's last checkpoint. Each rank's own listing can differ:
                # rank 0 still writing or rotating the checkpoint its last step saved, another node's
                # stale view of a shared folder. Stock lists on each rank: a hang where they differ.
                path = self._main_process_value(get_last_checkpoint(self.args.output_dir))
                if path is None:   # the Trainer's own message, on every rank
                    raise ValueError(f"No valid checkpoint found in output directory ({self.args.output_dir})")
                resume_from_checkpoint = path
            if os.path.isdir(path):   # a missing one gets the Trainer's own message
                check_checkpoint(path)
        self._watch("starting train() (preparing the model, the first collectives)")
        self._start_save_async()
        self._train_began = time.perf_counter()   # the run's time, for the saves' share of it (the report)
        try:
            output = super().train(resume_from_checkpoint, *args, **kwargs)
        except BaseException:
            self._end_training(gather_report=False)   # peers may be gone: no collective now
            raise
        self._end_training(gather_report=True)
        return output

    def _main_process_value(self, value):
        """``value`` as the main process has it, on every rank (a collective: call it where every rank does)."""
        if self.args.world_size == 1:
            return value
        import torch.distributed as dist

        box = [value]
        dist.broadcast_object_list(box, src=0, device=self.args.device)
        return box[0]

    def _end_training(self, gather_report: bool) -> None:
        """Close what train() opened, so the model is as it was: no hooks, no thread, no old trainer."""
        if gather_report:
            self._watch("gathering the step report at the end of train()")
            self._gather_report()
        self._close_watchdog()
        self._close_prefetcher()
        self._release_snapshot_buffers()
        if self._forward_hook is not None:
            self._forward_hook.remove()
            self._forward_hook = None
        if self.grad_sync is not None and not self.grad_sync.broken:
            # After a reduction that never completed (a peer gone) the GradSync is left as it is:
            # freeing what gloo's thread still waits on makes the process hang at exit.
            self.grad_sync.close()

    # -- configuration ---------------------------------------------------------------------------
    def _model_is_tensor_parallel(self) -> bool:
        return model_is_tensor_parallel(self.model, getattr(self, "is_distributed_loading_by_transformers", False))

    @property
    def _hfstream_sync(self) -> bool:
        return self.grad_sync_mode.by_gradsync

    @property
    def _zero1_optimizer(self) -> bool:
        """grad_sync="sharded" on several processes: each rank's optimizer holds its slices only."""
        return self.grad_sync is not None and self.grad_sync.mode is Mode.SHARDED and self.grad_sync.world_size > 1

    # -- where data moves to the device ------------------------------------------------------------
    def get_train_dataloader(self):
        from accelerate.data_loader import DataLoaderDispatcher

        loader = super().get_train_dataloader()
        if self.args.prefetch_depth > 0 and getattr(loader, "device", None) is not None:
            # The prefetcher copies to the device ahead of time; the loader must hand it host tensors.
            loader.device = None
        # Accelerate dispatches an IterableDataset's batches from rank 0 with a broadcast per batch:
        # such a loader must be read on the training thread, in step order on every rank.
        self._loader_collectives = isinstance(loader, DataLoaderDispatcher)
        return loader

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        self._watch(f"loading the batches of step {self.state.global_step + 1} (the data loader, then "
                    f"num_items_in_batch across ranks)")
        if self._timeline is not None:   # a step under a candidate cap of grad_bucket_mb="auto" is reported apart
            self._timeline.begin_step(self.state.global_step + 1,
                                      tuning=self.grad_sync is not None and self.grad_sync.tuning is not None)
        batches = super().get_batch_samples(self._prefetched(epoch_iterator), num_batches, device)
        if self._timeline is not None:
            self._timeline.data_ready()
        return batches

    def _get_num_items_in_batch(self, batch_samples, device):
        # The batches are loaded (get_batch_samples calls this after its loader). What follows is the
        # Trainer's count of the step's items across ranks, a collective: under sharded it waits behind
        # the previous step's all-gathers on the link, which is exposed communication, not data wait.
        if self._timeline is None or not self._zero1_optimizer:
            return super()._get_num_items_in_batch(batch_samples, device)
        self._timeline.data_ready()
        t0 = time.perf_counter()
        try:
            return super()._get_num_items_in_batch(batch_samples, device)
        finally:
            self._timeline.items_counted(t0, time.perf_counter())

    def _prefetched(self, epoch_iterator):
        """The same iterator, ``prefetch_depth`` batches ahead. One prefetcher per epoch iterator."""
        if self.args.prefetch_depth == 0:
            return epoch_iterator
        if self._prefetch_source is not epoch_iterator:
            from ..prefetch.prefetcher import StreamPrefetcher

            self._close_prefetcher()
            state = self.accelerator.gradient_state
            self._prefetcher = StreamPrefetcher(tag_loader_state(epoch_iterator, state), device=self.args.device,
                                                depth=self.args.prefetch_depth, time_copies=self.args.stream_report,
                                                source_issues_collectives=self._loader_collectives,
                                                batches_per_step=self.args.gradient_accumulation_steps)
            self._prefetch_iter = restore_loader_state(iter(self._prefetcher), state, self._loader_view)
            self._prefetch_source = epoch_iterator
        return self._prefetch_iter

    def _close_prefetcher(self) -> None:
        if self._prefetcher is not None:
            self._prefetcher.close()
        self._prefetcher = self._prefetch_source = self._prefetch_iter = None

    # -- where gradients leave and come back ---------------------------------------------------------
    def _wrap_model(self, model, training: bool = True, dataloader=None):
        if training and self._hfstream_sync and (self.grad_sync is None or self.grad_sync.closed):
            from ..gradsync import GradSync

            # Autocast and device placement from Accelerate, but no DDP wrapper: prepare_model
            # marks the module as prepared, so the Trainer's later prepare() leaves it alone.
            model = self.accelerator.prepare_model(model, evaluation_mode=True)
            self._say_what_ddp_options_do()
            self.grad_sync = GradSync(
                model,
                process_group=self._gradient_group(),
                bucket_mb=self.args.effective_bucket_mb,
                mode=self.grad_sync_mode,
                comm_dtype=self.args.grad_comm_dtype,
                comm_stream_priority=self.args.comm_stream_priority,
                timeout=self.args.ddp_timeout,
                # Unset means DDP's default (True), as the stock Trainer leaves it to DDP.
                broadcast_buffers=self.args.ddp_broadcast_buffers is not False,
            )
            release_at_exit(self.grad_sync)   # a finished run must exit 0 (clean_exit.py)
            # Only the Trainer's own training step synchronises: a backward in a callback (a gradient
            # diagnostic) accumulates locally, and a forward there (on one rank, say) broadcasts
            # nothing, as under DDP, whose reducer only follows forwards through its wrapper.
            self.grad_sync.require_backward_grad_sync = False
            self.grad_sync.follow_forwards = False
            self._step_began = True
            if self.grad_sync_mode is Mode.SHARDED:
                self._shard_optimizer()
            if self.args.effective_bucket_mb != self.args.grad_bucket_mb:
                notice(logger, "hfstream: using ddp_bucket_cap_mb=%s for hfstream's gradient buckets",
                               self.args.ddp_bucket_cap_mb)
        if training and self._timeline is not None and self._forward_hook is None:
            self._forward_hook = self.accelerator.unwrap_model(model).register_forward_hook(ModelHook(self._forward_done))
        return super()._wrap_model(model, training=training, dataloader=dataloader)

    def _shard_optimizer(self) -> None:
        """grad_sync="sharded": the optimizer the Trainer built (or was given) keeps this rank's slices only.

        Converted in place (same object, class, groups; the scheduler is built on it next). A
        second train() re-cuts the state the last one left to the new GradSync's slices.
        """
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)   # inside Accelerate's wrapper
        try:
            self.grad_sync.shard_optimizer(optimizer)
        except ValueError as exc:
            raise ValueError(f"{self._optimizer_origin} with grad_sync='sharded': {exc}") from None

    def _gradient_group(self):
        if self._grad_group is None:
            self._grad_group = gradient_group(self.args)
        return self._grad_group

    def _say_what_ddp_options_do(self) -> None:
        """DDP's own options set for a run whose gradients hfstream reduces: say once what becomes of each."""
        args = self.args
        ignored = []
        if getattr(args, "ddp_static_graph", False):   # a TrainingArguments field in later 5.x releases only
            ignored.append("ddp_static_graph (GradSync needs no static graph: it re-plans its buckets from the order "
                           "gradients arrive in the first step)")
        if args.ddp_find_unused_parameters:
            ignored.append("ddp_find_unused_parameters (not needed: GradSync always handles unused parameters)")
        for what in ignored:
            self._note(f"hfstream: {what} has no effect under grad_sync={self.grad_sync_mode!r}; "
                       f"use grad_sync='native' for DDP's own behaviour")

    def _note(self, message: str) -> None:
        if message not in self._notes:
            self._notes.append(message)
            logger.warning(message)

    def _forward_done(self, module, inputs, output):
        if module.training and self._timeline is not None:
            self._timeline.forward_end()

    def _watch(self, what: str) -> None:
        """Progress: the watchdog (multi-process only) restarts its clock for phase ``what``.

        A rank that stays in one phase past ``ddp_timeout`` + 15 s without progress is reported and
        ended (exit 124): a stopped peer ends the survivors wherever they wait for it.
        """
        limit = self.args.step_watchdog_s
        if self.args.world_size <= 1 or limit == 0:
            return
        if self._watchdog is None:
            from .watchdog import StepWatchdog

            timeout = float(self.args.ddp_timeout)
            self._watchdog = StepWatchdog(report_after_s=limit if limit is not None else timeout / 2,
                                          exit_after_s=max(timeout + 15.0, limit or 0.0),
                                          describe=self._describe_stuck_step, rank=self.args.process_index)
        self._watchdog.watch(what)

    def _describe_stuck_step(self) -> str:
        if self.grad_sync is None:
            return (f"grad_sync={self.grad_sync_mode!r}: hfstream does not own the reduction; the step is in forward, "
                    f"backward or the engine's own gradient reduction")
        return self.grad_sync.pending_report() or "GradSync has nothing pending: the step is in forward or backward"

    def _close_watchdog(self) -> None:
        if self._watchdog is not None:
            self._watchdog.close()
            self._watchdog = None

    @_synchronising
    def training_step(self, model, inputs, num_items_in_batch=None):
        return super().training_step(model, inputs, num_items_in_batch)

    def __init_subclass__(cls, **kwargs):
        # [Note: the training step is the user's] DDP's reducer follows every backward of a
        # synchronising forward, whoever runs it. A subclass's own training_step (with or without
        # super(), one backward or two: FGM, SAM) is wrapped here the same way as this class's, so
        # the window below (what syncs, finish at each backward's end) holds whatever it does.
        super().__init_subclass__(**kwargs)
        own = cls.__dict__.get("training_step")
        if own is not None and not getattr(own, "_hfstream_window", False):
            cls.training_step = _synchronising(own)

    def _stream_training_step(self, run, model, inputs, *args, **kwargs):
        """One micro-step, whatever ``training_step`` runs: tell GradSync whether it syncs, finish each backward.

        The outermost call only (an override's ``super()`` chain runs inside it). On the
        synchronising micro-step GradSync calls `_backward_ended` at the end of every backward
        whose gradients all arrived, so code between two backwards reads the mean gradient; what
        no backward finished (a rank whose backward fired no hook) is finished here.
        """
        if self._in_training_step:
            return run(self, model, inputs, *args, **kwargs)
        self._in_training_step = True
        try:
            step = self.state.global_step + 1
            self._watch(f"inside step {step} (forward, backward and the gradient reduction)")
            if self._snapshot_waits_at_step_start:   # save_async: the step may change what is being copied
                self._wait_for_snapshot_copies()
            loss = self._synchronised(run, model, inputs, *args, **kwargs)
            if self.accelerator.sync_gradients:   # save_async: the optimizer step changes what was copied
                self._wait_for_snapshot_copies()
            self._watch(f"inside step {step} (gradient clipping and the optimizer step)")
            return loss
        finally:
            self._in_training_step = False

    def _synchronised(self, run, model, inputs, *args, **kwargs):
        sync, timeline = self.grad_sync, self._timeline
        syncs = self.accelerator.sync_gradients or bool(
            self.accelerator.gradient_state.plugin_kwargs.get("sync_each_batch", False))
        whole = syncs and self._whole_gradients_in_step
        if sync is not None:
            sync.require_backward_grad_sync = syncs
            sync.follow_forwards = True
            sync.after_backward = self._backward_ended if syncs else None
            self._backwards, self._whole_in_window = 0, whole
            if self._zero1_optimizer:
                # The slices start from this backward's mean at an optimizer step's first synchronising
                # micro-step; a later one (Accelerate's sync_each_batch) adds to them, as .grad does.
                sync.accumulate = syncs and not self._step_began
        if timeline is not None:
            timeline.forward_start()
        try:
            loss = self._run_step_watched(run, model, inputs, *args, **kwargs)
        finally:
            if sync is not None:
                sync.require_backward_grad_sync = False   # until the next training step
                sync.follow_forwards = False
                sync.after_backward = None
                if syncs:
                    self._step_began = self.accelerator.sync_gradients   # the optimizer steps next
        if timeline is not None:
            timeline.backward_end()
        if sync is not None and syncs:
            self._backward_ended()
            if whole:   # the slices take the whole gradient, as the user's code left it
                sync.scatter_gradients()
        if timeline is not None and self.accelerator.sync_gradients:
            timeline.optimizer_start()
        return loss

    def _backward_ended(self) -> None:
        """A synchronising backward is over: wait for its reductions; under sharded, .grad as stock where read."""
        sync, timeline = self.grad_sync, self._timeline
        if sync.world_size > 1 and not sync.sync_pending:   # finished at its backward's end already
            return
        if timeline is not None:
            timeline.backward_end()
        t0 = time.perf_counter()
        sync.finish()
        if timeline is not None:
            # Read later, when the report is made: reading now would make the host wait for the
            # reductions' events on an accelerator, every step.
            timeline.add_comm_later(sync.stats_deferred(), (t0, time.perf_counter()))
        for note in sync.notes:
            self._note(note)
        self._backwards += 1
        if self._zero1_optimizer:
            if self._whole_in_window:
                sync.gather_gradients()   # the mean, whole, in .grad: a further backward adds to it there
                sync.accumulate = False   # (so the slices must not carry it as well)
                if self._gradient_reads is not None:
                    self._gradient_reads.gathered(sync.hooked_parameters)
            else:
                sync.accumulate = True    # a further backward adds its mean to the slices'
        if timeline is not None and sync.after_backward is not None:
            timeline.forward_start()   # a further forward of this step (FGM, SAM) is timed from here

    @property
    def _whole_gradients_in_step(self) -> bool:
        """Sharded, with a training_step of the user's: .grad holds the whole mean gradient inside the step.

        Watched in the first step (`GradientReads`): kept only if the step reads or changes
        .grad, or runs several backwards; said once.
        """
        return self._zero1_optimizer and self._user_training_step is not None and self._reads_gradients is not False

    def _run_step_watched(self, run, model, inputs, *args, **kwargs):
        """``run``; under sharded, current parameters for user code that reads them before the forward.

        A ``training_step`` or ``compute_loss`` of the user's is watched in the first step: if it reads
        parameters before the forward (a penalty on the weights), every later step waits for the
        gathers before it; if it reads the gradients, .grad holds the whole mean gradient in every
        step (`_whole_gradients_in_step`).
        """
        from .sharded import GradientReads, PreForwardReads, overrides_compute_loss

        user = self._user_training_step or ("compute_loss" if overrides_compute_loss(self) else None)
        if not self._zero1_optimizer or user is None:
            return run(self, model, inputs, *args, **kwargs)
        watch_params = self._reads_before_forward is None and not self.args.torch_compile
        watch_grads = self._whole_in_window and self._reads_gradients is None   # the first synchronising step
        if not watch_params and (self._reads_before_forward or self.args.torch_compile):
            self.grad_sync.wait_for_params()   # compiled: the forward waits first anyway
        if not (watch_params or watch_grads):
            return run(self, model, inputs, *args, **kwargs)
        with contextlib.ExitStack() as stack:
            watch = stack.enter_context(PreForwardReads(self.grad_sync.hooked_parameters, model)) if watch_params else None
            reads = self._gradient_reads = stack.enter_context(GradientReads()) if watch_grads else None
            try:
                loss = run(self, model, inputs, *args, **kwargs)
            finally:
                self._gradient_reads = None
        where = f"{type(self).__name__}.{user}"
        if watch is not None:
            self._reads_before_forward = watch.read
        if watch is not None and watch.read:
            self._note(f"hfstream: {where} reads parameters before the forward "
                       f"({', '.join(watch.read[:3])}{' ...' if len(watch.read) > 3 else ''}): under "
                       f"grad_sync='sharded' every step now waits for the parameter all-gathers before it, so "
                       f"they no longer overlap the forward. Compute such terms after the forward to keep it")
        if reads is not None:
            here = reads.touched(self.grad_sync.hooked_parameters) or self._backwards > 1
            # Every rank gathers in every step, or none does: the step may read .grad on one rank only
            # (a log line on the main process), and a gather on that rank alone would wait forever.
            touched = self._reads_gradients = self.grad_sync.agree(here)[0]
            if touched:
                self._note(f"hfstream: {where} reads or changes .grad inside the step (on some rank), or runs "
                           f"{self._backwards} backward(s): under grad_sync='sharded' each rank keeps only its slice of the mean "
                           f"gradient, so hfstream gathers the whole mean gradient into .grad after every backward "
                           f"of the step, as the stock Trainer holds it (an all-gather of the gradients per backward, "
                           f"into the buckets' own buffers). For norms only, read trainer.grad_sync.grad_norms() instead")
        return loss

    def _clip_grad_norm(self, model):
        if self._zero1_optimizer:   # the norm of the whole mean gradient, from every rank's slices
            return self.grad_sync.clip_grad_norm_(self.args.max_grad_norm)
        return super()._clip_grad_norm(model)

    def _get_grad_norm(self, model, grad_norm=None):
        if grad_norm is None and self._zero1_optimizer:   # max_grad_norm=0: the norm, unclipped
            grad_norm = self.grad_sync.clip_grad_norm_(float("inf"))
        return super()._get_grad_norm(model, grad_norm=grad_norm)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """grad_sync="sharded": the stock ``optimizer.pt``, gathered whole from every rank's slices."""
        if not self._zero1_optimizer:
            return super()._save_optimizer_and_scheduler(output_dir)
        from .sharded import save_optimizer

        self._watch(f"saving the optimizer of step {self.state.global_step} (gathering every rank's slices)")
        save_optimizer(self, output_dir)

    # -- the checkpoint, saved behind training (save_async; hfstream.trainer.save_async) ---------------------
    #   _save_checkpoint      at a save step: the previous save finishes first (at most one in flight),
    #                         then the stock save runs into a staging folder with its big writes deferred
    #                         to host copies (`DeferredWrites`), and a thread writes them (`AsyncSave`)
    #   _get_output_dir       the staging run dir while that stock save runs
    #   _settle_save          at a point every rank reaches: when every rank's files are written, the
    #                         staging folder becomes checkpoint-N, then rotation and on_save; a write
    #                         error on any rank fails every rank here, naming the path where it failed
    #   _finalize_training    train() ends only after the last save is checkpoint-N (before the best
    #                         model is loaded and the end-of-training rotation)
    def _save_checkpoint(self, model, trial) -> None:
        if not self.args.save_async:
            return self._save_blocking(model, trial)
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        from .save_async import STAGING_DIR, AsyncSave, DeferredWrites, HostCopies

        self._settle_save(wait=True)
        self.callback_handler.__dict__.pop("on_save", None)   # a deferral left by a save no on_save followed
        run_dir = self._get_output_dir(trial)
        folder = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        staging, final = os.path.join(run_dir, STAGING_DIR, folder), os.path.join(run_dir, folder)
        t0 = time.perf_counter()
        on_device = self.args.device.type != "cpu"
        self._new_snapshot_buffers()
        if not self._make_room_for_snapshot(staging):
            return self._save_blocking(model, trial)
        self._staging_run_dir = os.path.join(run_dir, STAGING_DIR)
        # On CPU the copies are queued, to run beside the next forward and backward (`HostCopies`).
        self._snapshot_buffers.copies = copies = None if on_device else HostCopies()
        try:
            with DeferredWrites(self._snapshot_buffers) as deferred:
                super()._save_checkpoint(model, trial)
        finally:
            self._staging_run_dir = None
            self._snapshot_buffers.copies = None
            taken = self._snapshot_buffers.drop_rest()
        if self.state.best_model_checkpoint == staging:   # stock named the folder it wrote: its final name
            self.state.best_model_checkpoint = final
            if self.args.should_save:
                from transformers.trainer import TRAINER_STATE_NAME

                self.state.save_to_json(os.path.join(staging, TRAINER_STATE_NAME))
        if on_device:   # the host copies were queued on the side stream, each after the training stream's work
            from .. import streams

            event = streams.new_event(self.args.device)
            event.record(self._snapshot_buffers.stream)
        else:           # the copies begin on their thread now
            event = copies.start()
        self._snapshot_copied = event
        self._snapshot_waits_at_step_start = self._step_may_change_weights(model)
        # Rotation waits for the rename, over the real run dir (the stock save named the staging one).
        rotations = [dict(kw, output_dir=run_dir, best_model_checkpoint=self.state.best_model_checkpoint)
                     for kw in deferred.rotations]
        self._save_in_flight = AsyncSave(deferred.writes, staging, final, state=copy.deepcopy(self.state),
                                         rotations=rotations, event=event, buffers=taken,
                                         writer=self._snapshot_buffers.writer, device=self.args.device).start()
        self.save_times["saves"] += 1
        self.save_times["snapshot_s"] += time.perf_counter() - t0
        self.save_times["exposed_s"] += time.perf_counter() - t0
        # The Trainer calls on_save next: the callbacks run at the commit, when the files are there.
        self.callback_handler.on_save = self._on_save_at_commit

    def _new_snapshot_buffers(self) -> None:
        """The run's `SnapshotBuffers`, once: pinned, with a copy stream, on an accelerator."""
        if self._snapshot_buffers is None:
            from .. import streams
            from .save_async import SnapshotBuffers

            device = self.args.device
            # The writer process serves the rank that saves the model; another rank's files (its RNG
            # state, a few KiB) are written sooner by a thread than a process could start. Without
            # side streams (Apple's MPS) the copies run on the training stream.
            stream = streams.new_stream(device) if streams.is_accelerator(device) and streams.has_side_streams(device) \
                else None
            self._snapshot_buffers = SnapshotBuffers(device=device, shared=self.args.should_save, stream=stream)

    def _prepare_snapshot_buffers(self) -> None:
        """save_async, after the first optimizer step (its state exists now): the saving rank allocates the
        first snapshot's buffers on a thread, behind the next steps, where they fit the host's memory (the
        save checks again, and saves blocking where they do not). Local: no collective depends on it."""
        if (self._snapshot_buffers is not None or not self.args.save_async or self.args.save_strategy == "no"
                or not self.args.should_save):
            return
        from .save_async import available_host_bytes, snapshot_sizes

        self._new_snapshot_buffers()
        sizes = snapshot_sizes(self.model, None if self._zero1_optimizer else self.optimizer)
        available = available_host_bytes()
        if available is None or sum(sizes) <= available:
            self._snapshot_buffers.prepare(sizes)

    def _step_may_change_weights(self, model) -> bool:
        """save_async: whether the next step may change what a snapshot copies before its optimizer step (then
        its copies are waited for at the step's start): a forward changes a saved buffer (a BatchNorm's
        statistics), and a ``training_step`` or ``compute_loss`` of the user's may perturb weights in place
        (FGM, SAM)."""
        from transformers import Trainer

        cls = type(self)
        saved = model.state_dict(keep_vars=True)
        return (any(name in saved for name, _ in model.named_buffers())
                or cls.training_step is not StreamTrainerMixin.training_step
                or cls.compute_loss is not Trainer.compute_loss)

    def _release_snapshot_buffers(self) -> None:
        """save_async, at the end of train(): the snapshot's host memory (and the writer's map of it) is freed;
        what it held is kept for the report."""
        if self._snapshot_buffers is None:
            return
        self.save_times.update(self._snapshot_memory())
        buffers, self._snapshot_buffers = self._snapshot_buffers, None
        writer = buffers.writer
        del buffers
        if writer is not None:
            writer.release()

    def _wait_for_snapshot_copies(self) -> None:
        """The last snapshot's copies are waited for: next the step may change what they read. On an
        accelerator the training stream waits (the device, not the host); on CPU the host waits for their
        thread, and that time is the save's."""
        if self._snapshot_copied is not None:
            from .. import streams
            from .save_async import HostCopies

            if isinstance(self._snapshot_copied, HostCopies):   # on CPU the host waits: the time is the save's
                t0 = time.perf_counter()
                self._snapshot_copied.synchronize()
                waited = time.perf_counter() - t0
                self.save_times["copy_wait_s"] += waited
                self.save_times["exposed_s"] += waited
            else:
                streams.wait_event(self._snapshot_copied, streams.current_stream(self.args.device))
            self._snapshot_copied = None

    def _save_blocking(self, model, trial) -> None:
        t0 = time.perf_counter()
        super()._save_checkpoint(model, trial)
        self.save_times["saves"] += 1
        self.save_times["exposed_s"] += time.perf_counter() - t0

    def _snapshot_short(self, needed: int, what: str) -> str | None:
        """None where ``needed`` bytes of host memory are available on every rank (one small all-reduce),
        else a sentence saying so, for ``what``, with the bytes where this rank is short."""
        from .save_async import available_host_bytes

        available = available_host_bytes()
        short = available is not None and needed > available
        (short_anywhere,) = self._save_flags([short])
        if not short_anywhere:
            return None
        return (f"save_async=True: {what} needs {needed} bytes ({needed / 2**30:.2f} GiB) of host memory, {available} "
                f"available here" if short else
                f"save_async=True: {what} does not fit another rank's host memory (its message gives the bytes)")

    def _save_flags(self, flags: list[bool]) -> list[bool]:
        """save_async's flags (short of memory, written, failed) OR-ed over the ranks, at a point every rank
        reaches: over a gloo group (`_start_save_async` makes it), so a step boundary with
        a save in flight makes no rank wait for its device, as a flag on an NCCL group would (a host copy
        in, a host read out)."""
        if self.args.world_size == 1:
            return [bool(f) for f in flags]
        import torch.distributed as dist

        from ..gradsync.agreement import any_rank

        if self._save_group is None:   # a save outside train(): the default group, on its device
            return any_rank(flags, dist.group.WORLD, self.args.device)
        return any_rank(flags, self._save_group, torch.device("cpu"))

    def _start_save_async(self) -> None:
        """save_async, at the start of train() on every rank: the gloo group its flags travel on, then refused
        where not even the model's state fits in host memory, then the writer process started."""
        if not self.args.save_async:
            return
        if self.args.world_size > 1 and self._save_group is None:   # every rank, from the arguments they share
            import torch.distributed as dist

            from ..gradsync.sharded.collectives import host_group

            self._save_group = host_group(dist.group.WORLD, self._note)
        if self.args.save_strategy == "no":
            return
        from .save_async import snapshot_bytes

        short = self._snapshot_short(snapshot_bytes(self.model, None), "a snapshot of the model's state alone")
        if short:
            raise ValueError(f"{short}, before the optimizer's state. Set save_async=False (the blocking save needs "
                             f"no copy), or free host memory")
        if self.args.should_save:   # the writer process starts (and imports) while the first steps run
            from .save_writer import writer

            try:
                writer()
            except OSError:   # said at the first save, which writes from a thread instead
                pass

    def _make_room_for_snapshot(self, staging: str) -> bool:
        """A crashed run's leftover staging folder goes; whether the snapshot fits the host's memory.

        Agreed by every rank (one small all-reduce), which also orders the saving rank's clean-up
        before any rank's writer starts. A snapshot that does not fit is not taken: the save is the
        stock Trainer's blocking one, said once (the run goes on as stock's would).
        """
        from .save_async import snapshot_bytes

        if self.args.should_save and os.path.isdir(staging):
            import shutil

            shutil.rmtree(staging)
        scale = self.grad_sync.world_size if self._zero1_optimizer else 1
        needed = snapshot_bytes(self.model, self.optimizer, scale) - self._snapshot_buffers.held_bytes
        short = self._snapshot_short(needed, "a checkpoint's snapshot")
        if short is None:
            return True
        self._note(f"hfstream: {short}: saved in the training loop instead, as the stock Trainer saves "
                   f"(this and any later save that does not fit). Free host memory for saves behind training, or "
                   f"set save_async=False")
        return False

    def _on_save_at_commit(self, args, state, control, **kwargs):
        del self.callback_handler.on_save   # one save's call only: the handler's own method again
        control.should_save = False
        return control

    def _get_output_dir(self, trial) -> str:
        return self._staging_run_dir or super()._get_output_dir(trial)

    def _settle_save(self, wait: bool) -> None:
        """The save in flight, if every rank has written it: checkpoint-N, rotation, on_save. On every rank."""
        save = self._save_in_flight
        if save is None:
            return
        if wait:
            self._watch(f"waiting for the save of {save.final_dir} to finish writing (save_async)")
            waited = save.join()
            self.save_times["wait_s"] += waited
            self.save_times["exposed_s"] += waited
        t0 = time.perf_counter()
        pending, failed = save.done is False, save.error is not None
        pending, failed = self._save_flags([pending, failed])   # every rank here, in step order
        if failed:
            self._save_in_flight = None
            raise RuntimeError(save.failure() if save.error is not None else
                               f"save_async: another rank failed to write its files of {save.final_dir!r} (its "
                               f"error names the path); the checkpoint was not made, the previous one is whole")
        if pending:
            return
        self._save_in_flight = None
        self._snapshot_buffers.give_back(save.buffers)   # written: the next snapshot copies into them
        by_thread = save.by_thread or (self._snapshot_buffers.unshared if save.writer is None else None)
        if by_thread and self.args.should_save:
            self._note(f"hfstream: save_async wrote from a thread of the training process, not its writer process "
                       f"({by_thread}): those writes share this process's GIL, and the steps beside them run slower "
                       f"(docs/benchmarks.md). Give /dev/shm room for one snapshot, and keep torch.save, "
                       f"safetensors' save_file and your TrainingArguments class importable by name (not from "
                       f"the script itself)")
        if self._snapshot_buffers.unpinned:
            self._note(f"hfstream: save_async's snapshot buffers are not pinned ({self._snapshot_buffers.unpinned}): "
                       f"each copy from {self.args.device} makes the training thread wait for it, so a save costs "
                       f"the steps the copy's time (the report's save exposed_s says how much)")
        renamed = None   # why the rename failed, on the saving rank
        if self.args.should_save:
            from transformers.trainer import rotate_checkpoints

            try:
                save.commit()
            except OSError as exc:
                renamed = f"{type(exc).__name__}: {exc}"
            else:
                for kwargs in save.rotations:
                    rotate_checkpoints(**kwargs)
        # The others must not go on into a collective the saving rank never joins.
        (failed,) = self._save_flags([renamed is not None])
        if failed:
            raise RuntimeError(f"save_async: renaming {save.staging_dir!r} to {save.final_dir!r} failed "
                               f"({renamed or 'on the saving rank; its error says why'}); its files are complete "
                               f"there. Fix output_dir's permissions, or set save_async=False")
        self.save_times["write_s"] += save.write_s
        # The callbacks the Trainer's on_save call would have run (it was deferred to here); should_save
        # is left alone: it may be this step's own save.
        self.control = self.callback_handler.call_event("on_save", self.args, save.state, self.control)
        self.save_times["commit_s"] += time.perf_counter() - t0
        self.save_times["exposed_s"] += time.perf_counter() - t0

    def _save_report(self) -> dict:
        """This rank's saves for the step report: the training thread's time in them, per save and in all."""
        from .save_async import snapshot_bytes

        times = self.save_times
        scale = self.grad_sync.world_size if self._zero1_optimizer else 1
        return {"save_async": self.args.save_async, "saves": times["saves"],
                "bytes": snapshot_bytes(self.model, self.optimizer, scale),   # the checkpoint's tensors
                "run_s": round(time.perf_counter() - self._train_began, 4),
                "exposed_s": round(times["exposed_s"], 4), "snapshot_s": round(times["snapshot_s"], 4),
                "exposed_s_per_save": round(times["exposed_s"] / times["saves"], 4),
                "wait_s": round(times["wait_s"], 4), "drain_s": round(times["drain_s"], 4),
                "write_s": round(times["write_s"], 4),
                # On CPU: the next step's wait, before its optimizer step, for the copies made beside it.
                "copy_wait_s": round(times["copy_wait_s"], 4),
                # Host memory the snapshots held at the end (one snapshot, reused by every save), and what
                # a save had to allocate itself (the rest was allocated behind the first steps).
                **self._snapshot_memory()}

    def _snapshot_memory(self) -> dict:
        """The snapshot's host memory: the live buffers' while train() holds them (the report is gathered
        before they are freed), else what they held when freed."""
        buffers = self._snapshot_buffers
        if buffers is None:
            return {"held_bytes": self.save_times["held_bytes"], "new_bytes": self.save_times["new_bytes"]}
        return {"held_bytes": buffers.held_bytes, "new_bytes": buffers.new_bytes}

    def _finalize_training(self, *args, **kwargs):
        waited = self.save_times["wait_s"]
        self._settle_save(wait=True)
        self.save_times["drain_s"] += self.save_times["wait_s"] - waited
        return super()._finalize_training(*args, **kwargs)

    # -- between steps ---------------------------------------------------------------------------------
    def _maybe_log_save_evaluate(self, *args, **kwargs):
        # Called right after each optimizer step (and at each epoch's end): the step is over.
        if self._timeline is not None:
            self._timeline.end_step()
        self._watch(f"after step {self.state.global_step} (logging, evaluation or saving a checkpoint)")
        self._settle_save(wait=False)   # save_async: a checkpoint whose files every rank wrote becomes checkpoint-N
        self._prepare_snapshot_buffers()
        if self._zero1_optimizer and (self.control.should_evaluate or self.control.should_save):
            # The step's all-gathers would otherwise wait for the next forward (sharded mode).
            self.grad_sync.wait_for_params()
        return super()._maybe_log_save_evaluate(*args, **kwargs)

    def prediction_step(self, *args, **kwargs):
        if self._watchdog is not None and self.is_in_train:
            self._watch(f"evaluating during training, after step {self.state.global_step}")
        return super().prediction_step(*args, **kwargs)

    # -- the report ----------------------------------------------------------------------------------
    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        if self._timeline is not None and "loss" in logs:
            # Only the steps the device has finished: a step still running comes in the next log.
            summary = self._timeline.summary(since_step=self._last_logged_step, wait=False)
            if self._timeline.last_step is not None:
                self._last_logged_step = self._timeline.last_step
            for key in REPORT_KEYS:
                value = summary.get(key, math.nan)
                if not math.isnan(value):
                    logs[f"stream/{key}"] = round(value, 4)
            copies = self._prefetcher.stats if self._prefetcher is not None else None
            if copies is not None and copies.copy_ms is not None:      # on an accelerator only
                logs["stream/copy_ms"], logs["stream/copy_gbps"] = round(copies.copy_ms, 4), round(copies.copy_gbps, 3)
            if self.grad_sync is not None and self.grad_sync.tuning is None:
                logs["stream/bucket_mb"] = self.grad_sync.cap_mb    # the tuned cap, under "auto"
            exposed = self.save_times["exposed_s"]
            if exposed > self._save_exposed_logged:   # the training thread's time in saves since the last log
                logs["stream/save_exposed_ms"] = round(1000 * (exposed - self._save_exposed_logged), 3)
                self._save_exposed_logged = exposed
        super().log(logs, *args, **kwargs)
        # The reporters (TensorBoard, W&B, the console) got the timings; the Trainer's state does
        # not keep them: trainer_state.json stays the stock Trainer's, and a resumed run's state
        # equals an uninterrupted one's.
        history = self.state.log_history
        if history and any(key.startswith("stream/") for key in history[-1]):
            history[-1] = {k: v for k, v in history[-1].items() if not k.startswith("stream/")}

    def _gather_report(self) -> None:
        """Every rank's summary, gathered when training ends (all ranks are there)."""
        if self._timeline is None:
            return
        local = self._timeline.summary(warmup=1)
        spans = [list(span) for span in self._timeline.last_spans(self.TIMELINE_STEPS)]
        gathered = gather_object([(local, spans)]) if self.accelerator.num_processes > 1 else [(local, spans)]
        per_rank = [summary for summary, _ in gathered]
        self._report = StreamReport(mean=combine_ranks(per_rank), per_rank=per_rank, grad_sync=self.grad_sync_mode,
                                    prefetch_depth=self.args.prefetch_depth,
                                    spans=[span for _, rank_spans in gathered for span in rank_spans],
                                    notes=list(self._notes))
        if self.save_times["saves"]:
            self._report["save"] = self._save_report()
        self._advise()

    def _advise(self) -> None:
        """The report's advice (`hfstream.report.advice`), said once on rank 0, and the report on disk."""
        from ..report.advice import advise_report, facts_from_trainer
        from .report_file import write_report
        from ..report.format import format_advice

        advise_report(self._report, facts_from_trainer(self))
        if self.is_world_process_zero():
            path = write_report(self._report, self.args.output_dir, step=self.state.global_step)
            advice = self._report["advice"] or []
            if advice:
                # One line: the first advice and where the rest is. The report itself (print it, or
                # `hfstream doctor`) holds every piece with its reason; the log does not say it twice.
                first = format_advice(advice[:1])[0].strip()
                more = f" and {len(advice) - 1} more" if len(advice) > 1 else ""
                notice(logger, "hfstream: %s -- why%s: print(trainer.stream_report()) (report: %s)", first, more, path)

    def stream_report(self) -> StreamReport:
        """The step breakdown against the ceiling for the last `train()` call.

        A dict with ``mean`` (averaged over ranks) and ``per_rank`` (each rank's mean over its
        steps after the first), each holding the fields of docs/design.md section 4, and ``spans``
        (every rank's timeline of its last few steps, for `hfstream.cli.plot.plot_timeline`);
        ``print()`` shows it as a table. Local and cheap: the gathering happened when training
        ended, on every rank.
        """
        return self._report


def _own_training_step(cls) -> str | None:
    """``"training_step"`` if a class of ``cls`` other than hfstream's mixin and ``Trainer`` defines one."""
    for base in cls.__mro__:
        if base is not StreamTrainerMixin and base is not Trainer and "training_step" in base.__dict__:
            return "training_step"
    return None


class StreamTrainer(StreamTrainerMixin, Trainer):
    """`transformers.Trainer` with hfstream's prefetching, overlapped gradient sync and step report.

    >>> trainer = StreamTrainer(model=model, args=StreamTrainingArguments("out"), train_dataset=ds)  # doctest: +SKIP
    >>> trainer.train(); print(trainer.stream_report())                                            # doctest: +SKIP
    """
