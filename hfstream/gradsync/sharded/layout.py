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

The parameters themselves are views of the bucket's gathered buffer (``gathered``; FSDP1's flat
parameter and Megatron's parameter buffer do the same), so the all-gather writes them where
they are: nothing is copied after a gather. It costs no memory: the buffer replaces the
parameters' own storage (with a bf16/fp16 wire it even saves a copy of them, the gradient
buffer no longer doubling as the gather's). A parameter that cannot be a view (a subclass of
``nn.Parameter``, another dtype) or that was given new storage since (``p.data = ...``) is
copied into after the gather instead, as before. `BucketShard.release` gives each parameter
its own storage back when sharded mode ends, so the model leaves as it came (``safetensors``
refuses tensors that share storage).
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


def slices_of(numels: list[int], world_size: int, rank: int) -> tuple[list[int], int, list["Piece"]]:
    """A bucket's geometry, without a buffer: each parameter's offset, elements per rank, ``rank``'s pieces.

    A re-plan cuts the new buckets' pieces with it before any new buffer exists (`state.carry_over`).

    >>> slices_of([3, 4], world_size=2, rank=1)
    ([0, 3], 4, [Piece(slot=1, start=0, end=3, param_start=1, param_end=4)])
    """
    offsets = offsets_of(numels)
    size = -(-sum(numels) // world_size)
    return offsets, size, pieces_of(offsets, numels, size, rank)


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
        st: the bucket's `BucketState` (its wire ``buffer``, of ``size * world_size`` elements, is the
            strategy's: `sharded.reduction.ShardedReduction`).
        world_size, rank: the data-parallel group's size and this rank's place in it.
        local_sum: the reduce-scatter is an all-to-all plus a local sum (gloo, `collectives`).

    Attributes:
        size: elements per rank (the padded bucket is ``world_size * size``).
        pieces: this rank's `Piece` s, in layout order.
        tensors: what the optimizer steps, one per piece: views of ``master``, with ``.grad``
            views of ``grad``.
        gathered: the padded parameters, all ranks' slices; the parameters are views of it.
        gather: the all-gather in flight, until `write_back` (None otherwise).
        timing: that gather's times for the step report (`stats`).
    """

    def __init__(self, st, world_size: int, rank: int, local_sum: bool):
        self.params = st.params
        dtype, device, wire = st.plan.dtype, st.plan.device, st.wire_dtype
        self.numels = [p.numel() for p in st.params]
        self.offsets, self.size, self.pieces = slices_of(self.numels, world_size, rank)
        padded = self.size * world_size
        self.grad = torch.zeros(self.size, dtype=dtype, device=device)
        self.master = torch.zeros(self.size, dtype=dtype, device=device)
        if local_sum:
            self.received = torch.empty(padded, dtype=wire, device=device)
        else:
            self.received = torch.empty(self.size, dtype=wire, device=device) if wire != dtype else None
        self.gathered = torch.zeros(padded, dtype=dtype, device=device)
        self.param_views = [self.gathered[o:o + n].view(p.shape)
                            for o, n, p in zip(self.offsets, self.numels, st.params)]
        self._attach()
        self.tensors = [self.master[pc.start:pc.end].detach().requires_grad_() for pc in self.pieces]
        self.gather = None
        self.timing = None
        self._versions: list = [None] * len(st.params)   # (storage, version) of each parameter we last wrote or read

    @torch.no_grad()
    def _attach(self) -> None:
        """Each parameter that can be becomes a view of ``gathered``, holding the values it has now."""
        for p, view in zip(self.params, self.param_views):
            view.copy_(p.detach())
            if type(p) is torch.nn.Parameter and p.dtype == view.dtype and p.device == view.device:
                p.data = view

    def viewed(self) -> list[bool]:
        """Per parameter: True if it is (still) a view of ``gathered``, so the gather wrote it in place."""
        return [p.data_ptr() == v.data_ptr() and p.dtype == v.dtype for p, v in zip(self.params, self.param_views)]

    @torch.no_grad()
    def release(self) -> None:
        """Give every parameter that is a view its own storage again (the end of sharded mode)."""
        for p, is_view in zip(self.params, self.viewed()):
            if is_view:
                p.data = p.detach().clone()

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

    def set_grads(self, unused: frozenset = frozenset()) -> None:
        """The mean gradient as the pieces' ``.grad``; None (the optimizer skips it) for a parameter frozen now,
        or whose slot is in ``unused`` (no rank used it in the step, as DDP leaves its ``.grad``)."""
        for pc, t in zip(self.pieces, self.tensors):
            keep = self.params[pc.slot].requires_grad and pc.slot not in unused
            t.grad = self.grad[pc.start:pc.end] if keep else None

    @torch.no_grad()
    def write_back(self) -> None:
        """After the gather: copy into the parameters that are not views of ``gathered`` (usually none)."""
        for p, view, is_view in zip(self.params, self.param_views, self.viewed()):
            if not is_view:
                p.copy_(view)
        self._seen(range(len(self.params)))
