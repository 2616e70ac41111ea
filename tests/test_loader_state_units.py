"""`loader_state.py` on a scripted loader: each batch shows the end-of-loader flags it was produced with.

Accelerate's `GradientState` reads ``end_of_dataloader`` and ``remainder`` from the last entry of
``dataloader_references``; the loader adds itself there when its iteration begins and removes
itself when it ends. A prefetcher reads the loader ahead, so by the time the training loop uses
the last batches the loader has ended (and gone from the list): the view must stand in for it,
once, with each batch's own flags, and leave when the epoch's batches are used. Wrong flags change
which step is an epoch's short last accumulation window; these tests hold them without a Trainer.
"""

from __future__ import annotations

from hfstream.trainer.loader_state import LoaderView, restore_loader_state, tag_loader_state


class State:
    """What the two functions use of Accelerate's `GradientState`: the list of loader references."""

    def __init__(self):
        self.dataloader_references = [None]   # Accelerate's own start


class Loader:
    """Registers itself while it iterates and sets its flags before its last batch, as Accelerate's does."""

    def __init__(self, state, n, remainder=3):
        self.state, self.n, self.last_remainder = state, n, remainder
        self.end_of_dataloader, self.remainder = False, -1

    def __iter__(self):
        self.state.dataloader_references = self.state.dataloader_references + [self]
        for i in range(self.n):
            if i == self.n - 1:
                self.end_of_dataloader, self.remainder = True, self.last_remainder
            yield i
        self.state.dataloader_references = [r for r in self.state.dataloader_references if r is not self]


def test_a_fresh_view_reads_as_accelerate_outside_a_loader():
    view = LoaderView()
    assert (view.end_of_dataloader, view.remainder) == (False, -1)


def test_each_batch_is_tagged_with_the_flags_its_loader_had_when_it_was_produced():
    state = State()
    loader = Loader(state, 3)
    tagged = list(tag_loader_state(loader, state))
    assert tagged == [(0, (loader, False, -1)), (1, (loader, False, -1)), (2, (loader, True, 3))]


def test_batches_with_no_loader_registered_are_tagged_with_accelerates_defaults():
    state = State()
    assert list(tag_loader_state(iter([7, 8]), state)) == [(7, (None, False, -1)), (8, (None, False, -1))]


def test_a_view_left_in_the_list_is_never_taken_for_the_loader():
    state = State()
    loader, stale = Loader(state, 2), LoaderView()
    state.dataloader_references = [None, loader, stale]
    (_, (found, _, _)), _ = list(tag_loader_state(iter([0, 1]), state))
    assert found is loader


def test_the_view_takes_the_loaders_place_while_it_iterates_and_each_batch_shows_its_own_flags():
    state, view = State(), LoaderView()
    loader = Loader(state, 3)
    seen = []
    for batch in restore_loader_state(tag_loader_state(loader, state), state, view):   # no look-ahead
        seen.append((batch, list(state.dataloader_references), view.end_of_dataloader, view.remainder))
    assert seen == [(0, [None, view], False, -1), (1, [None, view], False, -1), (2, [None, view], True, 3)]
    assert state.dataloader_references == [None]   # the view leaves with the epoch


def test_read_ahead_past_the_loaders_end_the_view_stands_in_once_until_the_last_batch_is_used():
    state, view = State(), LoaderView()
    loader = Loader(state, 3)
    ahead = list(tag_loader_state(loader, state))     # a prefetcher that read the whole epoch ahead
    assert state.dataloader_references == [None]      # the loader has ended and removed itself
    seen = []
    for batch in restore_loader_state(iter(ahead), state, view):
        seen.append((batch, list(state.dataloader_references), view.end_of_dataloader))
    assert seen == [(0, [None, view], False), (1, [None, view], False), (2, [None, view], True)]
    assert state.dataloader_references == [None]


def test_the_view_leaves_the_list_when_the_loop_stops_early():
    state, view = State(), LoaderView()
    consumer = restore_loader_state(tag_loader_state(Loader(state, 5), state), state, view)
    next(consumer)
    assert state.dataloader_references[-1] is view
    consumer.close()   # max_steps reached mid-epoch
    assert not any(r is view for r in state.dataloader_references)
