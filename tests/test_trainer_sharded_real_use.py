"""StreamTrainer(grad_sync="sharded") in the hands of Trainer users ends where the stock Trainer
(DDP on 2 CPU processes) ends: PEFT adapters (LoRA on the embedding, IA3, LoHa, DoRA, prompt
tuning), torch.compile, every optimizer the Trainer can build here, callbacks that read or edit
the weights and gradients, a compute_loss that reads the parameters before the forward,
freezing mid-run, an extra backward between steps, the best model loaded at the end, a short
last accumulation window.

Each scenario runs once with `transformers.Trainer` + `TrainingArguments` and once with
`StreamTrainer` + `StreamTrainingArguments(grad_sync="sharded", prefetch_depth=2)`, the other
arguments the same. A few groups of scenarios share one spawn of 2 gloo processes (module
fixtures); inside it each run that raises is kept as its traceback, so one scenario's failure
does not hide the others'.

Tolerances, as in test_trainer_sharded.py: SGD (momentum, weight decay) within 1e-6; AdamW with
clipping within 1e-5 (the clip coefficient's last bit, magnified by Adam's division by sqrt(v)).
"""

from __future__ import annotations

import os
import re
import traceback

import pytest
import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

from hfstream import StreamTrainer, StreamTrainingArguments
from tiny import lm_dataset, losses, params, tiny_causal_lm, train_args

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(900)]

SGD = dict(optim="sgd", optim_args="momentum=0.9", learning_rate=0.05, weight_decay=0.01, max_grad_norm=0.5)
ADAMW = dict(optim="adamw_torch", weight_decay=0.1, max_grad_norm=0.5)
ATOL = {"sgd": 1e-6, "adamw": 1e-5}
GROUP_TIMEOUT_S = 600

# The optimizers of transformers' OptimizerNames that build on CPU with this venv's packages (no
# bitsandbytes, torchao, galore, ...); more are tried when they import (`_buildable_optimizers`).
CPU_OPTIMIZERS = ("adamw_torch", "adamw_torch_fused", "sgd", "adagrad", "rmsprop", "adafactor")
NOT_ON_CPU = ("adamw_torch_xla", "adamw_torch_npu_fused")


# -- one run, as a user writes it --------------------------------------------------------------------
def _gpt2(seed):
    return tiny_causal_lm("gpt2", seed=seed)


def _train(side, rank, out_dir, *, build=_gpt2, trainer=None, callbacks=(), data=None, eval_data=None, **kw):
    """Train on ``side`` ("stock", or hfstream's "sharded"/"overlap", optionally "-variant"); return the trainer.

    The stock run starts every rank from the same weights (seed 0); hfstream's from seed=rank,
    which its broadcast of rank 0's weights must fix, as DDP's does.
    """
    stock = side == "stock"
    model = build(0 if stock else rank)
    base = Trainer if stock else StreamTrainer
    cls = trainer(base) if trainer is not None else base
    settings = {"max_steps": 10, "ddp_timeout": 120, **kw}   # a hung collective raises, not waits half an hour
    if not stock:
        settings.update(grad_sync=side.split("-")[0], prefetch_depth=2)
    args = train_args(TrainingArguments if stock else StreamTrainingArguments, out_dir, **settings)
    t = cls(model=model, args=args, train_dataset=data if data is not None else lm_dataset(), eval_dataset=eval_data,
            callbacks=list(callbacks))
    for cb in callbacks:
        cb.trainer = t
    t.train()
    return t


def _result(t, **extra):
    return dict(losses=losses(t), params=params(t.model), steps=t.state.global_step, **extra)


def _failure(exc):
    return {"error": traceback.format_exc(), "type": type(exc).__name__, "message": str(exc)}


SCENARIOS: dict[str, tuple] = {}


def scenario(name, sides=("stock", "sharded")):
    def register(fn):
        SCENARIOS[name] = (fn, sides)
        return fn
    return register


def _run_group(rank, world_size, tmp, names):
    out = {}
    for name in names:
        fn, sides = SCENARIOS[name]
        for side in sides:
            try:
                out[(name, side)] = fn(side, rank, f"{tmp}/{name}/{side}")
            except Exception as exc:   # kept: the other scenarios of the group still run
                out[(name, side)] = _failure(exc)
    return out


