"""The side streams gradient collectives are packed and issued on (accelerators only), one per device.

On an accelerator, packing a bucket on the compute stream would queue it behind the rest of
backward; a side stream of its own (high priority by default) lets the pack and the collective
start as soon as the gradients exist. On CPU there are no streams and this holds nothing.
"""

from __future__ import annotations

import logging

import torch.distributed as dist

from .. import streams

logger = logging.getLogger(__name__)


class CommStreams(dict):
    """``device -> side stream``; `add` creates one for a device that has side streams."""

    def __init__(self, priority: str):
        super().__init__()
        self.priority = priority

    def add(self, device) -> None:
        if streams.is_accelerator(device) and device not in self and streams.has_side_streams(device):
            self[device] = streams.new_stream(device, self.priority)

    def hint_nccl_priority(self, group) -> None:
        """Say (info) that NCCL's own stream is normal priority when the group was not created high."""
        if self.priority != "high" or not self:
            return
        try:
            if "nccl" not in str(dist.get_backend(group)):
                return
            high = group._get_backend(next(iter(self))).options.is_high_priority_stream
        except Exception:   # private accessor: a hint is not worth an error
            return
        if not high:
            logger.info("GradSync: NCCL kernels run on the process group's own stream at normal priority; "
                        "create the group with pg_options=ProcessGroupNCCL.Options(is_high_priority_stream=True) "
                        "to raise it (GradSync packs buckets on a high-priority stream either way)")
