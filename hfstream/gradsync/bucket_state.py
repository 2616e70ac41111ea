"""One bucket at run time: its parameters, its flat buffer, what is in flight, and its phase.

`Bucket` (buckets.py) is the plan: names and sizes, the same on every rank. `BucketState` is
what one rank holds for it while training. Its phase is explicit (FSDP2's ``TrainingState`` is
the model) and every change of phase is checked, so a bucket cannot be launched twice, packed
while its reduction still reads the buffer, or reused while an all-gather still writes it:

    COLLECTING --launch--> REDUCING --reduced--> COLLECTING          every mode
    COLLECTING --optimizer.step()--> GATHERING --waited--> COLLECTING   mode="sharded"
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

import torch

from .buckets import Bucket

if TYPE_CHECKING:
    from .sharded.layout import BucketShard


class Phase(enum.Enum):
    COLLECTING = "collecting"   # gradients arrive through the hooks; no collective uses the buffer
    REDUCING = "reducing"       # its all-reduce / reduce-scatter is in flight
    GATHERING = "gathering"     # mode="sharded": the all-gather of its updated parameters is in flight


_ALLOWED = {
    Phase.COLLECTING: {Phase.REDUCING, Phase.GATHERING},
    Phase.REDUCING: {Phase.COLLECTING},
    Phase.GATHERING: {Phase.COLLECTING},
}


class BucketState:
    """One bucket on this rank. The reduction strategy (`reduction`, `sharded`) owns the buffers.

    Args:
        plan: the bucket in the plan.
        params: its parameters, in plan order.
        wire_dtype: the dtype it travels in (the gradients', or ``comm_dtype``).
    """

    def __init__(self, plan: Bucket, params: list[torch.nn.Parameter], wire_dtype: torch.dtype):
        self.plan, self.params, self.wire_dtype = plan, params, wire_dtype
        self.buffer: torch.Tensor | None = None   # the flat buffer the collective reads, allocated at first launch
        self.views: list[torch.Tensor] = []       # each parameter's gradient in it, in the parameter's shape
        # Each strategy's own per-bucket data, one attribute per mode, each None under the other:
        self.as_view: list[bool] | None = None    # overlap: whether each .grad can be its slice of `buffer`
        self.shard: BucketShard | None = None     # sharded: this rank's pieces, master and gathered storage
        self.phase = Phase.COLLECTING
        self.reset()

    def reset(self) -> None:
        """A new step: no gradient seen, nothing in flight (also after a failure: see ``GradSync.broken``)."""
        n = len(self.params)
        self.used = [False] * n    # got a gradient since the last finish() (no_sync steps too)
        self.ready = [False] * n   # got one in the current synchronised backward (or is frozen)
        self.pending = n           # parameters not ready yet
        self.work = self.done = None   # the reduction in flight and its completion future
        self.launch_time = self.end_time = self.start_event = self.end_event = None
        if self.phase is Phase.REDUCING:
            self.phase = Phase.COLLECTING

    def move(self, to: Phase) -> None:
        """Change phase; raises on a change the lifecycle does not allow (a bug, never a user error)."""
        if to not in _ALLOWED[self.phase]:
            raise RuntimeError(f"GradSync: bucket {self.plan.index} cannot go from {self.phase.name} to {to.name}")
        self.phase = to

    def mark_ready(self, slot: int) -> bool:
        """Parameter ``slot`` is ready for this step; True if it was not before."""
        if self.ready[slot]:
            return False
        self.ready[slot] = True
        self.pending -= 1
        return True
