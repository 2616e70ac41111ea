"""Effect: under ``grad_sync="sharded"`` the reduce-scatters leave from the gradient hooks while backward runs.

The whole point of sharded mode's first half is that each bucket's reduce-scatter is on the wire
while the rest of backward computes (docs/design.md section 7: "during backward each ready bucket
is reduce-scattered"). What shows it, on 2 gloo ranks, without a clock: a post-accumulate-grad
hook on the parameter whose gradient backward produces last (the first layer's; GPT-2's tied
embedding), registered before GradSync's hooks, counts the buckets already launched at that
moment (phase ``REDUCING``): with several buckets some must be, in every step (the first, in
registration order; the later ones, re-planned in arrival order, with the previous step's
all-gathers still pending). The recorder's ``launched_in_backward`` says the same from the other
side: every bucket but the ones ``finish()`` found waiting.

Both through `GradSync(mode="sharded")` directly and through `StreamTrainer(grad_sync="sharded")`,
where ``finish()`` runs from the autograd engine's final callback and the optimizer is the
Trainer's. The results are compared with ``"overlap"`` (the same mean, all-reduced): a sharded
whose reduce-scatters waited for ``finish()`` still trains the same, so only the counts above
tell it apart (mutant checked by hand: ``launch_from_hooks = False`` on `ShardedReduction`).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from hfstream.testing import run_on_ranks

pytestmark = pytest.mark.multiprocess

STEPS = 3
LAYERS = 6


def _in_flight(sync) -> int:
    from hfstream.gradsync.bucket_state import Phase

    return sum(st.phase is Phase.REDUCING for st in sync.bucket_states)


def _gradsync_run(rank, mode):
    """``STEPS`` SGD steps of GradSync(mode) on a chain of layers, one bucket per parameter."""
    from hfstream.gradsync import GradSync

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(LAYERS)])
    first = model[0][0].weight   # its gradient is the last one backward produces
    seen, launched, buckets = [], [], []
    sync = None
    # Registered before GradSync's hooks: it runs before GradSync counts this gradient ready.
    first.register_post_accumulate_grad_hook(lambda p: seen.append(_in_flight(sync)))
    sync = GradSync(model, mode=mode, bucket_mb=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if mode == "sharded":
        opt = sync.shard_optimizer(opt)
    g = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        model(torch.randn(8, 16, generator=g)).pow(2).mean().backward()
        sync.finish()
        launched.append(sync.stats.launched_in_backward)
        buckets.append(len(sync.buckets))
        opt.step()
        opt.zero_grad()
    sync.wait_for_params()
    params = [p.detach().clone() for p in model.parameters()]
    sync.close()
    return {"seen": seen, "launched_in_backward": launched, "buckets": buckets, "params": params}


def _trainer_run(rank, tmp, mode):
    """``STEPS`` steps of StreamTrainer(grad_sync=mode) on a tiny GPT-2, one bucket per parameter."""
    from tiny import lm_dataset, losses, params, tiny_causal_lm, train_args

    from hfstream import StreamTrainer, StreamTrainingArguments

    model = tiny_causal_lm("gpt2", seed=rank)   # rank 0's weights reach rank 1 by GradSync's broadcast
    args = train_args(StreamTrainingArguments, f"{tmp}/{mode}", grad_sync=mode, grad_bucket_mb=0,
                      prefetch_depth=0, max_steps=STEPS, optim="sgd", learning_rate=0.05)
    trainer = StreamTrainer(model=model, args=args, train_dataset=lm_dataset())
    seen = []
    # The tied embedding: its gradient is complete only once the embedding's backward ran, last.
    # Registered before train() hooks the model, so before GradSync's hook on it.
    model.transformer.wte.weight.register_post_accumulate_grad_hook(lambda p: seen.append(
        (_in_flight(trainer.grad_sync), len(trainer.grad_sync.bucket_states))))
    trainer.train()
    return {"seen": seen, "last_launched_in_backward": trainer.grad_sync.stats.launched_in_backward,
            "buckets": len(trainer.grad_sync.buckets), "losses": losses(trainer), "params": params(trainer.model)}


def suite(rank, world_size, tmp):
    import torch.distributed as dist

    trainer = {mode: _trainer_run(rank, tmp, mode) for mode in ("sharded", "overlap")}
    assert dist.is_initialized() and dist.get_world_size() == 2   # Accelerate's group: GradSync's below
    return {"trainer": trainer, "gradsync": {mode: _gradsync_run(rank, mode) for mode in ("sharded", "overlap")}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sharded_backward_overlap")
    return run_on_ranks(suite, 2, str(tmp), init_process_group=False, timeout=240)


def _close(got, want, what):
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=what)


def test_gradsync_sharded_reduce_scatters_are_in_flight_before_backwards_last_gradient(runs):
    for rank, res in enumerate(runs):
        run = res["gradsync"]["sharded"]
        n = run["buckets"][0]
        assert n == 2 * LAYERS and len(run["seen"]) == STEPS, (n, run["seen"])
        # In every step (registration-order plan, then arrival-order plan with gathers pending):
        # when the first layer's gradient arrives, later layers' buckets are already on the wire.
        assert all(k >= 1 for k in run["seen"]), (
            f"rank {rank}: no reduce-scatter launched before backward's last gradient, per step {run['seen']} "
            f"of {n} buckets: they waited for finish() and could not overlap backward")
        # The first layer's own two buckets may wait for its gradients; every other one left in backward.
        assert all(k >= n - 2 for k in run["launched_in_backward"]), run["launched_in_backward"]


def test_gradsync_sharded_trains_as_overlap_does(runs):
    for res in runs:
        _close(res["gradsync"]["sharded"]["params"], res["gradsync"]["overlap"]["params"], "GradSync sharded")


def test_trainer_sharded_reduce_scatters_are_in_flight_before_backwards_last_gradient(runs):
    for rank, res in enumerate(runs):
        run = res["trainer"]["sharded"]
        assert run["buckets"] > 10 and len(run["seen"]) == STEPS, (run["buckets"], run["seen"])
        assert all(k >= 1 for k, _ in run["seen"]), (
            f"rank {rank}: StreamTrainer(grad_sync='sharded') launched no reduce-scatter before the tied "
            f"embedding's gradient arrived, per step (in flight, buckets) {run['seen']}: they waited for finish()")
        assert run["last_launched_in_backward"] >= run["buckets"] - 1, run["last_launched_in_backward"]


def test_trainer_sharded_trains_as_overlap_does(runs):
    for res in runs:
        sharded, overlap = res["trainer"]["sharded"], res["trainer"]["overlap"]
        assert len(sharded["losses"]) == STEPS
        _close(sharded["losses"], overlap["losses"], "losses")
        _close(list(sharded["params"].values()), list(overlap["params"].values()), "Trainer sharded")
