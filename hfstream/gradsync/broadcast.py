"""Start every rank from rank 0's weights: averaging gradients of different models averages nonsense.

DDP does the same at construction (``_sync_module_states``). Parameters and buffers are
coalesced into a few flat chunks, one broadcast each, instead of one collective per tensor.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .buckets import plan_buckets

BROADCAST_CHUNK_MB = 64.0   # size of one coalesced broadcast


@torch.no_grad()
def broadcast_from_rank0(model: torch.nn.Module, group, buffers_only: bool = False) -> None:
    """Overwrite every parameter and buffer of ``model`` (only buffers: ``buffers_only``) with rank 0's."""
    tensors = [*([] if buffers_only else model.named_parameters()), *model.named_buffers()]
    if not tensors:
        return
    by_name = dict(tensors)
    src = dist.get_global_rank(group, 0)
    for chunk in plan_buckets(tensors, BROADCAST_CHUNK_MB):
        members = [by_name[n] for n in chunk.names]
        flat = torch.cat([t.detach().reshape(-1) for t in members])
        dist.broadcast(flat, src=src, group=group)
        offset = 0
        for t in members:
            t.copy_(flat[offset:offset + t.numel()].view(t.shape))
            offset += t.numel()