@pytest.fixture(scope="module")
def all_runs(tmp_path_factory):
    """Every scenario of the default run in one spawn of 2 ranks (each spawn costs a transformers import)."""
    names = [f"peft-{n}" for n in PEFT] + ["optimizers"] + list(CALLBACKS) + [
        "best-model", "short-last-window", "compile-aot_eager"]
    return _spawn(tmp_path_factory, "real-use", names)


def _spawn(tmp_path_factory, label, names):
    from hfstream.testing import run_on_ranks

    tmp = tmp_path_factory.mktemp(label)
    return tmp, run_on_ranks(_run_group, 2, str(tmp), list(names), init_process_group=False, timeout=GROUP_TIMEOUT_S)


def _ok(out, name, side):
    got = out[(name, side)]
    assert "error" not in got, f"{name} [{side}] raised:\n{got['error']}"
    return got


def _same_params(got, ref, what, atol):
    assert ref and sorted(got) == sorted(ref), f"{what}: other parameter names"
    for k, v in ref.items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=atol, msg=lambda m, k=k: f"{what}: {k}: {m}")


def _same_run(out, name, side, atol):
    """``side`` of scenario ``name`` trained like its stock run: same steps, losses, final parameters."""
    ref, got = _ok(out, name, "stock"), _ok(out, name, side)
    assert got["steps"] == ref["steps"] > 0, (got["steps"], ref["steps"])
    assert len(got["losses"]) == len(ref["losses"]) > 0
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=atol,
                               msg=lambda m: f"{name} [{side}] losses: {m}")
    _same_params(got["params"], ref["params"], f"{name} [{side}]", atol)
    return ref, got


def _moved(before, after, tol=1e-4):
    return sorted(k for k, v in after.items() if (v - before[k]).abs().max() > tol)


# == PEFT adapters ===================================================================================
def _peft(make_config):
    def build(seed):
        from peft import get_peft_model

        return get_peft_model(_gpt2(seed), make_config())   # adapters drawn right after the base: same seed
    return build


def _peft_run(build, side, rank, out_dir):
    initial = params(build(0))   # the stock run's starting point (rank 0's, which hfstream broadcasts)
    t = _train(side, rank, out_dir, build=build, **ADAMW)
    return _result(t, moved=_moved(initial, params(t.model)))


def _lora_embedding():
    from peft import LoraConfig

    return LoraConfig(target_modules=["wte", "c_attn"], r=4, lora_dropout=0.0)


def _ia3():
    from peft import IA3Config

    return IA3Config(target_modules=["c_attn", "mlp.c_proj"], feedforward_modules=["mlp.c_proj"])


def _loha():
    from peft import LoHaConfig

    # LoHa adapts nn.Linear/Conv1d/Conv2d only: GPT-2's Conv1D projections are not among them; lm_head is.
    return LoHaConfig(target_modules=["lm_head"], r=4)


def _dora():
    from peft import LoraConfig

    return LoraConfig(target_modules=["c_attn"], r=4, lora_dropout=0.0, use_dora=True)


def _prompt_tuning():
    from peft import PromptTuningConfig

    return PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)


PEFT = {"lora-embedding": (_lora_embedding, "lora_embedding_"), "ia3": (_ia3, "ia3_l"), "loha": (_loha, "hada_"),
        "dora": (_dora, "lora_magnitude_vector"), "prompt-tuning": (_prompt_tuning, "prompt_encoder")}

for _name, (_config, _) in PEFT.items():
    scenario(f"peft-{_name}")(
        lambda side, rank, out_dir, _config=_config: _peft_run(_peft(_config), side, rank, out_dir))


@pytest.fixture(scope="module")
def peft_runs(all_runs):
    pytest.importorskip("peft")
    return all_runs[1]


def _check_peft(ranks, name):
    _, marker = PEFT[name]
    for out in ranks:
        ref, _ = _same_run(out, f"peft-{name}", "sharded", ATOL["adamw"])
        # the adapter this scenario is about did train in the stock run, and nothing else did
        assert any(marker in k for k in ref["moved"]), ref["moved"]
        adapters = ("lora_", "ia3_", "hada_", "prompt_encoder")
        assert all(any(a in k for a in adapters) for k in ref["moved"]), ref["moved"]


