"""User code that acts on some ranks only trains as the stock Trainer does, in every mode, and never hangs.

[Note: ranks agree] A decision that changes which collectives a rank issues (whether a step
gathers whole gradients, whether a forward broadcasts buffers, ...) is agreed by every rank when it
is made, or follows from state every rank shares: a user may log, read gradients, call a callback
or run a diagnostic forward on the main process only (docs/design.md, "Decisions every rank
agrees on"). Each scenario here does one such thing on one rank and runs under the stock
`transformers.Trainer` (DDP) and `StreamTrainer` in every mode on 2 gloo ranks; the final
parameters must match stock's on every rank. ``ddp_timeout`` is short, so a rank left waiting in a
collective ends the run (the watchdog) instead of the suite.
"""

from __future__ import annotations

import copy
import traceback

import pytest
import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

from hfstream import StreamTrainer, StreamTrainingArguments
from tiny import lm_dataset, params, tiny_causal_lm, train_args

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]

MODES = ("native", "overlap", "serial", "sharded")


def _reads_grad_on_rank0(base):
    class ReadsGradOnRank0(base):
        """A grad-norm log line on the main process only: the one-line user code that hung sharded."""

        def training_step(self, model, inputs, num_items_in_batch=None):
            loss = super().training_step(model, inputs, num_items_in_batch)
            if self.is_world_process_zero():
                self.norms = getattr(self, "norms", [])
                self.norms.append(float(sum(p.grad.norm() ** 2 for p in model.parameters() if p.grad is not None)))
            return loss

    return ReadsGradOnRank0


def _logs_on_rank0(base):
    class LogsOnRank0(base):
        """A log line of the user's own, from the main process only."""

        def training_step(self, model, inputs, num_items_in_batch=None):
            loss = super().training_step(model, inputs, num_items_in_batch)
            if self.is_world_process_zero():
                self.log({"probe": float(loss)})
            return loss

    return LogsOnRank0


class EvaluatesAndSavesOnRank0(TrainerCallback):
    """After each step, the main process alone evaluates a batch by hand and saves the weights."""

    def __init__(self):
        self.out_dir = None

    def on_step_end(self, args, state, control, model=None, **kwargs):
        probe = torch.arange(8).remainder(64).view(1, 8)
        model.eval()
        with torch.no_grad():
            self.loss = float(model(input_ids=probe, labels=probe)["loss"])
        model.train()
        torch.save(model.state_dict(), f"{args.output_dir}/rank0-weights.pt")


class GradNormLogger(TrainerCallback):
    """Reads the mean gradient where stock holds it; added on the main process only."""

    def __init__(self):
        self.norms = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.norms.append(float(sum(p.grad.norm() ** 2 for p in model.parameters() if p.grad is not None)))


class DiagnosticForward(TrainerCallback):
    """A training-mode forward with gradients enabled after each step (a probe), on the main process only.

    It moves that rank's BatchNorm statistics, which the next step's forward then broadcasts from
    rank 0. The stock Trainer (DDP) crashes on it (gloo: "collective mismatch", checked 2026-12-06 on
    torch 2.13), so the reference runs the same probe without gradients (`NoGradDiagnosticForward`),
    which computes the same statistics and which stock trains through.
    """

    grad = True

    def on_step_end(self, args, state, control, model=None, **kwargs):
        probe = torch.arange(8).remainder(64).view(1, 8)
        model.train()
        with torch.set_grad_enabled(self.grad):
            model(input_ids=probe, labels=probe)["loss"].detach()


class NoGradDiagnosticForward(DiagnosticForward):
    grad = False


class TinyBatchNormLM(torch.nn.Module):
    """Embedding, BatchNorm over the hidden units, a linear head: running statistics that differ per rank."""

    def __init__(self, vocab: int = 64, hidden: int = 16):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.norm = torch.nn.BatchNorm1d(hidden)
        self.head = torch.nn.Linear(hidden, vocab)

    def forward(self, input_ids=None, labels=None, **_):
        h = self.norm(self.embed(input_ids).transpose(1, 2)).transpose(1, 2)
        logits = self.head(h)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        return {"loss": loss, "logits": logits}


class TinyMoE(torch.nn.Module):
    """Four experts, one per batch, chosen by its first token: in most steps two experts are used by no rank."""

    def __init__(self, vocab: int = 64, hidden: int = 16, experts: int = 4):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden) for _ in range(experts))
        self.head = torch.nn.Linear(hidden, vocab)

    def forward(self, input_ids=None, labels=None, **_):
        expert = self.experts[int(input_ids[0, 0]) % len(self.experts)]
        logits = self.head(torch.tanh(expert(self.embed(input_ids))))
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        return {"loss": loss, "logits": logits}


