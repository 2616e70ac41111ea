"""`gradsync/comm_streams.py`: one side stream per accelerator, and the NCCL priority hint said only where it applies.

No accelerator here, so the `streams` helpers and the process group are scripted: the logic is
which device gets a stream (an accelerator with side streams, once, at the asked priority) and
when the hint is said (high priority asked, a stream exists, the backend is NCCL, and its own
stream is not high priority), never an error from the private accessor it reads.
"""

from __future__ import annotations

import logging
import types

import pytest
import torch

from hfstream.gradsync import comm_streams
from hfstream.gradsync.comm_streams import CommStreams


@pytest.fixture
def fake_streams(monkeypatch):
    made = []

    def new_stream(device, priority):
        made.append((device, priority))
        return f"stream{len(made)}"

    monkeypatch.setattr(comm_streams.streams, "is_accelerator", lambda d: d.type == "cuda")
    monkeypatch.setattr(comm_streams.streams, "has_side_streams", lambda d: d.index != 7)
    monkeypatch.setattr(comm_streams.streams, "new_stream", new_stream)
    return made


def test_each_accelerator_with_side_streams_gets_one_stream_once(fake_streams):
    cs = CommStreams("low")
    for d in ["cpu", "cuda:0", "cuda:0", "cuda:1", "cuda:7"]:
        cs.add(torch.device(d))
    assert cs == {torch.device("cuda:0"): "stream1", torch.device("cuda:1"): "stream2"}
    assert fake_streams == [(torch.device("cuda:0"), "low"), (torch.device("cuda:1"), "low")]


def test_on_cpu_it_holds_nothing():
    cs = CommStreams("high")
    cs.add(torch.device("cpu"))
    assert cs == {} and not cs


def group(high, backend="nccl"):
    options = types.SimpleNamespace(is_high_priority_stream=high)
    return types.SimpleNamespace(backend=backend, _get_backend=lambda device: types.SimpleNamespace(options=options))


@pytest.fixture
def backend_of(monkeypatch):
    monkeypatch.setattr(comm_streams.dist, "get_backend", lambda g: g.backend)


def hint(cs, g, caplog) -> list[str]:
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=comm_streams.__name__):
        cs.hint_nccl_priority(g)
    return [r.getMessage() for r in caplog.records]


def test_the_hint_is_said_for_nccl_at_normal_priority(fake_streams, backend_of, caplog):
    cs = CommStreams("high")
    cs.add(torch.device("cuda:0"))
    said = hint(cs, group(False), caplog)
    assert len(said) == 1 and "is_high_priority_stream=True" in said[0] and "normal priority" in said[0]


@pytest.mark.parametrize("case", ["high group", "gloo", "low asked", "no stream", "accessor fails"])
def test_the_hint_is_not_said_where_it_does_not_apply(fake_streams, backend_of, caplog, case):
    cs = CommStreams("low" if case == "low asked" else "high")
    if case != "no stream":
        cs.add(torch.device("cuda:0"))
    g = group(case == "high group", backend="gloo" if case == "gloo" else "nccl")
    if case == "accessor fails":
        def _get_backend(device):
            raise AttributeError("renamed")
        g._get_backend = _get_backend
    assert hint(cs, g, caplog) == []
