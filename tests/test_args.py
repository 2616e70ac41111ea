"""StreamTrainingArguments: defaults, command-line parsing, and a clear error for every bad value."""

import math

import pytest
from transformers import HfArgumentParser

from hfstream import StreamTrainingArguments


def make(tmp_path, **kw):
    return StreamTrainingArguments(output_dir=str(tmp_path), report_to=[], **kw)


def test_defaults(tmp_path):
    a = make(tmp_path)
    assert (a.prefetch_depth, a.grad_sync, a.grad_bucket_mb, a.grad_comm_dtype, a.comm_stream_priority,
            a.stream_report) == (2, "auto", "auto", None, "high", True)


def test_every_field_parses_from_the_command_line(tmp_path):
    (a,) = HfArgumentParser(StreamTrainingArguments).parse_args_into_dataclasses([
        "--output_dir", str(tmp_path), "--prefetch_depth", "4", "--grad_sync", "serial", "--grad_bucket_mb", "inf",
        "--grad_comm_dtype", "bf16", "--comm_stream_priority", "normal", "--no_stream_report", "--report_to", "none"])
    assert (a.prefetch_depth, a.grad_sync, a.grad_comm_dtype, a.comm_stream_priority, a.stream_report) == \
        (4, "serial", "bf16", "normal", False)
    assert math.isinf(a.grad_bucket_mb)


def test_command_line_rejects_unknown_choice(tmp_path, capsys):
    with pytest.raises(SystemExit):
        HfArgumentParser(StreamTrainingArguments).parse_args_into_dataclasses(
            ["--output_dir", str(tmp_path), "--grad_sync", "ring"])
    assert "grad_sync" in capsys.readouterr().err


@pytest.mark.parametrize("field,value,accepted", [
    ("prefetch_depth", -1, "integer >= 0"),
    ("prefetch_depth", 1.5, "integer >= 0"),
    ("prefetch_depth", True, "integer >= 0"),
    ("grad_sync", "ddp", "'overlap'"),
    ("grad_bucket_mb", -1.0, ">= 0"),
    ("grad_bucket_mb", float("nan"), ">= 0"),
    ("grad_bucket_mb", "big", "'auto'"),
    ("grad_bucket_mb", "Auto", "'auto'"),
    ("grad_comm_dtype", "int8", "'bf16'"),
    ("comm_stream_priority", "urgent", "'high'"),
    ("stream_report", "yes", "True, False"),
])
def test_bad_values_name_the_field_and_the_accepted_values(tmp_path, field, value, accepted):
    with pytest.raises(ValueError) as err:
        make(tmp_path, **{field: value})
    assert field in str(err.value) and accepted in str(err.value)


def test_bucket_auto_and_numbers_from_the_command_line(tmp_path):
    parse = HfArgumentParser(StreamTrainingArguments).parse_args_into_dataclasses
    (a,) = parse(["--output_dir", str(tmp_path), "--grad_bucket_mb", "auto", "--report_to", "none"])
    (b,) = parse(["--output_dir", str(tmp_path), "--grad_bucket_mb", "4", "--report_to", "none"])
    assert a.grad_bucket_mb == "auto" and a.effective_bucket_mb == "auto" and b.grad_bucket_mb == 4.0


def test_comm_dtype_aliases(tmp_path):
    assert make(tmp_path, grad_comm_dtype="bfloat16").grad_comm_dtype == "bf16"
    assert make(tmp_path, grad_comm_dtype="float16").grad_comm_dtype == "fp16"


@pytest.mark.parametrize("mode", ["overlap", "serial"])
def test_hfstream_sync_with_fsdp_says_use_native(tmp_path, mode):
    with pytest.raises(ValueError, match="grad_sync='native'"):
        make(tmp_path, grad_sync=mode, fsdp="full_shard")


@pytest.mark.parametrize("mode", ["overlap", "serial"])
def test_hfstream_sync_with_deepspeed_says_use_native_before_deepspeed_is_imported(tmp_path, mode):
    # DeepSpeed is not installed on CPU machines; the error must come first, from hfstream.
    with pytest.raises(ValueError, match="grad_sync='native'"):
        make(tmp_path, grad_sync=mode, deepspeed={"train_micro_batch_size_per_gpu": "auto"})


@pytest.mark.parametrize("field,bad", [("step_watchdog_s", -1), ("step_watchdog_s", "soon"), ("step_watchdog_s", True)])
def test_watchdog_rejects_bad_values(tmp_path, field, bad):
    with pytest.raises(ValueError, match=field):
        make(tmp_path, **{field: bad})


def test_bucket_falls_back_to_ddp_bucket_cap(tmp_path):
    assert make(tmp_path, ddp_bucket_cap_mb=4).effective_bucket_mb == 4.0
    assert make(tmp_path, ddp_bucket_cap_mb=4, grad_bucket_mb=8).effective_bucket_mb == 8.0
    assert make(tmp_path).effective_bucket_mb == "auto"
    assert make(tmp_path, grad_bucket_mb=25).effective_bucket_mb == 25.0


def test_hfstream_log_lines_carry_the_prefix_once():
    import logging

    from hfstream.log import Prefixed

    def shown(message):
        return Prefixed().format(logging.LogRecord("hfstream.x", logging.WARNING, __file__, 1, message, (), None))

    assert shown("hfstream watchdog: rank 0 has been waiting") == "[hfstream] watchdog: rank 0 has been waiting"
    assert shown("hfstream: grad_sync='auto' resolved") == "[hfstream] grad_sync='auto' resolved"
    assert shown("GradSync: overlap lost") == "[hfstream] GradSync: overlap lost"