def test_sharded_trains_a_lora_adapter_on_the_embedding_whose_parameter_dict_is_never_called(peft_runs):
    _check_peft(peft_runs, "lora-embedding")


def test_sharded_trains_an_ia3_adapter_on_gpt2s_conv1d_projections_like_stock(peft_runs):
    _check_peft(peft_runs, "ia3")


@pytest.mark.parametrize("name", ["loha", "dora", "prompt-tuning"])
def test_sharded_trains_loha_dora_and_prompt_tuning_adapters_like_stock(peft_runs, name):
    _check_peft(peft_runs, name)


# == optimizers ======================================================================================
def _buildable_optimizers():
    """CPU_OPTIMIZERS, plus any other OptimizerNames value whose optimizer the Trainer can build here."""
    from transformers.training_args import OptimizerNames

    found = list(CPU_OPTIMIZERS)
    model = _gpt2(0)
    for name in (o.value for o in OptimizerNames):
        if name in found or name in NOT_ON_CPU:
            continue
        try:
            args = TrainingArguments(output_dir="unused", optim=name, use_cpu=True, report_to=[], ddp_timeout=120)
            Trainer.get_optimizer_cls_and_kwargs(args, model)
        except Exception:
            continue
        found.append(name)
    return found


def _optimizer_settings(name):
    if name == "adagrad":
        # Adagrad divides each element by its own gradient history (eps 1e-10): on GPT-2's key bias,
        # whose gradient is only rounding noise, a last-bit difference in the clip coefficient (the
        # norm is summed in another order) turns into steps of up to lr. Unclipped, the mean
        # gradients are the same to the bit, and so must the runs be.
        return dict(ADAMW, optim=name, max_grad_norm=0.0)
    return dict(SGD) if name == "sgd" else dict(ADAMW, optim=name)


@scenario("optimizers")
def _optimizers(side, rank, out_dir):
    out = {"tried": _buildable_optimizers()}
    for name in out["tried"]:
        try:
            out[name] = _result(_train(side, rank, f"{out_dir}/{name}", max_steps=8, **_optimizer_settings(name)))
        except Exception as exc:
            out[name] = _failure(exc)
    return out


@pytest.fixture(scope="module")
def optimizer_runs(all_runs):
    return all_runs[1]


def _optimizer_outcome(out, name):
    """None if the sharded run trained like stock; the refusal's message if it refused with a clear ValueError."""
    stock, sharded = _ok(out, "optimizers", "stock"), _ok(out, "optimizers", "sharded")
    ref = stock[name]
    assert "error" not in ref, f"stock Trainer with optim={name!r} raised:\n{ref['error']}"
    got = sharded[name]
    if "error" in got:
        assert got["type"] == "ValueError", f"optim={name!r}: neither trained nor refused clearly:\n{got['error']}"
        message = got["message"]
        assert name.lower() in message.lower(), f"the refusal does not name optim={name!r}: {message}"
        assert re.search(r"\b(use|instead)\b", message, re.I), f"the refusal does not say what to use: {message}"
        return message
    atol = ATOL["sgd"] if name == "sgd" else ATOL["adamw"]
    assert got["steps"] == ref["steps"] == 8
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=atol,
                               msg=lambda m: f"optim={name!r} losses: {m}")
    _same_params(got["params"], ref["params"], f"optim={name!r}", atol)
    return None


def test_every_optimizer_the_trainer_builds_here_trains_like_stock_or_is_refused_naming_it(optimizer_runs):
    for out in optimizer_runs:
        tried = _ok(out, "optimizers", "stock")["tried"]
        assert set(CPU_OPTIMIZERS) <= set(tried) and _ok(out, "optimizers", "sharded")["tried"] == tried
        failures = []
        for name in tried:
            try:
                _optimizer_outcome(out, name)
            except AssertionError as exc:
                failures.append(f"--- optim={name!r}: {exc}")
        assert not failures, "\n".join(failures)


