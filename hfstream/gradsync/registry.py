"""Which GradSync hooks a parameter: a second one on the same model is refused, not run twice.

Two GradSyncs on one model would launch every reduction twice. The registry is keyed weakly by tensor
identity (tensors compare elementwise) with weak values, so it keeps nothing alive and
changes nothing the model pickles or saves.
"""

from __future__ import annotations

import weakref
from typing import Iterable

import torch
from torch.utils.weak import WeakIdKeyDictionary

_OWNERS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def owner_of(params: Iterable[torch.Tensor]):
    """The live GradSync that hooks any of ``params``, or None."""
    for p in params:
        ref = _OWNERS.get(p)
        owner = ref() if ref is not None else None
        if owner is not None:
            return owner
    return None


def claim(owner, params: Iterable[torch.Tensor]) -> None:
    """Record ``owner`` as the GradSync that hooks ``params``.

    Raises:
        RuntimeError: when another live GradSync hooks one of them already.
    """
    params = list(params)
    other = owner_of(params)
    if other is not None and other is not owner:
        raise RuntimeError(
            f"this model is already hooked by {other!r}; call close() on it (or leave its "
            f"`with` block) before constructing another GradSync, or every gradient is reduced twice"
        )
    for p in params:
        _OWNERS[p] = weakref.ref(owner)


def release(owner, params: Iterable[torch.Tensor]) -> None:
    """Forget ``owner`` for the parameters it holds (others' claims are left alone)."""
    for p in params:
        ref = _OWNERS.get(p)
        if ref is not None and ref() is owner:
            del _OWNERS[p]
