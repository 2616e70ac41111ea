"""`GradSync` (`gradsync/sync.py`) where no value shows what it does: a note said in the log once,
`finish()` returning only after every bucket's completion was recorded, and the pending report
empty between steps.

The completion callbacks run on gloo's own thread as each reduction completes; `finish()` waits for
them (not only for the works), or a step's stats could lack the buckets that completed last. The
test slows the callback so that the difference is not left to a race.
"""

from __future__ import annotations

import logging
import time

import torch

from hfstream.gradsync import sync as sync_module
from hfstream.gradsync.sync import GradSync
from test_gradsync import FrozenBiasMLP, mlp_batch, mlp_loss


def test_a_note_is_kept_and_logged_once(caplog):
    with GradSync(FrozenBiasMLP()) as sync, caplog.at_level(logging.WARNING, logger=sync_module.__name__):
        sync._say("GradSync: overlap lost (a test)")
        sync._say("GradSync: overlap lost (a test)")
        sync._say("GradSync: another")
    assert sync.notes == ["GradSync: overlap lost (a test)", "GradSync: another"]
    assert [r.getMessage() for r in caplog.records] == sync.notes


def slow_completions(rank, world_size):
    torch.manual_seed(0)
    model = FrozenBiasMLP()
    sync = GradSync(model, bucket_mb=0.0004)
    done = []

    real = sync._recorder.completed

    def slow(st, _future=None):
        time.sleep(0.05)
        real(st, _future)
        done.append(st.plan.index)
    sync._recorder.completed = slow   # read when each bucket is launched
    reports = [sync.pending_report()]
    out = []
    for step in range(2):
        done.clear()
        mlp_loss(model, mlp_batch(step)).backward()
        sync.finish()
        out.append((sorted(done), len(sync.buckets)))
        reports.append(sync.pending_report())
        for p in model.parameters():
            p.grad = None
    sync.close()
    return out, reports


def test_finish_returns_after_every_buckets_completion_and_nothing_is_pending_between_steps(run_distributed):
    for out, reports in run_distributed(slow_completions, 2, timeout=120):
        for done, n in out:
            assert n > 1 and done == list(range(n)), (done, n)
        assert reports == ["", "", ""]
