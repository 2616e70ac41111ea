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


def broadcast_from_rank0(model: torch.nn.Module, group, buffers_only: bool = False) -> None:
    """Overwrite every parameter and buffer of ``model`` (only buffers: ``buffers_only``) with rank 0's."""
    land(launch_from_rank0(model, group, buffers_only))
