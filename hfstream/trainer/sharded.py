"""What ``grad_sync="sharded"`` needs from the Trainer loop, so that user code sees what stock shows.

Between ``optimizer.step()`` and the next forward the parameters wait for their all-gathers, and
after ``finish()`` each rank holds only its slice of the mean gradient. User code that runs in
that window would see stale parameters or no gradient; stock shows current parameters and the
mean gradient. Three places in the Trainer loop run user code there:

    callbacks         `CallbackGuard`: before an event reaches a callback that is not one of
                      transformers' own (which never read parameters), the gathers are waited
                      for; ``on_pre_optimizer_step``/``on_optimizer_step`` also get the whole mean
                      gradient in ``.grad`` (gathered for them; what a callback writes to it
                      before the step is kept)
    compute_loss      `PreForwardReads`: an overridden ``compute_loss`` or ``training_step`` is watched
                      once; if it reads parameters before the forward (a penalty on the weights),
                      every later step waits for the gathers before it (said once)
    training_step     `GradientReads`: an overridden ``training_step`` gets the whole mean gradient
                      in ``.grad`` after each backward of the first step, and is watched; if it reads
                      or changes ``.grad`` (FGM, SAM, gradient surgery) or runs several backwards,
                      every step keeps doing so (said once), else the slices suffice
    the checkpoint    `save_optimizer`: every rank's slices, saved whole as the stock ``optimizer.pt``

Each costs overlap only where user code actually needs the values, and says so once.
"""

from __future__ import annotations

import os
import warnings
from typing import Callable

import torch
from torch.overrides import TorchFunctionMode
from transformers import TrainerCallback

from ..gradsync.eager import ModelHook

_OWN_CALLBACKS = ("transformers.trainer_callback", "transformers.integrations")   # never read parameters
_GRADIENT_EVENTS = ("on_pre_optimizer_step", "on_optimizer_step")   # stock holds the mean gradient there


def _user_callbacks(callbacks, event: str) -> list:
    """Callbacks that are not transformers' own and implement ``event``."""
    base = getattr(TrainerCallback, event, None)
    return [cb for cb in callbacks if getattr(type(cb), event, None) is not base
            and not type(cb).__module__.startswith(_OWN_CALLBACKS)]


class CallbackGuard:
    """Wraps the Trainer's ``callback_handler.call_event`` (the one place every event goes through).

    Constructing it changes nothing; `install` puts it in front of ``call_event``, `uninstall`
    puts the handler's own back.

    Args:
        handler: the Trainer's ``callback_handler``.
        sharded_sync: returns the trainer's GradSync while its optimizer is sharded (ZeRO-1) on several
            processes, else None.
        note: says a note once (the trainer's log).

    >>> guard = CallbackGuard(trainer.callback_handler, lambda: None, print).install()   # doctest: +SKIP
    """

    def __init__(self, handler, sharded_sync: Callable[[], object | None], note: Callable[[str], None]):
        self.handler = handler               # the Trainer's CallbackHandler, whose call_event is wrapped
        self._sharded_sync = sharded_sync    # the GradSync to wait on, or None: pass every event through
        self._note = note                    # says a note once
        self._call = None                    # the handler's own call_event, while installed
        # Per GradSync (a train() each): the gradient events for which some rank has a reader, agreed
        # at the first such event (every rank reaches it; the readers may differ: a callback added
        # on the main process only), so every rank gathers there, or none does.
        self._agreed: tuple[object, dict[str, bool]] | None = None

    def install(self) -> "CallbackGuard":
        """Put the guard in front of the handler's ``call_event``; returns itself."""
        if self._call is None:
            self._call = self.handler.call_event
            self.handler.call_event = self.call_event
        return self

    def uninstall(self) -> None:
        """Give the handler its own ``call_event`` back."""
        if self._call is not None:
            self.handler.call_event, self._call = self._call, None

    def call_event(self, event, args, state, control, **kwargs):
        sync = self._sharded_sync()
        if sync is None:
            return self._call(event, args, state, control, **kwargs)
        readers = _user_callbacks(self.handler.callbacks, event)
        if readers or event == "on_train_end":
            sync.wait_for_params()   # this rank's own wait: no collective
        if event not in _GRADIENT_EVENTS or not self._gathers_for(sync, event, readers):
            return self._call(event, args, state, control, **kwargs)
        names = ", ".join(sorted({type(cb).__name__ for cb in readers})) or "a callback on another rank"
        self._note(f"hfstream: {names} implements {event}, where the stock Trainer holds the mean gradient "
                           f"in .grad; under grad_sync='sharded' each rank holds only its slice, so hfstream gathers "
                           f"the whole gradient for it every step (one all-gather of the gradients, their memory "
                           f"again). For norms only, read trainer.grad_sync.grad_norms() instead")
        sync.gather_gradients()
        try:
            return self._call(event, args, state, control, **kwargs)
        finally:
            # Before the step a callback may have changed .grad (custom clipping): the slices take it.
            sync.scatter_gradients() if event == "on_pre_optimizer_step" else _release(sync)


    def _gathers_for(self, sync, event: str, readers: list) -> bool:
        """Whether ``event`` gathers the whole gradient on every rank: agreed at the first gradient event."""
        if self._agreed is None or self._agreed[0] is not sync:
            here = [bool(_user_callbacks(self.handler.callbacks, e)) for e in _GRADIENT_EVENTS]
            self._agreed = (sync, dict(zip(_GRADIENT_EVENTS, sync.agree(*here))))
        agreed = self._agreed[1][event]
        if readers and not agreed:
            names = ", ".join(sorted({type(cb).__name__ for cb in readers}))
            self._note(f"hfstream: {names} implements {event} but was added on this rank after training began: "
                       f"under grad_sync='sharded' the ranks agreed at the first step which events gather the "
                       f"whole gradient, so it sees .grad of None. Add it before train(), on every rank that "
                       f"trains, or use grad_sync='overlap'")
        return agreed


