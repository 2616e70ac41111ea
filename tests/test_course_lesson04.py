"""Lesson 04 (data parallel from scratch): the likely mistakes, run in two real gloo processes, get
the hint that names them, and the right answer passes. Each check spawns two ranks once."""

from __future__ import annotations

import json
import textwrap

import pytest

from course.grading import LEARNER_PREAMBLE, check, run_cell


@pytest.fixture(autouse=True)
def _progress_elsewhere(tmp_path, monkeypatch):
    monkeypatch.setenv("HFSTREAM_COURSE_PROGRESS", str(tmp_path / "progress.json"))


def _ns(*cells):
    ns = run_cell(LEARNER_PREAMBLE)
    for cell in cells:
        ns = run_cell(textwrap.dedent(cell), ns)
    return ns


def _messages(exercise_id, ns):
    results = check(exercise_id, namespace=ns, quiet=True)
    return results, " | ".join(r.message for r in results if not r.passed)


RIGHT_AVERAGE = """
def broadcast_parameters(model):
    for p in model.parameters():
        dist.broadcast(p.data, src=0)

def average_gradients(model):
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
"""

RIGHT_TRAIN = """
def sgd_step(model, lr):
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= lr * p.grad

def train_data_parallel(model, x, y, steps, lr):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    xs, ys = x.chunk(world_size)[rank], y.chunk(world_size)[rank]
    broadcast_parameters(model)
    losses = []
    for _ in range(steps):
        model.zero_grad()
        loss = F.mse_loss(model(xs), ys)
        loss.backward()
        average_gradients(model)
        sgd_step(model, lr)
        losses.append(loss.item())
    return losses
"""


# --------------------------------------------------------------------------- 04.average_gradients
def test_average_right_answer_passes_even_with_a_test_call_left_in_the_cell():
    # The stray call would fail in a rank (no `model` there): the module file keeps definitions only.
    results, messages = _messages("04.average_gradients", _ns(RIGHT_AVERAGE + "\nmodel = TinyMLP()\n"
                                                                              "print(average_gradients)\n"))
    assert all(r.passed for r in results), messages


def test_average_that_forgets_to_divide_is_told_it_summed():
    wrong = """
    def broadcast_parameters(model):
        for p in model.parameters():
            dist.broadcast(p.data, src=0)

    def average_gradients(model):
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
    """
    results, messages = _messages("04.average_gradients", _ns(wrong))
    assert "the gradients are the SUM over ranks" in messages
    assert results[0].passed and not results[1].passed and "SUM" in results[1].message  # the drawn worlds, first


def test_average_that_reduces_parameters_and_broadcasts_a_copy_gets_both_hints():
    wrong = """
    def broadcast_parameters(model):
        for p in model.parameters():
            dist.broadcast(p.detach().clone(), src=0)

    def average_gradients(model):
        for p in model.parameters():
            dist.all_reduce(p.data)
            p.data /= dist.get_world_size()
    """
    _, messages = _messages("04.average_gradients", _ns(wrong))
    assert "kept its own initial weights" in messages
    assert "you reduced the parameters" in messages


# --------------------------------------------------------------------------- 04.train_parity
def test_train_parity_right_answer_passes():
    results, messages = _messages("04.train_parity", _ns(RIGHT_AVERAGE, RIGHT_TRAIN))
    assert all(r.passed for r in results), messages


def test_train_on_the_whole_batch_on_every_rank_is_told_to_shard():
    wrong = RIGHT_TRAIN.replace("x.chunk(world_size)[rank], y.chunk(world_size)[rank]", "x, y")
    results, messages = _messages("04.train_parity", _ns(RIGHT_AVERAGE, wrong))
    assert "every rank reports the full batch's loss" in results[0].message   # the drawn worlds, first
    assert all(r.message.startswith("fix the case above first") for r in results[1:])


def test_train_with_summed_gradients_is_told_it_doubled_the_learning_rate():
    summed = RIGHT_AVERAGE.replace("            p.grad /= dist.get_world_size()\n", "")
    _, messages = _messages("04.train_parity", _ns(summed, RIGHT_TRAIN))
    assert "twice the learning rate" in messages and "summed over the ranks" in messages


def test_the_ranks_file_keeps_definitions_and_drops_calls():
    from course.grading import keep_definitions as _keep_definitions

    text = textwrap.dedent("""
        import torch
        SCALE = 2.0
        END = object()
        def f(x):
            return x * SCALE
        @staticmethod
        def g():
            return 1
        print(f(3))
        out = f(4)
        for i in range(3):
            f(i)
        zeros = torch.zeros(3)
    """)
    kept = _keep_definitions(text)
    assert "def f" in kept and "SCALE = 2.0" in kept and "END = object()" in kept and "zeros = torch" in kept
    assert "@staticmethod" in kept
    assert "print(" not in kept and "out = f(4)" not in kept and "for i" not in kept


# --------------------------------------------------------------------------- one root cause, one diagnosis
FIX_ABOVE = "fix the case above first"


def test_train_without_broadcast_gets_one_diagnosis_and_the_code_only_on_the_third_try(tmp_path):
    wrong = RIGHT_TRAIN.replace("    broadcast_parameters(model)\n", "")
    ns = _ns(RIGHT_AVERAGE, wrong)
    for attempt in (1, 3):
        if attempt == 3:   # as if the second try had failed too (each try spawns two ranks)
            progress = json.loads((tmp_path / "progress.json").read_text())
            progress["04.train_parity"]["failures"][results[0].case] = 2
            (tmp_path / "progress.json").write_text(json.dumps(progress))
        results, messages = _messages("04.train_parity", ns)
        assert "started from different weights" in results[0].message
        assert "shards must split the batch" not in messages
        for r in results[1:]:
            assert not r.passed and r.message.startswith(FIX_ABOVE), r.message
            assert "started from different weights" in r.message
        # the first stage names the mistake; the code comes from the third failure on
        assert "broadcast_parameters(model)" not in messages
        assert bool(results[0].reveal) == (attempt == 3) and "broadcast_parameters(model)" in (results[0].reveal or
                                                                                            "broadcast_parameters(model)")


def test_averaging_the_parameters_is_not_told_to_broadcast():
    # average_gradients reduces p.data, not p.grad: the ranks start equal and drift apart.
    wrong = RIGHT_AVERAGE.replace("if p.grad is not None:\n            dist.all_reduce(p.grad)\n"
                                  "            p.grad /= dist.get_world_size()",
                                  "dist.all_reduce(p.data)\n        p.data /= dist.get_world_size()")
    assert "p.data /=" in wrong
    results, messages = _messages("04.train_parity", _ns(wrong, RIGHT_TRAIN))
    assert "broadcast_parameters" not in messages
    assert "started from the same weights" in results[0].message and "p.grad" in results[0].message
    assert all(r.message.startswith(FIX_ABOVE) for r in results[1:])
    # and in 04.average_gradients the same mistake is named once, by the drawn worlds
    results, messages = _messages("04.average_gradients", _ns(wrong))
    assert results[0].passed and "you reduced the parameters" in results[1].message
    assert "changed the parameters themselves" not in messages
    assert results[2].passed and results[3].message.startswith(FIX_ABOVE)
