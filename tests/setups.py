"""Generated training setups, each run under the stock Trainer and under every ``grad_sync`` mode.

A differential test: `draw` turns a seed into a `Setup` (model family, dtype, accumulation,
clipping, optimizer, freezing, PEFT, callbacks and ``training_step`` overrides that read or write
gradients on some ranks only, evaluation and saving mid-run, 2 or 3 ranks); `run_setups` trains
it with `transformers.Trainer` + `TrainingArguments` (the reference: DDP over gloo) and with
`StreamTrainer` under each of `MODES`, every run in the same spawn of ``world`` processes; `compare`
says where a mode ended somewhere else than the stock run did.

Rerun one seed (its setup is printed with every failure):

    HFSTREAM_SEED=123 OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_generated_setups.py
    HFSTREAM_SEED=123 HFSTREAM_MODES=sharded ...                       # one mode only

A run that hangs (a collective one rank never joins) ends after ``ddp_timeout`` (`DDP_TIMEOUT_S`):
hfstream's watchdog ends the process at ``ddp_timeout`` + 15 s, the spawn is restarted for the
runs left, and the hang is a finding like any other. Results go to files after every run, so one
setup's crash does not lose the others'.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import math
import os
import random
import re
import time
import traceback
from dataclasses import dataclass

import torch

MODES = ("native", "overlap", "serial", "sharded")

# Open issues this generator found (tests/test_generated_named.py has a named test for each), and the
# runs of the budgets in tests/test_generated_setups.py that meet them, which the budgets leave out.
BN_BF16_SYNC_EACH = ("sharded logs another grad norm with a bf16 submodule before BatchNorm, sync_each_batch and a "
                     "callback scaling .grad (named: seed 27)")
OPEN: dict[tuple[int, str], str] = {
    (27, "sharded"): BN_BF16_SYNC_EACH,
}
# What the stock Trainer itself cannot train (so there is nothing to compare with): DDP with
# find_unused_parameters meets a parameter twice when a loss term reads it outside the forward (the
# L2 penalty) and the forward leaves it unused (an expert no token reached).
STOCK_LIMITS = ("has been marked as ready twice",)
DDP_TIMEOUT_S = 30   # a hung collective raises after this, and hfstream's watchdog ends the rank 15 s later

FAMILIES = ("gpt2", "llama", "bert", "mixtral", "qwen2moe", "t5", "bart", "bn-mlp", "moe-experts")
DTYPES = ("fp32", "bf16-submodule", "bf16-autocast")
# "adafactor" is transformers' Adafactor given as optimizer_cls_and_kwargs (with its eps raised, see
# `tolerance`); "user-sgd-momentum" is `SGDMomentum`, given built over every parameter as optimizers=.
OPTIMS = ("adamw_torch", "adamw_torch_fused", "sgd", "adafactor", "user-sgd-momentum")
FREEZING = ("none", "embeddings", "unfreeze-at-2")
CALLBACKS = ("none", "read-grad-rank0", "scale-grad-all", "scale-grad-rank0")
STEPS = ("none", "read-grad-rank0", "user-step-scaled", "compute-loss-scaled", "l2-before-forward")
CAUSAL = ("gpt2", "llama", "mixtral", "qwen2moe", "t5", "bart", "moe-experts")   # input_ids -> labels = input_ids
VOCAB = 64


# == the space ========================================================================================
@dataclass(frozen=True)
class Setup:
    """One training setup: every choice the generator makes, nothing derived."""

    seed: int
    world: int             # processes (gloo, CPU)
    family: str            # FAMILIES
    dtype: str             # fp32; one submodule in bf16 (its inputs cast in, outputs back); bf16=True autocast
    accum: int             # gradient_accumulation_steps
    sync_each_batch: bool  # Accelerate's gradient_accumulation_kwargs (reduce every micro-step)
    clip: float            # max_grad_norm (0 = no clipping; the norm is still logged)
    optim: str             # OPTIMS; "user-sgd-momentum" is `SGDMomentum` over every parameter, via optimizers=
    freeze: str            # FREEZING: the input embeddings frozen from the start, or until step 2
    peft: str              # "none" or "lora" (get_peft_model before the Trainer)
    callback: str          # CALLBACKS, all on_pre_optimizer_step
    step: str              # STEPS: a training_step or compute_loss override
    eval: bool             # eval_strategy="steps", every 2 steps
    save: bool             # save_strategy="steps", every 2 steps, save_total_limit=1
    prefetch: int          # prefetch_depth (hfstream runs)
    bucket_mb: str         # grad_bucket_mb (hfstream runs): "auto" (the default), "0.001" (about one parameter
                           # a bucket), "inf" (one bucket)
    batch: int             # per_device_train_batch_size
    seq: int
    samples: int           # train set size: small ones end an epoch inside an accumulation window
    steps: int             # max_steps
    init_per_rank: bool    # hfstream runs start from seed=rank weights: its broadcast must fix that
    declared_elementwise: bool   # "user-sgd-momentum" declares hfstream_elementwise = True: sharded shards it
                                 # (else refuses it, saying what to do)
    save_async: bool = False     # hfstream runs save with save_async=True (where ``save``)
    masked: bool = False         # labels -100 on a random prefix of each sample (a prompt not scored): the
                                 # ranks' token counts differ (num_items_in_batch, average_tokens_across_devices)
    grad_ckpt: bool = False      # gradient_checkpointing=True (the transformers families): a forward again in backward
    resume: bool = False         # (where ``save``) then a new trainer resumes from the last checkpoint its side wrote
                                 # (resume_from_checkpoint=True) and trains 2 steps more: what is compared
    tokens_seen: bool = False    # include_num_input_tokens_seen: the stock loop gathers a count over WORLD each micro-batch
    smoothing: bool = False      # label_smoothing_factor=0.1 (the transformers families): the Trainer computes the loss

    def __repr__(self) -> str:
        parts = [f"seed={self.seed}", f"world={self.world}", self.family, self.dtype, f"accum={self.accum}"]
        parts += ["sync_each_batch"] if self.sync_each_batch else []
        parts += [f"clip={self.clip}", self.optim, f"freeze={self.freeze}", f"peft={self.peft}",
                  f"callback={self.callback}", f"step={self.step}"]
        parts += ["eval"] if self.eval else []
        parts += ["save"] if self.save else []
        parts += [f"prefetch={self.prefetch}"] + ([] if self.bucket_mb == "auto" else [f"bucket_mb={self.bucket_mb}"])
        parts += [f"batch={self.batch}", f"seq={self.seq}", f"samples={self.samples}",
                  f"steps={self.steps}"]
        parts += ["init_per_rank"] if self.init_per_rank else []
        parts += ["declared_elementwise"] if self.declared_elementwise else []
        parts += ["save_async"] if self.save_async else []
        parts += ["masked"] if self.masked else []
        parts += ["grad_ckpt"] if self.grad_ckpt else []
        parts += ["resume"] if self.resume else []
        parts += ["tokens_seen"] if self.tokens_seen else []
        parts += ["smoothing"] if self.smoothing else []
        return f"Setup({', '.join(parts)})"

    @property
    def stock_replicas_may_differ(self) -> bool:
        """User code makes the stock run's replicas differ: gradients written on rank 0 only, or a
        parameter unfrozen mid-run, whose gradient DDP never reduces (its reducer was built without it)."""
        return self.callback == "scale-grad-rank0" or self.freeze == "unfreeze-at-2"


def draw(seed: int) -> Setup:
    """The setup of ``seed``, the same on every machine (``random.Random(seed)``)."""
    rng = random.Random(seed)
    pick = rng.choice
    s = dict(
        seed=seed,
        world=pick((2, 2, 3)),
        family=pick(FAMILIES),
        dtype=rng.choices(DTYPES, weights=(6, 2, 2))[0],
        accum=pick((1, 2, 3)),
        sync_each_batch=rng.random() < 0.2,
        clip=pick((0.0, 1.0)),
        optim=rng.choices(OPTIMS, weights=(3, 2, 3, 1, 2))[0],
        freeze=rng.choices(FREEZING, weights=(5, 2, 2))[0],
        peft=rng.choices(("none", "lora"), weights=(4, 1))[0],
        callback=rng.choices(CALLBACKS, weights=(4, 2, 2, 1))[0],
        step=rng.choices(STEPS, weights=(4, 2, 1, 1, 1))[0],
        eval=rng.random() < 0.3,
        save=rng.random() < 0.3,
        prefetch=pick((0, 2)),
        bucket_mb=rng.choices(("auto", "0.001", "inf"), weights=(2, 1, 1))[0],
        batch=pick((2, 4)),
        seq=pick((8, 16)),
        samples=pick((24, 48, 96)),
        steps=pick((4, 5, 6)),
        init_per_rank=rng.random() < 0.5,
    )
    # Drawn last, so that adding it left every earlier choice of every seed as it was.
    s["declared_elementwise"] = s["optim"] == "user-sgd-momentum" and rng.random() < 0.5
    s["save_async"] = rng.random() < 0.5 and s["save"]
    s["masked"] = rng.random() < 0.3 and s["family"] in CAUSAL
    s["grad_ckpt"] = rng.random() < 0.2 and s["family"] not in ("bn-mlp", "moe-experts")
    s["resume"] = rng.random() < 0.5 and s["save"]
    s["tokens_seen"] = rng.random() < 0.2
    # Label smoothing pops the labels an encoder-decoder builds its decoder inputs from: stock raises there.
    s["smoothing"] = rng.random() < 0.15 and s["family"] in ("gpt2", "llama", "bert", "mixtral", "qwen2moe")
    # What does not combine: PEFT freezes the base itself; an accumulation of 1 syncs every batch anyway.
    if s["peft"] == "lora":
        s["freeze"] = "none"
    if s["accum"] == 1:
        s["sync_each_batch"] = False
    return Setup(**s)


def seeds_for(world: int, count: int, start: int = 0) -> list[int]:
    """The first ``count`` seeds from ``start`` whose setup runs on ``world`` processes."""
    found, seed = [], start
    while len(found) < count:
        if draw(seed).world == world:
            found.append(seed)
        seed += 1
    return found


# == tolerances =======================================================================================
@dataclass(frozen=True)
class Tolerance:
    """How far a mode may end from the stock run (`tolerance` says why)."""

    rtol: float    # logged scalars (losses, grad norms, evaluation losses, gradient reads): relative
    atol: float    # ... and absolute
    moved: float   # a tensor: how far it may be from stock's, as a fraction of its scale (a parameter:
                   # how far it moved in the stock run; optimizer state: its own size)
    elementwise: bool   # True: every element within ``moved`` of the tensor's largest move (or value);
                        # False: the tensor's difference in L2 norm within ``moved`` of its move's norm


def tolerance(setup: Setup) -> Tolerance:
    """How far a mode may end from the stock run, for ``setup``.

    fp32: the runs differ only in the order of a few sums (the all-reduce of 3 ranks over other
    bucket boundaries, the clip's norm over buckets rather than parameters): measured, overlap
    against stock, 1e-7 of each tensor's move after 6 steps. Adam and Adafactor divide by the
    gradient's own size: on an element whose gradient is only rounding noise (an attention key's
    bias: softmax ignores it) a last-bit difference would become a step of ``lr``; `ADAM_EPS`
    (1e-5 rather than 1e-8; Adafactor's eps[0] = ADAM_EPS**2) keeps such noise below 1e-6 a step
    and is far below every gradient that carries signal here. So every element within 1e-3 of
    its tensor's largest move, losses and norms within 1e-5.
    bf16 anywhere: a bf16 sum of 3 ranks' gradients in another order differs in its last bit
    (2**-8), and where the terms nearly cancel Adam turns that into a step of ``lr`` in the other
    direction: measured, overlap against stock, single elements off by a whole move, tensors up to
    2.1e-2 of their move in L2 norm (a bf16 weight that moves less than its own ulps: a few ulps),
    logged losses and norms within 1e-3; a T5 with LoRA under bf16 autocast on 3 ranks drifts
    further: its grad norm 3.1e-3 off after 6 steps, and stock's own DDP with another bucket size
    (0.001 MiB) lands on the same values as hfstream, 3.1e-3 from stock's default (seed 331,
    2026-12-06). So tensors within 5e-2 of their move in norm (plus an ulp on a sixteenth of a bf16
    tensor's elements), losses and norms within 5e-3. A missing reduction,
    a stale gradient or a clip left out moves a logged norm by a percent or more, and most of a
    tensor by much more than its noise.
    """
    if setup.dtype == "fp32":
        return Tolerance(rtol=1e-5, atol=1e-6, moved=1e-3, elementwise=True)
    return Tolerance(rtol=5e-3, atol=1e-4, moved=5e-2, elementwise=False)


# == the pieces a setup is made of ===================================================================
class BNClassifier(torch.nn.Module):
    """Embedding, mean over tokens, Linear, BatchNorm1d, Linear: a buffer DDP broadcasts every forward."""

    def __init__(self, vocab=VOCAB, hidden=16, num_labels=3):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.fc1 = torch.nn.Linear(hidden, 32, bias=False)   # a bias before BatchNorm has no gradient
        self.bn = torch.nn.BatchNorm1d(32)
        self.fc2 = torch.nn.Linear(32, num_labels)

    def get_input_embeddings(self):
        return self.embed

    def forward(self, input_ids, labels=None):
        logits = self.fc2(torch.relu(self.bn(self.fc1(self.embed(input_ids).mean(1)))))
        loss = None if labels is None else torch.nn.functional.cross_entropy(logits, labels)
        return {"loss": loss, "logits": logits}


class Expert(torch.nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.fc_in, self.fc_out = torch.nn.Linear(hidden, 32), torch.nn.Linear(32, hidden)

    def forward(self, x):
        return self.fc_out(torch.nn.functional.gelu(self.fc_in(x)))


class TinyMoE(torch.nn.Module):
    """A top-1 router over 8 experts, each its own module: an expert no token reaches gets no gradient on
    that rank in that micro-step (transformers' MoE models pack their experts into one tensor, which
    always gets one). A causal LM loss."""

    def __init__(self, vocab=VOCAB, hidden=16, experts=8):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.router = torch.nn.Linear(hidden, experts, bias=False)
        with torch.no_grad():
            self.router.weight.mul_(4.0)   # peaked routing: on 16-32 tokens some experts get none
        self.experts = torch.nn.ModuleList(Expert(hidden) for _ in range(experts))
        self.head = torch.nn.Linear(hidden, vocab)

    def get_input_embeddings(self):
        return self.embed

    def forward(self, input_ids, labels=None):
        h = self.embed(input_ids)
        probs = self.router(h).softmax(-1)
        chosen = probs.argmax(-1)
        mixed = torch.zeros_like(h)
        for i, expert in enumerate(self.experts):
            mask = chosen == i
            if mask.any():
                out = expert(h[mask]) * probs[..., i][mask].unsqueeze(-1)
                mixed = mixed.index_put((mask,), out.to(mixed.dtype))
        logits = self.head(h + mixed)
        loss = None
        if labels is not None:
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                     labels[:, 1:].reshape(-1))
        return {"loss": loss, "logits": logits}


def build_model(family: str, seed: int):
    from transformers import (BartConfig, BartForConditionalGeneration, MixtralConfig, MixtralForCausalLM,
                              Qwen2MoeConfig, Qwen2MoeForCausalLM, T5Config, T5ForConditionalGeneration)

    from tiny import tiny_bert_classifier, tiny_causal_lm

    torch.manual_seed(seed)
    small = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                 max_position_embeddings=32, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    if family in ("gpt2", "llama"):
        return tiny_causal_lm(family, vocab=VOCAB, seed=seed)
    if family == "bert":
        return tiny_bert_classifier(vocab=VOCAB, seed=seed)
    if family == "mixtral":   # 4 experts, top-2: on a batch of 2 x 8 tokens some expert often gets none
        return MixtralForCausalLM(MixtralConfig(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                                                **small))
    if family == "qwen2moe":  # routed experts plus a shared expert and its gate
        return Qwen2MoeForCausalLM(Qwen2MoeConfig(intermediate_size=32, moe_intermediate_size=16,
                                                  shared_expert_intermediate_size=32, num_experts=4,
                                                  num_experts_per_tok=2, **small))
    if family == "t5":        # encoder-decoder; shared embedding tied to both stacks and the head
        return T5ForConditionalGeneration(T5Config(vocab_size=VOCAB, d_model=32, d_kv=16, d_ff=64, num_layers=2,
                                                   num_heads=2, decoder_start_token_id=0, pad_token_id=0,
                                                   eos_token_id=1, dropout_rate=0.0))
    if family == "bart":
        return BartForConditionalGeneration(BartConfig(
            vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
            decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32,
            pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, dropout=0.0,
            attention_dropout=0.0, activation_dropout=0.0))
    if family == "bn-mlp":
        return BNClassifier()
    if family == "moe-experts":
        return TinyMoE()
    raise ValueError(family)


BF16_SUBMODULE = {"gpt2": "transformer.h.1.mlp", "llama": "model.layers.1.mlp",
                  "bert": "bert.encoder.layer.1.intermediate", "mixtral": "model.layers.1.mlp",
                  "qwen2moe": "model.layers.1.mlp", "t5": "decoder.block.1.layer.2",
                  "bart": "model.decoder.layers.0.fc1", "bn-mlp": "fc1", "moe-experts": "experts.1"}
LORA_TARGETS = {"gpt2": ["c_attn"], "llama": ["q_proj", "v_proj"], "bert": ["query", "value"],
                "mixtral": ["q_proj", "v_proj"], "qwen2moe": ["q_proj", "v_proj"], "t5": ["q", "v"],
                "bart": ["q_proj", "v_proj"], "bn-mlp": ["fc1"], "moe-experts": ["fc_in", "router"]}


def _cast(x, dtype):
    if isinstance(x, torch.Tensor):
        return x.to(dtype) if x.is_floating_point() else x
    if isinstance(x, (list, tuple)):
        return type(x)(_cast(v, dtype) for v in x)
    if isinstance(x, dict):
        return {k: _cast(v, dtype) for k, v in x.items()}
    return x


class _CastIn:
    def __call__(self, module, args, kwargs):
        return _cast(args, torch.bfloat16), _cast(kwargs, torch.bfloat16)


class _CastOut:
    def __call__(self, module, args, output):
        return _cast(output, torch.float32)


def model_for(setup: Setup, seed: int):
    """The model of ``setup`` as a user builds it: family, bf16 submodule, frozen embeddings, LoRA."""
    model = build_model(setup.family, seed)
    if setup.dtype == "bf16-submodule":
        # A user keeping one block in bf16: its inputs cast in, its outputs cast back to fp32.
        sub = model.get_submodule(BF16_SUBMODULE[setup.family]).to(torch.bfloat16)
        sub.register_forward_pre_hook(_CastIn(), with_kwargs=True)
        sub.register_forward_hook(_CastOut())
    if setup.freeze != "none":
        model.get_input_embeddings().requires_grad_(False)
    if setup.peft == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(target_modules=LORA_TARGETS[setup.family], r=4, lora_alpha=8,
                                                 lora_dropout=0.0))
    return model


def datasets_for(setup: Setup):
    from tiny import cls_dataset, lm_dataset

    make = lm_dataset if setup.family in CAUSAL else cls_dataset
    # The random ids include T5's and BART's special tokens (0-2): harmless for a loss; no setup generates.
    train = make(n=setup.samples, seq=setup.seq, vocab=VOCAB, seed=1)
    if setup.masked:   # the first `cut` labels of each sample not scored; its last always is
        cuts = torch.randint(0, setup.seq - 1, (setup.samples,), generator=torch.Generator().manual_seed(3)).tolist()
        train = train.map(lambda row, i: {"labels": [-100] * cuts[i] + row["labels"][cuts[i]:]}, with_indices=True)
    evals = make(n=8, seq=setup.seq, vocab=VOCAB, seed=5) if setup.eval else None
    return train, evals


class SGDMomentum(torch.optim.Optimizer):
    """A user-written optimizer: SGD with momentum and decoupled weight decay, state made in step()."""

    def __init__(self, params, lr=0.05, momentum=0.9, weight_decay=0.01):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = p.grad.detach().clone()
                else:
                    state["momentum_buffer"].mul_(group["momentum"]).add_(p.grad)
                p.mul_(1 - group["lr"] * group["weight_decay"]).add_(state["momentum_buffer"], alpha=-group["lr"])


class ElementwiseSGDMomentum(SGDMomentum):
    """The same optimizer, declared elementwise (each element's update reads only its own gradient and
    state), as hfstream's refusal of an unknown optimizer under grad_sync='sharded' suggests."""

    hfstream_elementwise = True


def _grad_norm(model) -> float:
    grads = [p.grad.detach().float().norm() for p in model.parameters() if p.grad is not None]
    return float(torch.stack(grads).norm()) if grads else 0.0


def _callbacks_for(setup: Setup, rank: int) -> list:
    from transformers import TrainerCallback

    class GradCallback(TrainerCallback):
        """``setup.callback``: reads .grad on rank 0 only, or scales it (on all ranks, or on rank 0 only)."""

        def __init__(self):
            self.seen = []

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            if setup.callback == "read-grad-rank0" and state.is_world_process_zero:
                self.seen.append(_grad_norm(model))
            if setup.callback == "scale-grad-all" or (setup.callback == "scale-grad-rank0" and rank == 0):
                for p in model.parameters():
                    if p.grad is not None:
                        p.grad.mul_(0.5)

    class Unfreeze(TrainerCallback):
        """Unfreezes the input embeddings after step 2."""

        def on_step_end(self, args, state, control, model=None, **kwargs):
            if state.global_step == 2:
                model.get_input_embeddings().requires_grad_(True)

    found = []
    if setup.callback != "none":
        found.append(GradCallback())
    if setup.freeze == "unfreeze-at-2":
        found.append(Unfreeze())
    return found


def _trainer_class(setup: Setup, base):
    """``base`` with the training_step or compute_loss override of ``setup.step``."""
    if setup.step == "none":
        return base

    class Subclass(base):
        seen: list

        if setup.step == "read-grad-rank0":
            def training_step(self, model, inputs, num_items_in_batch=None):
                loss = super().training_step(model, inputs, num_items_in_batch)
                if self.is_world_process_zero():   # a monitor on rank 0 only
                    self.seen.append(_grad_norm(model))
                return loss

        elif setup.step == "user-step-scaled":
            def training_step(self, model, inputs, num_items_in_batch=None):
                # A user's own step, without super(): its loss halved before backward.
                model.train()
                inputs = self._prepare_inputs(inputs)
                with self.compute_loss_context_manager():
                    loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
                if num_items_in_batch is None:
                    loss = loss / self.args.gradient_accumulation_steps
                self.accelerator.backward(0.5 * loss)
                return loss.detach()

        elif setup.step == "compute-loss-scaled":
            def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
                out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
                return (out[0] * 0.5, out[1]) if return_outputs else out * 0.5

        elif setup.step == "l2-before-forward":
            def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
                penalty = sum(p.float().pow(2).sum() for p in model.parameters() if p.requires_grad)
                out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
                return (out[0] + 1e-3 * penalty, out[1]) if return_outputs else out + 1e-3 * penalty

    Subclass.__name__ = f"{base.__name__}_{setup.step.replace('-', '_')}"
    return Subclass


ADAM_EPS = 1e-5   # `tolerance` says why


def _learning_rate(setup: Setup) -> float:
    return 0.05 if setup.optim in ("sgd", "user-sgd-momentum") else 1e-3


def _arguments(setup: Setup, side: str, out_dir: str, ddp_timeout: int, steps: int | None = None):
    from transformers import TrainingArguments

    from hfstream import StreamTrainingArguments

    kw = dict(output_dir=out_dir, max_steps=steps or setup.steps, per_device_train_batch_size=setup.batch,
              per_device_eval_batch_size=4, learning_rate=_learning_rate(setup), logging_steps=1, report_to=[],
              seed=0, use_cpu=True, disable_tqdm=True, dataloader_num_workers=0, lr_scheduler_type="constant",
              gradient_accumulation_steps=setup.accum, max_grad_norm=setup.clip, weight_decay=0.01,
              adam_epsilon=ADAM_EPS, ddp_timeout=ddp_timeout, save_strategy="no", bf16=setup.dtype == "bf16-autocast",
              log_level="error", log_level_replica="error")
    if setup.optim not in ("user-sgd-momentum", "adafactor"):
        kw["optim"] = setup.optim
        if setup.optim == "sgd":
            kw["optim_args"] = "momentum=0.9"
    if setup.sync_each_batch:
        kw["accelerator_config"] = {"gradient_accumulation_kwargs": {"sync_each_batch": True}}
    if setup.eval:
        kw.update(eval_strategy="steps", eval_steps=2)
    if setup.save:
        kw.update(save_strategy="steps", save_steps=2, save_total_limit=1)
    if setup.grad_ckpt:
        kw["gradient_checkpointing"] = True
    if setup.tokens_seen:
        kw["include_num_input_tokens_seen"] = "all"
    if setup.smoothing:
        kw["label_smoothing_factor"] = 0.1
    if side == "stock":
        return TrainingArguments(**kw)
    return StreamTrainingArguments(grad_sync=side, prefetch_depth=setup.prefetch, grad_bucket_mb=setup.bucket_mb,
                                   save_async=setup.save_async, **kw)


# == one run ==========================================================================================
def run_side(setup: Setup, side: str, rank: int, out_dir: str, ddp_timeout: int = DDP_TIMEOUT_S) -> dict:
    """Train ``setup`` on ``side`` ("stock" or a grad_sync mode) on this rank; what the comparison reads."""
    from transformers import PrinterCallback, Trainer

    from hfstream import StreamTrainer

    stock = side == "stock"
    seed = rank if (setup.init_per_rank and not stock) else 0
    train, evals = datasets_for(setup)
    cls = _trainer_class(setup, Trainer if stock else StreamTrainer)

    def trainer_for(model, steps=None):
        extra = {}
        if setup.optim == "user-sgd-momentum":   # over every parameter, frozen ones too (a later unfreeze trains them)
            optimizer = ElementwiseSGDMomentum if setup.declared_elementwise else SGDMomentum
            extra["optimizers"] = (optimizer(model.parameters(), lr=_learning_rate(setup)), None)
        if setup.optim == "adafactor":
            from transformers import Adafactor

            extra["optimizer_cls_and_kwargs"] = (Adafactor, dict(lr=_learning_rate(setup), scale_parameter=False,
                                                                 relative_step=False, eps=(ADAM_EPS ** 2, 1e-3)))
        callbacks = _callbacks_for(setup, rank)
        trainer = cls(model=model, args=_arguments(setup, side, out_dir, ddp_timeout, steps), train_dataset=train,
                      eval_dataset=evals, callbacks=callbacks, **extra)
        trainer.remove_callback(PrinterCallback)   # the console's copy of every log: noise in a test's output
        trainer.seen = []
        return trainer, callbacks

    model = model_for(setup, seed)
    # Where the stock run starts: what a tensor's move (`tolerance`) is measured from.
    initial = _tensors(model.named_parameters()) if stock else None
    initial_buffers = _tensors(model.named_buffers()) if stock else None
    trainer, callbacks = trainer_for(model)
    trainer.train()
    first = _digest(trainer.accelerator.unwrap_model(trainer.model))   # where the run stopped, before a resume
    if setup.resume:
        # As a new launch resumes: after every rank's last save is written and rotated (stock lists the folder
        # on each rank; a rank ahead of the saving one would resume elsewhere and hang: seeds 307, 341).
        torch.distributed.barrier()
        # A fresh model (from other weights: only the checkpoint may
        # make the run go on where it stopped; resumed, it ends where an uninterrupted run does), its side's
        # own last checkpoint
        trainer, callbacks = trainer_for(model_for(setup, seed + 1000), steps=setup.steps + 2)
        trainer.train(resume_from_checkpoint=True)
    history = trainer.state.log_history
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    out = dict(
        steps=trainer.state.global_step,
        tokens_seen=trainer.state.num_input_tokens_seen,
        losses=[h["loss"] for h in history if "loss" in h],
        grad_norms=[h["grad_norm"] for h in history if "grad_norm" in h],
        eval_losses=[h["eval_loss"] for h in history if "eval_loss" in h],
        params=_tensors(unwrapped.named_parameters()),
        buffers=_tensors(unwrapped.named_buffers()),
        initial=initial,
        initial_buffers=initial_buffers,
        reads=list(trainer.seen) + [v for cb in callbacks for v in getattr(cb, "seen", [])],
        notes=list(getattr(trainer, "_notes", [])),
        first=first,
    )
    if setup.save and rank == 0:
        out["checkpoint"] = _checkpoint(out_dir)
    return out


def _digest(model) -> str:
    """The parameters' bytes, hashed: whether two ranks' replicas are the same."""
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        h.update(name.encode())
        h.update(p.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


def _tensors(named) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in named if t.is_floating_point()}


def _checkpoint(out_dir: str) -> dict | None:
    """The last checkpoint: its files' names, the tensors of its weights (``*.safetensors``) by name and its
    optimizer.pt's state tensors by (parameter index, key); what else is in ``out_dir`` (a save's leftovers)."""
    from safetensors.torch import load_file

    from hfstream.trainer.report_file import REPORT_FILE

    found = sorted(glob.glob(f"{out_dir}/checkpoint-*/"), key=lambda p: int(p.rstrip("/").split("-")[-1]))
    if not found:
        return None
    last = found[-1]
    optimizer = f"{last}optimizer.pt"
    state = torch.load(optimizer, weights_only=False)["state"] if os.path.exists(optimizer) else {}
    weights = {f"{name}:{k}": v.clone() for name in sorted(glob.glob(f"{last}*.safetensors"))
               for k, v in load_file(name).items() if v.is_floating_point()}
    return {"file": os.path.relpath(last, out_dir).rstrip("/"),
            "files": sorted(f for f in os.listdir(last) if f != REPORT_FILE),   # hfstream's step report: its own
            "dirs": sorted(d for d in os.listdir(out_dir) if d != "runs"),
            "weights": {k.split("/")[-1]: v for k, v in weights.items()},
            # Files the stock Trainer writes from state every rank's run shares exactly: byte for byte.
            "exact": {os.path.basename(f): hashlib.sha256(open(f, "rb").read()).hexdigest()
                      for f in sorted(glob.glob(f"{last}rng_state*.pth") + glob.glob(f"{last}scheduler.pt"))},
            "state": {(i, k): v.clone() for i, s in state.items() for k, v in s.items()
                      if isinstance(v, torch.Tensor)}}


# == a spawn: runs in sequence, results to files =====================================================
def _result_path(out_dir: str, index: int, side: str, rank: int) -> str:
    return f"{out_dir}/results/{index}-{side}-rank{rank}.pt"


def _write(path: str, obj) -> None:
    tmp = path + ".tmp"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _read(path: str):
    return torch.load(path, weights_only=False)


def is_refusal(result: dict) -> bool:
    """A ValueError that names grad_sync and says what to use instead (a refusal before the first step)."""
    return (result.get("type") == "ValueError" and "grad_sync" in result.get("message", "")
            and re.search(r"\b(use|instead)\b", result.get("message", ""), re.I) is not None)


def _barrier_s(ddp_timeout: int) -> float:
    """How long ranks wait for each other's result between runs: past the watchdog's exit, with a margin."""
    return ddp_timeout + 40.0


def _worker(rank: int, world_size: int, out_dir: str, plan: list, ddp_timeout: int) -> str:
    """Run ``plan`` ([(index, setup, side)]) in order on this rank; after each run wait for every rank's result.

    Stops after a run that failed anywhere, other than the same refusal on every rank: a rank may be
    left inside a collective, and the next run would meet it there. The parent starts a fresh spawn.
    """
    os.makedirs(f"{out_dir}/results", exist_ok=True)
    stock_failed: set[int] = set()   # nothing to compare these setups' modes with
    for index, setup, side in plan:
        if index in stock_failed:
            continue
        started = time.perf_counter()
        try:
            result = run_side(setup, side, rank, f"{out_dir}/{index}/{side}", ddp_timeout)
        except Exception as exc:
            result = {"error": traceback.format_exc(), "type": type(exc).__name__, "message": str(exc)}
        result["seconds"] = time.perf_counter() - started
        _write(_result_path(out_dir, index, side, rank), result)
        everyone = _wait_for_ranks([_result_path(out_dir, index, side, r) for r in range(world_size)],
                                   _barrier_s(ddp_timeout))
        if everyone is None:
            return "a peer never wrote its result"
        errors = [r for r in everyone if "error" in r]
        if side == "stock" and errors:
            stock_failed.add(index)
        if errors and not (len(errors) == world_size and all(is_refusal(r) for r in errors)):
            return f"stopped after {setup.seed}/{side}"
    return "done"


def _wait_for_ranks(paths: list[str], timeout: float):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(os.path.exists(p) for p in paths):
            return [_read(p) for p in paths]
        time.sleep(0.05)
    return None


def run_setups(setups: list[Setup], world: int, out_dir: str, modes: tuple = MODES, skip=(), log=print,
               ddp_timeout: int = DDP_TIMEOUT_S) -> dict:
    """Each setup on ``world`` ranks, stock first, then each mode: ``{(setup, side): [per-rank result]}``.

    One spawn runs them all in sequence; a spawn that stops (a failure) or dies (a hang the watchdog
    ended, a crash) is followed by another for the runs left. A run no rank finished is kept as
    ``{"error": ...}`` with the spawn's own report. ``skip``: (seed, mode) pairs not to run.
    """
    from hfstream.testing import RankFailure, run_on_ranks

    plan = [(i, setup, side) for i, setup in enumerate(setups) for side in ("stock", *modes)
            if (setup.seed, side) not in skip]
    results: dict = {}
    spawns = 0
    while plan:
        spawns += 1
        spawn_error = None
        try:
            run_on_ranks(_worker, world, out_dir, plan, ddp_timeout, init_process_group=False,
                         timeout=len(plan) * (_barrier_s(ddp_timeout) + 30) + 120)
        except RankFailure as exc:
            spawn_error = str(exc)
        left, finished, marked = [], len(results), False
        for index, setup, side in plan:
            paths = [_result_path(out_dir, index, side, r) for r in range(world)]
            if all(os.path.exists(p) for p in paths):
                results[(setup, side)] = [_read(p) for p in paths]
                continue
            if any("error" in r for r in results.get((setup, "stock"), [{}])):
                continue   # not run: nothing to compare it with
            # The run a spawn died in (a hang the watchdog ended, a crash), or one a spawn never got past.
            if not marked and (spawn_error is not None or len(results) == finished):
                marked = True
                got = {r: _read(p) for r, p in enumerate(paths) if os.path.exists(p)}
                message = spawn_error or "the spawn ended before this run finished on every rank"
                results[(setup, side)] = [got.get(r) or {"error": message, "type": "RankFailure",
                                                         "message": message.splitlines()[0]} for r in range(world)]
                log(f"seed {setup.seed} [{side}] on {world} ranks: {message.splitlines()[0]}")
                continue
            left.append((index, setup, side))
        plan = left
    results["spawns"] = spawns
    return results


# == the comparison ===================================================================================
@dataclass
class Finding:
    """A mode that did not end where the stock run did (or did not end)."""

    setup: Setup
    mode: str
    kind: str        # "raised", "hang", "steps", "tokens_seen", "losses", "grad_norms", "eval_losses", "reads", "params",
                     # "buffers", "replicas", "checkpoint", "refused" (a clear refusal: counted apart)
    detail: str
    size: float = math.nan   # the largest absolute difference, where there is one
    # The stock run's own replicas differ (user code wrote .grad on one rank only): there is no one
    # result to match, so a difference is reported, not failed (except under "native", stock's own DDP).
    stock_diverged: bool = False

    @property
    def failure(self) -> bool:
        return self.kind not in ("refused", "stock-limit") and not self.stock_diverged

    def __str__(self) -> str:
        size = "" if math.isnan(self.size) or math.isinf(self.size) else f" (max |diff| {self.size:.3g})"
        why = " [stock's replicas differ too]" if self.stock_diverged else ""
        return f"seed {self.setup.seed} [{self.mode}] {self.kind}{size}{why}: {self.detail}\n    {self.setup!r}"


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


def _close(a, b, tol: Tolerance) -> bool:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return a.shape == b.shape and bool(torch.isclose(a, b, rtol=tol.rtol, atol=tol.atol, equal_nan=True).all())


def _tensor_error(got: torch.Tensor, ref: torch.Tensor, base: torch.Tensor | None, tol: Tolerance) -> float:
    """How far ``got`` is from ``ref`` over what `Tolerance` allows (> 1: too far)."""
    g, r = got.double(), ref.double()
    if g.shape != r.shape:
        return math.inf
    if not r.numel():
        return 0.0
    move = r - base.double() if base is not None else r
    if tol.elementwise:   # floor: an fp32 ulp of the element, and 1e-9 for state that is only noise (~1e-12)
        allowed = tol.moved * float(move.abs().max()) + 2e-7 * r.abs() + 1e-9
        return float(((g - r).abs() / allowed).max())
    # A bf16 tensor that moves less than its ulps in a step is rounding, not arithmetic: also allow one
    # ulp (2**-8 of it) on a sixteenth of its elements.
    ulps = 2.0 ** -8 * float(r.norm()) / 4 if ref.dtype == torch.bfloat16 else 0.0
    # An element whose gradient is only noise (an attention key's bias) moves by noise: 1e-6 each.
    return float((g - r).norm()) / (tol.moved * float(move.norm()) + ulps + 1e-6 * r.numel() ** 0.5)


def _compare_tensors(got: dict, ref: dict, base: dict | None, tol: Tolerance) -> tuple[list[str], float]:
    """Names (with their largest |diff|) of the tensors of ``got`` too far from ``ref``'s; the largest |diff|."""
    if sorted(got) != sorted(ref):
        return [f"other names: {sorted(set(got) ^ set(ref))[:5]}"], math.nan
    base = base or {}
    bad = [(k, _max_diff(got[k], ref[k])) for k in ref if _tensor_error(got[k], ref[k], base.get(k), tol) > 1]
    bad.sort(key=lambda kv: -kv[1])
    return [f"{k} ({d:.3g})" for k, d in bad], max((d for _, d in bad), default=0.0)


def compare(setup: Setup, results: dict, modes: tuple = MODES) -> list[Finding]:
    """Each mode's run of ``setup`` against the stock run: what differs, per rank, beyond `tolerance`."""
    findings: list[Finding] = []
    stock = results[(setup, "stock")]
    if any("error" in r for r in stock):
        failed = _failed_run(setup, "stock", [(i, r) for i, r in enumerate(stock) if "error" in r])
        limit = any(m in r.get("error", "") for r in stock for m in STOCK_LIMITS)
        return [dataclasses.replace(failed, kind="stock-limit" if limit else "stock-raised")]
    tol = tolerance(setup)
    for mode in modes:
        ranks = results.get((setup, mode))
        if ranks is None:   # not run (an open issue's, `OPEN`)
            continue
        errors = [(i, r) for i, r in enumerate(ranks) if "error" in r]
        if errors:
            if all(is_refusal(r) for _, r in errors) and len(errors) == len(ranks):
                findings.append(Finding(setup, mode, "refused", " ".join(ranks[0]["message"].split())[:300]))
            else:
                findings.append(_failed_run(setup, mode, errors))
            continue
        findings += _compare_mode(setup, mode, stock, ranks, tol)
    return findings


def _failed_run(setup, mode, errors) -> Finding:
    """A run that raised on some rank, or never finished (a hang the watchdog or the run's timeout ended)."""
    text = "\n".join(r["error"] for _, r in errors)
    hang = re.search(r"timed out|[Tt]imeout|code 124|exited with code|never wrote|Connection closed by peer", text)
    # Each rank's last line says what it died of (a spawn's report holds every rank's traceback).
    said = []
    for _, r in errors:
        for block in re.split(r"--- rank \d+ ---", r["error"]):
            lines = [line.strip() for line in block.strip().splitlines() if line.strip()]
            if lines and lines[-1] not in said:
                said.append(lines[-1][:240])
    ranks = ", ".join(str(i) for i, _ in errors)
    return Finding(setup, mode, "hang" if hang else "raised", f"ranks {ranks}: " + " | ".join(said[:4]))


def _compare_mode(setup, mode, stock, ranks, tol) -> list[Finding]:
    """One finding per kind of difference, its size the largest over ranks, its detail the worst rank's."""
    worst: dict[str, tuple[float, str, list[int]]] = {}

    def found(kind, rank, size, detail):
        size = math.inf if math.isnan(size) else size
        old = worst.get(kind)
        ranks_seen = (old[2] if old else []) + [rank]
        worst[kind] = (size, f"rank {rank}: {detail}", ranks_seen) if old is None or size > old[0] \
            else (old[0], old[1], ranks_seen)

    # The stock run's replicas differ at its end, or did where it stopped before a resume (each rank's
    # checkpoint was rank 0's: they agree again, but from a point only stock's DDP reached).
    diverging = setup.stock_replicas_may_differ and not all(
        all(torch.equal(v, r["params"][k]) for k, v in stock[0]["params"].items()) and r["first"] == stock[0]["first"]
        for r in stock[1:])
    for rank, (got, ref) in enumerate(zip(ranks, stock)):
        if got["steps"] != ref["steps"]:
            found("steps", rank, math.nan, f"{got['steps']} steps, stock {ref['steps']}")
            continue
        if got["tokens_seen"] != ref["tokens_seen"]:
            found("tokens_seen", rank, math.nan, f"{got['tokens_seen']} input tokens seen, stock {ref['tokens_seen']}")
        for key in ("losses", "grad_norms", "eval_losses", "reads"):
            if not _close(got[key], ref[key], tol):
                size = (_max_diff(torch.tensor(got[key]), torch.tensor(ref[key]))
                        if len(got[key]) == len(ref[key]) else math.nan)
                found(key, rank, size, f"{_short(got[key])}, stock {_short(ref[key])}")
        bad, size = _compare_tensors(got["params"], ref["params"], stock[0]["initial"], tol)
        if bad:
            found("params", rank, size, f"{len(bad)} of {len(ref['params'])} differ: {', '.join(bad[:4])}")
        bad, size = _compare_tensors(got["buffers"], ref["buffers"], stock[0]["initial_buffers"], tol)
        if bad:
            found("buffers", rank, size, ", ".join(bad[:4]))
        if ref.get("checkpoint") is not None:
            problem = _compare_checkpoint(got.get("checkpoint"), ref["checkpoint"], tol)
            if problem:
                found("checkpoint", rank, *problem)
    if not diverging:   # replicas agree with each other, where the stock run's do
        for rank, got in enumerate(ranks[1:], 1):
            differ = [k for k, v in ranks[0]["params"].items() if not torch.equal(v, got["params"][k])]
            if differ:
                size = max(_max_diff(ranks[0]["params"][k], got["params"][k]) for k in differ)
                found("replicas", rank, size,
                      f"differs from rank 0 in {len(differ)} parameters: {', '.join(differ[:4])}")
    return [Finding(setup, mode, kind, f"{detail} (ranks {', '.join(map(str, seen))})", size,
                    stock_diverged=diverging and mode != "native")
            for kind, (size, detail, seen) in worst.items()]


def _compare_checkpoint(got, ref, tol) -> tuple[float, str] | None:
    """(size, detail) where the last checkpoint differs from stock's (its name, its files, what else the
    output directory holds, its weights and optimizer state); None where it does not."""
    if got is None:
        return math.nan, f"no checkpoint (stock wrote {ref['file']})"
    for key in ("file", "files", "dirs"):
        if got[key] != ref[key]:
            return math.nan, f"{key}: {got[key]}, stock {ref[key]}"
    if got["exact"] != ref["exact"]:
        return math.nan, f"{ref['file']}: other bytes than stock's in {sorted(set(got['exact'].items()) ^ set(ref['exact'].items()))[0][0]}"
    for key in ("weights", "state"):
        bad, size = _compare_tensors({str(k): v for k, v in got[key].items()},
                                     {str(k): v for k, v in ref[key].items()}, None, tol)
        if bad:
            return size, f"{ref['file']} {key}: {len(bad)} differ: {', '.join(bad[:4])}"
    return None


def _short(values: list) -> str:
    return "[" + ", ".join(f"{v:.6g}" for v in values[:6]) + (", ...]" if len(values) > 6 else "]")


def rerun_hint(seeds) -> str:
    return (f"rerun: HFSTREAM_SEED={','.join(map(str, sorted(set(seeds))))} OMP_NUM_THREADS=1 "
            f".venv/bin/python -m pytest tests/test_generated_setups.py")


def check_seeds(seeds: list[int], out_dir: str, modes: tuple = MODES, skip: dict | None = None, log=print,
                ddp_timeout: int = DDP_TIMEOUT_S) -> dict:
    """`check_setups` of each seed's `draw`."""
    return check_setups([draw(seed) for seed in seeds], out_dir, modes, skip, log, ddp_timeout)


def check_setups(setups: list[Setup], out_dir: str, modes: tuple = MODES, skip: dict | None = None,
                 log=print, ddp_timeout: int = DDP_TIMEOUT_S) -> dict:
    """Run and compare ``setups`` (one spawn per world size); a summary for `report`.

    ``skip``: {(seed, mode): reason} of open issues (`OPEN`, each a named test in
    tests/test_generated_named.py), not run: one may hang for ``ddp_timeout``.
    """
    skip = skip or {}
    summary = dict(setups=list(setups), findings=[], refusals=[], diverged=[], skipped=[], seconds={}, spawns=0,
                   runs=0)
    by_world: dict[int, list[Setup]] = {}
    for setup in setups:
        by_world.setdefault(setup.world, []).append(setup)
    for world, group in sorted(by_world.items()):
        started = time.perf_counter()
        results = run_setups(group, world, f"{out_dir}/world{world}", modes, skip=skip, log=log,
                             ddp_timeout=ddp_timeout)
        summary["spawns"] += results.pop("spawns")
        summary["runs"] += len(results)
        summary["seconds"][world] = time.perf_counter() - started
        for setup in group:
            summary["skipped"] += [(setup.seed, m, skip[(setup.seed, m)]) for m in modes if (setup.seed, m) in skip]
            for f in compare(setup, results, modes):
                which = ("refusals" if f.kind in ("refused", "stock-limit") else "diverged" if f.stock_diverged
                         else "findings")
                summary[which].append(f)
    return summary


def report(summary: dict) -> str:
    lines = [f"{len(set(summary['setups']))} distinct setups, {summary['runs']} runs, {summary['spawns']} spawns, "
             + ", ".join(f"world {w}: {s:.0f} s" for w, s in summary["seconds"].items())]
    for f in summary["findings"]:
        lines.append(f"FAIL {f}")
    for seed, mode, reason in summary["skipped"]:
        lines.append(f"not run (open, tests/test_generated_named.py): seed {seed} [{mode}]: {reason}")
    for f in summary["refusals"]:
        lines.append(f"refused {f}")
    for f in summary["diverged"]:
        lines.append(f"not compared {f}")
    if summary["findings"]:
        lines.append(rerun_hint(f.setup.seed for f in summary["findings"]))
    return "\n".join(lines)
