"""`sharded_trainer.py`'s pieces on their own: which callbacks are user code, what the guard does per event,
and what the two watches (reads before the forward, reads of a gathered gradient) note.

The 2-rank Trainer runs (`test_trainer_sharded*.py`) hold the end-to-end results; these hold each
rule where a value would not show it: a wait for the gathers that is missing (the parameters are
current anyway on a quick machine), a gather for a callback that reads nothing, a gradient left
whole after the event, a read that is not noted.
"""

from __future__ import annotations

import types

import pytest
import torch
from transformers import PrinterCallback, TrainerCallback

from hfstream.trainer import sharded as st


class Reads(TrainerCallback):
    def on_pre_optimizer_step(self, args, state, control, **kw):
        pass

    def on_optimizer_step(self, args, state, control, **kw):
        pass

    def on_log(self, args, state, control, **kw):
        pass


class Other(TrainerCallback):
    def on_optimizer_step(self, args, state, control, **kw):
        pass


def test_user_callbacks_are_the_ones_that_implement_the_event_outside_transformers():
    cbs = [PrinterCallback(), Reads(), TrainerCallback(), Other()]   # PrinterCallback implements on_log
    assert st._user_callbacks(cbs, "on_log") == [cbs[1]]
    assert st._user_callbacks(cbs, "on_optimizer_step") == [cbs[1], cbs[3]]
    assert st._user_callbacks(cbs, "on_step_end") == []


class FakeSync:
    def __init__(self):
        self.calls = []
        self.p = torch.nn.Parameter(torch.zeros(2))
        self.p.grad = torch.ones(2)
        self.hooked_parameters = [("w", self.p)]

    def wait_for_params(self):
        self.calls.append("wait")

    def agree(self, *flags):   # one process: every rank is this one
        return list(flags)

    def gather_gradients(self):
        self.calls.append("gather")

    def scatter_gradients(self):
        self.calls.append("scatter")


class Handler:
    def __init__(self, callbacks, sync):
        self.callbacks, self.sync = callbacks, sync

    def call_event(self, event, args, state, control, **kwargs):
        self.sync.calls.append(("event", event, kwargs.get("x")))
        if kwargs.get("fail"):
            raise RuntimeError("callback failed")
        return control


@pytest.fixture
def guarded():
    sync = FakeSync()
    notes = []

    def make(callbacks, sharded=True):
        handler = Handler(callbacks, sync)
        own = handler.call_event
        guard = st.CallbackGuard(handler, lambda: sync if sharded else None, notes.append)
        assert handler.call_event == own   # constructing it changes nothing
        return guard.install(), handler, own
    return make, sync, notes


def test_install_wraps_once_and_uninstall_gives_the_handlers_own_back(guarded):
    make, sync, _ = guarded
    guard, handler, own = make([])
    assert handler.call_event == guard.call_event
    guard.install()   # twice: still one wrapper, and the handler's own kept
    assert guard._call == own
    guard.uninstall()
    assert handler.call_event == own
    guard.uninstall()   # twice: nothing
    assert handler.call_event == own


def test_without_a_sharded_sync_every_event_passes_through_untouched(guarded):
    make, sync, notes = guarded
    guard, handler, _ = make([Reads()], sharded=False)
    control = object()
    assert handler.call_event("on_optimizer_step", None, None, control, x=1) is control
    assert sync.calls == [("event", "on_optimizer_step", 1)] and notes == []


def test_an_event_no_user_callback_implements_passes_without_waiting(guarded):
    make, sync, _ = guarded
    guard, handler, _ = make([PrinterCallback(), Other()])
    handler.call_event("on_log", None, None, "c", x=2)
    assert sync.calls == [("event", "on_log", 2)]


def test_train_end_always_waits_for_the_gathers(guarded):
    make, sync, _ = guarded
    guard, handler, _ = make([PrinterCallback()])
    handler.call_event("on_train_end", None, None, "c")
    assert sync.calls == ["wait", ("event", "on_train_end", None)]


def test_a_user_callback_gets_current_parameters_but_no_gather_outside_the_gradient_events(guarded):
    make, sync, notes = guarded
    guard, handler, _ = make([Reads()])
    handler.call_event("on_log", None, None, "c")
    assert sync.calls == ["wait", ("event", "on_log", None)] and notes == []


def test_before_the_step_the_whole_gradient_is_gathered_and_scattered_back(guarded):
    make, sync, notes = guarded
    guard, handler, _ = make([Reads(), Other(), Reads()])
    assert handler.call_event("on_pre_optimizer_step", None, None, "c") == "c"
    assert sync.calls == ["wait", "gather", ("event", "on_pre_optimizer_step", None), "scatter"]
    assert len(notes) == 1 and notes[0].startswith("hfstream: Reads implements on_pre_optimizer_step")
    assert sync.p.grad is not None   # the slices take what the callback left; .grad is not dropped here


def test_after_the_step_the_gathered_gradient_is_released(guarded):
    make, sync, notes = guarded
    guard, handler, _ = make([Other(), Reads()])
    handler.call_event("on_optimizer_step", None, None, "c")
    assert sync.calls == ["wait", "gather", ("event", "on_optimizer_step", None)]
    assert sync.p.grad is None
    assert notes[0].startswith("hfstream: Other, Reads implements on_optimizer_step")   # sorted, once each
    assert "grad_norms()" in notes[0]


