"""A rank whose backward reaches no parameter still takes part in the step's reductions (overlap, sharded).

A loss that does not depend on the parameters on one rank (every sample filtered out, a
``compute_loss`` returning a constant for an empty batch) fires no gradient hook there, so no
backward end calls `GradSync.finish()` on that rank. The training step's end does (`_synchronised`):
without it, the other rank's reductions wait for a peer that never launches them. The run must
train as if that rank's loss had a zero gradient.
"""

from __future__ import annotations

import pytest
import torch

from hfstream import StreamTrainer, StreamTrainingArguments
from tiny import lm_dataset, params, tiny_causal_lm, train_args

pytestmark = pytest.mark.multiprocess


class EmptyOnOneRank(StreamTrainer):
    """Each step one rank's loss is a constant: rank 0's in steps 1 and 3 (the first, before the re-plan in
    arrival order), rank 1's in steps 2 and 4; detached (no hook fires) or zeroed (hooks fire)."""

    detached = True

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        if self.args.process_index == self.state.global_step % 2:
            return (loss.detach() * 0).requires_grad_() if self.detached else loss * 0
        return loss


class ZeroedOnOneRank(EmptyOnOneRank):
    detached = False


def _runs(rank, world_size, tmp):
    out = {}
    for mode in ("overlap", "sharded"):
        for cls in (EmptyOnOneRank, ZeroedOnOneRank):
            trainer = cls(model=tiny_causal_lm("gpt2", seed=0), train_dataset=lm_dataset(),
                          args=train_args(StreamTrainingArguments, f"{tmp}/{mode}-{cls.__name__}", max_steps=4,
                                          grad_sync=mode, prefetch_depth=0, ddp_timeout=60))
            trainer.train()
            out[f"{mode}-{cls.__name__}"] = params(trainer.model)
    return out


def test_a_rank_whose_loss_reaches_no_parameter_trains_as_a_zero_gradient(tmp_path, run_distributed):
    ranks = run_distributed(_runs, 2, str(tmp_path), init_process_group=False, timeout=300)
    for mode in ("overlap", "sharded"):
        got, ref = ranks[0][f"{mode}-EmptyOnOneRank"], ranks[0][f"{mode}-ZeroedOnOneRank"]
        assert ref and set(got) == set(ref)
        for k, v in ref.items():
            torch.testing.assert_close(got[k], v, rtol=1e-6, atol=1e-7, msg=lambda m, k=k: f"{mode} {k}: {m}")
            assert torch.equal(got[k], ranks[1][f"{mode}-EmptyOnOneRank"][k]), (mode, k)   # replicas agree
