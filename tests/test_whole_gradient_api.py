"""GradSync's gradient API under the whole-gradient modes (overlap, serial): what it returns, on one process.

`clip_grad_norm_` must be torch's on the hooked parameters (the mean gradient is whole in
``.grad`` here), `grad_norms` one norm per parameter that has a gradient (a frozen or unused one
has none, and is left out, not an error), and `params_pending` empty: nothing is ever gathered.
Under sharded the same API is held by `test_gradsync_sharded.py`.
"""

from __future__ import annotations

import copy

import pytest
import torch

from hfstream.gradsync.sync import GradSync


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 8)
        self.b = torch.nn.Linear(8, 2)
        self.unused = torch.nn.Linear(2, 2)   # trainable, never reached: no gradient
        self.a.bias.requires_grad_(False)     # frozen: not hooked

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def backward(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    model(torch.randn(16, 4, generator=g)).pow(2).sum().backward()


@pytest.mark.parametrize("mode", ["overlap", "serial"])
def test_grad_norms_are_one_per_parameter_that_has_a_gradient(mode):
    torch.manual_seed(0)
    model = Net()
    with GradSync(model, mode=mode) as sync:
        backward(model)
        sync.finish()
        norms = sync.grad_norms()
        assert sync.params_pending == []
    want = {n: torch.linalg.vector_norm(p.grad) for n, p in model.named_parameters() if p.grad is not None}
    assert set(norms) == set(want) == {"a.weight", "b.weight", "b.bias"}
    assert all(torch.equal(norms[n], want[n]) for n in want)


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf"), None])
def test_clip_grad_norm_is_torchs_on_the_hooked_parameters(norm_type):
    # None: neither is given a norm type, so the default is torch's too.
    norm = {} if norm_type is None else {"norm_type": norm_type}
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    backward(ref)
    want = torch.nn.utils.clip_grad_norm_([p for p in ref.parameters() if p.requires_grad], 0.5, **norm)
    with GradSync(model) as sync:
        backward(model)
        sync.finish()
        got = sync.clip_grad_norm_(0.5, **norm)
    assert torch.equal(got, want) and got > 0.5   # it did clip
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None), n
        if p.grad is not None:
            assert torch.equal(p.grad, q.grad), n
