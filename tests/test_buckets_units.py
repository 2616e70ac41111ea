"""The bucket planner's edges, one rule per test: what `tests/test_gradsync.py`'s plan tests do not reach.

Each test here was written against a mutant of `hfstream/gradsync/buckets.py` that the plan tests
let through (docs/design.md, "Mutation testing"): a byte count started at 1 instead of 0, the
launch order left unsorted, a bool taken for a number of MiB, the plan's table.
"""

import math

import pytest
import torch
from torch.distributed import _compute_bucket_assignment_by_size as ddp_assignment
from torch.nn.parallel import distributed as ddp_module

from hfstream.gradsync.buckets import DDP_BUCKET_MB, MiB, bucket_cap_bytes, format_plan, plan_buckets


def _named(*sizes):
    """uint8 tensors of these many bytes each (one byte an element, so any sum can fall one byte
    short of a cap), named t0, t1, ... in registration order; backward's order is the reverse."""
    return [(f"t{i}", torch.zeros(n, dtype=torch.uint8)) for i, n in enumerate(sizes)]


def test_the_default_cap_is_ddps_own():
    assert DDP_BUCKET_MB == ddp_module._DEFAULT_BUCKET_CAP_MB


@pytest.mark.parametrize("sizes", [
    (16, 16, 31, 32),              # backward's order 32, 31: 63 stays open, + 16 = 79 closes
    (16, 31, 32, 64),              # 64 closes; then 32 + 31 = 63 open, + 16 = 79 closes
    (16, 16, 32, 32),              # 32 + 32 = 64: closed at the cap exactly, twice
    (4, 64, 64),                   # a tensor of exactly the cap is a bucket of its own
])
def test_a_bucket_closes_where_ddps_does_a_byte_either_side_of_the_cap(sizes):
    named, cap = _named(*sizes), 64
    params = [t for _, t in named]
    indices, _ = ddp_assignment(params[::-1], [cap], [False] * len(params))
    want = [tuple(named[len(params) - 1 - i][0] for i in bucket) for bucket in indices]
    assert [b.names for b in plan_buckets(named, cap / MiB)] == want
    assert len(want) > 1


def test_the_tail_is_at_most_one_buckets_worth_of_the_last_gradients():
    # cap 64: the tail is the last gradients backward makes (t0, then t1) up to 64 bytes:
    # 16 + 48 = 64 fits exactly, t2 would not; in one tail bucket of 64.
    plan = plan_buckets(_named(16, 48, 64), 64 / MiB, last_bucket_mb=64 / MiB)
    assert [b.names for b in plan] == [("t2",), ("t1", "t0")]
    # Not cut, the same tensors close at the cap the usual way: t2 alone, then t1 + t0.
    assert [b.names for b in plan_buckets(_named(16, 48, 64), 64 / MiB)] == [("t2",), ("t1", "t0")]
    # With a byte more the tail would be t0 alone: t1 + t0 = 65 is over the cap.
    plan = plan_buckets(_named(16, 49, 64), 64 / MiB, last_bucket_mb=64 / MiB)
    assert [b.names for b in plan] == [("t2",), ("t1",), ("t0",)]


def test_each_tail_bucket_counts_its_bytes_from_zero():
    # The tail is t0..t3 (16 + 47 + 16 + 64 = 143 bytes, under the cap of 150; t4 is not), cut in
    # buckets of 64 in backward's order t3, t2, t1, t0: 64 closes; then 16 + 47 = 63 stays open,
    # and 79 closes.
    plan = plan_buckets(_named(16, 47, 16, 64, 200), 150 / MiB, last_bucket_mb=64 / MiB)
    assert [b.names for b in plan] == [("t4",), ("t3",), ("t2", "t1", "t0")]
    # The first tail bucket too: 16 + 47 = 63 is open, 79 closes.
    plan = plan_buckets(_named(16, 47, 16, 200), 150 / MiB, last_bucket_mb=64 / MiB)
    assert [b.names for b in plan] == [("t3",), ("t2", "t1", "t0")]


def test_buckets_of_several_dtypes_are_launched_by_when_their_first_gradient_is_ready():
    # Backward's order: c (fp32, 16 B), b (bf16, 64 B: closes first), a (fp32, 48 B: closes [c, a]).
    # The fp32 bucket closes after the bf16 one but holds the first gradient: it goes first.
    named = [("a", torch.zeros(12)), ("b", torch.zeros(32, dtype=torch.bfloat16)), ("c", torch.zeros(4))]
    plan = plan_buckets(named, 64 / MiB)
    assert [(b.names, b.dtype, b.index) for b in plan] == [(("c", "a"), torch.float32, 0),
                                                          (("b",), torch.bfloat16, 1)]


@pytest.mark.parametrize("bad", [True, False, "1", None, float("nan"), -1.0])
def test_a_cap_that_is_not_a_number_of_mib_is_refused_by_name(bad):
    with pytest.raises(ValueError, match=r"^first_bucket_mb=.* is not valid"):
        bucket_cap_bytes(bad, "first_bucket_mb")


def test_caps_in_bytes():
    assert bucket_cap_bytes(0) == 0.0 and bucket_cap_bytes(1) == MiB and bucket_cap_bytes(0.5) == MiB / 2
    assert math.isinf(bucket_cap_bytes(math.inf))


def test_format_plan_is_one_line_per_bucket_with_its_size_and_first_names():
    named = [(f"layer{i}.weight", torch.zeros(2**16)) for i in range(5)] + [("head.bias", torch.zeros(4))]
    plan = plan_buckets(named, 0.5)   # 256 KiB a layer: the head's bias and two layers reach 0.5 MiB
    text = format_plan(plan).splitlines()
    assert len(text) == 1 + len(plan) == 4
    assert text[0].split() == ["bucket", "MiB", "numel", "dtype", "device", "parameters"]
    assert text[1].split()[:5] == ["0", "0.500", "131076", "torch.float32", "cpu"]
    assert text[1].endswith("head.bias, layer4.weight, layer3.weight")
    assert text[3].split()[:3] == ["2", "0.250", "65536"] and text[3].endswith(" layer0.weight")
    (one,) = plan_buckets(named, math.inf)
    line = format_plan([one]).splitlines()[1]
    assert line.split()[1] == f"{one.nbytes / MiB:.3f}" == "1.250"
    assert line.endswith("head.bias, layer4.weight, layer3.weight, ... (+3)")
    (four,) = plan_buckets(named[2:], math.inf)
    assert format_plan([four]).splitlines()[1].endswith("head.bias, layer4.weight, layer3.weight, ... (+1)")
    (three,) = plan_buckets(named[3:], math.inf)
    assert format_plan([three]).splitlines()[1].endswith("head.bias, layer4.weight, layer3.weight")
