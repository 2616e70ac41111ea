"""Lesson 04 (data parallel from scratch): the likely mistakes, run in two real gloo processes, get
the hint that names them, and the right answer passes. Each check spawns two ranks once."""

from __future__ import annotations

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
    assert results[0].passed and not results[1].passed


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


def test_train_without_broadcast_is_told_to_broadcast():
    wrong = RIGHT_TRAIN.replace("    broadcast_parameters(model)\n", "")
    _, messages = _messages("04.train_parity", _ns(RIGHT_AVERAGE, wrong))
    assert "Call broadcast_parameters(model) before the first step" in messages


def test_train_on_the_whole_batch_on_every_rank_is_told_to_shard():
    wrong = RIGHT_TRAIN.replace("x.chunk(world_size)[rank], y.chunk(world_size)[rank]", "x, y")
    results, messages = _messages("04.train_parity", _ns(RIGHT_AVERAGE, wrong))
    assert "both ranks report the full batch's loss" in messages
    assert results[0].passed and results[2].passed   # same parameters: only the sharding is wrong


def test_train_with_summed_gradients_is_told_it_doubled_the_learning_rate():
    summed = RIGHT_AVERAGE.replace("            p.grad /= dist.get_world_size()\n", "")
    _, messages = _messages("04.train_parity", _ns(summed, RIGHT_TRAIN))
    assert "twice the learning rate" in messages


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
