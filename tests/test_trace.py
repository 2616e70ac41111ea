"""A Chrome trace of a chosen step range is written, and bad ranges are clear errors."""

import json

import pytest

from hfstream import StreamTrainer, StreamTrainingArguments
from hfstream.cli.trace import TraceSteps, parse_step_range
from tiny import lm_dataset, tiny_causal_lm, train_args


def test_trace_of_steps(tmp_path):
    cb = TraceSteps(2, 3, tmp_path / "traces")
    trainer = StreamTrainer(model=tiny_causal_lm(), train_dataset=lm_dataset(), callbacks=[cb],
                            args=train_args(StreamTrainingArguments, tmp_path, max_steps=5))
    trainer.train()
    assert cb.path is not None and cb.path.name == "trace_steps2-3_rank0.json"
    events = json.loads(cb.path.read_text())["traceEvents"]
    assert any("addmm" in str(e.get("name", "")) or "mm" in str(e.get("name", "")) for e in events)


def test_trace_stops_when_training_ends_inside_the_range(tmp_path):
    cb = TraceSteps(2, 50, tmp_path)
    StreamTrainer(model=tiny_causal_lm(), train_dataset=lm_dataset(), callbacks=[cb],
                  args=train_args(StreamTrainingArguments, tmp_path, max_steps=3)).train()
    assert cb.path is not None and cb.path.exists()


@pytest.mark.parametrize("text", ["", "a-b", "0-3", "5-2", "3-"])
def test_bad_ranges(text):
    if text == "3-":
        assert parse_step_range(text) == (3, 3)
        return
    with pytest.raises(ValueError, match="trace_steps"):
        parse_step_range(text)


def test_parse():
    assert parse_step_range("10-12") == (10, 12) and parse_step_range("7") == (7, 7)
