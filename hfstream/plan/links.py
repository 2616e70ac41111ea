"""Links by level: the cost of a collective when a node's devices talk faster to each other than across nodes.

A flat ring at one bandwidth calls 8 GPUs of one NVLink node communication-bound, because it
prices their all-reduce at the network's speed. NCCL instead runs its collectives per level
(NCCL's ``NCCL_ALGO=Ring``/``Tree`` over a topology of NVLink inside the node and one NIC per
GPU across nodes; the decomposition below is the hierarchical all-reduce of Jia et al. 2018,
"Highly Scalable Deep Learning Training System with Mixed-Precision", arXiv:1807.11205, and of
Horovod's ``HOROVOD_HIERARCHICAL_ALLREDUCE``). For ``N = g x n`` devices, ``g`` per node:

    all-reduce of b bytes    reduce-scatter inside the node   (g-1)/g x b / B_intra + (g-1) alpha
                             all-reduce across nodes of b/g   2(n-1)/n x (b/g) / B_inter + 2(n-1) alpha
                             all-gather inside the node       (g-1)/g x b / B_intra + (g-1) alpha
    reduce-scatter (or       half of each: (g-1)/g x b / B_intra + (n-1)/n x (b/g) / B_inter
    all-gather) of b bytes   + (g-1 + n-1) alpha

``B_intra`` is the bus bandwidth of a ring inside the node and ``B_inter`` the network bandwidth
of one device (its own NIC: the g devices of a node each carry 1/g of the bytes across nodes at
once). With ``N <= g`` only the node's ring runs; with ``g = 1`` (or no node size) it is the flat
ring of `predict.allreduce_s`. A world size that is not a multiple of ``g`` is priced as
``ceil(N / g)`` full nodes (the slowest node sets the pace).

Bus bandwidth is nccl-tests' ``busbw``: the all-reduce's ``algbw x 2(N-1)/N``
(github.com/NVIDIA/nccl-tests, doc/PERFORMANCE.md), so a ring's time is ``2(N-1)/N x b / busbw``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Links:
    """The two levels of links a device sees.

    Args:
        inter_gbs: network bandwidth of one device across nodes, GB/s (10**9 B/s); the only
            bandwidth when ``devices_per_node`` is None or 1.
        latency_us: latency of one ring step in microseconds, either level.
        devices_per_node: devices sharing the fast links (8 in an HGX node); None = one flat ring.
        intra_gbs: bus bandwidth of a ring inside the node, GB/s; None = ``inter_gbs``.
    """

    inter_gbs: float
    latency_us: float = 0.0
    devices_per_node: int | None = None
    intra_gbs: float | None = None

    def levels(self, world_size: int) -> tuple[int, int]:
        """``(g, n)``: devices per node in the ring and nodes, for ``world_size`` devices."""
        g = self.devices_per_node or 1
        if world_size <= g:
            return world_size, 1
        return g, math.ceil(world_size / g)

    def all_reduce_s(self, nbytes: float, world_size: int) -> float:
        """Seconds of one all-reduce of ``nbytes`` alone on the links (module docstring)."""
        return 2.0 * self.reduce_scatter_s(nbytes, world_size)

    def reduce_scatter_s(self, nbytes: float, world_size: int) -> float:
        """Seconds of one reduce-scatter (or all-gather) of ``nbytes``: half an all-reduce."""
        if world_size <= 1:
            return 0.0
        g, n = self.levels(world_size)
        intra = self.intra_gbs if self.intra_gbs is not None else self.inter_gbs
        inside = (g - 1) / g * nbytes / (intra * 1e9) if g > 1 else 0.0
        across = (n - 1) / n * (nbytes / g) / (self.inter_gbs * 1e9) if n > 1 else 0.0
        return inside + across + (g - 1 + n - 1) * self.latency_us * 1e-6