@pytest.mark.parametrize("event, last", [("on_pre_optimizer_step", "scatter"), ("on_optimizer_step", None)])
def test_a_failing_callback_still_puts_the_gradients_back(guarded, event, last):
    make, sync, _ = guarded
    guard, handler, _ = make([Reads()])
    with pytest.raises(RuntimeError, match="callback failed"):
        handler.call_event(event, None, None, "c", fail=True)
    if last:
        assert sync.calls[-1] == last
    else:
        assert sync.p.grad is None


def test_whole_gradient_calls_are_nothing_under_a_whole_gradient_mode():
    # The Trainer calls GradSync's public gather/scatter/accumulate only (it used to reach for the
    # sharded strategy and refuse another by name): under "overlap" they leave .grad as it is.
    from hfstream import GradSync

    model = torch.nn.Linear(3, 2)
    model(torch.ones(1, 3)).sum().backward()
    before = [p.grad.clone() for p in model.parameters()]
    with GradSync(model, mode="overlap") as sync:
        sync.gather_gradients()
        sync.accumulate = True
        sync.scatter_gradients()
        assert sync.accumulate is True
    assert all(torch.equal(p.grad, b) for p, b in zip(model.parameters(), before))


def test_overrides_compute_loss():
    from transformers import Trainer

    class Plain(Trainer):
        pass

    class Custom(Trainer):
        def compute_loss(self, *a, **k):
            return 0

    assert not st.overrides_compute_loss(Plain.__new__(Plain))
    assert st.overrides_compute_loss(Custom.__new__(Custom))


class Two(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(2, 2)
        self.b = torch.nn.Linear(2, 2)

    def forward(self, x):
        return self.b(self.a(x))


def test_pre_forward_reads_notes_parameters_read_before_the_forward_once_in_order():
    model = Two()
    hooked = list(model.named_parameters())
    with st.PreForwardReads(hooked, model) as watch:
        penalty = model.b.weight.square().sum() + model.a.weight.abs().sum() + model.b.weight.sum()
        _ = model.a.bias.shape, model.a.bias.grad   # attribute reads do not count
        model(torch.ones(1, 2))                      # the forward ends the watch: its reads are not noted
        _ = model.b.bias * 2
    assert watch.read == ["b.weight", "a.weight"]
    assert not model._forward_pre_hooks            # its hook is removed on exit
    assert penalty.requires_grad


def test_gradient_reads_notes_a_torch_function_on_a_gathered_gradient_and_a_replaced_one():
    model = Two()
    hooked = list(model.named_parameters())
    for _, p in hooked:
        p.grad = torch.ones_like(p)
    with st.GradientReads() as watch:
        _ = model.a.weight.grad.shape            # nothing given yet, and an attribute read
        torch.ones(2).sum()
        assert not watch.read
        watch.gathered(hooked)
        _ = model.a.weight * 2                   # the parameter, not its gradient
        assert not watch.read and not watch.touched(hooked)
        model.b.bias.grad.norm()
        assert watch.read and watch.touched(hooked)
    with st.GradientReads() as watch:
        watch.gathered(hooked)
        model.a.bias.grad = None                 # replaced (zero_grad) with no torch function
        assert not watch.read and watch.touched(hooked)


def test_gradient_reads_ignores_the_autograd_engines_own_use():
    w = torch.nn.Parameter(torch.ones(2))
    w.grad = torch.ones(2)
    seen = []
    with st.GradientReads() as watch:
        watch.gathered([("w", w)])
        given = w.grad
        x = torch.nn.Parameter(torch.ones(2))
        x.register_hook(lambda g: seen.append(torch.add(g, given)) or g)   # runs inside backward
        (x * 3).sum().backward()
        assert seen and not watch.read


def test_tensors_finds_every_tensor_in_nested_arguments():
    a, b, c, d = (torch.zeros(1) for _ in range(4))
    found = list(st._tensors((a, [b, (c,)], "x", 3), {"k": {"d": d}, "n": None}))
    assert {id(t) for t in found} == {id(a), id(b), id(c), id(d)} and len(found) == 4


def test_pre_forward_reads_stops_watching_when_its_block_ends():
    model = Two()
    with st.PreForwardReads(list(model.named_parameters()), model) as watch:
        pass
    model.a.weight.sum()     # no forward ran, but the block is over: the mode is off the stack
    assert watch.read == []


class FakeScheduler:
    def state_dict(self):
        import warnings
        warnings.warn("first", FutureWarning)
        warnings.warn("second", FutureWarning)
        return {"last_epoch": 3}


def fake_trainer(should_save):
    calls = []

    def optimizer_state_dict(keep):
        calls.append(keep)
        return {"state": {}, "param_groups": []}
    trainer = types.SimpleNamespace(args=types.SimpleNamespace(should_save=should_save),
                                    grad_sync=types.SimpleNamespace(optimizer_state_dict=optimizer_state_dict),
                                    lr_scheduler=FakeScheduler())
    return trainer, calls


def test_save_optimizer_writes_the_stock_files_and_reissues_the_schedulers_warnings_as_stock_does(tmp_path):
    trainer, calls = fake_trainer(should_save=True)
    with pytest.warns(FutureWarning) as said:
        st.save_optimizer(trainer, str(tmp_path))
    assert [str(w.message) for w in said] == ["first", "second"]
    assert calls == [True]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["optimizer.pt", "scheduler.pt"]
    assert torch.load(tmp_path / "scheduler.pt") == {"last_epoch": 3}


def test_a_rank_that_does_not_save_still_joins_the_collective_and_writes_nothing(tmp_path):
    trainer, calls = fake_trainer(should_save=False)
    st.save_optimizer(trainer, str(tmp_path))
    assert calls == [False] and list(tmp_path.iterdir()) == []