def test_adafactor_is_refused_with_a_value_error_that_names_it(optimizer_runs):
    # Adafactor factors its second moment over each matrix's rows and columns: not elementwise,
    # so stepping slices would change its arithmetic; it must be refused, never trained.
    for out in optimizer_runs:
        assert _optimizer_outcome(out, "adafactor") is not None, "optim='adafactor' was not refused"


def test_adagrad_whose_state_is_created_in_its_constructor_trains_like_stock(optimizer_runs):
    for out in optimizer_runs:
        assert _optimizer_outcome(out, "adagrad") is None, "adagrad was refused"


# == callbacks, a subclass, edits between steps ======================================================
class HalveAWeightAtStep3(TrainerCallback):
    """An in-place edit of a weight between steps (``wait``: after wait_for_params(), where hfstream has it)."""

    def __init__(self, wait=False):
        self.wait, self.trainer = wait, None

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step == 3:
            sync = getattr(self.trainer, "grad_sync", None)
            if self.wait and sync is not None and hasattr(sync, "wait_for_params"):
                sync.wait_for_params()
            with torch.no_grad():
                model.transformer.h[0].mlp.c_fc.weight.mul_(0.5)


@scenario("in-place-edit", sides=("stock", "sharded", "sharded-wait"))
def _in_place_edit(side, rank, out_dir):
    return _result(_train(side, rank, out_dir, callbacks=[HalveAWeightAtStep3(wait=side.endswith("wait"))], **SGD))


def _l2_trainer(base):
    class L2(base):
        """An L2 penalty on the trainable parameters, computed before the model's forward."""

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            penalty = sum(p.pow(2).sum() for p in model.parameters() if p.requires_grad)
            result = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                          num_items_in_batch=num_items_in_batch)
            if return_outputs:
                loss, outputs = result
                return loss + 1e-3 * penalty, outputs
            return result + 1e-3 * penalty
    return L2


@scenario("l2-before-forward")
def _l2_before_forward(side, rank, out_dir):
    t = _train(side, rank, out_dir, trainer=_l2_trainer, **SGD)
    return _result(t, notes=list(getattr(t, "_notes", [])), before=getattr(t, "_reads_before_forward", None))


class FreezeBlock0AtStep3(TrainerCallback):
    def __init__(self):
        self.trainer, self.at_freeze = None, None

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step == 3:
            model.transformer.h[0].requires_grad_(False)
            self.at_freeze = {n: p.detach().clone() for n, p in model.transformer.h[0].named_parameters()}


def _freeze(side, rank, out_dir, settings):
    cb = FreezeBlock0AtStep3()
    t = _train(side, rank, out_dir, callbacks=[cb], max_steps=8, **settings)
    return _result(t, at_freeze=cb.at_freeze)


scenario("freeze-sgd")(lambda side, rank, out_dir: _freeze(side, rank, out_dir, SGD))
scenario("freeze-adamw")(lambda side, rank, out_dir: _freeze(side, rank, out_dir, ADAMW))

EVENTS = ("on_train_begin", "on_epoch_begin", "on_step_begin", "on_substep_end", "on_pre_optimizer_step",
          "on_optimizer_step", "on_step_end", "on_log", "on_evaluate", "on_save", "on_epoch_end", "on_train_end")


def _checksum(model) -> float:
    return float(sum(p.detach().double().sum() for p in model.parameters()))


def _recorder(event):
    def record(self, args, state, control, model=None, **kwargs):
        self.seen.append((event, state.global_step, _checksum(model)))
    return record


class ParamsAtEveryEvent(TrainerCallback):
    """Reads the parameters (``model.parameters()``, as a callback does) at every event."""

    def __init__(self):
        self.trainer, self.seen = None, []


for _event in EVENTS:
    setattr(ParamsAtEveryEvent, _event, _recorder(_event))


@scenario("every-event")
def _every_event(side, rank, out_dir):
    cb = ParamsAtEveryEvent()
    t = _train(side, rank, out_dir, callbacks=[cb], gradient_accumulation_steps=2, eval_data=lm_dataset(n=16, seed=5),
               eval_strategy="steps", eval_steps=5, save_strategy="steps", save_steps=5, **SGD)
    return _result(t, seen=cb.seen)


