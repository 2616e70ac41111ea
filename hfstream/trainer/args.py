"""`StreamTrainingArguments`: `TrainingArguments` plus the few knobs hfstream adds.

Every field carries `metadata={"help": ...}`, so `HfArgumentParser` (and therefore
`accelerate launch script.py --prefetch_depth 2 ...`) exposes it as a command-line flag.

How the new fields meet the existing ones (never two names for one thing):
    - ``ddp_bucket_cap_mb`` governs DDP's buckets under ``grad_sync="native"``. Under
      ``"overlap"``/``"serial"``, hfstream's own buckets use ``grad_bucket_mb``; if that is left
      at its default and ``ddp_bucket_cap_mb`` is set, the DDP value is used (logged once).
    - ``ddp_timeout`` is the process group's timeout; hfstream waits on its reductions no
      longer than that, so a dead or stopped peer becomes an error, not a hang. The step
      watchdog (``step_watchdog_s``) reports what a stuck step waits for, and ends the process
      after ``ddp_timeout`` plus 15 s when even that is not enough.
    - ``dataloader_pin_memory`` still pins in the DataLoader; the prefetcher pins only what is
      not pinned already, so leaving it on costs nothing extra.
    - ``use_cpu`` is switched on (and logged) when several processes are launched on a machine
      with no accelerator: otherwise Transformers silently trains each CPU rank on its own.
    - ``ddp_find_unused_parameters`` has no effect under ``"overlap"``/``"serial"``: hfstream
      always handles parameters whose gradient never arrives (see `GradSync.finish`).

Parent defaults it changes (`SPEED_DEFAULTS`; each gives the same parameters, only faster):
    - ``logging_nan_inf_filter``: None (auto) = off unless the run is the stock one
      (``prefetch_depth=0, grad_sync="native"``). With the filter on, the Trainer evaluates
      ``bool(isnan(loss) or isinf(loss))`` after every micro-step: the host waits for that
      backward and for every reduction launched in it, so nothing is queued ahead of the GPU
      (the next batch's copies, the optimizer's kernels) and the report's optimizer time absorbs
      the gap. Off, a NaN/Inf loss shows in the logged loss instead of being replaced by the
      recent average; gradients and parameters are the same. ``True`` brings the filter back.

With another `TrainingArguments` subclass (TRL's ``SFTConfig``, a project's own): use
``stream_arguments(SFTConfig)``, or put the other class first, ``@dataclass class Args(SFTConfig,
StreamTrainingArguments)``. The other order would give every field the other class overrides
(``SFTConfig``'s ``bf16``, ``learning_rate``, ...) `TrainingArguments`' default again, because a
dataclass takes each field from the last base in reverse MRO order that has it, and
`StreamTrainingArguments` carries all of `TrainingArguments`' fields; `__post_init__` refuses
such a class with a `TypeError` that names the fields.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field

import torch
from transformers import TrainingArguments

from .field_defaults import check_field_defaults
from ..gradsync.options import COMM_DTYPES, DEFAULT_BUCKET_MB, MODES, STREAM_PRIORITIES, Mode, comm_dtype_name
from ..log import notice

GRAD_SYNC_MODES = ("auto", *(m.value for m in Mode))   # "auto": resolved by the Trainer (`data_parallel`)

logger = logging.getLogger(__name__)


def _choice_error(name: str, value, accepted) -> ValueError:
    return ValueError(f"{name}={value!r} is not valid; accepted values: {', '.join(map(repr, accepted))}")


@dataclass
class StreamTrainingArguments(TrainingArguments):
    """`TrainingArguments` with stream prefetching, overlapped gradient sync and the step report.

    With ``prefetch_depth=0, grad_sync="native"`` a `StreamTrainer` behaves exactly like the
    stock `Trainer`.

    >>> args = StreamTrainingArguments(output_dir="out", prefetch_depth=2, grad_sync="overlap")
    >>> args.grad_bucket_mb
    'auto'
    """

    # --- data movement -------------------------------------------------------------------
    prefetch_depth: int = field(
        default=2,
        metadata={"help": "Batches in flight to the device ahead of the step that uses them "
                          "(side stream on an accelerator, background thread on CPU). 0 = stock behaviour."},
    )

    # --- gradient communication ------------------------------------------------------------
    grad_sync: str = field(
        default="auto",
        metadata={"help": "How gradients are averaged across ranks: 'overlap' (hfstream buckets launched "
                          "from gradient hooks during backward), 'serial' (one all-reduce after backward; "
                          "the teaching baseline), 'sharded' (reduce-scatter during backward, each rank steps its 1/N of "
                          "the optimizer, the parameter all-gather hidden in the next forward; opt-in, as it changes "
                          "the optimizer's layout), 'native' (whatever Accelerate does: DDP, FSDP, DeepSpeed), "
                          "'auto' (overlap under plain multi-process data parallel, native otherwise).",
                  "choices": list(GRAD_SYNC_MODES)},
    )
    # Typed str so that the command line accepts "auto" as well as numbers; stored as a float
    # (or "auto") after validation.
    grad_bucket_mb: str = field(
        default=DEFAULT_BUCKET_MB,
        metadata={"help": "Gradient bucket cap in MiB for 'overlap'/'serial' (a bucket closes once it reaches "
                          "the cap, as in DDP). 0 = one parameter per bucket, inf = one bucket, 'auto' = tuned "
                          "online in the first steps from measured communication. A number left at its default "
                          "falls back to ddp_bucket_cap_mb when that is set."},
    )
    grad_comm_dtype: str | None = field(
        default=None,
        metadata={"help": "Dtype on the wire for gradient all-reduce: None = the gradient's own dtype, "
                          "'bf16'/'fp16' = compress on the wire: each rank divides by the world size in the "
                          "gradient's precision, the sum runs in the wire dtype, the mean is cast back into .grad."},
    )
    comm_stream_priority: str = field(
        default="high",
        metadata={"help": "Priority of the communication stream where the backend has one (NCCL): "
                          "'high' or 'normal'. Accepted and ignored on gloo.",
                  "choices": list(STREAM_PRIORITIES)},
    )

    step_watchdog_s: float | None = field(
        default=None,
        metadata={"help": "Seconds one training step may take on several processes before each rank logs what it "
                          "waits for (buckets never ready, reductions not complete). None = half of ddp_timeout; "
                          "0 = off. A step still stuck after ddp_timeout plus 15 s ends the process with exit "
                          "code 124 instead of hanging."},
    )

    # --- checkpoints -----------------------------------------------------------------------
    save_async: bool = field(
        default=False,
        metadata={"help": "Write checkpoints behind training: at a save step each rank copies what the stock "
                          "Trainer saves into host memory, a background thread writes the same files into "
                          "<output_dir>/.hfstream-saving/checkpoint-N, renamed to checkpoint-N once every rank's "
                          "files are complete. At most one save in flight; a write error fails the run at the "
                          "next step. Not with DeepSpeed, FSDP or push_to_hub."},
    )

    # --- measurement -----------------------------------------------------------------------
    stream_report: bool = field(
        default=True,
        metadata={"help": "Measure each step (data wait, forward, backward, communication, optimizer) and "
                          "log the breakdown against the ceiling through Trainer.log."},
    )

    # --- parent defaults it changes (module docstring; listed in SPEED_DEFAULTS) ---------------
    logging_nan_inf_filter: bool | None = field(
        default=None,
        metadata={"help": "Replace NaN/Inf training losses by the recent average when logging (TrainingArguments' "
                          "filter). None = off unless prefetch_depth=0 and grad_sync='native' (the stock run): the "
                          "filter reads every micro-step's loss on the host, a device sync that stalls prefetching "
                          "and overlapped communication. Only the logged loss differs."},
    )

    # Changed parent defaults that give the same parameters, only faster: a class that loses one
    # to another parent (``class Args(SFTConfig, StreamTrainingArguments)``) keeps that parent's,
    # and is not refused for it (`field_defaults`); ``stream_arguments`` declares them again.
    SPEED_DEFAULTS = ("logging_nan_inf_filter",)

    def __post_init__(self):
        check_field_defaults(type(self), StreamTrainingArguments)   # another subclass's defaults must survive
        self._validate_stream_fields()
        if self.logging_nan_inf_filter is None:
            self.logging_nan_inf_filter = self.prefetch_depth == 0 and self.grad_sync == Mode.NATIVE
        if not self.use_cpu and int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.accelerator.is_available():
            notice(logger, "hfstream: %s processes and no accelerator: setting use_cpu=True so that they train "
                           "as one data-parallel job over gloo", os.environ["WORLD_SIZE"])
            self.use_cpu = True
        if self.grad_sync == Mode.SHARDED and self.fp16:
            raise ValueError(
                "grad_sync='sharded' cannot be combined with fp16=True: the fp16 GradScaler looks for inf/NaN in each "
                "rank's own gradient slices only, so ranks could disagree on skipping a step. Use bf16=True (no "
                "scaler), or grad_sync='overlap' with fp16."
            )
        if self.grad_sync in MODES and self.uses_engine_owning_comm():
            raise ValueError(
                f"grad_sync={self.grad_sync!r} cannot be combined with FSDP, DeepSpeed or tensor parallelism: "
                "those engines own gradient communication. Use grad_sync='native' (or 'auto')."
            )
        self._refuse_unsaveable_async()   # before the parent's checks import DeepSpeed
        super().__post_init__()

    def _refuse_unsaveable_async(self) -> None:
        """save_async=True where hfstream cannot take the snapshot: say so now, not at the first save."""
        if not self.save_async:
            return
        launched = {k: os.environ.get(f"ACCELERATE_USE_{k.upper()}", "false").lower() in ("1", "true")
                    for k in ("DeepSpeed", "FSDP")}   # accelerate launch with a DeepSpeed/FSDP config
        engine = ("DeepSpeed" if self.deepspeed or launched["DeepSpeed"] else
                  "FSDP" if self.fsdp or launched["FSDP"] else None)
        if engine is not None:
            raise ValueError(
                f"save_async=True cannot be combined with {engine}: its checkpoint is written by the engine's own "
                f"collective save, which hfstream cannot snapshot. Use save_async=False, or "
                f"torch.distributed.checkpoint.async_save in a callback for sharded engines."
            )
        if self.push_to_hub:
            raise ValueError(
                "save_async=True cannot be combined with push_to_hub=True: the upload would start before the "
                "checkpoint's files are written. Use save_async=False, or push the finished checkpoint-N yourself."
            )

    def _validate_stream_fields(self) -> None:
        if isinstance(self.prefetch_depth, bool) or not isinstance(self.prefetch_depth, int) or self.prefetch_depth < 0:
            raise ValueError(
                f"prefetch_depth={self.prefetch_depth!r} is not valid; accepted values: an integer >= 0 "
                "(0 turns prefetching off, 2 is a good default)"
            )
        if self.grad_sync not in GRAD_SYNC_MODES:
            raise _choice_error("grad_sync", self.grad_sync, GRAD_SYNC_MODES)
        if self.grad_bucket_mb != "auto":
            try:
                bucket = float(self.grad_bucket_mb)
            except (TypeError, ValueError):
                bucket = math.nan
            if isinstance(self.grad_bucket_mb, bool) or math.isnan(bucket) or bucket < 0:
                raise ValueError(
                    f"grad_bucket_mb={self.grad_bucket_mb!r} is not valid; accepted values: a number of MiB >= 0 "
                    "(0 = one parameter per bucket, inf = one bucket) or 'auto'"
                )
            self.grad_bucket_mb = bucket
        if isinstance(self.grad_comm_dtype, str) and self.grad_comm_dtype.lower() in ("none", ""):
            self.grad_comm_dtype = None   # the command line's spelling of None
        try:
            self.grad_comm_dtype = comm_dtype_name(self.grad_comm_dtype, "grad_comm_dtype")
        except ValueError:
            raise _choice_error("grad_comm_dtype", self.grad_comm_dtype, (None, *COMM_DTYPES)) from None
        if self.comm_stream_priority not in STREAM_PRIORITIES:
            raise _choice_error("comm_stream_priority", self.comm_stream_priority, STREAM_PRIORITIES)
        if self.step_watchdog_s is not None:
            w = self.step_watchdog_s
            if isinstance(w, bool) or not isinstance(w, (int, float)) or math.isnan(w) or w < 0:
                raise ValueError(f"step_watchdog_s={w!r} is not valid; accepted values: None (half of ddp_timeout), "
                                 "0 (off) or seconds > 0")
            self.step_watchdog_s = float(w)
        if not isinstance(self.save_async, bool):
            raise ValueError(f"save_async={self.save_async!r} is not valid; accepted values: True, False")
        if not isinstance(self.stream_report, bool):
            raise ValueError(f"stream_report={self.stream_report!r} is not valid; accepted values: True, False")

    def uses_engine_owning_comm(self) -> bool:
        """FSDP, DeepSpeed or tensor parallelism: engines that own gradient communication."""
        pc = getattr(self, "parallelism_config", None)
        tp = bool(pc is not None and getattr(pc, "tp_enabled", False))
        return bool(self.fsdp) or bool(self.deepspeed) or tp

    @property
    def effective_bucket_mb(self) -> float | str:
        """The bucket cap hfstream's own buckets use (see the module docstring): MiB or "auto"."""
        if self.grad_bucket_mb == DEFAULT_BUCKET_MB and self.ddp_bucket_cap_mb is not None:
            return float(self.ddp_bucket_cap_mb)
        return self.grad_bucket_mb
