"""Where the next forward waits for each bucket's all-gather: as late as possible, never too late.

After ``optimizer.step()`` the model's parameters are stale until their bucket's all-gather
lands. A forward pre-hook waits for a bucket on the first module that reads it, so the forward
of the layers before it overlaps the gather. Which module reads a parameter is not always its
owner: PEFT keeps embedding LoRA and IA3 vectors in a ``ParameterDict`` that is never called
(its parent reads them), and any module may read a child's weight without calling the child.

So the first training forward is watched: every module that runs is noted. From then on, a
parameter's wait sits on the nearest module, from its owner up to the root, that ran -- the
code that reads it runs inside that module's forward. A tied parameter waits at each owner.

Under ``torch.compile`` of the whole model, per-module waits would split the graph at every
layer; there the root waits for every bucket (said once): the gathers then overlap what runs
between the step and the forward (the scheduler, logging, data), not the forward itself. Every
hook runs eagerly under torch.compile, never as a traced copy that would skip the wait (`eager`).
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

from ..eager import eager_hook


def is_compiled(model: torch.nn.Module) -> bool:
    """``torch.compile(model)`` (an OptimizedModule) or ``model.compile()``."""
    return hasattr(model, "_orig_mod") or getattr(model, "_compiled_call_impl", None) is not None


class ForwardWaits:
    """Learns in the first training forward which modules run, then hooks the waits there.

    Args:
        model: the hooked model (possibly compiled).
        hooked: ``(name, parameter)`` GradSync hooks.
        wait: ``wait(indices, module)``: wait for the buckets of these hooked parameters.
        note: says a note once.
    """

    def __init__(self, model: torch.nn.Module, hooked: list, wait: Callable, note: Callable[[str], None]):
        self.model, self.hooked, self._wait, self._note = model, hooked, wait, note
        self.inner = getattr(model, "_orig_mod", model)   # the module tree under a torch.compile wrapper
        self.compiled = is_compiled(model)
        self._ran: set[int] = set()       # id() of the modules that ran in the first training forward
        self._recording: list = []        # the watching hooks, until `place`
        self._waits: list = []            # the waiting hooks
        self.placed = False

    def watch(self) -> None:
        """Note which modules run in the next training forward (before any gather is pending)."""
        if self.compiled:
            return
        for module in self.inner.modules():
            self._recording.append(module.register_forward_pre_hook(eager_hook(self._ran_hook)))

    def _ran_hook(self, module, _args) -> None:
        if module.training and torch.is_grad_enabled():
            self._ran.add(id(module))

    def place(self) -> None:
        """Before the first gathers: remove the watchers, hook each wait on the module that reads first."""
        if self.placed:
            return
        for handle in self._recording:
            handle.remove()
        self._recording.clear()
        self.placed = True
        if self.compiled:
            self._hook(self.model, list(range(len(self.hooked))))
            self._note("GradSync(mode='sharded'): the model is compiled (torch.compile); the next forward waits "
                       "for all parameter all-gathers before it starts, since per-layer waits would split the "
                       "graph at every layer. The gathers still overlap the scheduler, logging and data "
                       "loading between steps, not the forward")
            return
        # A module that did not run waits on its nearest ancestor that did; where nothing ran (the
        # first forward was not a training one), every parameter climbs to the root.
        parent: dict[int, torch.nn.Module] = {}
        for module in self.inner.modules():
            for child in module.children():
                parent.setdefault(id(child), module)
        index = {id(p): i for i, (_, p) in enumerate(self.hooked)}
        readers: dict[int, tuple[torch.nn.Module, set[int]]] = {}
        for module in self.inner.modules():
            mine = {index[id(p)] for p in module.parameters(recurse=False) if id(p) in index}
            if not mine:
                continue
            reader = module
            while id(reader) not in self._ran and id(reader) in parent:
                reader = parent[id(reader)]
            readers.setdefault(id(reader), (reader, set()))[1].update(mine)
        for reader, indices in readers.values():
            self._hook(reader, sorted(indices))

    def _hook(self, module: torch.nn.Module, indices: list[int]) -> None:
        hook = eager_hook(functools.partial(self._before_forward, indices))
        # First among the module's pre-hooks: one of the user's that rebuilds a weight from parameters
        # (torch.nn.utils.prune, weight_norm, spectral_norm) must read them gathered.
        self._waits.append(module.register_forward_pre_hook(hook, prepend=True))

    def _before_forward(self, indices: list[int], module, _args) -> None:
        self._wait(indices, module)

    def close(self) -> None:
        for handle in self._recording + self._waits:
            handle.remove()
        self._recording.clear()
        self._waits.clear()