@scenario("every-event-no-save")
def _every_event_no_save(side, rank, out_dir):
    # No evaluation or checkpoint at all (with save_strategy="steps" the last step always saves): nothing
    # but the callback reads the weights after the last step, in on_log, on_epoch_end and on_train_end.
    cb = ParamsAtEveryEvent()
    t = _train(side, rank, out_dir, callbacks=[cb], gradient_accumulation_steps=2, max_steps=6, **SGD)
    return _result(t, seen=cb.seen)


class GradNorms(TrainerCallback):
    """What a gradient monitor sees before the optimizer step: each parameter's ``.grad`` norm (or None)."""

    def __init__(self, scale=None):
        self.trainer, self.scale, self.norms = None, scale, []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.norms.append({n: None if p.grad is None else float(p.grad.norm()) for n, p in model.named_parameters()})
        if self.scale is not None:
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.mul_(self.scale)


@scenario("read-grads")
def _read_grads(side, rank, out_dir):
    cb = GradNorms()
    return _result(_train(side, rank, out_dir, callbacks=[cb], gradient_accumulation_steps=2, max_steps=8, **SGD),
                   norms=cb.norms)


@scenario("halve-grads")
def _halve_grads(side, rank, out_dir):
    cb = GradNorms(scale=0.5)
    return _result(_train(side, rank, out_dir, callbacks=[cb], gradient_accumulation_steps=2, max_steps=8, **SGD),
                   norms=cb.norms)


class GradientDiagnostic(TrainerCallback):
    """After each step: a forward and backward on a small batch of its own, then zero_grad()."""

    def __init__(self):
        self.trainer, self.losses = None, []
        self.batch = torch.tensor(lm_dataset(n=2, seed=7)["input_ids"])

    def on_step_end(self, args, state, control, model=None, **kwargs):
        loss = model(input_ids=self.batch, labels=self.batch).loss
        loss.backward()
        self.losses.append(loss.item())
        model.zero_grad()


@scenario("diagnostic-backward", sides=("stock", "sharded", "overlap"))
def _diagnostic_backward(side, rank, out_dir):
    cb = GradientDiagnostic()
    return _result(_train(side, rank, out_dir, callbacks=[cb], gradient_accumulation_steps=2, max_steps=8, **SGD),
                   diagnostic=cb.losses)


CALLBACKS = ("in-place-edit", "l2-before-forward", "freeze-sgd", "freeze-adamw", "every-event", "every-event-no-save",
             "read-grads", "halve-grads", "diagnostic-backward")


@pytest.fixture(scope="module")
def callback_runs(all_runs):
    return all_runs[1]


def test_sharded_keeps_an_in_place_edit_made_by_a_callback_between_steps(callback_runs):
    for out in callback_runs:
        _same_run(out, "in-place-edit", "sharded", ATOL["sgd"])


def test_sharded_keeps_an_in_place_edit_made_after_wait_for_params(callback_runs):
    for out in callback_runs:
        _same_run(out, "in-place-edit", "sharded-wait", ATOL["sgd"])


def test_a_compute_loss_that_reads_the_parameters_before_the_forward_trains_like_stock(callback_runs):
    for out in callback_runs:
        _, got = _same_run(out, "l2-before-forward", "sharded", ATOL["sgd"])
        # Seen in the first step and said once: from then on every step waits for its gathers first.
        assert got["before"] and got["before"][0] == "transformer.wte.weight", got["before"]
        said = [n for n in got["notes"] if "L2.compute_loss reads parameters before the forward" in n]
        assert len(said) == 1 and "no longer overlap the forward" in said[0], got["notes"]


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_a_block_frozen_by_a_callback_mid_run_stops_moving_as_in_stock(callback_runs, optimizer):
    name = f"freeze-{optimizer}"
    for out in callback_runs:
        ref, got = _same_run(out, name, "sharded", ATOL[optimizer])
        frozen = {f"transformer.h.0.{n}": v for n, v in ref["at_freeze"].items()}
        assert len(frozen) == 12
        for k, v in frozen.items():   # stock: from step 3 on, the block's weights stay exactly where they were
            assert torch.equal(ref["params"][k], v), f"stock: {k} moved after it was frozen"


