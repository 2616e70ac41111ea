"""`trainer.py`'s class-level rule: which Trainer classes run a training step of their own.

Under sharded, a training step of the user's (FGM, SAM, gradient surgery) is given the whole mean
gradient in its first step and watched; the stock step is not. Taking the stock step for a user's
costs a gather of every gradient in the first step and changes no value, so only this rule holds it.
"""

from __future__ import annotations

from transformers import Trainer

from hfstream.trainer.trainer import StreamTrainer, StreamTrainerMixin, _own_training_step


class Mine(Trainer):
    def training_step(self, model, inputs, num_items_in_batch=None):
        return super().training_step(model, inputs, num_items_in_batch)


class MineStreamed(StreamTrainerMixin, Mine):
    pass


class Sub(StreamTrainer):
    def training_step(self, model, inputs, num_items_in_batch=None):
        return super().training_step(model, inputs, num_items_in_batch)


class SubSub(Sub):
    pass


class OnlyLoss(StreamTrainer):
    def compute_loss(self, *a, **k):
        return super().compute_loss(*a, **k)


def test_the_stock_and_hfstreams_own_steps_are_not_the_users():
    assert _own_training_step(StreamTrainer) is None
    assert _own_training_step(OnlyLoss) is None          # compute_loss is watched separately


def test_a_training_step_anywhere_in_the_users_classes_is():
    assert _own_training_step(Sub) == "training_step"
    assert _own_training_step(SubSub) == "training_step"
    assert _own_training_step(MineStreamed) == "training_step"   # the mixin on an existing subclass
