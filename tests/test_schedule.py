"""`hfstream.report.schedule`, the one-link model the planner and the advice share, on cases worked by hand.

Each expected number is derived in the comment beside it from the rules in the module's
docstrings (one collective at a time on the link; the sharded step bucket by bucket in forward
order, its gathers launched at once; the forward waiting for a bucket when it reaches it).
"""

from __future__ import annotations

import pytest

from hfstream.report.schedule import overlap_exposed, sharded_step


def test_overlap_exposes_what_the_link_still_owes_after_backward():
    # bwd 10: bucket 0 ready at 5, done at 7; bucket 1 ready at 10, done at 12: 2 ms after backward
    assert overlap_exposed([2.0, 2.0], [0.5, 1.0], 10.0) == pytest.approx(2.0)
    # a bucket queued behind a busy link: 0 ready at 1 (runs 1-9), 1 ready at 5 waits, runs 9-12
    assert overlap_exposed([8.0, 3.0], [0.1, 0.5], 10.0) == pytest.approx(2.0)
    # all done inside backward: nothing exposed (not negative)
    assert overlap_exposed([1.0], [0.5], 10.0) == 0.0


def test_sharded_step_on_one_rank_is_the_plain_step():
    assert sharded_step([1.0, 2.0], [0.5, 1.0], 1, 3.0, 4.0, 5.0) == {
        "optimizer_sharded_ms": 5.0, "reduce_scatter_busy_ms": 0.0, "reduce_scatter_exposed_ms": 0.0,
        "all_gather_busy_ms": 0.0, "all_gather_exposed_ms": 0.0, "step_sharded_ms": 12.0, "cross_step_limit_ms": 12.0}


def test_sharded_step_forward_waits_for_a_gather_it_reaches_first():
    # t = [1, 1, 2], ready = [0.25, 0.5, 1], 2 ranks, fwd 4, bwd 8, opt 4 (2 per rank).
    # Step in forward order, shares of 2 ms by wire time: bucket 2 stepped by 1, gathered 1-3;
    # bucket 1 by 1.5, gathered 3-4; bucket 0 by 2, gathered 4-5.
    # Forward from 2: bucket 2 (half the forward, 2 ms) waits for 3, runs to 5; bucket 1 (1 ms)
    # to 6; bucket 0 (1 ms) to 7: 1 ms of all-gather exposed.
    # Backward 7-15; reduce-scatters: 9-10, 11-12, 15-17: 2 ms exposed. Step 4+1+8+2+2 = 17.
    assert sharded_step([1.0, 1.0, 2.0], [0.25, 0.5, 1.0], 2, 4.0, 8.0, 4.0) == pytest.approx({
        "optimizer_sharded_ms": 2.0, "reduce_scatter_busy_ms": 4.0, "reduce_scatter_exposed_ms": 2.0,
        "all_gather_busy_ms": 4.0, "all_gather_exposed_ms": 1.0, "step_sharded_ms": 17.0,
        "cross_step_limit_ms": 14.0})


def test_sharded_step_hides_everything_when_compute_covers_the_link():
    # t = [0.5, 0.5], ready = [0.5, 0.9], fwd 10, bwd 10, opt 2 (1 per rank): gathers done by 1.5,
    # forward 1-10 never waits; backward 10-20, reduce-scatters 15-15.5 and 19-19.5: nothing exposed.
    got = sharded_step([0.5, 0.5], [0.5, 0.9], 2, 10.0, 10.0, 2.0)
    assert got["all_gather_exposed_ms"] == 0.0 and got["reduce_scatter_exposed_ms"] == 0.0
    assert got["step_sharded_ms"] == pytest.approx(21.0) and got["cross_step_limit_ms"] == pytest.approx(21.0)


def test_sharded_limit_is_the_link_when_the_link_is_the_bottleneck():
    # busy = both halves = 2 x 20; compute = 2 + 4 + 2/2 = 7: the limit is the link's 40
    got = sharded_step([10.0, 10.0], [0.5, 1.0], 2, 2.0, 4.0, 2.0)
    assert got["reduce_scatter_busy_ms"] == got["all_gather_busy_ms"] == 20.0
    assert got["cross_step_limit_ms"] == pytest.approx(40.0)


def test_the_clock_starts_at_zero_a_bucket_ready_at_once_starts_at_once():
    # overlap: bwd 2, one 3 ms bucket ready at 0 runs 0-3: 1 ms after backward (not 1-4, 2 ms).
    assert overlap_exposed([3.0], [0.0], 2.0) == pytest.approx(1.0)
    # sharded, an optimizer of no time: the gather launches at 0 and ends at 1, the forward (2 ms)
    # waits for it, 1-3: 1 ms exposed; backward 3-5, its reduce-scatter 5-6: 1 ms. Step 2+1+2+1 = 6.
    got = sharded_step([1.0], [1.0], 2, 2.0, 2.0, 0.0)
    assert (got["all_gather_exposed_ms"], got["reduce_scatter_exposed_ms"], got["step_sharded_ms"]) == \
        pytest.approx((1.0, 1.0, 6.0))
