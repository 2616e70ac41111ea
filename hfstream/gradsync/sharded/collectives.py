"""The two halves of an all-reduce, each with the primitive that is actually cheaper on the backend.

Sharded mode (`sharded`) reduce-scatters gradients and all-gathers parameters. The obvious
primitives are not the cheapest everywhere. On gloo ``reduce_scatter_single`` costs about as
much as a whole all-reduce (docs/design.md section 7: 242 vs 226 ms for 27 MB), because gloo
implements it as one; ``all_to_all_single`` moves the same (N-1)/N of the bytes without the
reduction, and a local sum of the N received chunks finishes the job for about half the time
(119 ms). NCCL has a real ring reduce-scatter, so it is used there. The all-gather is
``all_gather_single`` on every backend (it works on gloo and costs about as much as gloo's list
form, measured by the 2-rank probe in docs/design.md section 7).

torch 2.13 renamed ``reduce_scatter_tensor``/``all_gather_into_tensor`` to
``reduce_scatter_single``/``all_gather_single`` (the old names warn); both are looked up here,
once, so the rest of the package never names either.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def reduces_locally(group) -> bool:
    """True where the reduce-scatter is an all-to-all plus a local sum (gloo), False where the backend reduces (NCCL, ...)."""
    return str(dist.get_backend(group)).lower() == "gloo"


def launch_reduce_scatter(flat: torch.Tensor, out: torch.Tensor, group, local_sum: bool):
    """Start reducing ``flat`` (N equal chunks, one per rank) so that this rank gets the sum of chunk ``rank``.

    Args:
        flat: this rank's contributions, ``N * S`` elements, already divided by N (the sum is the mean).
        out: with ``local_sum``, ``N * S`` elements that receive every rank's chunk for this rank
            (sum them with `sum_received`); otherwise ``S`` elements that receive the sum.
        group: the process group.
        local_sum: `reduces_locally` of the group.

    Returns:
        The async work.
    """
    if local_sum:
        return dist.all_to_all_single(out, flat, group=group, async_op=True)
    return _reduce_scatter(out, flat, op=dist.ReduceOp.SUM, group=group, async_op=True)


def sum_received(received: torch.Tensor, out: torch.Tensor, world_size: int) -> None:
    """Finish an all-to-all reduce-scatter: ``out`` = the sum of the N received chunks, in ``out``'s dtype.

    The additions run in ``out``'s dtype (the parameters'), so a compressed wire (bf16) rounds
    each rank's contribution once and the sum not at all. On the same dtype the first two chunks
    are added straight into ``out``: one pass over memory fewer than a copy and an add (measured
    faster on CPU, docs/benchmarks.md).
    """
    chunks = received.view(world_size, -1)
    if received.dtype == out.dtype and world_size > 1:
        torch.add(chunks[0], chunks[1], out=out)
        rest = chunks[2:]
    else:
        out.copy_(chunks[0])   # into the parameters' dtype first: the sum below runs in it
        rest = chunks[1:]
    for chunk in rest:
        out.add_(chunk)


def launch_all_gather(out: torch.Tensor, mine: torch.Tensor, group):
    """Start gathering every rank's ``mine`` (S elements) into ``out`` (N * S, rank order); returns the async work."""
    return _all_gather(out, mine, group=group, async_op=True)


def host_group(group, note):
    """A group over ``group``'s ranks whose backend reduces CPU tensors: ``group`` itself where it does (gloo).

    For flags that live on the host (which parameters got a gradient here): reducing them there
    makes neither side wait for a device. On NCCL a gloo group is created (torch's ``new_group``,
    which every process of the world must call); where ``group`` spans part of the world only,
    None is returned and that is said once.
    """
    backend = str(dist.get_backend(group)).lower()
    if backend == "gloo" or "cpu:" in backend:
        return group
    ranks = dist.get_process_group_ranks(group)
    if len(ranks) != dist.get_world_size():
        note("GradSync(mode='sharded'): no host group beside a process group that spans part of the world, so a "
             "parameter that no rank used in a step gets a zero mean gradient and is stepped (weight decay, "
             "momentum), where DDP leaves it untouched; freeze such parameters, or use grad_sync='overlap'")
        return None
    return dist.new_group(ranks=ranks, backend="gloo")