def _release(sync) -> None:
    for _, p in sync.hooked_parameters:
        p.grad = None


def overrides_compute_loss(trainer) -> bool:
    from transformers import Trainer

    return type(trainer).compute_loss is not Trainer.compute_loss


class PreForwardReads(TorchFunctionMode):
    """Notes the hooked parameters that torch functions read before the model's forward begins.

    Active around one training step; attribute reads (``.shape``, ``.grad``) do not count.

    Args:
        hooked: ``(name, parameter)`` to watch.
        model: the module whose forward marks the end of the watch.
    """

    def __init__(self, hooked, model: torch.nn.Module):
        super().__init__()
        self._names = {id(p): n for n, p in hooked}   # id(parameter) -> its name, the ones watched
        self.read: list[str] = []   # names read before the forward, in the order first read
        self._began = False         # the model's forward has begun: the watch is over
        self._handle = model.register_forward_pre_hook(ModelHook(self._forward_began))   # removed on exit

    def _forward_began(self, *_):
        self._began = True

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self._began and getattr(func, "__name__", "") != "__get__":
            for t in _tensors(args, kwargs):
                name = self._names.get(id(t))
                if name is not None and name not in self.read:
                    self.read.append(name)
        return func(*args, **kwargs)

    def __exit__(self, *exc):
        self._handle.remove()
        return super().__exit__(*exc)


class GradientReads(TorchFunctionMode):
    """Notes whether code outside backward passes a gathered ``.grad`` to a torch function, or replaces one.

    Active around the first training step of a ``training_step`` override (sharded): `gathered`
    names the gradients hfstream put in ``.grad`` after a backward; a torch function that receives
    one of them outside the autograd engine (hfstream's own hooks run inside it) reads or writes
    it; `touched` also counts one cleared or replaced since (``zero_grad``, ``p.grad = ...``).
    """

    def __init__(self):
        super().__init__()
        self._ids: set[int] = set()   # id() of the gradients hfstream gave (`gathered`)
        self._given: list = []   # (parameter, the gradient hfstream gave it)
        self.read = False        # a torch function outside backward received one of them

    def gathered(self, hooked) -> None:
        self._given = [(p, p.grad) for _, p in hooked if p.grad is not None]
        self._ids = {id(g) for _, g in self._given}

    def touched(self, hooked) -> bool:
        return self.read or any(p.grad is not g for p, g in self._given)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.read and self._ids and torch._C._current_graph_task_id() == -1:
            self.read = any(id(t) in self._ids for t in _tensors(args, kwargs))
        return func(*args, **kwargs)


def _tensors(args, kwargs):
    stack = [*args, *kwargs.values()]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            yield x
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
        elif isinstance(x, dict):
            stack.extend(x.values())


def save_optimizer(trainer, output_dir: str) -> None:
    """Every rank's slices saved whole, as the unsharded optimizer's state dict (``optimizer.pt``).

    The file is the one the stock Trainer writes, layout-free: resuming on another process count
    or bucket cap, or with the stock Trainer, loads it; the sharded optimizer's ``load_state_dict``
    cuts it into this rank's slices (`gradsync.sharded.state`).
    """
    from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME, reissue_pt_warnings

    state = trainer.grad_sync.optimizer_state_dict(keep=trainer.args.should_save)   # a collective
    if trainer.args.should_save:
        torch.save(state, os.path.join(output_dir, OPTIMIZER_NAME))
        with warnings.catch_warnings(record=True) as caught:
            torch.save(trainer.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))
        reissue_pt_warnings(caught)
