"""Where each rank's slice of a bucket lies, and the buffers both halves of sharded mode use.

A bucket's parameters sit one after another in a flat layout (plan order), padded to a multiple
of the world size N; rank r owns elements ``[r * size, (r + 1) * size)``. A parameter may lie in
one slice or across several. Its part in one rank's slice is a `Piece`, computed in one place,
`pieces_of`, which everything that cuts or joins slices uses (the optimizer's tensors, loading
and saving its state, a re-plan):

    flat layout   |-- p0 --|------ p1 ------|- p2 -|pad|
    rank 0 slice  |-- p0 --|-p1-|                          pieces (p0 whole), (p1 start)
    rank 1 slice                |-- p1 rest --|- p2 -|pad|  pieces (p1 rest), (p2 whole)

The optimizer steps one tensor per piece (Megatron's distributed optimizer keeps per-parameter
ranges the same way), so each piece has its own state and its own ``.grad``: a parameter that
is frozen gets ``grad=None`` and is skipped, as the unsharded optimizer skips it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Piece(NamedTuple):
    """One parameter's part of one rank's slice."""

    slot: int          # the parameter's position in its bucket
    start: int         # where the part begins in the rank's slice
    end: int
    param_start: int   # the same elements in the parameter, flattened
    param_end: int


def offsets_of(numels: list[int]) -> list[int]:
    """Where each parameter starts in the flat layout."""
    out, offset = [], 0
    for n in numels:
        out.append(offset)
        offset += n
    return out


def pieces_of(offsets: list[int], numels: list[int], size: int, rank: int) -> list[Piece]:
    """The parts of the parameters that fall in ``rank``'s slice ``[rank * size, (rank + 1) * size)``.

    >>> pieces_of([0, 3], [3, 4], size=4, rank=1)   # 7 elements, 2 slices of 4
    [Piece(slot=1, start=0, end=3, param_start=1, param_end=4)]
    """
    lo, hi = rank * size, (rank + 1) * size
    out = []
    for slot, (offset, n) in enumerate(zip(offsets, numels)):
        a, b = max(offset, lo), min(offset + n, hi)
        if b > a:
            out.append(Piece(slot, a - lo, b - lo, a - offset, b - offset))
    return out


class BucketShard:
    """One bucket in sharded mode: its padded layout, this rank's pieces, the buffers of both halves.

    Args:
        st: the bucket's `BucketState`; its ``buffer`` and ``views`` become the padded layout.
        world_size, rank: the data-parallel group's size and this rank's place in it.
        local_sum: the reduce-scatter is an all-to-all plus a local sum (gloo, `collectives`).

    Attributes:
        size: elements per rank (the padded bucket is ``world_size * size``).
        pieces: this rank's `Piece` s, in layout order.
        tensors: what the optimizer steps, one per piece: views of ``master``, with ``.grad``
            views of ``grad``.
        gather: the all-gather in flight, until `write_back` (None otherwise).
        timing: that gather's times for the step report (`stats`).
    """

    def __init__(self, st, world_size: int, rank: int, local_sum: bool):
        self.params = st.params
        dtype, device, wire = st.plan.dtype, st.plan.device, st.wire_dtype
        self.numels = [p.numel() for p in st.params]
        self.offsets = offsets_of(self.numels)
        self.size = -(-sum(self.numels) // world_size)
        padded = self.size * world_size
        self.pieces = pieces_of(self.offsets, self.numels, self.size, rank)
        # Padding is zero and stays zero: packing writes the parameters' views only.
        st.buffer = torch.zeros(padded, dtype=wire, device=device)
        st.views = [st.buffer[o:o + n].view(p.shape) for o, n, p in zip(self.offsets, self.numels, st.params)]
        self.grad = torch.zeros(self.size, dtype=dtype, device=device)
        self.master = torch.zeros(self.size, dtype=dtype, device=device)
        if local_sum:
            self.received = torch.empty(padded, dtype=wire, device=device)
        else:
            self.received = torch.empty(self.size, dtype=wire, device=device) if wire != dtype else None
        # Between finish() and the next launch the gradient buffer is idle: the gather reuses it
        # (`ShardedReduction.prepare` waits for a gather still writing there before packing).
        self.gathered = st.buffer if wire == dtype else torch.empty(padded, dtype=dtype, device=device)
        self.param_views = [self.gathered[o:o + n].view(p.shape)
                            for o, n, p in zip(self.offsets, self.numels, st.params)]
        self.tensors = [self.master[pc.start:pc.end].detach().requires_grad_() for pc in self.pieces]
        self.gather = None
        self.timing = None
        self._versions: list = [None] * len(st.params)   # (storage, version) of each parameter we last wrote or read

    def _seen(self, slots) -> None:
        for s in slots:
            p = self.params[s]
            self._versions[s] = (p.data_ptr(), p._version)

    @torch.no_grad()
    def refresh(self, slots=None) -> None:
        """``master`` = this rank's part of the parameters (those in ``slots``; all by default) as they are now."""
        wanted = range(len(self.params)) if slots is None else set(slots)
        for pc in self.pieces:
            if pc.slot in wanted:
                flat = self.params[pc.slot].detach().reshape(-1)
                self.master[pc.start:pc.end].copy_(flat[pc.param_start:pc.param_end])
        self._seen(wanted)

    def edited(self) -> list[int]:
        """Parameters written since we last wrote or read them (a callback, an EMA swap-in, surgery)."""
        return [s for s, p in enumerate(self.params) if self._versions[s] != (p.data_ptr(), p._version)]

    def set_grads(self) -> None:
        """The mean gradient as the pieces' ``.grad``; None for a parameter frozen now, which the optimizer skips."""
        for pc, t in zip(self.pieces, self.tensors):
            t.grad = self.grad[pc.start:pc.end] if self.params[pc.slot].requires_grad else None

    @torch.no_grad()
    def write_back(self) -> None:
        torch._foreach_copy_(list(self.params), self.param_views)
        self._seen(range(len(self.params)))
