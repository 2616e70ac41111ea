"""The sharded optimizer's small rules, on one process: which optimizers are elementwise, which norms clip."""

from __future__ import annotations

import pytest
import torch

from hfstream.gradsync.shard_optim import DECLARATION, check_norm_type, declared_elementwise


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
    from hfstream.gradsync.shard_optim import check_elementwise

    cls = type("Opt", (Declared,), {m: (lambda self: None) for m in methods})
    optimizer = cls([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    if refused:
        with pytest.raises(ValueError, match="cannot shard Opt: its train\\(\\)/eval\\(\\) swap the weights"):
            check_elementwise(optimizer)
    else:
        check_elementwise(optimizer)
