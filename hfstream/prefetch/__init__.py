"""Prefetching: the next batches prepared and moved to the device while the current step computes.

    prefetcher  `StreamPrefetcher`, the facade: one epoch (a pass over the source) at a time
    epoch       what every way of prefetching shares; depth 0 reads on the training thread
    thread      CPU: a background thread prepares the next batches
    stream      accelerator: copies on a side stream, one event per batch
    batches     a batch's structure: `map_tensors` pins and moves a batch of any shape
"""

from .prefetcher import StreamPrefetcher

__all__ = ["StreamPrefetcher"]
