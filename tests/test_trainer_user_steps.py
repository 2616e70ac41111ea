"""What Trainer users do between the forward and the optimizer, under every mode, against stock DDP.

The second real-use pass (issue 27): a BatchNorm model (its buffers, evaluation after), buffers
broadcast under accumulation, a ``training_step`` written out without ``super()``, FGM (a second
backward on a perturbed embedding), SAM (two ``super().training_step`` calls, perturbing by the
gradient between), gradient surgery inside the step, a layer re-initialised between steps, model surgery between
epochs (a frozen block unfrozen, the last block dropped), an EMA made by ``copy.deepcopy``
(``AveragedModel``) and a teacher copy used in the loss, a user-written elementwise optimizer
(Lion) declared for sharding or refused by name, schedule-free refused by name under sharded.

Each scenario runs with the stock ``Trainer`` (DDP, 2 gloo ranks) and with ``StreamTrainer`` in
``"overlap"`` and ``"sharded"`` (prefetch on); the whole ``state_dict`` of every rank, the losses
and each scenario's extras (evaluation loss, the EMA's parameters) must match within 1e-4, or
the run must be refused with a ValueError that names what the user set. All scenarios share one
spawn of 2 processes; a run that raises is kept as its traceback so the others still run.
"""

from __future__ import annotations

import copy
import traceback

import pytest
import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

from hfstream import StreamTrainer, StreamTrainingArguments
from tiny import lm_dataset, losses, params, tiny_causal_lm, train_args

# One spawn of 2 ranks, 42 runs: 1 min on 2 idle cores, 5 loaded, so under `make test-slow` (the deep-copy unit
# test at the end runs in the default suite).
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(900)]

SIDES = ("stock", "overlap", "sharded")
ATOL = 1e-4


# -- models and data ---------------------------------------------------------------------------------
def _resnet(seed):
    from transformers import ResNetConfig, ResNetForImageClassification

    torch.manual_seed(seed)
    cfg = ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3,
                       downsample_in_first_stage=False)
    return ResNetForImageClassification(cfg)


def _images(n=64, seed=3):
    import datasets

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, 16, 16, generator=g)
    y = torch.randint(0, 3, (n,), generator=g)
    return datasets.Dataset.from_dict({"pixel_values": x.tolist(), "labels": y.tolist()}).with_format("torch")


def _gpt2(seed):
    return tiny_causal_lm("gpt2", seed=seed)


# -- user code -----------------------------------------------------------------------------------------
def written_out(base):
    class WrittenOut(base):
        """A training_step of one's own, no super(): compute_loss, then the accelerator's backward."""

        def training_step(self, model, inputs, num_items_in_batch=None):
            model.train()
            inputs = self._prepare_inputs(inputs)
            loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
            self.accelerator.backward(loss)
            return loss.detach()
    return WrittenOut


def fgm(base):
    class FGM(base):
        """Adversarial training: perturb the embedding along its gradient, a second backward, restore."""

        def training_step(self, model, inputs, num_items_in_batch=None):
            loss = super().training_step(model, inputs, num_items_in_batch)
            emb = self.accelerator.unwrap_model(model).transformer.wte.weight
            with torch.no_grad():
                r = 0.5 * emb.grad / (emb.grad.norm() + 1e-12)
                emb.add_(r)
            adv = self.compute_loss(model, self._prepare_inputs(inputs), num_items_in_batch=num_items_in_batch)
            self.accelerator.backward(adv)
            with torch.no_grad():
                emb.sub_(r)
            return loss
    return FGM


def sam(base):
    class SAM(base):
        """Sharpness-aware minimisation: a step up the gradient, the gradient there, back."""

        def training_step(self, model, inputs, num_items_in_batch=None):
            loss = super().training_step(model, inputs, num_items_in_batch)
            ps = [p for p in model.parameters() if p.grad is not None]
            norm = torch.norm(torch.stack([p.grad.norm(2) for p in ps]), 2)
            with torch.no_grad():
                eps = [p.grad * (0.05 / (norm + 1e-12)) for p in ps]
                for p, e in zip(ps, eps):
                    p.add_(e)
            model.zero_grad()
            super().training_step(model, inputs, num_items_in_batch)
            with torch.no_grad():
                for p, e in zip(ps, eps):
                    p.sub_(e)
            return loss
    return SAM


