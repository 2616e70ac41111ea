"""`gradsync/eager.py`: hfstream's hooks run eagerly under torch.compile, refuse being traced, and copy as nothing.

Written against the mutants of eager.py that the deep-copy test alone let through
(docs/design.md, "Mutation testing").
"""

import copy
import pickle
import sys

import pytest
import torch

from hfstream.gradsync.eager import ModelHook, eager_hook


def test_under_torch_compile_a_hook_runs_eagerly_every_call_and_its_result_is_used():
    import torch._dynamo  # noqa: F401  (what a user's torch.compile imports)

    seen = []

    def double_the_input(module, args):
        seen.append(torch.compiler.is_compiling())   # True only while being traced
        return (args[0] * 2,)

    model = torch.nn.Linear(3, 2)
    model.register_forward_pre_hook(eager_hook(double_the_input))
    compiled = torch.compile(model, backend="eager")
    x = torch.ones(1, 3)
    out = compiled(x)
    compiled(x)
    assert seen == [False, False]   # run each call, outside any trace
    with torch.no_grad():
        assert torch.allclose(out, torch.nn.functional.linear(2 * x, model.weight, model.bias))


def test_without_dynamo_a_hook_is_plain_and_refuses_to_be_traced_naming_the_order_that_works(monkeypatch):
    monkeypatch.delitem(sys.modules, "torch._dynamo", raising=False)
    calls = []
    hook = eager_hook(lambda *args, **kwargs: calls.append((args, kwargs)) or "result")
    assert hook(1, k=2) == "result" and calls == [((1,), {"k": 2})]
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with pytest.raises(RuntimeError, match=r"compiled \(torch.compile\) after GradSync hooked it.*Compile first"):
        hook(3)
    assert len(calls) == 1


@pytest.mark.parametrize("copier", [copy.copy, copy.deepcopy, lambda h: pickle.loads(pickle.dumps(h))],
                         ids=["copy", "deepcopy", "pickle"])
def test_a_copied_hook_does_nothing_and_returns_nothing(copier):
    calls = []
    hook = ModelHook(lambda *args, **kwargs: calls.append(args) or "changed")
    assert hook("x") == "changed" and calls == [("x",)]
    twin = copier(hook)
    assert not isinstance(twin, ModelHook)
    assert twin("x", anything=1) is None and calls == [("x",)]
