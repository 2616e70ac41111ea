"""CPU checks of the CUDA/NCCL paths (issue 29): what only a GPU shows, read through fakes."""
from types import SimpleNamespace

import pytest
import torch

from hfstream import streams
from hfstream.gradsync.sharded.reduction import ShardedReduction


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
    from hfstream.gradsync.sharded import state as shard_state
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


def _pieces_of(full_grads, cuts):
    """Each full gradient cut into ``cuts[i]`` slices, as the sharded optimizer's piece tensors hold them,
    with each piece's owner: its parameter's index and whether it holds all of it."""
    pieces, owners = [], []
    for i, (g, n) in enumerate(zip(full_grads, cuts)):
        for chunk in g.flatten().chunk(n):
            t = torch.zeros_like(chunk)
            t.grad = chunk.clone()
            pieces.append(t)
            owners.append((i, n == 1))
    return pieces, owners


@pytest.mark.parametrize("cuts", [(1, 1), (7, 7), (1, 7)])
def test_sharded_clip_takes_at_most_two_fused_norm_calls_whatever_the_number_of_pieces(monkeypatch, cuts):
    from hfstream.gradsync.sharded import optim as shard_optim
    monkeypatch.setattr(shard_optim.dist, "all_reduce", lambda *a, **k: None)
    calls = {"foreach": 0, "vector": 0}
    real_foreach, real_vector = torch._foreach_norm, torch.linalg.vector_norm
    monkeypatch.setattr(torch, "_foreach_norm", lambda *a, **k: calls.__setitem__("foreach", calls["foreach"] + 1)
                        or real_foreach(*a, **k))
    monkeypatch.setattr(torch.linalg, "vector_norm", lambda *a, **k: calls.__setitem__("vector", calls["vector"] + 1)
                        or real_vector(*a, **k))
    full = [torch.randn(30), torch.randn(5, 4)]
    pieces, owners = _pieces_of(full, cuts)
    shard_optim.clip_grad_norm_(pieces, owners, len(full), group=None, max_norm=0.1)
    assert calls["foreach"] == len(set(cuts))   # one for the whole parameters, one for the cut ones
    assert calls["vector"] == 1                 # the norm of the per-parameter norms, as stock; none per piece


def _stock_and_ours(max_norm, cuts, dtype=torch.float32):
    from hfstream.gradsync.sharded import optim as shard_optim
    torch.manual_seed(0)
    # 256x256: large enough that float32's own summation (stock's) and float64's rounded once differ
    full = [torch.randn(300, dtype=dtype), torch.randn(256, 256, dtype=dtype), torch.randn(1000, dtype=dtype) * 1e-3]
    whole = [torch.zeros_like(g) for g in full]
    for t, g in zip(whole, full):
        t.grad = g.clone()
    stock = torch.nn.utils.clip_grad_norm_(whole, max_norm)
    pieces, owners = _pieces_of(full, cuts)
    ours = shard_optim.clip_grad_norm_(pieces, owners, len(full), group=None, max_norm=max_norm)
    return full, whole, stock, pieces, ours


@pytest.mark.parametrize("max_norm", [0.5, 1e3])   # above and below the gradient's norm
def test_sharded_clip_matches_stock_clip_grad_norm_on_the_whole_gradient(monkeypatch, max_norm):
    from hfstream.gradsync.sharded import optim as shard_optim
    monkeypatch.setattr(shard_optim.dist, "all_reduce", lambda *a, **k: None)
    full, whole, stock, pieces, ours = _stock_and_ours(max_norm, (5, 5, 3))
    # Every parameter cut: their norms come from float64 partial sums, equal to float32's rounding only.
    torch.testing.assert_close(ours, stock, rtol=2e-7, atol=0)
    got = torch.cat([t.grad for t in pieces])
    want = torch.cat([t.grad.flatten() for t in whole])
    torch.testing.assert_close(got, want, rtol=3e-7, atol=0)   # a coefficient one ulp off, then the product's rounding
    if max_norm > 1e2:
        assert torch.equal(got, torch.cat([g.flatten() for g in full]))   # not clipped: left exactly as it was


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sharded_clip_of_parameters_held_whole_is_stocks_bit_for_bit(monkeypatch, dtype):
    # Stock: one norm per parameter in the gradient's dtype, stacked in parameter order, then the norm
    # of that. The same here for every parameter a piece holds whole; with a cut one the rest stay so.
    from hfstream.gradsync.sharded import optim as shard_optim
    monkeypatch.setattr(shard_optim.dist, "all_reduce", lambda *a, **k: None)
    _, whole, stock, pieces, ours = _stock_and_ours(0.5, (1, 1, 1), dtype)
    assert ours.dtype == stock.dtype == dtype
    assert torch.equal(ours, stock)
    assert torch.equal(torch.cat([t.grad for t in pieces]), torch.cat([t.grad.flatten() for t in whole]))


