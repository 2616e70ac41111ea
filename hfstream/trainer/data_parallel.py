"""How the Trainer's data parallelism is set up: which ``grad_sync`` mode runs, on which process group.

`resolve_grad_sync` turns ``grad_sync="auto"`` into a mode and refuses a mode that cannot work
with the engine Accelerate runs; `gradient_group` creates the process group the gradient
collectives run on, once per trainer.
"""

from __future__ import annotations

import datetime
import logging

from accelerate.utils import DistributedType

from ..gradsync.options import Mode
from ..log import notice

logger = logging.getLogger(__name__)

# Plain data parallel: one full replica per process, gradients averaged by an all-reduce.
PLAIN_DP = {
    DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU,
    DistributedType.MULTI_XPU, DistributedType.MULTI_NPU, DistributedType.MULTI_MLU,
    DistributedType.MULTI_SDAA, DistributedType.MULTI_MUSA, DistributedType.MULTI_HPU,
} - {None}


def model_is_tensor_parallel(model, loaded_distributed: bool) -> bool:
    """A model transformers sharded at load time (tensor parallel): its parameters are DTensors."""
    if loaded_distributed:
        return True
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return False
    return model is not None and any(isinstance(p, DTensor) for p in model.parameters())


def resolve_grad_sync(args, accelerator, tensor_parallel_model: bool) -> Mode:
    """'auto' -> 'overlap' under plain multi-process data parallel, else 'native' (said once, see `notice`).

    Raises:
        ValueError: an hfstream mode asked for where FSDP, DeepSpeed or tensor parallelism owns
            gradient communication.
    """
    requested = args.grad_sync if args.grad_sync == "auto" else Mode(args.grad_sync)
    engine = accelerator.distributed_type
    plain_dp = engine in PLAIN_DP and not args.uses_engine_owning_comm() and not tensor_parallel_model
    if requested != "auto" and requested.by_gradsync and not plain_dp:
        owner = ("the model was sharded at load time (DTensor parameters / from_pretrained(distributed_config=...))"
                 if tensor_parallel_model else f"Accelerate runs {engine}")
        raise ValueError(
            f"grad_sync={requested!r} needs plain data parallel, but {owner}: FSDP, DeepSpeed and tensor "
            "parallelism own gradient communication. Use grad_sync='native'.")
    if requested != "auto":
        if requested.by_gradsync and accelerator.num_processes == 1:
            notice(logger, "hfstream: grad_sync=%r on one process: there is nothing to synchronise, so no gradient "
                   "is communicated (prefetching and the step report still apply); it takes effect under "
                   "`accelerate launch` with several processes", requested)
        return requested
    multi = accelerator.num_processes > 1
    if multi and (args.uses_engine_owning_comm() or tensor_parallel_model):
        logger.warning("hfstream: grad_sync='auto' falls back to 'native': FSDP/DeepSpeed/tensor parallelism (or a "
                       "model sharded at load time) own gradient communication (prefetching still applies)")
        return Mode.NATIVE
    mode = Mode.OVERLAP if plain_dp and multi and args.n_gpu <= 1 else Mode.NATIVE
    reason = ("plain multi-process data parallel" if mode is Mode.OVERLAP
              else f"distributed type {engine}, {accelerator.num_processes} process(es)")
    notice(logger, "hfstream: grad_sync='auto' resolved to %r (%s)", mode, reason)
    return mode


def gradient_group(args):
    """A group of the gradient collectives' own where they need one; else None (the default group).

    One is made for ``comm_stream_priority="high"``: NCCL fixes its stream's priority when the
    communicator is created, so the default group (made by Accelerate) cannot be raised
    afterwards. One is made for ``grad_sync="sharded"`` whatever the priority: its parameter
    all-gathers are in flight across the next forward, and a communicator runs its collectives
    in the order they were queued, so on the default group the Trainer's per-step
    ``accelerator.gather(num_items_in_batch)`` (before the forward) would wait for every
    gather. So on gloo too (its work queue is a FIFO as well, ``ProcessGroupGloo.hpp``'s
    ``workQueue_``): a 2-rank sharded run on a 200 Mbit/s link waited 47 ms a step for that gather
    on the default group, 31 ms on its own (the rest is the link itself, still busy with the
    gathers), and stepped in 114 ms instead of 130. Under "overlap"/"serial" with normal priority
    the default group is kept: every gradient collective has finished at ``finish()``, before the
    step, so nothing of the Trainer's queues behind one. A mixed backend ("cpu:gloo,cuda:nccl")
    counts as NCCL: its CUDA collectives are. The Trainer creates the group once and reuses it for every ``train()`` (a
    communicator per call would pile up over a hyperparameter search).
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    high = args.comm_stream_priority == "high"
    sharded = getattr(args, "grad_sync", None) == Mode.SHARDED
    if not (high or sharded):
        return None
    timeout = datetime.timedelta(seconds=args.ddp_timeout)
    backend = str(dist.get_backend())
    if sharded and "nccl" not in backend and "gloo" in backend:
        return dist.new_group(backend="gloo", timeout=timeout)
    if "nccl" not in backend or not hasattr(dist, "ProcessGroupNCCL"):
        return None
    options = dist.ProcessGroupNCCL.Options()
    options.is_high_priority_stream = high
    # new_group() compares the options' own timeout with its argument and warns on every rank when
    # they differ; this is the attribute it reads (and then overwrites with the argument).
    options._timeout = timeout
    return dist.new_group(backend="nccl", pg_options=options, timeout=timeout)
