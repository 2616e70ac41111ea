"""A batch's structure: apply a function to every tensor in it, rebuilding each container as it was.

Batches come as dicts, `BatchEncoding` (a ``UserDict``), lists, tuples, namedtuples, nested;
non-tensor leaves (strings, ids, None) must come through untouched. `StreamPrefetcher` uses
`map_tensors` to pin and to move a batch without knowing its shape.
"""

from __future__ import annotations

import copy
from collections import UserDict
from collections.abc import Mapping
from typing import Any, Callable

import torch


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor], skip_keys=frozenset()) -> Any:
    """Apply ``fn`` to every tensor in ``obj`` and rebuild each container with its own type.

    Mappings (dict, dict subclasses, ``UserDict`` such as ``BatchEncoding``), lists, tuples and
    namedtuples are traversed; every other leaf is returned as is, and so are the values of
    mapping keys in ``skip_keys``.
    """
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, Mapping):
        # UserDict's own items() goes through __getitem__, which BatchEncoding overrides.
        src = obj.data if isinstance(obj, UserDict) else obj
        items = {k: v if k in skip_keys else map_tensors(v, fn, skip_keys) for k, v in src.items()}
        return _rebuild_mapping(obj, items)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):     # namedtuple: fields are positional
        return type(obj)(*(map_tensors(v, fn, skip_keys) for v in obj))
    if isinstance(obj, (list, tuple)):
        items = [map_tensors(v, fn, skip_keys) for v in obj]
        return items if type(obj) is list else type(obj)(items)
    return obj


def _rebuild_mapping(obj: Mapping, items: dict) -> Mapping:
    if type(obj) is dict:
        return items
    if isinstance(obj, UserDict):
        # A shallow copy keeps BatchEncoding's encodings and n_sequences; only .data changes.
        new = copy.copy(obj)
        new.data = items
        return new
    if isinstance(obj, dict):
        try:
            return type(obj)(items)            # OrderedDict and most subclasses
        except TypeError:                      # e.g. defaultdict: keep its factory via a copy
            new = copy.copy(obj)
            new.update(items)                  # every key of obj: each value replaced
            return new
    return type(obj)(items)
