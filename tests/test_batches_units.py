"""`batches.map_tensors` on the containers the prefetch tests do not cycle through."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from hfstream.prefetch.batches import map_tensors


class ReadOnlyBatch(Mapping):
    """A batch type of the user's: a Mapping that is neither a dict nor a UserDict."""

    def __init__(self, items):
        self._items = dict(items)

    def __getitem__(self, key):
        return self._items[key]

    def __iter__(self):
        return iter(self._items)

    def __len__(self):
        return len(self._items)


def test_a_mapping_of_the_users_own_type_is_rebuilt_as_that_type():
    batch = ReadOnlyBatch({"input_ids": torch.ones(2, dtype=torch.long), "name": "b0"})
    got = map_tensors(batch, lambda t: t * 2)
    assert type(got) is ReadOnlyBatch and list(got) == ["input_ids", "name"]
    assert torch.equal(got["input_ids"], torch.full((2,), 2)) and got["name"] == "b0"
