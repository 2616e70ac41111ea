"""A layer frozen when training begins and unfrozen mid-run, under an optimizer of the user's over every parameter.

Stock (DDP, whose reducer hooks the parameters trainable when it was built) steps the unfrozen layer
with each rank's own gradient, not averaged: the replicas drift apart. `"overlap"` does what DDP does
(GradSync hooks what was trainable at construction, as DDP's reducer), so it equals stock on every rank.
`"sharded"` cannot: its optimizer holds slices of the parameters trainable when it was sharded, so
the layer is not stepped, and it says so once, with what to do instead (unfreeze before train(),
or `"overlap"`), instead of leaving the layer still in silence. Its clip counts the layer's gradient
as stock's does (each rank its own): step 3, the first with the layer unfrozen and the last whose
parameters still agree with stock's, logs stock's grad norm.
"""

from __future__ import annotations

import pytest
import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

from hfstream import StreamTrainer, StreamTrainingArguments
from hfstream.testing import run_on_ranks
from tiny import lm_dataset, params, tiny_causal_lm, train_args

pytestmark = pytest.mark.multiprocess

LAYER = "transformer.h.0.mlp.c_fc.weight"


class UnfreezeAtStep2(TrainerCallback):
    def on_step_begin(self, args, state, control, model=None, **kwargs):
        if state.global_step == 2:
            for name, p in model.named_parameters():
                if name.startswith("transformer.h.0.mlp."):
                    p.requires_grad_(True)


def _run(rank, world_size, tmp):
    out = {}
    for side in ("stock", "overlap", "sharded"):
        model = tiny_causal_lm("gpt2", seed=0)
        for name, p in model.named_parameters():
            if name.startswith("transformer.h.0.mlp."):
                p.requires_grad_(False)
        start = model.get_parameter(LAYER).detach().clone()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
        stock = side == "stock"
        kw = dict(max_steps=5, ddp_timeout=60)
        if not stock:
            kw.update(grad_sync=side, prefetch_depth=0)
        args = train_args(TrainingArguments if stock else StreamTrainingArguments, f"{tmp}/{side}", **kw)
        trainer = (Trainer if stock else StreamTrainer)(model=model, args=args, train_dataset=lm_dataset(),
                                                          optimizers=(optimizer, None), callbacks=[UnfreezeAtStep2()])
        trainer.train()
        notes = list(trainer.grad_sync.notes) if not stock else []
        out[side] = dict(params=params(trainer.model), moved=not torch.equal(model.get_parameter(LAYER), start),
                         notes=notes, norms=[h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h])
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_on_ranks(_run, 2, str(tmp_path_factory.mktemp("unfreeze")), init_process_group=False, timeout=300)


def test_overlap_steps_the_unfrozen_layer_as_stock_does_on_every_rank(ranks):
    for rank, out in enumerate(ranks):
        assert out["stock"]["moved"], "precondition: stock moves the layer unfrozen mid-run"
        for k, v in out["stock"]["params"].items():
            torch.testing.assert_close(out["overlap"]["params"][k], v, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, k=k: f"rank {rank} {k}: {m}")
    # Stock's replicas drift apart on that layer (its gradient is each rank's own), and overlap's alike.
    assert not torch.equal(ranks[0]["stock"]["params"][LAYER], ranks[1]["stock"]["params"][LAYER])


def test_sharded_leaves_the_unfrozen_layer_and_says_so_once_with_what_to_do(ranks):
    for rank, out in enumerate(ranks):
        assert not out["sharded"]["moved"], f"rank {rank}: sharded stepped a layer its optimizer holds no slice of"
        said = [n for n in out["sharded"]["notes"] if "unfrozen during train()" in n]
        assert len(said) == 1, out["sharded"]["notes"]
        assert LAYER in said[0] and "grad_sync='overlap'" in said[0] and "before train()" in said[0]


def test_sharded_counts_the_unfrozen_layers_own_gradient_in_the_grad_norm_as_stock_does(ranks):
    out = ranks[0]
    # Steps 1-2: the layer frozen; step 3: unfrozen, parameters still stock's (sharded's differ after
    # it: stock steps the layer, sharded cannot). On 192f30c step 3 logged the norm without the layer.
    assert out["sharded"]["norms"][:3] == pytest.approx(out["stock"]["norms"][:3], rel=1e-5)