@pytest.mark.parametrize("name, steps, events", [("every-event", 10, set(EVENTS)),
                                                  ("every-event-no-save", 6, set(EVENTS) - {"on_evaluate", "on_save"})],
                         ids=["eval-and-save-every-5-steps", "no-eval-no-save"])
def test_a_callback_sees_the_current_parameters_at_every_event_as_in_stock(callback_runs, name, steps, events):
    for out in callback_runs:
        ref, got = _ok(out, name, "stock")["seen"], _ok(out, name, "sharded")["seen"]
        assert {e for e, _, _ in ref} == events
        assert [(e, s) for e, s, _ in got] == [(e, s) for e, s, _ in ref], "other events, or in another order"
        # Each step moves the checksum by more than 10 x the tolerance (measured: 2.7e-4 at least; two runs
        # differ by 1e-7 at most): a stale read cannot pass.
        begins = [c for e, _, c in ref if e == "on_step_begin"]
        assert len(begins) == steps and min(abs(a - b) for a, b in zip(begins, begins[1:])) > 1e-4
        wrong = [f"{e} at step {s}: {c!r}, stock {r!r}" for (e, s, c), (_, _, r) in zip(got, ref) if abs(c - r) > 1e-5]
        assert not wrong, "stale or other parameters:\n" + "\n".join(wrong)


def test_a_callback_reading_gradients_before_the_optimizer_step_sees_stocks_gradients(callback_runs):
    for out in callback_runs:
        ref, got = _ok(out, "read-grads", "stock")["norms"], _ok(out, "read-grads", "sharded")["norms"]
        assert len(ref) == 8 and len(got) == len(ref)
        for step, (r, g) in enumerate(zip(ref, got), 1):
            assert sorted(g) == sorted(r)
            missing = [n for n in r if (r[n] is None) != (g[n] is None)]
            assert not missing, f"step {step}: .grad None in one run but not the other: {missing}"
            assert any(v is not None for v in r.values())
            names = [n for n in r if r[n] is not None]
            torch.testing.assert_close(torch.tensor([g[n] for n in names]), torch.tensor([r[n] for n in names]),
                                       rtol=1e-5, atol=1e-6, msg=lambda m, step=step: f"step {step}: {m}")


def test_a_callback_scaling_the_gradients_before_the_optimizer_step_has_stocks_effect(callback_runs):
    for out in callback_runs:
        ref, _ = _same_run(out, "halve-grads", "sharded", ATOL["sgd"])
        unscaled = _ok(out, "read-grads", "stock")["params"]   # same run without the scaling
        assert _moved(unscaled, ref["params"]), "halving the gradients must change the stock run"


@pytest.mark.parametrize("mode", ["sharded", "overlap"])
def test_an_extra_backward_in_a_callback_between_steps_leaves_training_as_in_stock(callback_runs, mode):
    for out in callback_runs:
        ref, got = _same_run(out, "diagnostic-backward", mode, ATOL["sgd"])
        assert len(ref["diagnostic"]) == 8
        torch.testing.assert_close(torch.tensor(got["diagnostic"]), torch.tensor(ref["diagnostic"]),
                                   rtol=1e-5, atol=1e-6)
        # stock: the diagnostic changes nothing (the same run without it)
        _same_params(ref["params"], _ok(out, "read-grads", "stock")["params"], "stock with the diagnostic", 0)


# == after training, compile, a short last window ====================================================
@scenario("best-model")
def _best_model(side, rank, out_dir):
    t = _train(side, rank, out_dir, eval_data=lm_dataset(n=16, seed=5), max_steps=15, load_best_model_at_end=True,
               metric_for_best_model="eval_loss", eval_strategy="steps", eval_steps=5, save_strategy="steps",
               save_steps=5, **SGD)
    evals = [h["eval_loss"] for h in t.state.log_history if "eval_loss" in h]
    evaluated = t.evaluate()["eval_loss"]
    predicted = t.predict(lm_dataset(n=8, seed=6))
    logits = predicted.predictions[0] if isinstance(predicted.predictions, tuple) else predicted.predictions
    prompt = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    with torch.no_grad():
        generated = t.model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=5,
                                     do_sample=False, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    t.save_model(f"{out_dir}/saved")
    best = t.state.best_model_checkpoint
    return _result(t, evals=evals, best=best and os.path.basename(best), evaluated=evaluated,
                   predictions=torch.as_tensor(logits), test_loss=predicted.metrics["test_loss"],
                   generated=generated.sequences.tolist(), scores=torch.stack(generated.scores))


