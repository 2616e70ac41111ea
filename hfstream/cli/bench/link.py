"""The benchmark's simulated link: `hfstream.testing.link.SimulatedLink`, routing ``all_reduce`` only.

The link itself (its model, the delayed works, the timer thread) lives in `hfstream.testing.link`,
which the course shares. The benchmark installs it for ``torch.distributed.all_reduce`` alone:
its simulated runs compare the all-reduce modes (serial, DDP, overlap), and the sharded modes are
compared on the shaped namespace (docs/design.md section 5), so a table made with the simulated
link stays comparable with the ones before the link could delay all-to-all and all-gather too.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from hfstream.testing import link as _link
from hfstream.testing.link import measure_allreduce, ring_allreduce_bytes

__all__ = ["SimulatedLink", "measure_allreduce", "ring_allreduce_bytes"]


class SimulatedLink(_link.SimulatedLink):
    """`hfstream.testing.link.SimulatedLink` whose ``installed()`` routes ``dist.all_reduce`` only."""

    @contextlib.contextmanager
    def installed(self, *ops: str) -> Iterator["SimulatedLink"]:
        with super().installed(*(ops or ("all_reduce",))):
            yield self
