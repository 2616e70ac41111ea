"""The order buckets are planned in: reverse registration first, then the order gradients arrived.

Reverse registration order is only a guess at the order backward produces gradients. Where it is
wrong, a bucket waits for a gradient that comes late or never -- a trainable parameter the loss
does not use (an unused pooler, an unrouted expert) registered last sits in the *first* bucket,
and since buckets launch in plan order, nothing launches before ``finish()``: every reduction is
exposed, silently. DDP fixes this by rebuilding its buckets from the order gradients arrived in
the first iteration (``Reducer::rebuild_buckets``, rank 0's order broadcast to all); so does
`ArrivalOrder`. Parameters that never got a gradient on rank 0 go last, so they cost at most
their own bucket.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class ArrivalOrder:
    """Records the order gradient hooks fire in the first synchronised step; rank 0's order wins.

    Args:
        num_params: hooked parameters, indexed in registration order.
    """

    def __init__(self, num_params: int):
        self.num_params = num_params
        self._arrived: list[int] = []
        self._seen = [False] * num_params
        self.done = False

    def arrived(self, i: int) -> None:
        if not self._seen[i]:
            self._seen[i] = True
            self._arrived.append(i)

    def seen(self, i: int) -> bool:
        """Parameter ``i`` got a gradient on this rank in the first synchronised step."""
        return self._seen[i]

    def agree(self, group, device: torch.device) -> list[int]:
        """Rank 0's arrival order, never-arrived parameters last (reverse registration): a collective."""
        order = self._arrived + [i for i in reversed(range(self.num_params)) if not self._seen[i]]
        t = torch.tensor(order, dtype=torch.int64, device=device)
        dist.broadcast(t, src=dist.get_global_rank(group, 0), group=group)
        self.done = True
        return t.tolist()


def planning_sequence(named: list, order: list[int]) -> list:
    """``named`` rearranged so that the planner, which walks its input backwards, meets ``order``."""
    return [named[i] for i in reversed(order)]
