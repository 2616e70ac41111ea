"""The sharded optimizer's small rules, on one process: which optimizers are elementwise, which norms clip."""

from __future__ import annotations

import pytest
import torch

from hfstream.gradsync.sharded.optim import DECLARATION, check_norm_type, declared_elementwise


class Declared(torch.optim.SGD):
    hfstream_elementwise = True


class Undeclared(torch.optim.Optimizer):
    def __init__(self, params):
        super().__init__(params, {})


class SaysNo(torch.optim.SGD):
    hfstream_elementwise = False


def test_an_optimizer_is_elementwise_if_torch_lists_it_or_its_class_declares_it():
    params = [torch.nn.Parameter(torch.zeros(2))]
    assert DECLARATION == "hfstream_elementwise"
    assert declared_elementwise(torch.optim.AdamW(params))
    assert declared_elementwise(Declared(params, lr=0.1))
    assert not declared_elementwise(Undeclared(params))
    # A subclass of a listed optimizer is listed, unless its class says its step is not elementwise.
    assert declared_elementwise(type("PlainSubclass", (torch.optim.SGD,), {})(params, lr=0.1))
    assert not declared_elementwise(SaysNo(params, lr=0.1))


@pytest.mark.parametrize("norm_type", [0.5, 1, 2.0, float("inf")])
def test_any_positive_norm_clips(norm_type):
    assert check_norm_type(norm_type) == float(norm_type)


@pytest.mark.parametrize("norm_type", [0, -1.0, float("nan")])
def test_a_norm_that_is_not_positive_is_refused_by_name(norm_type):
    with pytest.raises(ValueError, match="norm_type="):
        check_norm_type(norm_type)


@pytest.mark.parametrize("methods, refused", [(("train", "eval"), True), (("train",), False), (("eval",), False),
                                              ((), False)])
def test_only_an_optimizer_with_both_train_and_eval_is_taken_for_schedule_free(methods, refused):
    # Schedule-free optimizers swap the weights in train()/eval(); one method alone is something else.
    from hfstream.gradsync.sharded.optim import check_elementwise

    cls = type("Opt", (Declared,), {m: (lambda self: None) for m in methods})
    optimizer = cls([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    if refused:
        with pytest.raises(ValueError, match="cannot shard Opt: its train\\(\\)/eval\\(\\) swap the weights"):
            check_elementwise(optimizer)
    else:
        check_elementwise(optimizer)


def _pieces_of(full, cuts):
    """Each gradient cut into ``cuts[i]`` pieces, with each piece's owner ``(parameter, whole)``."""
    pieces, owners = [], []
    for i, (g, n) in enumerate(zip(full, cuts)):
        for chunk in g.flatten().chunk(n):
            t = torch.zeros_like(chunk)
            t.grad = chunk.clone()
            pieces.append(t)
            owners.append((i, n == 1))
    return pieces, owners


def _mixed_gradients():
    # Twenty parameters, every third one bfloat16 from the second on: stock stacks the bfloat16
    # norms apart from the float32 ones (grouped by dtype), not in parameter order.
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(50 + 37 * i, generator=g) * (1 + i % 5)).to(torch.bfloat16 if i % 3 == 1 else torch.float32)
            for i in range(20)]


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
@pytest.mark.parametrize("cut", [False, True])
def test_the_sharded_clip_of_a_mixed_dtype_model_is_stocks_bit_for_bit(monkeypatch, cut, norm_type):
    # Stock: each norm in its gradient's dtype, grouped by dtype, stacked in the promoted dtype
    # (float32). With the bfloat16 gradients cut into pieces, their norms come from float64 sums,
    # rounded as torch rounds its own: the same bits here.
    from hfstream.gradsync.sharded import optim as shard_optim
    monkeypatch.setattr(shard_optim.dist, "all_reduce", lambda *a, **k: None)
    full = _mixed_gradients()
    whole = [torch.zeros_like(g) for g in full]
    for t, g in zip(whole, full):
        t.grad = g.clone()
    stock = torch.nn.utils.clip_grad_norm_(whole, 1.0, norm_type)
    pieces, owners = _pieces_of(full, [3 if cut and g.dtype == torch.bfloat16 else 1 for g in full])
    ours = shard_optim.clip_grad_norm_(pieces, owners, len(full), group=None, max_norm=1.0, norm_type=norm_type)
    assert ours.dtype == stock.dtype == torch.float32
    assert torch.equal(ours, stock), (ours.item(), stock.item())
    for i, t in enumerate(whole):
        got = torch.cat([p.grad for p, (j, _) in zip(pieces, owners) if j == i])
        assert torch.equal(got, t.grad.flatten()), i
