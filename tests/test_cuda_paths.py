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


def test_shard_state_reads_per_parameter_state_without_a_host_read_per_piece(monkeypatch):
    from hfstream.gradsync import shard_state
    tensors = [torch.zeros(2) for _ in range(3)]
    pieces = [SimpleNamespace(slot=i) for i in range(3)]
    sh = SimpleNamespace(params=tensors, pieces=pieces, tensors=tensors, master=torch.zeros(1))
    opt = SimpleNamespace(state={t: {"step": torch.tensor(float(i + 5))} for i, t in enumerate(tensors)})
    monkeypatch.setattr(shard_state.dist, "all_reduce", lambda *a, **k: None)
    reads = []
    real_float = torch.Tensor.__float__
    monkeypatch.setattr(torch.Tensor, "__float__", lambda t: reads.append(t) or real_float(t))
    has, values = shard_state._param_values(opt, sh, ["step"], group=None)
    assert has == [True, True, True] and values["step"] == [5.0, 6.0, 7.0]
    assert reads == []   # one .tolist() for the table, no float() per piece
