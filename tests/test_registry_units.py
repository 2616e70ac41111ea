"""`gradsync/registry.py`: a second GradSync on a model is refused, not run twice.

Two GradSyncs hooking the same parameters would reduce every gradient twice, with values that can
still look right (an average of averages). The registry refuses the second by name, frees a
model at `close()` (and only the closer's claims), and keeps nothing alive: neither the
parameters nor the GradSync that claimed them.
"""

from __future__ import annotations

import gc

import pytest
import torch

from hfstream.gradsync import registry
from hfstream.gradsync.sync import GradSync


class Owner:
    def __repr__(self) -> str:
        return "Owner()"


def params(n=3) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(2)) for _ in range(n)]


def test_a_second_owner_of_any_parameter_is_refused_and_told_to_close_the_first():
    ps, first, second = params(), Owner(), Owner()
    registry.claim(first, ps)
    with pytest.raises(RuntimeError, match=r"already hooked by Owner\(\); call close\(\) on it"):
        registry.claim(second, [params(1)[0], ps[2]])   # one shared parameter is enough
    assert registry.owner_of(ps) is first
    registry.claim(first, ps)   # the owner itself may claim again (re-planning keeps its hooks)
    assert all(registry.owner_of([p]) is first for p in ps)


def test_release_frees_only_the_releasers_claims():
    ps, first, second = params(), Owner(), Owner()
    registry.claim(first, ps[:2])
    registry.claim(second, ps[2:])
    registry.release(second, ps)          # names first's parameters too: they stay first's
    assert registry.owner_of(ps[:1]) is first and registry.owner_of(ps[1:2]) is first
    assert registry.owner_of(ps[2:]) is None
    registry.release(first, ps[:2])
    assert registry.owner_of(ps) is None
    registry.claim(second, ps)            # a released model can be hooked again


def test_owner_of_is_none_for_parameters_nobody_claimed():
    assert registry.owner_of(params()) is None
    assert registry.owner_of([]) is None


def test_it_keeps_neither_the_owner_nor_the_parameters_alive():
    ps, owner = params(), Owner()
    registry.claim(owner, ps)
    del owner
    gc.collect()
    assert registry.owner_of(ps) is None    # a dead owner holds nothing
    registry.claim(Owner(), ps)             # and does not block a new one
    before = len(registry._OWNERS)
    del ps
    gc.collect()
    assert len(registry._OWNERS) == before - 3


def test_a_second_gradsync_on_one_model_is_refused_until_the_first_is_closed():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    first = GradSync(model)
    with pytest.raises(RuntimeError, match="already hooked by .*every gradient is reduced twice"):
        GradSync(model)
    first.close()
    second = GradSync(model)        # closing freed it
    second.close()
    other = torch.nn.Linear(2, 2)   # another model is never refused
    GradSync(other).close()
