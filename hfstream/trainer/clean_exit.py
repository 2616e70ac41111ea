"""A finished run exits 0: gloo's worker threads end before the interpreter's teardown begins.

A gloo group's worker thread drops each finished collective's tensors itself, and that needs the
GIL. Once teardown has begun, a thread that asks for the GIL is ended by Python (pthread_exit),
which unwinds through a C++ destructor and aborts the process: "terminate called without an
active exception" after a run that finished (pytorch/pytorch#190489). The threads end, and wait
for the GIL first, only when the group is destroyed *and* its last reference is gone; GradSync
(and its bucket tuner, in a reference cycle) holds one, so a script's own destroy_process_group()
did not end them either. An atexit handler runs before teardown: it closes the GradSyncs
hfstream made and destroys the default group if the script did not. It does nothing after an
uncaught exception, while a reduction is in flight or abandoned (a collective may still wait on
a peer), or on NCCL (whose destroy must be collective).

How often a finished run aborted without it, and with it: docs/benchmarks.md, "A finished run
exits 0".
"""

from __future__ import annotations

import atexit
import gc
import logging
import sys
import weakref

logger = logging.getLogger(__name__)

_SYNCS_AT_EXIT: "weakref.WeakSet" = weakref.WeakSet()   # the GradSyncs to close when the interpreter exits
_EXIT_HOOK_REGISTERED = False


def release_at_exit(sync) -> None:
    """Close ``sync`` and destroy the default group at a normal exit, before teardown (see the module)."""
    global _EXIT_HOOK_REGISTERED
    _SYNCS_AT_EXIT.add(sync)
    if not _EXIT_HOOK_REGISTERED:
        atexit.register(_release_at_exit)
        _EXIT_HOOK_REGISTERED = True


def _release_at_exit() -> None:
    import torch.distributed as dist

    if getattr(sys, "last_value", None) is not None:   # leaving on an uncaught exception
        return
    syncs = list(_SYNCS_AT_EXIT)
    if any(s.broken or s.pending_report() for s in syncs):   # a collective that may wait on a peer
        return
    try:
        group = dist.is_available() and dist.is_initialized()
        if group and "nccl" in str(dist.get_backend()).lower():
            return
        for s in syncs:
            s.close()                   # drops its reference to the group (train() may have closed it)
        gc.collect()                    # and the ones in reference cycles (a finished bucket tuner holds one)
        if group:
            dist.destroy_process_group()    # the last reference: the group's destructor joins its threads
    except Exception as exc:            # an exit hook must never turn a finished run into a failure
        logger.warning("hfstream: releasing the process group at exit failed: %r", exc)
