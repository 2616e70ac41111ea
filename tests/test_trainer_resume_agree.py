"""``resume_from_checkpoint=True`` resumes every rank from the main process's last checkpoint.

Where to resume decides every later collective (the first step, the batches skipped), and each rank
lists ``output_dir`` itself in the stock Trainer: a rank that sees another last checkpoint (the main
process still writing or rotating what the last step saved when a script resumes in the same
process; another node's stale view of a shared folder) starts at another step, and the ranks hang in
mismatched collectives. Found by the generator's resume (seeds 307 and 341 of a run of seeds
300-399, 3 ranks). Here rank 1 is made to list an older checkpoint.
"""

from __future__ import annotations

import pytest

from hfstream import StreamTrainer, StreamTrainingArguments
from tiny import lm_dataset, params, tiny_causal_lm, train_args

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


def _trainer(out, max_steps, mode):
    return StreamTrainer(model=tiny_causal_lm("gpt2", seed=0), train_dataset=lm_dataset(),
                         args=train_args(StreamTrainingArguments, out, max_steps=max_steps, save_strategy="steps",
                                         save_steps=2, ddp_timeout=20, grad_sync=mode, prefetch_depth=0))


def _resume_with_a_stale_listing(rank, world_size, tmp, mode):
    import transformers.trainer
    import transformers.trainer_utils

    out = f"{tmp}/{mode}"
    _trainer(out, 4, mode).train()   # checkpoint-2 and checkpoint-4
    if rank == 1:   # this rank's view of the folder is one save behind, wherever it is listed
        for module in (transformers.trainer_utils, transformers.trainer):
            module.get_last_checkpoint = lambda folder: f"{folder}/checkpoint-2"
    resumed = _trainer(out, 6, mode)
    resumed.train(resume_from_checkpoint=True)
    return resumed.state.global_step, len(resumed.state.log_history), params(resumed.model)


@pytest.mark.parametrize("mode", ["native", "sharded"])
def test_every_rank_resumes_from_the_main_process_last_checkpoint(run_distributed, tmp_path, mode):
    (steps0, logs0, p0), (steps1, logs1, p1) = run_distributed(_resume_with_a_stale_listing, 2, str(tmp_path),
                                                               mode, timeout=240)
    assert steps0 == steps1 == 6 and logs0 == logs1
    for name, value in p0.items():
        assert (value == p1[name]).all(), name   # the replicas resumed at the same step: still one model
