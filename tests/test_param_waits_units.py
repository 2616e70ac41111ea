"""Where the forward waits for the gathers (`ForwardWaits`), on one process: which modules get the waits,
and that the watchers of the first forward are gone once the waits are placed."""

from __future__ import annotations

import torch
import torch.nn as nn

from hfstream.gradsync.sharded.param_waits import ForwardWaits, is_compiled


def _hooks(model):
    return sum(len(m._forward_pre_hooks) for m in model.modules())


def test_the_waits_replace_the_watchers_on_the_modules_that_ran():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 1))
    waited = []
    fw = ForwardWaits(model, list(model.named_parameters()), lambda idx, m: waited.append(list(idx)), lambda s: None)
    fw.watch()
    assert _hooks(model) == 4   # a watcher on each module, the root included
    model(torch.randn(2, 4)).sum().backward()
    fw.place()
    # One wait per layer (each owns its parameters and ran), nothing left of the watchers.
    assert _hooks(model) == len(fw._waits) == 3
    model(torch.randn(2, 4))
    assert waited == [[0, 1], [2, 3], [4, 5]]
    fw.close()
    assert _hooks(model) == 0


def test_a_compiled_model_is_recognised_both_ways():
    assert not is_compiled(nn.Linear(2, 2))
    assert is_compiled(torch.compile(nn.Linear(2, 2)))   # an OptimizedModule; nothing compiles until it runs
    m = nn.Linear(2, 2)
    m.compile()
    assert is_compiled(m)


def test_the_root_waits_for_everything_when_compiled_or_when_no_module_was_seen_running():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    waited, notes = [], []
    fw = ForwardWaits(model, list(model.named_parameters()), lambda idx, m: waited.append((list(idx), m)),
                      notes.append)
    fw.watch()
    with torch.no_grad():
        model(torch.randn(2, 4))   # not a training forward: nothing is noted as having run
    fw.place()
    model(torch.randn(2, 4))
    assert waited == [([0, 1, 2, 3], model)] and notes == []
    compiled = torch.compile(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1)))
    fw = ForwardWaits(compiled, list(compiled.named_parameters()), lambda idx, m: None, notes.append)
    fw.watch()
    fw.place()
    assert len(fw._waits) == 1 and len(compiled._forward_pre_hooks) == 1
    assert len(notes) == 1 and "the model is compiled (torch.compile)" in notes[0]
    fw.close()


class _ReadsItsChildsWeight(nn.Module):
    """Reads ``scale.weight`` without calling ``scale`` (as PEFT's embedding LoRA reads a ParameterDict)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.scale = nn.Linear(4, 4)   # never called

    def forward(self, x):
        return self.body(x) @ self.scale.weight


def test_a_parameter_of_a_module_that_never_runs_waits_on_the_nearest_ancestor_that_did():
    model = nn.Sequential(nn.Linear(4, 4), _ReadsItsChildsWeight())
    waited = []
    fw = ForwardWaits(model, list(model.named_parameters()), lambda idx, m: waited.append((list(idx), m)),
                      lambda s: None)
    fw.watch()
    model(torch.randn(2, 4)).sum().backward()
    fw.place()
    model(torch.randn(2, 4))
    reader = model[1]
    # model.0 (0, 1) and model.1.body (2, 3) ran and wait for their own; model.1.scale (4, 5) never ran,
    # so its wait sits on model.1, whose forward reads it -- before body's, which model.1 calls.
    assert waited == [([0, 1], model[0]), ([4, 5], reader), ([2, 3], reader.body)]
    fw.close()
