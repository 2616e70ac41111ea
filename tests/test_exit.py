"""A script that does not call destroy_process_group still exits cleanly after a StreamTrainer run.

On gloo a group's worker threads drop each finished collective's tensors themselves, which needs the
GIL; a thread still waiting for it when the interpreter's teardown begins is ended by Python and
aborts the process ("terminate called without an active exception", pytorch/pytorch#190489).
hfstream's exit hook closes its GradSyncs and destroys the default group before teardown, so that
the group's destructor joins those threads. Checked deterministically here: after the hook, no gloo
thread is left (the exit codes over many launches are in docs/benchmarks.md).
"""

from __future__ import annotations

import os

import pytest

from tiny import lm_dataset, tiny_causal_lm, train_args


def _threads() -> list[str]:
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            pass
    return sorted(names)


def _train_then_exit_hook(rank, world_size, tmp, destroy_first):
    import torch.distributed as dist

    from hfstream import StreamTrainer, StreamTrainingArguments
    from hfstream.trainer import clean_exit

    import atexit

    atexit.unregister(clean_exit._release_at_exit)   # a fresh process's state: the run must register it
    clean_exit._EXIT_HOOK_REGISTERED = False
    args = train_args(StreamTrainingArguments, tmp, max_steps=6, grad_sync="overlap", grad_bucket_mb="auto")
    trainer = StreamTrainer(model=tiny_causal_lm("gpt2", seed=0), args=args, train_dataset=lm_dataset())
    trainer.train()
    registered = clean_exit._EXIT_HOOK_REGISTERED and trainer.grad_sync in clean_exit._SYNCS_AT_EXIT
    before = _threads()
    if destroy_first:                     # what the README asks of a script: it must not keep the threads
        dist.destroy_process_group()
    clean_exit._release_at_exit()         # what atexit runs
    return dict(before=before, after=_threads(), initialized=dist.is_initialized(), registered=registered,
                group_released=trainer.grad_sync.process_group is None)


@pytest.mark.multiprocess
@pytest.mark.parametrize("destroy_first", [False, True])
def test_exit_hook_ends_gloo_threads(tmp_path, run_distributed, destroy_first):
    for out in run_distributed(_train_then_exit_hook, 2, str(tmp_path), destroy_first,
                               init_process_group=False, timeout=300):
        assert out["registered"]   # the run put its GradSync and the hook in place for the real exit
        assert "pt_gloo_runloop" in out["before"]
        assert not out["initialized"] and out["group_released"]
        assert not [t for t in out["after"] if t.startswith(("pt_gloo", "gloo_"))], out["after"]
