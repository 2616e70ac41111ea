"""`make gpu-check` part 5 (the Trainer with GradSync active on a one-rank group, against the stock
Trainer) fails when what it claims is broken, on CPU with gloo: the plain GradSync (which does
nothing at world size 1, as a one-GPU Trainer run gets), an fp32 wire, a sharded clip that does not
clip, a re-plan that drops the optimizer's state. Its passing run is in the dry run
(tests/test_gpu_check.py) and tests/test_gpu_readiness.py.
"""

from __future__ import annotations

import pytest

from dev.gpu_check import one_rank_trainer

SHORT = dict(n_embd=64, n_layer=2, n_head=2, vocab=64, seq=32, batch=4, steps=14)   # overlap tunes in 6 steps


def failed_names(result: dict) -> set[str]:
    return {name for name, ok, _ in result["checks"] if not ok}


@pytest.fixture
def overlap_only(monkeypatch):
    monkeypatch.setattr(one_rank_trainer, "MODES", ("overlap",))
    monkeypatch.setattr(one_rank_trainer, "trainer_sizes", lambda quick, on_cpu: dict(SHORT))


@pytest.fixture
def sharded_only(monkeypatch):
    monkeypatch.setattr(one_rank_trainer, "MODES", ("sharded",))   # the CPU size: its tuning settles at step 24


def test_part_5_passes_on_the_short_overlap_run_with_parameters_equal_to_the_bit(overlap_only):
    r = one_rank_trainer.part_trainer(True, True, 120)
    assert r["status"] == "pass", r["failed"]
    n = r["numbers"]["overlap"]
    assert n["param_diff"] == 0.0 and n["chosen_mb"] is not None and len(n["replans"]) >= 2
    assert r["numbers"]["stock_vs_bf16_param_diff"] > 0            # the wire's rounding shows in the parameters


def test_part_5_fails_with_the_plain_grad_sync_that_does_nothing_at_world_size_1(overlap_only, monkeypatch):
    from hfstream import GradSync

    monkeypatch.setattr(one_rank_trainer, "one_rank_grad_sync", lambda: GradSync)   # the test-only switch removed
    r = one_rank_trainer.part_trainer(True, True, 120)
    failed = failed_names(r)
    assert {"overlap: GradSync ran active in the Trainer on a one-rank gloo group (every bucket a collective in the "
            "last step)", "overlap: grad_bucket_mb='auto' tried caps, chose one and re-planned to it",
            "overlap: the gradients the clip saw came through the bf16 wire (bf16 values)"} <= failed


def test_part_5_fails_when_the_gradients_travel_in_fp32(overlap_only, monkeypatch):
    import hfstream

    post_init = hfstream.StreamTrainingArguments.__post_init__

    def fp32_wire(self):
        self.grad_comm_dtype = None
        post_init(self)

    monkeypatch.setattr(hfstream.StreamTrainingArguments, "__post_init__", fp32_wire)
    r = one_rank_trainer.part_trainer(True, True, 120)
    assert "overlap: the gradients the clip saw came through the bf16 wire (bf16 values)" in failed_names(r)
    assert r["numbers"]["overlap"]["not_bf16"] > 0


def test_part_5_fails_when_the_sharded_clip_does_not_clip(sharded_only, monkeypatch):
    from hfstream.gradsync.sharded.reduction import ShardedReduction

    clip = ShardedReduction.clip_grad_norm_

    def norm_only(self, max_norm, norm_type, error_if_nonfinite, foreach):
        return clip(self, float("inf"), norm_type, error_if_nonfinite, foreach)   # the norm, nothing scaled

    monkeypatch.setattr(ShardedReduction, "clip_grad_norm_", norm_only)
    r = one_rank_trainer.part_trainer(True, True, 120)
    assert "sharded: parameters after the run equal stock-bf16's" in failed_names(r)
    assert r["numbers"]["sharded"]["param_diff"] > 10 * one_rank_trainer.PARAM_ATOL


def test_part_5_fails_when_a_re_plan_drops_the_optimizer_state(sharded_only, monkeypatch):
    from hfstream.gradsync.sharded import state as shard_state

    carry_over = shard_state.carry_over

    def without_state(*args, **kwargs):
        grads, _ = carry_over(*args, **kwargs)
        return grads, {}

    monkeypatch.setattr(shard_state, "carry_over", without_state)
    r = one_rank_trainer.part_trainer(True, True, 120)
    assert "sharded: parameters after the run equal stock-bf16's" in failed_names(r)
    assert r["numbers"]["sharded"]["param_diff"] > 10 * one_rank_trainer.PARAM_ATOL
