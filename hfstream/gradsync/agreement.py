"""Decisions every rank takes together: one small all-reduce where one rank's own view could differ.

[Note: ranks agree] Collectives are matched by the order each rank issues them. A decision that
changes which collectives a rank issues (whether a step gathers whole gradients, whether an event
gathers them for a callback, ...) read from one rank's own history splits the ranks the first
time user code acts on one rank only (a log line on the main process that reads ``.grad``, a
callback added there): one rank waits in a gather its peer never issues. So such a decision is
taken once, at the point every rank reaches, by `any_rank` (the logical OR over ranks), or it
follows from state every rank shares (the model, the arguments, a broadcast). docs/design.md
lists each decision and how it is agreed.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist


def any_rank(flags: Sequence[bool], group, device: torch.device) -> list[bool]:
    """Each flag OR-ed over the ranks of ``group``: a collective, to call at the same point on every rank.

    One all-reduce of ``len(flags)`` bytes and one host read: meant for decisions taken once (the
    first step) or rarely, not for every step on an accelerator.

    Args:
        flags: this rank's view of each decision.
        group: the process group; None means one process (the flags are returned as they are).
        device: where the tensor travels (one every backend of ``group`` serves: the gradients' device).

    >>> any_rank([True, False], None, torch.device("cpu"))
    [True, False]
    """
    if group is None or dist.get_world_size(group) == 1:
        return [bool(f) for f in flags]
    t = torch.tensor([int(bool(f)) for f in flags], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return [v > 0 for v in t.tolist()]