def surgery(base):
    class Surgery(base):
        """Gradient surgery inside the step: each parameter's gradient clipped to a norm of its own."""

        def training_step(self, model, inputs, num_items_in_batch=None):
            loss = super().training_step(model, inputs, num_items_in_batch)
            with torch.no_grad():
                for p in model.parameters():
                    if p.grad is not None:
                        p.grad.mul_(torch.clamp(0.05 / (p.grad.norm() + 1e-12), max=1.0))
            return loss
    return Surgery


def distilled(base):
    class Distilled(base):
        """A frozen teacher copied from the student at the start (copy.deepcopy), a KL term in the loss."""

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            if not hasattr(self, "teacher"):
                self.teacher = copy.deepcopy(self.accelerator.unwrap_model(model)).eval().requires_grad_(False)
            out = model(**inputs)
            with torch.no_grad():
                t = self.teacher(**inputs).logits
            kl = torch.nn.functional.kl_div(out.logits.log_softmax(-1), t.softmax(-1), reduction="batchmean")
            loss = out.loss + 0.5 * kl
            return (loss, out) if return_outputs else loss
    return Distilled


class EMA(TrainerCallback):
    """torch's AveragedModel (a deepcopy of the model) at train begin, updated after every step."""

    def __init__(self):
        self.ema = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

        self.ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.ema.update_parameters(model)


class Reinit(TrainerCallback):
    """Parameter re-initialisation between steps: one layer drawn afresh (the same draw on every rank)."""

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step == 2:
            with torch.no_grad():
                torch.manual_seed(7)
                model.transformer.h[1].mlp.c_fc.weight.normal_(0.0, 0.02)


class Unfreeze(TrainerCallback):
    """Model surgery between epochs, gradual unfreezing: the first block, frozen before training, is
    trainable again from the second epoch (not in the optimizer, which the Trainer built without it)."""

    def on_epoch_end(self, args, state, control, model=None, **kwargs):
        if round(state.epoch) == 1:
            model.transformer.h[0].requires_grad_(True)


class DropBlock(TrainerCallback):
    """Model surgery between epochs, layer dropping: the last block leaves the model after the first epoch."""

    def on_epoch_end(self, args, state, control, model=None, **kwargs):
        if round(state.epoch) == 1:
            model.transformer.h = model.transformer.h[:-1]
            model.config.n_layer = len(model.transformer.h)


