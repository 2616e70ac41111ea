"""Under grad_sync="sharded", a training_step of the user's keeps the slices-only step unless it reads .grad.

The first synchronising step of a user's ``training_step`` is watched (`GradientReads`): one that
reads or changes ``.grad``, or runs several backwards, gets the whole mean gradient in ``.grad``
in every step (an all-gather of the gradients per backward, said once); one that does not keeps
the sharded step's own path, each rank holding only its slices. Both train the same. The effect
held here is the choice: a step that reads nothing must not pay for the gather (what it costs
is not seen in the values), and one that reads must be told; and a step that reads no parameter
before its forward starts with the previous step's all-gathers still in flight.
"""

from __future__ import annotations

import pytest
import torch

from hfstream import StreamTrainer, StreamTrainingArguments
from tiny import lm_dataset, params, tiny_causal_lm, train_args

pytestmark = pytest.mark.multiprocess


class PlainStep(StreamTrainer):
    def training_step(self, model, inputs, num_items_in_batch=None):
        # The previous step's all-gathers, still in flight as the step begins: the forward waits for
        # them layer by layer, not the step for all of them before it.
        self.pending = getattr(self, "pending", [])
        self.pending.append(len(self.grad_sync.params_pending))
        return super().training_step(model, inputs, num_items_in_batch)


class ReadsGrad(StreamTrainer):
    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.seen = getattr(self, "seen", [])
        self.seen.append(float(sum(p.grad.float().pow(2).sum() for p in model.parameters() if p.grad is not None)))
        return loss


def _two_steps(rank, world_size, tmp):
    from hfstream.gradsync.sharded.reduction import ShardedReduction

    gathers = [0]
    real = ShardedReduction.gather_gradients

    def counted(self):
        gathers[0] += 1
        return real(self)

    ShardedReduction.gather_gradients = counted   # this rank's process only
    out = {}
    for cls in (PlainStep, ReadsGrad):
        gathers[0] = 0
        trainer = cls(model=tiny_causal_lm("gpt2", seed=rank), train_dataset=lm_dataset(),
                      args=train_args(StreamTrainingArguments, f"{tmp}/{cls.__name__}", max_steps=4,
                                      grad_sync="sharded", prefetch_depth=0))
        trainer.train()
        out[cls.__name__] = dict(reads=trainer._reads_gradients, notes=list(trainer._notes),
                                 params=params(trainer.model), seen=getattr(trainer, "seen", []),
                                 pending=getattr(trainer, "pending", []), gathers=gathers[0],
                                 before=trainer._reads_before_forward)
    return out


def test_a_user_step_keeps_the_sliced_gradients_unless_it_reads_them(tmp_path, run_distributed):
    for out in run_distributed(_two_steps, 2, str(tmp_path), init_process_group=False, timeout=300):
        plain, reads = out["PlainStep"], out["ReadsGrad"]
        told = "reads or changes .grad inside the step"
        assert plain["reads"] is False and not any(told in n for n in plain["notes"]), plain["notes"]
        # Neither step reads a parameter before its forward: decided in the first step (the watch is
        # not installed again), and nothing said about it.
        assert plain["before"] == reads["before"] == [], (plain["before"], reads["before"])
        assert not any("before the forward" in n for n in plain["notes"] + reads["notes"])
        assert len(plain["pending"]) == 4 and all(n > 0 for n in plain["pending"][1:]), plain["pending"]
        assert reads["reads"] is True and sum(told in n for n in reads["notes"]) == 1, reads["notes"]
        assert len(reads["seen"]) == 4 and all(s > 0 for s in reads["seen"])   # whole mean gradients, every step
        # One gather of the gradients per backward where they are read (4 steps), only the watched
        # first step's where they are not.
        assert (plain["gathers"], reads["gathers"]) == (1, 4)
        for k, v in plain["params"].items():
            torch.testing.assert_close(reads["params"][k], v, rtol=1e-5, atol=1e-6, msg=k)


class HalvesGrad(StreamTrainer):
    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(0.5)   # gradient surgery: the optimizer must step what the step left in .grad
        return loss


def _halved(rank, world_size, tmp):
    out = {}
    for cls, lr in ((HalvesGrad, 0.1), (PlainStep, 0.05)):
        trainer = cls(model=tiny_causal_lm("gpt2", seed=rank), train_dataset=lm_dataset(),
                      args=train_args(StreamTrainingArguments, f"{tmp}/{cls.__name__}", max_steps=4, optim="sgd",
                                      learning_rate=lr, max_grad_norm=0.0, grad_sync="sharded", prefetch_depth=0))
        trainer.train()
        out[cls.__name__] = params(trainer.model)
    return out


def test_a_user_step_that_changes_grad_is_stepped_with_what_it_left(tmp_path, run_distributed):
    # Plain SGD: half the gradient at lr 0.1 is the whole one at lr 0.05, to the bit (a power of 2).
    for out in run_distributed(_halved, 2, str(tmp_path), init_process_group=False, timeout=300):
        for k, v in out["PlainStep"].items():
            torch.testing.assert_close(out["HalvesGrad"][k], v, rtol=1e-6, atol=1e-7, msg=k)


def _forwards_around_evaluation(rank, world_size, tmp):
    model = tiny_causal_lm("gpt2", seed=rank)
    trainer = StreamTrainer(model=model, train_dataset=lm_dataset(), eval_dataset=lm_dataset(8),
                            args=train_args(StreamTrainingArguments, tmp, max_steps=4, grad_sync="sharded",
                                            grad_bucket_mb=0.01, prefetch_depth=0, eval_strategy="steps",
                                            eval_steps=2, per_device_eval_batch_size=4))
    seen = []   # (training?, buckets whose gathers were not waited for yet) at each forward's start
    model.register_forward_pre_hook(
        lambda m, a: seen.append((m.training, len(trainer.grad_sync.params_pending)))
        if trainer.grad_sync is not None else None)
    trainer.train()
    return seen


def test_the_stock_step_overlaps_the_gathers_with_the_next_forward_and_waits_before_evaluation(tmp_path,
                                                                                               run_distributed):
    # Without the wait, evaluation's forward would wait layer by layer (values equal, its waits not
    # counted as the step's); with a wait every step the gathers would no longer overlap the forward.
    for seen in run_distributed(_forwards_around_evaluation, 2, str(tmp_path), init_process_group=False,
                                timeout=300):
        training = [n for t, n in seen if t]
        evaluating = [n for t, n in seen if not t]
        # Step 1 has nothing gathered yet; step 3 follows the evaluation after step 2, which waited.
        assert [n > 0 for n in training] == [False, True, False, True], seen
        assert evaluating and all(n == 0 for n in evaluating), seen   # every gather waited for before it
