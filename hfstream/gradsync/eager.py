"""Hooks that torch.compile must run eagerly, never trace.

GradSync's hooks keep Python state (what is pending, which bucket to wait for) and wait on
collectives; a traced copy would freeze the state it saw while tracing and skip the waits. Where
torch.compile is in use (its ``torch._dynamo`` is imported), a hook is ``torch.compiler.disable``-d:
a compiled region that meets it breaks there and runs it eagerly. Elsewhere the hook is left
plain: importing ``torch._dynamo`` costs seconds per process (measured 2.4 s on 2 loaded cores),
which every rank would pay for nothing. A model compiled only after GradSync hooked it would
trace a plain hook; that is refused, naming the order that works.
"""

from __future__ import annotations

import functools
import sys

import torch


def eager_hook(fn):
    """``fn`` as a hook that runs eagerly under torch.compile (see the module docstring)."""
    if "torch._dynamo" in sys.modules:
        return torch.compiler.disable(fn)

    @functools.wraps(fn)
    def hook(*args, **kwargs):
        if torch.compiler.is_compiling():
            raise RuntimeError(
                "GradSync: the model was compiled (torch.compile) after GradSync hooked it, so its hooks would be "
                "traced instead of run. Compile first, then construct GradSync (the Trainer does it in that order)")
        return fn(*args, **kwargs)
    return hook