@scenario("short-last-window")
def _short_last_window(side, rank, out_dir):
    # 20 samples, 2 per device on 2 ranks: 5 batches per epoch per rank, windows of 3 then 2.
    t = _train(side, rank, out_dir, data=lm_dataset(n=20), per_device_train_batch_size=2,
               gradient_accumulation_steps=3, num_train_epochs=2, max_steps=-1, **ADAMW)
    return _result(t)


def _compiled(backend):
    def run(side, rank, out_dir):
        t = _train(side, rank, out_dir, max_steps=6, torch_compile=True, torch_compile_backend=backend, **SGD)
        return _result(t, notes=list(getattr(t, "_notes", [])))
    return run


scenario("compile-aot_eager")(_compiled("aot_eager"))
scenario("compile-inductor")(_compiled("inductor"))


@pytest.fixture(scope="module")
def end_runs(all_runs):
    return all_runs


def test_best_model_at_end_evaluate_predict_generate_and_save_model_match_stock(end_runs):
    from safetensors.torch import load_file

    tmp, ranks = end_runs
    for out in ranks:
        ref, got = _same_run(out, "best-model", "sharded", ATOL["sgd"])
        # the evaluation loss rises after step 5 (random eval tokens): the best model is not the last one
        assert len(ref["evals"]) == 3 and ref["best"] not in (None, "checkpoint-15")
        torch.testing.assert_close(torch.tensor(got["evals"]), torch.tensor(ref["evals"]), rtol=1e-5, atol=1e-6)
        assert got["best"] == ref["best"]
        for key in ("evaluated", "test_loss"):
            torch.testing.assert_close(torch.tensor(got[key]), torch.tensor(ref[key]), rtol=1e-5, atol=1e-6, msg=key)
        assert got["predictions"].shape == ref["predictions"].shape == (8, 16, 64)
        torch.testing.assert_close(got["predictions"], ref["predictions"], rtol=1e-5, atol=1e-5)
        assert got["generated"] == ref["generated"] and len(ref["generated"][0]) == 9
        assert ref["scores"].shape == (5, 2, 64)   # greedy: each new token's logits
        torch.testing.assert_close(got["scores"], ref["scores"], rtol=1e-5, atol=1e-5)
    saved = {side: load_file(str(tmp / "best-model" / side / "saved" / "model.safetensors"))
             for side in ("stock", "sharded")}
    assert len(saved["stock"]) > 0
    _same_params(saved["sharded"], saved["stock"], "save_model", ATOL["sgd"])
    _same_params(saved["sharded"], {k: v for k, v in ranks[0][("best-model", "sharded")]["params"].items()
                                    if k in saved["stock"]}, "save_model vs the trainer's model", 0)


def test_accumulation_over_three_micro_steps_with_a_short_last_window_over_two_epochs(end_runs):
    _, ranks = end_runs
    for out in ranks:
        ref, _ = _same_run(out, "short-last-window", "sharded", ATOL["adamw"])
        assert ref["steps"] == 4


def test_sharded_with_torch_compile_aot_eager_trains_like_stock(end_runs):
    _, ranks = end_runs
    for out in ranks:
        _, got = _same_run(out, "compile-aot_eager", "sharded", ATOL["sgd"])
        # Where the compiled graph takes overlap away, the run says so once.
        said = [n for n in got["notes"] if "compiled" in n and "all-gathers" in n]
        assert len(said) == 1, got["notes"]


@pytest.mark.slow
def test_sharded_with_torch_compile_inductor_trains_like_stock(tmp_path_factory):
    _, ranks = _spawn(tmp_path_factory, "inductor", ["compile-inductor"])
    for out in ranks:
        _same_run(out, "compile-inductor", "sharded", ATOL["sgd"])