class _FakeNCCL:
    class Options:
        is_high_priority_stream = None
        _timeout = None


def _group_choice(monkeypatch, backend, priority, grad_sync):
    import torch.distributed as dist

    from hfstream.trainer.data_parallel import gradient_group
    made = []
    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(dist, "ProcessGroupNCCL", _FakeNCCL, raising=False)
    monkeypatch.setattr(dist, "new_group", lambda **kw: made.append(kw) or "own group")
    args = SimpleNamespace(comm_stream_priority=priority, grad_sync=grad_sync, ddp_timeout=60)
    return gradient_group(args), made


@pytest.mark.parametrize("backend", ["nccl", "cpu:gloo,cuda:nccl"])
def test_sharded_gets_its_own_nccl_group_at_normal_priority(monkeypatch, backend):
    group, made = _group_choice(monkeypatch, backend, "normal", "sharded")
    assert group == "own group" and len(made) == 1
    assert made[0]["backend"] == "nccl" and made[0]["pg_options"].is_high_priority_stream is False


def test_a_mixed_backend_still_gets_the_high_priority_group(monkeypatch):
    group, made = _group_choice(monkeypatch, "cpu:gloo,cuda:nccl", "high", "overlap")
    assert group == "own group" and made[0]["pg_options"].is_high_priority_stream is True


@pytest.mark.parametrize("backend,priority", [("nccl", "normal"), ("gloo", "normal"), ("gloo", "high")])
def test_overlap_keeps_the_default_group_unless_nccl_is_asked_for_high_priority(monkeypatch, backend, priority):
    group, made = _group_choice(monkeypatch, backend, priority, "overlap")
    assert group is None and made == []


def test_sharded_on_gloo_gets_its_own_gloo_group(monkeypatch):
    # Gloo's work queue is a FIFO too: the Trainer's num_items gather would wait for every all-gather.
    group, made = _group_choice(monkeypatch, "gloo", "normal", "sharded")
    assert group == "own group" and made[0]["backend"] == "gloo" and made[0]["timeout"].total_seconds() == 60


def test_a_replan_drops_the_old_plans_wire_buffers_before_the_new_plan_builds_its_own():
    from hfstream.gradsync.sync import GradSync
    old = [SimpleNamespace(buffer=torch.zeros(8), views=[torch.zeros(4)],
                           shard=SimpleNamespace(received=torch.zeros(8)), as_view=None),
           SimpleNamespace(buffer=torch.zeros(8), views=[], shard=None, as_view=[True])]   # AllReduce's bucket
    seen = []

    def build(previous):
        seen.append([(st.buffer, st.views, st.shard.received if st.shard is not None else None) for st in previous])

    from hfstream.gradsync.sharded.reduction import ShardedReduction

    strategy = object.__new__(ShardedReduction)   # its release() only: the buffers are the strategy's
    fake = SimpleNamespace(buckets=[SimpleNamespace(names=["a"])], _states=old, _build_states=build,
                           _reset_step=lambda: None, _planner=SimpleNamespace(planned_mb=1), reduction=strategy)
    GradSync._replan(fake, [SimpleNamespace(names=["b"])])
    assert seen == [[(None, [], None), (None, [], None)]]
