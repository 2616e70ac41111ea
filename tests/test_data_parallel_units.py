"""`data_parallel.py` on fakes: which mode ``grad_sync`` resolves to, what is refused, and when no group is made."""

from __future__ import annotations

import logging
import types

import pytest
import torch
from accelerate.utils import DistributedType

from hfstream import log
from hfstream.trainer.data_parallel import gradient_group, model_is_tensor_parallel, resolve_grad_sync


def _args(grad_sync, engine_owns=False, n_gpu=1):
    return types.SimpleNamespace(grad_sync=grad_sync, uses_engine_owning_comm=lambda: engine_owns, n_gpu=n_gpu)


def _accelerator(engine=DistributedType.MULTI_CPU, processes=2):
    return types.SimpleNamespace(distributed_type=engine, num_processes=processes)


@pytest.fixture
def said(monkeypatch, caplog):
    monkeypatch.setattr(log, "_said", set())   # each decision is said once per process: start afresh
    caplog.set_level(logging.INFO, logger="hfstream")
    return caplog


def test_a_model_is_tensor_parallel_when_loaded_so_and_never_for_no_model_or_plain_tensors():
    assert model_is_tensor_parallel(None, loaded_distributed=True) is True
    assert model_is_tensor_parallel(None, loaded_distributed=False) is False
    assert model_is_tensor_parallel(torch.nn.Linear(2, 2), loaded_distributed=False) is False


def test_an_hfstream_mode_is_refused_where_an_engine_owns_the_communication_and_native_is_kept():
    with pytest.raises(ValueError, match="grad_sync='overlap' needs plain data parallel.*Use grad_sync='native'"):
        resolve_grad_sync(_args("overlap", engine_owns=True), _accelerator(), tensor_parallel_model=False)
    assert resolve_grad_sync(_args("native", engine_owns=True), _accelerator(DistributedType.FSDP), False) == "native"


def test_auto_falls_back_to_native_under_an_engine_and_says_why(said):
    assert resolve_grad_sync(_args("auto", engine_owns=True), _accelerator(), tensor_parallel_model=False) == "native"
    assert any("falls back to 'native'" in r.getMessage() for r in said.records), said.records


def test_auto_is_overlap_under_plain_multi_process_data_parallel_and_says_so(said):
    assert resolve_grad_sync(_args("auto"), _accelerator(), tensor_parallel_model=False) == "overlap"
    assert any("resolved to 'overlap' (plain multi-process data parallel)" in r.getMessage() for r in said.records)


def test_auto_is_native_with_several_gpus_in_one_process_and_says_which_setup(said):
    got = resolve_grad_sync(_args("auto", n_gpu=2), _accelerator(DistributedType.MULTI_GPU), tensor_parallel_model=False)
    assert got == "native"
    assert any("resolved to 'native' (distributed type" in r.getMessage() for r in said.records), said.records


def test_no_gradient_group_without_a_process_group():
    assert not torch.distributed.is_initialized()
    assert gradient_group(types.SimpleNamespace(comm_stream_priority="high", grad_sync="sharded")) is None
