"""`gradsync/order.py`: rank 0's arrival order wins on every rank, the never-arrived go last.

Two gloo ranks record different arrival orders on purpose (a rank whose backward produced its
gradients in another order, or skipped a parameter); both must plan with rank 0's, as DDP's
``Reducer::rebuild_buckets`` does, or their buckets would differ and the collectives mismatch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hfstream.gradsync.order import ArrivalOrder, planning_sequence


def agree_on(rank, world_size):
    order = ArrivalOrder(4)
    arrivals = [2, 0, 2] if rank == 0 else [0, 1, 3, 2]      # rank 0: 1 and 3 never arrive
    for i in arrivals:
        order.arrived(i)
    seen = [order.seen(i) for i in range(4)]
    agreed = order.agree(dist.group.WORLD, torch.device("cpu"))
    return agreed, seen, order.done


def test_every_rank_takes_rank_0s_order_with_its_never_arrived_last(run_distributed):
    (a0, seen0, done0), (a1, seen1, done1) = run_distributed(agree_on, 2, timeout=60)
    assert a0 == a1 == [2, 0, 3, 1]       # arrived, a repeat ignored; then reverse registration
    assert seen0 == [True, False, True, False] and seen1 == [True] * 4
    assert done0 and done1


def test_the_planner_walking_backwards_meets_the_order():
    named = ["p0", "p1", "p2", "p3"]
    assert planning_sequence(named, [2, 0, 3, 1]) == ["p1", "p3", "p0", "p2"]
