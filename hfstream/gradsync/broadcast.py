"""Start every rank from rank 0's weights: averaging gradients of different models averages nonsense.

DDP does the same at construction (``_sync_module_states``). Parameters and buffers are
coalesced into a few flat chunks, one broadcast each, instead of one collective per tensor.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from .buckets import plan_buckets

BROADCAST_CHUNK_MB = 64.0   # size of one coalesced broadcast


class Broadcast(NamedTuple):
    """Broadcasts from rank 0 in flight (`launch_from_rank0`); `land` waits for them and writes the tensors."""

    works: list
    chunks: list   # (flat tensor received into, the tensors it lands in)


@torch.no_grad()
def launch_from_rank0(model: torch.nn.Module, group, buffers_only: bool = False) -> Broadcast:
    """Start broadcasting every parameter and buffer of ``model`` (only buffers: ``buffers_only``) from rank 0."""
    tensors = [*([] if buffers_only else model.named_parameters()), *model.named_buffers()]
    by_name = dict(tensors)
    src = dist.get_global_rank(group, 0) if tensors else 0
    works, chunks = [], []
    for chunk in plan_buckets(tensors, BROADCAST_CHUNK_MB) if tensors else ():
        members = [by_name[n] for n in chunk.names]
        flat = torch.cat([t.detach().reshape(-1) for t in members])
        works.append(dist.broadcast(flat, src=src, group=group, async_op=True))
        chunks.append((flat, members))
    return Broadcast(works, chunks)


@torch.no_grad()
def land(pending: Broadcast) -> None:
    """Wait for the broadcasts and copy rank 0's values into the tensors."""
    for work, (flat, members) in zip(pending.works, pending.chunks):
        work.wait()
        offset = 0
        for t in members:
            t.copy_(flat[offset:offset + t.numel()].view(t.shape))
            offset += t.numel()


def buffer_group(group, note):
    """Under sharded: a process group for the buffer broadcast beside ``group``, over the same ranks.

    [Note: buffer broadcast order] Collectives on one process group run in the order they are
    issued (``ProcessGroupNCCL``: one stream per communicator and device; ``ProcessGroupGloo``: one
    work queue). Under sharded the step's parameter all-gathers are in flight until the next
    forward has waited for them, bucket by bucket; DDP's buffer broadcast before that forward, on
    their group, would wait for every one of them, and the forward with it: the gathers would hide
    behind nothing. On another group it waits for none, and it still happens where DDP's does, at
    the forward, with rank 0's buffers as they are then (an evaluation or a probe forward between
    the step and the next one sees and moves each rank's own, as under DDP). Every rank issues
    the two groups' collectives in the same order (the step's gathers, then the forward's
    broadcast), which is what torch's ``new_group`` docstring asks of several NCCL communicators.
    The default group serves where it is not ``group`` (the Trainer's own NCCL group for the
    gradients, `data_parallel.gradient_group`); else one is created (torch's ``new_group``, which
    every process of the world must call: where ``group`` spans part of the world only, the
    broadcast stays on ``group``, and that is said once).
    """
    ranks = dist.get_process_group_ranks(group)
    if len(ranks) != dist.get_world_size():
        note(f"GradSync(mode='sharded'): the buffer broadcast (broadcast_buffers=True) shares the gradients' "
             f"process group, which is part of the world only, so each training forward's broadcast waits for the "
             f"step's parameter all-gathers. Pass broadcast_buffers=False where rank 0's buffers need not be copied")
        return group
    if group is not dist.group.WORLD:
        return dist.group.WORLD
    return dist.new_group(ranks=ranks)


def broadcast_from_rank0(model: torch.nn.Module, group, buffers_only: bool = False) -> None:
    """Overwrite every parameter and buffer of ``model`` (only buffers: ``buffers_only``) with rank 0's."""
    land(launch_from_rank0(model, group, buffers_only))
