"""The bench's account of a sharded step over the cross-step limit (hfstream/cli/bench/over_limit.py)."""

import pytest

from hfstream.cli.bench.over_limit import PARTS, format_over_limit, over_limit

SERIAL = dict(forward_ms=200.0, backward_ms=240.0, optimizer_ms=40.0, comm_busy_ms=300.0)


def test_every_millisecond_over_serials_compute_is_in_one_part():
    mode = dict(forward_ms=198.0, backward_ms=257.0, reduce_scatter_exposed_ms=16.0, all_gather_exposed_ms=0.4,
                optimizer_ms=21.5, data_wait_ms=0.5, step_ms=503.0)
    split = over_limit(mode, SERIAL, world_size=2, limit_ms=460.0)
    assert split["compute_ms"] == pytest.approx(200 + 240 + 20)
    assert split["over_ms"] == pytest.approx(43.0)
    assert tuple(split["parts"]) == PARTS
    assert sum(split["parts"].values()) == pytest.approx(503 - 460)
    assert split["parts"]["backward"] == pytest.approx(17.0) and split["parts"]["rest"] == pytest.approx(9.6)
    line = format_over_limit("sharded", split)
    assert line.startswith("  sharded: 43 ms over the limit") and "backward +17" in line and "rest +10" in line


def test_a_step_under_a_comm_bound_limit_says_so():
    mode = dict(forward_ms=200.0, backward_ms=240.0, optimizer_ms=20.0, step_ms=560.0, reduce_scatter_exposed_ms=100.0)
    split = over_limit(mode, dict(SERIAL, comm_busy_ms=600.0), world_size=2, limit_ms=600.0)
    assert split["over_ms"] == pytest.approx(-40.0)
    assert "at or under the limit (-40 ms)" in format_over_limit("sharded", split)
