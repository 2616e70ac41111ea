"""Bucket planning: which gradients travel together in one all-reduce.

One all-reduce per parameter pays the per-collective latency hundreds of times; one all-reduce
for the whole model cannot start before the last gradient exists. Buckets of roughly
``bucket_mb`` MiB sit between the two: large enough to amortise latency, small enough that the
first bucket is ready early in backward and its reduction overlaps the rest of backward.

The plan follows PyTorch DDP's reducer (``compute_bucket_assignment_by_size``; Li et al.,
"PyTorch Distributed: Experiences on Accelerating Data Parallel Training", VLDB 2020):

- parameters are taken in *reverse* registration order, the order backward roughly produces
  their gradients (the last layer's gradient is ready first);
- a bucket holds tensors of one dtype on one device (the flat buffer it is reduced in has one
  dtype and lives on one device), so each (dtype, device) pair fills its own buckets;
- a bucket is *filled until it reaches* the cap: it closes as soon as its bytes are >= the cap,
  so every bucket but the last of its (dtype, device) holds at least ``bucket_mb`` MiB, and at
  most the cap plus one parameter. A parameter is never split. ``bucket_mb=0`` therefore gives
  one parameter per bucket and ``float('inf')`` one bucket per (dtype, device);
- the first bucket of each (dtype, device) may have a cap of its own, ``first_bucket_mb``
  (DDP's ``_DEFAULT_FIRST_BUCKET_BYTES``, 1 MiB, under its default cap): the gradients of the
  last layers then leave as soon as they exist instead of waiting for a whole bucket's worth;
- the end of backward's order may be cut finer, ``last_bucket_mb`` (hfstream's, DDP has none):
  the gradients backward produces last, up to one bucket's worth (at most ``bucket_mb``), go in
  buckets of ``last_bucket_mb``. What is left to reduce after backward is then one small
  bucket, not a whole one (sharded mode's default, where that tail is all the step cannot
  hide): DDP's small first bucket, applied to the other end. Those are cut first; the rest is
  filled as above. With ``bucket_mb=inf`` (one bucket) there is no tail to cut;
- the buckets are ordered by their first parameter, i.e. by when they are expected to be ready.
  Every rank computes the same plan from the same model, which is what lets all ranks launch
  the same collectives in the same order.

The planner is pure (no communication, no hooks), so it is also used for the coalesced
broadcast of parameters and buffers at construction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Real
from typing import Sequence

import torch

MiB = 2**20
DDP_BUCKET_MB = 25.0   # DistributedDataParallel's default bucket_cap_mb


@dataclass(frozen=True)
class Bucket:
    """One planned all-reduce.

    Args:
        index: position in the plan; buckets are launched in this order on every rank.
        names: the parameters it carries, in the order they sit in its flat buffer (their
            names in ``model.named_parameters()``; a tied parameter appears once, under its
            first name).
        numel: number of gradient elements.
        nbytes: bytes of those gradients in their own dtype (what ``bucket_mb`` caps).
        dtype: the gradients' dtype.
        device: the device the gradients live on.
    """

    index: int
    names: tuple[str, ...]
    numel: int
    nbytes: int
    dtype: torch.dtype
    device: torch.device


def bucket_cap_bytes(bucket_mb: float, argument: str = "bucket_mb") -> float:
    """Turn a cap in MiB (0 = one parameter per bucket; inf = one bucket) into bytes.

    Raises:
        ValueError: for a negative, NaN or non-numeric value, naming ``argument``.
    """
    if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, Real) or math.isnan(bucket_mb) or bucket_mb < 0:
        raise ValueError(
            f"{argument}={bucket_mb!r} is not valid; accepted values: a number of MiB >= 0 "
            f"(0 = one parameter per bucket, float('inf') = one bucket per dtype and device)"
        )
    return float(bucket_mb) * MiB


def plan_buckets(named_tensors: Sequence[tuple[str, torch.Tensor]], bucket_mb: float,
                 first_bucket_mb: float | None = None, last_bucket_mb: float | None = None) -> list[Bucket]:
    """Group tensors into buckets that close once they reach ``bucket_mb`` MiB, in reverse order.

    The assignment is DDP's (``torch.distributed._compute_bucket_assignment_by_size``): take the
    tensors one by one, add each to the open bucket of its (dtype, device), and close that bucket
    as soon as it holds ``>=`` its cap. Buckets are therefore at least the cap (except the last
    one of each dtype and device) and never split a tensor.

    Args:
        named_tensors: ``(name, tensor)`` pairs in registration order, without duplicates
            (``model.named_parameters()`` already drops the second name of a tied tensor).
        bucket_mb: cap per bucket in MiB; 0 puts every tensor in a bucket of its own,
            ``float('inf')`` gives one bucket per (dtype, device).
        first_bucket_mb: cap of the first bucket of each (dtype, device), the one that holds the
            gradients backward produces first; None = ``bucket_mb``.
        last_bucket_mb: cap of the buckets backward fills last: the end of backward's order, up
            to at most one bucket's worth (``bucket_mb``), is cut at this cap; None = not cut.

    Returns:
        The buckets in launch order (by the position of their first tensor in reverse order).

    >>> layers = [("a.weight", torch.zeros(4, 4)), ("a.bias", torch.zeros(4)), ("b.weight", torch.zeros(4, 4))]
    >>> [b.names for b in plan_buckets(layers, bucket_mb=0)]
    [('b.weight',), ('a.bias',), ('a.weight',)]
    >>> [b.names for b in plan_buckets(layers, bucket_mb=float("inf"))]
    [('b.weight', 'a.bias', 'a.weight')]
    >>> [b.names for b in plan_buckets(layers, bucket_mb=64 / 2**20)]   # 64 B: b.weight alone reaches it
    [('b.weight',), ('a.bias', 'a.weight')]
    >>> [b.names for b in plan_buckets(layers, bucket_mb=96 / 2**20)]   # 96 B: a.weight is left alone
    [('b.weight', 'a.bias', 'a.weight')]
    >>> [b.names for b in plan_buckets(layers, bucket_mb=96 / 2**20, last_bucket_mb=0)]   # the last 80 B cut finer
    [('b.weight',), ('a.bias',), ('a.weight',)]
    """
    cap = bucket_cap_bytes(bucket_mb)
    first_cap = cap if first_bucket_mb is None else bucket_cap_bytes(first_bucket_mb, "first_bucket_mb")
    sequence = list(reversed(list(named_tensors)))   # backward's order
    tail: dict[tuple[torch.dtype, torch.device], list[tuple[int, str, torch.Tensor]]] = {}
    last_cap = None if last_bucket_mb is None else bucket_cap_bytes(last_bucket_mb, "last_bucket_mb")
    if last_cap is not None and math.isfinite(cap):
        tail_bytes: dict[tuple[torch.dtype, torch.device], int] = {}
        full: set[tuple[torch.dtype, torch.device]] = set()
        for order in reversed(range(len(sequence))):   # from the end of backward: one bucket's worth
            name, tensor = sequence[order]
            key, nbytes = (tensor.dtype, tensor.device), tensor.numel() * tensor.element_size()
            if key in full:
                continue
            if key in tail and tail_bytes[key] + nbytes > cap:
                full.add(key)
                continue
            tail.setdefault(key, []).insert(0, (order, name, tensor))
            tail_bytes[key] = tail_bytes.get(key, 0) + nbytes
    in_tail = {id(t) for members in tail.values() for _, _, t in members}
    open_buckets: dict[tuple[torch.dtype, torch.device], list[tuple[int, str, torch.Tensor]]] = {}
    open_bytes: dict[tuple[torch.dtype, torch.device], int] = {}
    closed_keys: set[tuple[torch.dtype, torch.device]] = set()   # keys whose first bucket is closed
    closed: list[list[tuple[int, str, torch.Tensor]]] = []
    for order, (name, tensor) in enumerate(sequence):
        if id(tensor) in in_tail:
            continue
        key = (tensor.dtype, tensor.device)
        members = open_buckets.setdefault(key, [])
        members.append((order, name, tensor))
        open_bytes[key] = open_bytes.get(key, 0) + tensor.numel() * tensor.element_size()
        # Close once the cap is reached (not before it would be exceeded): DDP's rule, so the
        # same cap gives the same buckets, and a tensor larger than the cap is a bucket of its own.
        if open_bytes[key] >= (cap if key in closed_keys else first_cap):
            closed.append(members)
            closed_keys.add(key)
            open_buckets[key], open_bytes[key] = [], 0
    closed.extend(m for m in open_buckets.values() if m)
    for members in tail.values():   # the tail in buckets of last_bucket_mb, the usual closing rule
        size, current = 0, []
        for member in members:
            current.append(member)
            size += member[2].numel() * member[2].element_size()
            if size >= last_cap:
                closed.append(current)
                size, current = 0, []
        if current:
            closed.append(current)
    # Interleave the (dtype, device) streams by expected readiness: the bucket whose first
    # gradient comes earliest in backward goes first.
    closed.sort(key=lambda members: members[0][0])
    return [
        Bucket(
            index=i,
            names=tuple(name for _, name, _ in members),
            numel=sum(t.numel() for _, _, t in members),
            nbytes=sum(t.numel() * t.element_size() for _, _, t in members),
            dtype=members[0][2].dtype,
            device=members[0][2].device,
        )
        for i, members in enumerate(closed)
    ]


def format_plan(buckets: Sequence[Bucket]) -> str:
    """A small table of the plan, one line per bucket (for logs and the course)."""
    lines = [f"{'bucket':>6}  {'MiB':>8}  {'numel':>10}  {'dtype':<15} {'device':<8} parameters"]
    for b in buckets:
        shown = ", ".join(b.names[:3]) + (f", ... (+{len(b.names) - 3})" if len(b.names) > 3 else "")
        lines.append(f"{b.index:>6}  {b.nbytes / MiB:>8.3f}  {b.numel:>10}  {str(b.dtype):<15} {str(b.device):<8} {shown}")
    return "\n".join(lines)
