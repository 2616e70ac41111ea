"""The hooks hfstream puts on a user's model: run eagerly under torch.compile, left behind by a copy.

Eagerly: GradSync's hooks keep Python state (what is pending, which bucket to wait for) and wait
on collectives; a traced copy would freeze the state it saw while tracing and skip the waits.
Where torch.compile is in use (its ``torch._dynamo`` is imported), a hook is
``torch.compiler.disable``-d: a compiled region that meets it breaks there and runs it eagerly.
Elsewhere the hook is left plain: importing ``torch._dynamo`` costs seconds per process (measured
2.4 s on 2 loaded cores), which every rank would pay for nothing. A model compiled only after
GradSync hooked it would trace a plain hook; that is refused, naming the order that works.

Left behind: users copy the model they train (``copy.deepcopy`` for an EMA, torch's
``AveragedModel``, a teacher), and a module's copy copies its hook dictionaries. A bound method
or a ``functools.partial`` is copied with everything it reaches (the GradSync, its process group,
the trainer), which cannot be copied. Every hook is therefore a `ModelHook`, whose copy (and
pickle) is a hook that does nothing: a copy of the model is the model without hfstream.
"""

from __future__ import annotations

import functools
import sys

import torch


def _no_hook(*_args, **_kwargs) -> None:
    """What a copied hfstream hook becomes: it changes nothing (every hook kind accepts None)."""
    return None


def _copied():
    return _no_hook


class ModelHook:
    """A hook on the user's model (or its parameters) that copies and pickles as a no-op.

    Args:
        fn: the hook itself.
    """

    __slots__ = ("fn",)

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)

    def __deepcopy__(self, memo):
        return _no_hook

    def __copy__(self):
        return _no_hook

    def __reduce__(self):
        return (_copied, ())


def eager_hook(fn) -> ModelHook:
    """``fn`` as a hook that runs eagerly under torch.compile (see the module docstring)."""
    if "torch._dynamo" in sys.modules:
        return ModelHook(torch.compiler.disable(fn))

    @functools.wraps(fn)
    def hook(*args, **kwargs):
        if torch.compiler.is_compiling():
            raise RuntimeError(
                "GradSync: the model was compiled (torch.compile) after GradSync hooked it, so its hooks would be "
                "traced instead of run. Compile first, then construct GradSync (the Trainer does it in that order)")
        return fn(*args, **kwargs)
    return ModelHook(hook)
