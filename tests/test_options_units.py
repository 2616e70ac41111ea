"""`gradsync/options.py`: every accepted value of GradSync's arguments is accepted, every other refused by name.

`StreamTrainingArguments` checks its fields against these names, so a value refused here is
refused before a Trainer is built; a value accepted here must not fail later. The refusals of
GradSync itself are in `test_gradsync.py`; this holds the accepting side and the timeout.
"""

from __future__ import annotations

import math

import pytest
import torch

from hfstream.gradsync.options import (COMM_DTYPES, DEFAULT_TIMEOUT_S, MODES, STREAM_PRIORITIES, check_arguments,
                                       comm_dtype_name)


@pytest.mark.parametrize("value, name", [
    (None, None), ("bf16", "bf16"), ("BF16", "bf16"), ("bfloat16", "bf16"), (torch.bfloat16, "bf16"),
    ("fp16", "fp16"), ("float16", "fp16"), ("Half", "fp16"), (torch.float16, "fp16"),
])
def test_each_wire_dtype_spelling_gives_its_short_name(value, name):
    assert comm_dtype_name(value) == name


@pytest.mark.parametrize("value", ["fp32", torch.float32, 16, "", "bf 16"])
def test_other_wire_dtypes_are_refused_naming_the_argument_given(value):
    with pytest.raises(ValueError, match=r"^ddp_comm_dtype=.* is not valid; accepted values: None .*'bf16'.*'fp16'"):
        comm_dtype_name(value, argument="ddp_comm_dtype")


def test_the_names_are_the_documented_ones():
    assert MODES == ("overlap", "serial", "sharded")
    assert STREAM_PRIORITIES == ("normal", "high")
    assert COMM_DTYPES == {"bf16": torch.bfloat16, "fp16": torch.float16}
    assert DEFAULT_TIMEOUT_S == 1800.0   # torch's default process-group timeout (30 min)


def good(**over):
    kw = dict(mode="overlap", bucket_mb="auto", first_bucket_mb=None, comm_stream_priority="high", timeout=None,
              last_bucket_mb=None)
    kw.update(over)
    return kw


@pytest.mark.parametrize("over", [
    {}, dict(mode="serial"), dict(mode="sharded"), dict(bucket_mb=0), dict(bucket_mb=25), dict(bucket_mb=math.inf),
    dict(first_bucket_mb=1), dict(last_bucket_mb=0.5), dict(comm_stream_priority="normal"), dict(timeout=1),
    dict(timeout=0.5), dict(timeout=1800.0),
])
def test_every_accepted_value_passes(over):
    check_arguments(**good(**over))


@pytest.mark.parametrize("timeout", [0, -1, True, False, "60", float("nan"), [60]])
def test_a_timeout_that_is_not_positive_seconds_is_refused_with_the_default_named(timeout):
    with pytest.raises(ValueError, match=r"^timeout=.* is not valid; give seconds > 0 .* or None for 1800 s"):
        check_arguments(**good(timeout=timeout))


@pytest.mark.parametrize("over, argument", [
    (dict(mode="Overlap"), "mode"), (dict(bucket_mb="auto "), "bucket_mb"),
    (dict(first_bucket_mb="auto"), "first_bucket_mb"), (dict(last_bucket_mb="auto"), "last_bucket_mb"),
    (dict(comm_stream_priority="HIGH"), "comm_stream_priority"),
])
def test_near_misses_are_refused_by_name(over, argument):
    with pytest.raises(ValueError, match=rf"^{argument}="):
        check_arguments(**good(**over))


def test_a_bad_cap_is_told_that_auto_is_accepted_too():
    with pytest.raises(ValueError, match=r"bucket_mb=.*, or 'auto' \(tuned online"):
        check_arguments(**good(bucket_mb=-1))
    with pytest.raises(ValueError) as refused:   # first_bucket_mb has no 'auto'
        check_arguments(**good(first_bucket_mb=-1))
    assert "'auto'" not in str(refused.value)
