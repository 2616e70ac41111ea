"""Effect: on CPU the prefetch thread prepares the next batches while the step computes.

A collate function that takes a while (it sleeps, as a tokenizer or a network read would
block) records its own start and end. The step report's spans say where the training thread
was: waiting for data (lane ``data``) or computing (forward, backward, optimizer). Read against
each other, on one clock, in one run:

- ``prefetch_depth=0``: each collate runs on the training thread inside a data wait; none
  overlaps a compute span (every batch's preparation is on the step's critical path);
- ``prefetch_depth=2``: collates run during compute spans, so that time is hidden: the report's
  data-wait spans cover only part of the collate time.

No wall-clock threshold: only containment and overlap of intervals. A prefetcher that reads
the source on the training thread (the same batches, the same values) fails the second part.
"""

from __future__ import annotations

import threading
import time

import pytest
from transformers.data.data_collator import default_data_collator

from hfstream import StreamTrainer, StreamTrainingArguments
from tiny import lm_dataset, losses, tiny_causal_lm, train_args

COLLATE_S = 0.03   # the collate's sleep: makes the preparation visible, no assertion depends on it
STEPS = 6


class SlowCollate:
    def __init__(self):
        self.spans = []   # (start, end, thread name), perf_counter seconds: the report's clock on CPU

    def __call__(self, features):
        t0 = time.perf_counter()
        time.sleep(COLLATE_S)
        batch = default_data_collator(features)
        self.spans.append((t0, time.perf_counter(), threading.current_thread().name))
        return batch


def _overlap(a, b):
    return max(0.0, min(a[1], b[1]) - max(a[0], b[0]))


def _run(tmp, depth):
    collate = SlowCollate()
    trainer = StreamTrainer(model=tiny_causal_lm("gpt2"), data_collator=collate,
                            args=train_args(StreamTrainingArguments, f"{tmp}/d{depth}", max_steps=STEPS,
                                            prefetch_depth=depth, grad_sync="native"),
                            train_dataset=lm_dataset())
    trainer.train()
    spans = [tuple(s) for s in trainer.stream_report()["spans"]]
    compute = [(s[3], s[4]) for s in spans if s[1] == "compute"]
    waits = [(s[3], s[4]) for s in spans if s[1] == "data"]
    return {"collates": collate.spans, "compute": compute, "waits": waits, "losses": losses(trainer)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("data_wait")
    return {depth: _run(tmp, depth) for depth in (0, 2)}


def test_without_prefetch_every_collate_is_inside_a_data_wait_and_overlaps_no_compute(runs):
    r = runs[0]
    assert r["compute"] and r["waits"], "the report has compute and data-wait spans"
    assert all(name == threading.main_thread().name for *_, name in r["collates"])
    assert sum(_overlap(c, s) for c in r["collates"] for s in r["compute"]) == 0.0
    # every reported data wait holds its batch's whole collate: the wait is the preparation
    for w in r["waits"]:
        assert any(w[0] <= c[0] and c[1] <= w[1] for c in r["collates"]), w


def test_with_the_prefetch_thread_collates_run_during_compute_and_the_data_wait_covers_less(runs):
    r = runs[2]
    assert r["compute"] and len(r["collates"]) >= STEPS
    assert all(name.startswith("hfstream-prefetch") for *_, name in r["collates"])
    first, last = r["compute"][0][0], r["compute"][-1][1]
    seen = [c for c in r["collates"] if c[1] > first and c[0] < last]   # within the reported steps
    hidden = sum(_overlap(c, s) for c in seen for s in r["compute"])
    waited = sum(_overlap(c, w) for c in seen for w in r["waits"])
    total = sum(c[1] - c[0] for c in seen)
    assert hidden > 0.0, "no collate ran while the step computed: the data preparation was not hidden"
    assert waited < total   # the training thread waited for only part of the preparation
    assert runs[0]["losses"] == r["losses"]   # the same batches, the same training
