"""Accelerate's end-of-loader flags, kept right while a prefetcher reads the loader ahead of the loop.

Accelerate's `GradientState` reads ``end_of_dataloader`` and ``remainder`` from the training
dataloader to know when an epoch's last, possibly short, accumulation window comes. A
prefetcher reaches the loader's end up to ``prefetch_depth`` batches before the training loop
does; `tag_loader_state` (producer side) tags each batch with the flags it had when it was
produced, and `restore_loader_state` (consumer side) shows them when the batch is used, through
a `LoaderView` that stands in for the loader.
"""

from __future__ import annotations


class LoaderView:
    """What Accelerate's `GradientState` reads of the training dataloader, as the loop sees it.

    The prefetcher pulls batches ahead, so the real loader reaches its end (and sets
    ``end_of_dataloader``) up to ``prefetch_depth`` batches before the training loop does. This
    stands in for the loader in ``GradientState.dataloader_references`` and carries the flags
    each batch had when it was produced.
    """

    def __init__(self):
        self.end_of_dataloader = False
        self.remainder = -1


def tag_loader_state(source, state):
    """Producer side: each batch with its loader's ``end_of_dataloader`` and ``remainder``."""
    loader = None
    for batch in source:
        if loader is None:   # the loader registered itself on its first batch; it is the last one
            refs = [r for r in state.dataloader_references if r is not None and not isinstance(r, LoaderView)]
            loader = refs[-1] if refs else None
        yield batch, (loader, getattr(loader, "end_of_dataloader", False), getattr(loader, "remainder", -1))


def restore_loader_state(prefetched, state, view: LoaderView):
    """Consumer side: the view takes the loader's place and shows each batch's flags when it is used."""
    try:
        for batch, (loader, end, remainder) in prefetched:
            refs = state.dataloader_references
            if loader is not None and any(r is loader for r in refs):
                state.dataloader_references = [view if r is loader else r for r in refs]
            elif not any(r is view for r in refs):
                state.dataloader_references = refs + [view]
            view.end_of_dataloader, view.remainder = end, remainder
            yield batch
    finally:
        state.dataloader_references = [r for r in state.dataloader_references if r is not view]
