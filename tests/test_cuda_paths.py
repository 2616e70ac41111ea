"""CPU checks of the CUDA/NCCL paths (issue 29): what only a GPU shows, read through fakes."""
from types import SimpleNamespace

import torch

from hfstream import streams
from hfstream.gradsync.sharded import ShardedReduction


def _packed_bucket(n_params=3):
    params = [torch.nn.Parameter(torch.randn(4)) for _ in range(n_params)]
    for p in params:
        p.grad = torch.randn(4)
    buffer = torch.zeros(4 * n_params)
    views = [buffer[4 * i:4 * (i + 1)] for i in range(n_params)]
    return SimpleNamespace(params=params, views=views, plan=SimpleNamespace(names=[str(i) for i in range(n_params)]))


def test_sharded_pack_on_a_side_stream_records_each_gradient_before_freeing_it(monkeypatch):
    recorded = []
    monkeypatch.setattr(streams, "record_stream", lambda t, s: recorded.append((t, s)))
    st = _packed_bucket()
    grads = [p.grad for p in st.params]
    side = object()   # stands for a torch.cuda.Stream: pack only hands it on
    ShardedReduction.pack(SimpleNamespace(wiring=SimpleNamespace(world_size=2)), st, side)
    assert [id(t) for t, _ in recorded] == [id(g) for g in grads]
    assert all(s is side for _, s in recorded)
    assert all(p.grad is None for p in st.params)
    torch.testing.assert_close(st.views[0], grads[0] / 2)


def test_sharded_pack_on_the_current_stream_records_nothing(monkeypatch):
    recorded = []
    monkeypatch.setattr(streams, "record_stream", lambda t, s: recorded.append((t, s)))
    st = _packed_bucket()
    ShardedReduction.pack(SimpleNamespace(wiring=SimpleNamespace(world_size=2)), st, None)
    assert recorded == []