class Lion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023), written by a user: the update is elementwise, and the class says so."""

    hfstream_elementwise = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.99), weight_decay=0.01):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                m = state["exp_avg"]
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_((m * b1 + p.grad * (1 - b1)).sign_(), alpha=-group["lr"])
                m.mul_(b2).add_(p.grad, alpha=1 - b2)


class UndeclaredLion(Lion):
    hfstream_elementwise = False


# -- one run --------------------------------------------------------------------------------------------
def _train(side, rank, out_dir, *, build=_gpt2, trainer=None, callbacks=(), data=None, eval_data=None,
           optimizer=None, **kw):
    stock = side == "stock"
    model = build(0 if stock else rank)   # hfstream's broadcast of rank 0's weights must fix seed=rank
    base = Trainer if stock else StreamTrainer
    cls = trainer(base) if trainer is not None else base
    settings = {"max_steps": 5, "ddp_timeout": 120, "learning_rate": 5e-3, "max_grad_norm": 1.0, **kw}
    if not stock:
        settings.update(grad_sync=side, prefetch_depth=2)
    args = train_args(TrainingArguments if stock else StreamTrainingArguments, out_dir, **settings)
    t = cls(model=model, args=args, train_dataset=data if data is not None else lm_dataset(n=48),
            eval_dataset=eval_data, callbacks=list(callbacks),
            optimizers=(optimizer(model), None) if optimizer is not None else (None, None))
    t.train()
    return t


def _result(t, **extra):
    return dict(losses=losses(t), params=params(t.model), steps=t.state.global_step, **extra)


SCENARIOS: dict = {}


def scenario(name):
    def register(fn):
        SCENARIOS[name] = fn
        return fn
    return register


@scenario("batchnorm-evaluate")
def _bn_eval(side, rank, out_dir):
    t = _train(side, rank, out_dir, build=_resnet, data=_images(), eval_data=_images(32, seed=4))
    return _result(t, eval_loss=t.evaluate()["eval_loss"])


@scenario("batchnorm-broadcast-accumulate")
def _bn_accum(side, rank, out_dir):
    t = _train(side, rank, out_dir, build=_resnet, data=_images(), ddp_broadcast_buffers=True,
               gradient_accumulation_steps=2, per_device_train_batch_size=2)
    return _result(t)


for _name, _cls in (("written-out-step", written_out), ("fgm", fgm), ("sam", sam), ("gradient-surgery", surgery),
                    ("teacher-deepcopy", distilled)):
    scenario(_name)(lambda side, rank, out_dir, _cls=_cls: _result(_train(side, rank, out_dir, trainer=_cls)))


@scenario("fgm-accumulate")
def _fgm_accumulate(side, rank, out_dir):
    # The first micro-step does not synchronise: the watch of .grad reads waits for the one that does.
    return _result(_train(side, rank, out_dir, trainer=fgm, gradient_accumulation_steps=2,
                          per_device_train_batch_size=2))


@scenario("ema-deepcopy")
def _ema(side, rank, out_dir):
    ema = EMA()
    t = _train(side, rank, out_dir, callbacks=[ema])
    return _result(t, ema={k: v.detach().clone() for k, v in ema.ema.module.state_dict().items()})


@scenario("reinit-between-steps")
def _reinit(side, rank, out_dir):
    return _result(_train(side, rank, out_dir, callbacks=[Reinit()]))


def _frozen_first_block(seed):
    model = _gpt2(seed)
    model.transformer.h[0].requires_grad_(False)
    return model


# Two epochs of 2 steps each; no clipping in the unfreezing run: stock's clip_grad_norm_ would read the
# unfrozen block's gradient, which DDP (built before the unfreezing) never reduces, so stock's own ranks
# would clip by different norms.
@scenario("unfreeze-between-epochs")
def _unfreeze(side, rank, out_dir):
    return _result(_train(side, rank, out_dir, build=_frozen_first_block, callbacks=[Unfreeze()],
                          data=lm_dataset(n=16), max_steps=-1, num_train_epochs=2, max_grad_norm=0.0))


@scenario("drop-block-between-epochs")
def _drop_block(side, rank, out_dir):
    return _result(_train(side, rank, out_dir, callbacks=[DropBlock()], data=lm_dataset(n=16), max_steps=-1,
                          num_train_epochs=2))


@scenario("bf16-clipping")
def _bf16_clipping(side, rank, out_dir):
    # Clipping active at every step (max_grad_norm below every norm) under bf16 autocast, which carries a
    # coefficient's last bit into the weights: sharded took the norm as stock does, per parameter.
    t = _train(side, rank, out_dir, bf16=True, max_grad_norm=0.1, max_steps=6)
    return _result(t, grad_norms=[h["grad_norm"] for h in t.state.log_history if "grad_norm" in h])


@scenario("lion-declared")
def _lion(side, rank, out_dir):
    return _result(_train(side, rank, out_dir, optimizer=lambda m: Lion(m.parameters(), lr=1e-3)))


@scenario("lion-undeclared")
def _lion_undeclared(side, rank, out_dir):
    return _result(_train(side, rank, out_dir, optimizer=lambda m: UndeclaredLion(m.parameters(), lr=1e-3)))


@scenario("schedule-free")
def _schedule_free(side, rank, out_dir):
    import schedulefree  # noqa: F401  (the Trainer's optim="schedule_free_adamw" needs it)

    return _result(_train(side, rank, out_dir, optim="schedule_free_adamw", max_grad_norm=0.0,
                          lr_scheduler_type="constant"))


def _run_all(rank, world_size, tmp):
    out = {}
    for name, fn in SCENARIOS.items():
        for side in SIDES:
            try:
                out[(name, side)] = fn(side, rank, f"{tmp}/{name}/{side}")
            except Exception as exc:   # kept: the other scenarios still run
                out[(name, side)] = {"error": traceback.format_exc(), "type": type(exc).__name__, "message": str(exc)}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from hfstream.testing import run_on_ranks

    tmp = tmp_path_factory.mktemp("user-steps")
    return run_on_ranks(_run_all, 2, str(tmp), init_process_group=False, timeout=800)


def _ok(out, name, side):
    got = out[(name, side)]
    assert "error" not in got, f"{name} [{side}] raised:\n{got['error']}"
    return got


def _same(ref, got, what):
    assert ref and sorted(got) == sorted(ref), f"{what}: other keys: {sorted(set(got) ^ set(ref))}"
    for k, v in ref.items():
        torch.testing.assert_close(got[k].float(), v.float(), rtol=1e-4, atol=ATOL, msg=lambda m, k=k: f"{what}: {k}: {m}")


def _trains_like_stock(runs, name, side, extra=()):
    for rank, out in enumerate(runs):
        ref, got = _ok(out, name, "stock"), _ok(out, name, side)
        assert got["steps"] == ref["steps"] > 0
        assert len(got["losses"]) == len(ref["losses"]) > 0
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=1e-4, atol=ATOL,
                                   msg=lambda m: f"{name} [{side}] rank {rank} losses: {m}")
        _same(ref["params"], got["params"], f"{name} [{side}] rank {rank} state_dict")
        for key in extra:
            if isinstance(ref[key], dict):
                _same(ref[key], got[key], f"{name} [{side}] rank {rank} {key}")
            else:
                assert got[key] == pytest.approx(ref[key], rel=1e-4, abs=ATOL), (name, side, rank, key)


MATCH = [("batchnorm-evaluate", ("eval_loss",)), ("batchnorm-broadcast-accumulate", ()), ("written-out-step", ()),
         ("fgm", ()), ("fgm-accumulate", ()), ("sam", ()), ("gradient-surgery", ()), ("teacher-deepcopy", ()), ("ema-deepcopy", ("ema",)),
         ("reinit-between-steps", ()), ("unfreeze-between-epochs", ()), ("drop-block-between-epochs", ()),
         ("bf16-clipping", ("grad_norms",)), ("lion-declared", ())]


@pytest.mark.slow
@pytest.mark.parametrize("side", ["overlap", "sharded"])
@pytest.mark.parametrize("name, extra", MATCH, ids=[m[0] for m in MATCH])
def test_trains_like_stock_ddp_on_every_rank(runs, name, extra, side):
    _trains_like_stock(runs, name, side, extra)


@pytest.mark.slow
def test_the_stock_run_itself_differs_between_ranks_where_buffers_are_per_rank(runs):
    # The comparison above is per rank: under DDP the running statistics are rank 0's, broadcast,
    # then moved by each rank's own last batch, so a BatchNorm model's buffers differ between ranks.
    a, b = (_ok(out, "batchnorm-evaluate", "stock")["params"] for out in runs)
    assert any(not torch.equal(a[k], b[k]) for k in a if "running_mean" in k)


@pytest.mark.slow
def test_an_undeclared_optimizer_of_ones_own_is_refused_under_sharded_naming_it_and_the_declaration(runs):
    for out in runs:
        _trains_like_stock([out], "lion-undeclared", "overlap")
        got = out[("lion-undeclared", "sharded")]
        assert got.get("type") == "ValueError", got
        msg = got["message"]
        assert "optimizers=(UndeclaredLion(...)" in msg and "hfstream_elementwise = True" in msg, msg
        assert "adamw_torch" not in msg, msg   # the user never set optim=


@pytest.mark.slow
def test_schedule_free_is_refused_by_name_under_sharded_and_trains_like_stock_under_overlap(runs):
    pytest.importorskip("schedulefree")
    for out in runs:
        _trains_like_stock([out], "schedule-free", "overlap")
        got = out[("schedule-free", "sharded")]
        assert got.get("type") == "ValueError", got
        assert "optim='schedule_free_adamw'" in got["message"] and "schedule-free" in got["message"], got["message"]
        assert "grad_sync='overlap'" in got["message"]


def test_a_deep_copy_of_a_hooked_model_carries_no_hfstream_hook():
    # A copy of the model must not reach the GradSync, its process group or the trainer: every hook
    # hfstream puts on it becomes a no-op in the copy (one process: the hooks are those of a trainer).
    import pickle

    from hfstream.gradsync.eager import ModelHook, eager_hook

    model = torch.nn.Linear(2, 2)
    calls = []
    model.register_forward_pre_hook(eager_hook(lambda *a: calls.append(1)))
    model.weight.register_post_accumulate_grad_hook(ModelHook(lambda p: calls.append(2)))
    twin = copy.deepcopy(model)
    twin(torch.ones(1, 2)).sum().backward()
    assert calls == []
    model(torch.ones(1, 2)).sum().backward()
    assert calls == [1, 2]
    pickle.loads(pickle.dumps(model))(torch.ones(1, 2))
    assert calls == [1, 2]