SCENARIOS = {
    "reads-grad-rank0": dict(trainer=_reads_grad_on_rank0),
    "callback-rank0": dict(callback=GradNormLogger),
    "log-evaluate-save-rank0": dict(trainer=_logs_on_rank0, callback=EvaluatesAndSavesOnRank0),
    "forward-rank0": dict(callback=DiagnosticForward, stock_callback=NoGradDiagnosticForward, build=TinyBatchNormLM),
    # Each rank's own running statistics after the last step, as DDP leaves them (it broadcasts
    # rank 0's only before the next training forward), with and without accumulation.
    "batchnorm-eval": dict(build=TinyBatchNormLM, evaluate=True, ddp_broadcast_buffers=True),
    "batchnorm-eval-accumulated": dict(build=TinyBatchNormLM, evaluate=True, gradient_accumulation_steps=2),
    # Experts that no rank used in a step keep .grad None and are not stepped (no weight decay, no
    # momentum), as DDP(find_unused_parameters=True) leaves them; one used on one rank gets the mean.
    "moe-idle-experts": dict(build=TinyMoE, weight_decay=0.1, max_steps=6),
    # Accelerate's sync_each_batch: every micro-batch is reduced, and the step sees their sum.
    "sync-each-batch": dict(gradient_accumulation_steps=2, atol=1e-5,
                            accelerator_config={"gradient_accumulation_kwargs": {"sync_each_batch": True}}),
}


def _gpt2():
    return tiny_causal_lm("gpt2", seed=0)


def _train(side: str, rank: int, out_dir: str, trainer=None, callback=None, build=_gpt2, evaluate=False,
           stock_callback=None, atol=None, **kw):
    stock = side == "stock"
    callback = stock_callback if stock and stock_callback is not None else callback
    base = Trainer if stock else StreamTrainer
    cls = trainer(base) if trainer is not None else base
    settings = {"max_steps": 4, "ddp_timeout": 30, "max_grad_norm": 1.0, "optim": "adamw_torch", **kw}
    if not stock:
        settings.update(grad_sync=side, prefetch_depth=0)
    args = train_args(TrainingArguments if stock else StreamTrainingArguments, out_dir, **settings)
    t = cls(model=build(), args=args, train_dataset=lm_dataset(), eval_dataset=lm_dataset(n=16, seed=5))
    if callback is not None and rank == 0:
        t.add_callback(callback())
    t.train()
    out = params(t.model)
    if evaluate:
        out["eval_loss"] = torch.tensor(t.evaluate()["eval_loss"])
    return out


def _runs(rank, world_size, tmp, name, modes):
    out = {}
    for side in ("stock",) + modes:
        try:
            # A copy each run: the Trainer writes into accelerator_config's dicts (num_steps).
            out[side] = _train(side, rank, f"{tmp}/{name}-{side}", **copy.deepcopy(SCENARIOS[name]))
        except Exception:
            out[side] = traceback.format_exc()
    return out


_SPAWNED: dict = {}


def _spawned(name, mode, tmp_path_factory):
    """One spawn of 2 gloo ranks per scenario and group of modes (a crash takes only its own down)."""
    from hfstream.testing import run_on_ranks

    modes = QUICK_MODES if mode in QUICK_MODES else tuple(m for m in MODES if m not in QUICK_MODES)
    if (name, modes) not in _SPAWNED:
        _SPAWNED[(name, modes)] = run_on_ranks(_runs, 2, str(tmp_path_factory.mktemp(name)), name, modes,
                                               init_process_group=False, timeout=300)
    return _SPAWNED[(name, modes)]


# overlap and sharded in `make test`; native (DDP under StreamTrainer) and serial under `make test-slow`.
QUICK_MODES = ("overlap", "sharded")


@pytest.mark.parametrize("mode", [m if m in QUICK_MODES else pytest.param(m, marks=pytest.mark.slow) for m in MODES])
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_code_on_one_rank_only_trains_as_stock_in_every_mode(tmp_path_factory, name, mode):
    for rank, out in enumerate(_spawned(name, mode, tmp_path_factory)):
        ref, got = out["stock"], out[mode]
        assert isinstance(ref, dict), f"stock failed on rank {rank}:\n{ref}"
        assert isinstance(got, dict), f"{mode} failed on rank {rank}:\n{got}"
        # sync_each_batch: the sharded slices add this micro-batch's mean to the last one's after the
        # reduce-scatter, where DDP averages (last mean + this gradient): equal up to rounding, which
        # Adam's division by sqrt(v) magnifies (1.0e-6 seen): the AdamW tolerance of the sharded tests.
        atol = SCENARIOS[name].get("atol") or 1e-6
        for k, v in ref.items():
            torch.testing.assert_close(got[k], v, rtol=1e-5, atol=atol,
                                       msg=lambda m, k=k: f"{name} {mode} rank {rank} {k}: {m}")
