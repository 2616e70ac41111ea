"""Part 5: the Trainer with GradSync active on a one-rank NCCL group (gloo with ``--on-cpu``), against
the stock Trainer on the same device.

On one GPU ``grad_sync="auto"`` resolves to "native", and an hfstream mode asked for there gets a
GradSync that does nothing (world size 1): a one-GPU Trainer run never runs hfstream's gradient
path. `OneRankTrainer` is the test-only switch for the Trainer: a `StreamTrainer` whose GradSync is
part 6's `one_rank.one_rank_grad_sync` on a one-rank group, so that the hooks, the buckets, the side
stream, the bf16 wire, ``grad_bucket_mb="auto"`` with its re-plans, the sharded step, clip and
all-gathers all run on NCCL, through the Trainer's own loop (the mean over one rank is the
identity). It is defined here and nowhere in the training path.

The runs (a GPT-2 from a config with eager attention, the same data, seed, AdamW and clipping):

    stock        transformers.Trainer
    stock-bf16   the same, each gradient rounded to bf16 as it is accumulated: what the bf16 wire
                 gives on one rank (each rank's gradient rounded once, the sum over one rank exact)
    overlap      OneRankTrainer, grad_sync="overlap", grad_bucket_mb="auto", grad_comm_dtype="bf16",
                 max_grad_norm (the Trainer's clip on the all-reduced gradients)
    sharded      the same with grad_sync="sharded" (the sharded clip: ``GradSync.clip_grad_norm_``)

Checks, for each of overlap and sharded: GradSync ran active on the group (every bucket a
collective in the last step); ``"auto"`` tried caps, chose one and re-planned to it; the
gradients the clip saw are bf16 values (and the stock run's are not: the control); the clip
acted (the pre-clip norm above ``max_grad_norm``) and the logged norms and losses equal
stock-bf16's; the parameters after the run equal stock-bf16's (`PARAM_ATOL`); on a GPU, the
memory row (`memory`): step 1, every re-plan step and the last step against steady state,
within one bucket. And the run trains (its loss falls).

Why `PARAM_ATOL` is 1e-5: the runs do the same arithmetic on the same device (eager attention,
no atomics in this model's backward; one rank's mean is exact; AdamW steps each element alone,
so stepping flat pieces is the same arithmetic as stepping the parameters). What may still differ
is the last bit of a reduction (the clip's norm summed in another order), and AdamW's update is
nearly invariant to a common scale of the gradients, so such a bit moves a parameter far less
than lr x 1e-6 a step; a last bit that moves a gradient's bf16 rounding by one step (2^-8)
moves one update by at most about lr x 2^-8 (4e-6 at lr 1e-3): 1e-5 allows two of those on one
element. What the check is there for moves parameters much further: in the CPU run (28 steps), a
sharded clip that does not clip by 1.8e-3, a re-plan that drops the optimizer's state by 2e-2, an
fp32 wire against the bf16 reference by 3.6e-5 (that one the bf16-values check catches first);
the runs themselves agree to the bit there (tests/test_gpu_check_trainer.py).
"""

from __future__ import annotations

import copy
import gc
import logging
import math
import tempfile
from dataclasses import dataclass, field
from typing import Any

from dev.gpu_check.checks import Checks, compare_tensors
from dev.gpu_check.memory import MemoryLog, memory_checks
from dev.gpu_check.one_rank import one_rank_grad_sync, one_rank_group, one_rank_world

PARAM_ATOL = 1e-5           # parameters against stock-bf16's (see the module docstring)
NORM_RTOL = 1e-4            # the logged pre-clip norms and losses against stock-bf16's
MAX_GRAD_NORM = 1.0         # the model's gradient norm starts at 1-2.5: the clip acts in the first steps
MODES = ("overlap", "sharded")


def trainer_sizes(quick: bool, on_cpu: bool) -> dict:
    """The model and the run. ``steps`` outlasts ``"auto"``'s tuning (its candidates are the caps that cut
    the model differently: 2 on CPU, 5 quick, 7 full; sharded scores 5 steps each, and rematches two)."""
    if on_cpu:
        return dict(n_embd=64, n_layer=2, n_head=2, vocab=64, seq=32, batch=4, steps=28)
    if quick:
        return dict(n_embd=128, n_layer=4, n_head=4, vocab=256, seq=64, batch=16, steps=60)
    return dict(n_embd=256, n_layer=4, n_head=4, vocab=256, seq=64, batch=16, steps=100)


def one_rank_trainer(group):
    """The test-only `StreamTrainer` whose GradSync stays active on the one-rank ``group`` (see the module docstring)."""
    from hfstream import StreamTrainer

    OneRankGradSync = one_rank_grad_sync()

    class OneRankTrainer(StreamTrainer):
        """Test-only: StreamTrainer with GradSync active at world size 1; ``probe`` sees each step."""

        def __init__(self, *args, probe=None, **kwargs):
            super().__init__(*args, **kwargs)
            self._grad_group = group   # what _gradient_group() returns (gradient_group makes none at world size 1)
            self.probe = probe

        def _wrap_model(self, model, training=True, dataloader=None):
            import hfstream.gradsync as gradsync

            plain, gradsync.GradSync = gradsync.GradSync, OneRankGradSync   # the class _wrap_model constructs
            try:
                wrapped = super()._wrap_model(model, training=training, dataloader=dataloader)
            finally:
                gradsync.GradSync = plain
            if self.probe is not None and self.grad_sync is not None:
                self.probe.wrapped(self.grad_sync)
            return wrapped

        @property
        def _zero1_optimizer(self) -> bool:
            # The mixin asks for world size > 1, where sharded means one slice per rank; here the one slice is cut.
            return self.grad_sync is not None and self.grad_sync.mode == "sharded"

        def _backward_ended(self) -> None:
            # The mixin finishes a backward once at world size > 1 (at 1 GradSync has nothing pending); the same rule here.
            if not self.grad_sync.sync_pending:
                return
            super()._backward_ended()

        def _clip_grad_norm(self, model):
            if self.probe is not None:
                self.probe.before_clip(self)
            return super()._clip_grad_norm(model)

        def _maybe_log_save_evaluate(self, *args, **kwargs):
            if self.probe is not None:   # right after each optimizer step (and at an epoch's end)
                self.probe.step_ended(self)
            return super()._maybe_log_save_evaluate(*args, **kwargs)

    return OneRankTrainer


def observed_stock_trainer():
    """``transformers.Trainer`` with the same probe before its clip (it sees the gradients the stock step clips)."""
    from transformers import Trainer

    class ObservedTrainer(Trainer):
        def __init__(self, *args, probe=None, **kwargs):
            super().__init__(*args, **kwargs)
            self.probe = probe

        def _clip_grad_norm(self, model):
            if self.probe is not None:
                self.probe.before_clip(self)
            return super()._clip_grad_norm(model)

    return ObservedTrainer


class RunProbe:
    """What one run showed, step by step: the plan, re-plans, memory, and the gradients the clip saw at ``look_at``.

    Args:
        device: the training device.
        look_at: the step (1-based) whose pre-clip gradients are kept as seen.
    """

    def __init__(self, device, look_at: int):
        self.memory = MemoryLog(device)
        self.look_at = look_at
        self.first_plan: tuple = ()         # the plan GradSync was built with
        self.plans: list[tuple] = []        # the plan (bucket names) after each step, in step order
        self.replans: list[int] = []        # steps whose finish() changed the plan
        self.grads: list = []               # the gradients the clip saw at step look_at (clones)
        self.collectives = (0, 0)           # (collectives, buckets) in the last step

    @staticmethod
    def _plan(sync) -> tuple:
        return tuple(tuple(b.names) for b in sync.buckets)

    def wrapped(self, sync) -> None:
        if not self.plans:
            self.first_plan = self._plan(sync)

    def before_clip(self, trainer) -> None:
        if trainer.state.global_step + 1 != self.look_at or self.grads:
            return
        sync = getattr(trainer, "grad_sync", None)
        if sync is not None and sync.mode == "sharded":   # the mean gradient is in the slices
            self.grads = [st.shard.grad.detach().clone() for st in sync.reduction.states]
        else:
            self.grads = [p.grad.detach().clone() for p in trainer.model.parameters() if p.grad is not None]

    def step_ended(self, trainer) -> None:
        sync, step = trainer.grad_sync, trainer.state.global_step
        if sync is None or len(self.plans) >= step:
            return
        plan = self._plan(sync)
        if plan != (self.plans[-1] if self.plans else self.first_plan):
            self.replans.append(step)
        self.plans.append(plan)
        self.memory.step_ended(step, max((b.nbytes for b in sync.buckets), default=0))
        if step == trainer.args.max_steps:
            stats = sync.stats   # waits for the last step's events: the run is over
            self.collectives = (stats.num_collectives, len(sync.buckets))


def part_trainer(quick: bool, on_cpu: bool, timeout_s: float) -> dict:
    with one_rank_world(on_cpu, timeout_s) as (dev, timeout):
        return _run(quick, on_cpu, dev, one_rank_group(not on_cpu, timeout))


def _model_and_data(size: dict):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=size["vocab"], n_positions=size["seq"], n_embd=size["n_embd"],
                     n_layer=size["n_layer"], n_head=size["n_head"], resid_pdrop=0.0, embd_pdrop=0.0,
                     attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, attn_implementation="eager")
    model = GPT2LMHeadModel(cfg)
    # Arithmetic sequences (start, stride): predictable after two tokens, so the loss must fall.
    g = torch.Generator().manual_seed(1)
    n, seq, vocab = size["steps"] * size["batch"], size["seq"], size["vocab"]
    ids = (torch.randint(0, vocab, (n, 1), generator=g) + torch.randint(1, 4, (n, 1), generator=g)
           * torch.arange(seq)) % vocab
    return model, [{"input_ids": row.clone(), "labels": row.clone()} for row in ids]


@dataclass
class Run:
    """What a run left to compare, its trainer gone (so that the next run's memory row sees only its own)."""

    params: list            # the parameters after the run
    norms: list[float]      # the logged pre-clip gradient norms
    losses: list[float]     # the logged losses
    mode: str | None        # its GradSync's mode (None: no GradSync)
    tuning: Any = None      # what grad_bucket_mb="auto" chose (`TuningResult`), if it chose
    chosen_plan: tuple = () # the plan GradSync makes at the chosen cap (bucket names)
    report_mean: dict = field(default_factory=dict)   # stream_report()'s mean row


def _train(name: str, base, data, size: dict, on_cpu: bool, group, probe) -> Run:
    """One run on a copy of ``base``."""
    from transformers import PrinterCallback, TrainingArguments

    from hfstream import StreamTrainingArguments

    model = copy.deepcopy(base)
    common = dict(max_steps=size["steps"], per_device_train_batch_size=size["batch"], learning_rate=1e-3,
                  logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, dataloader_num_workers=0,
                  lr_scheduler_type="constant", seed=0, max_grad_norm=MAX_GRAD_NORM, optim="adamw_torch",
                  use_cpu=on_cpu)
    with tempfile.TemporaryDirectory() as out:
        if name.startswith("stock"):
            if name == "stock-bf16":   # each gradient rounded to bf16 once accumulated: the bf16 wire on one rank
                for p in model.parameters():
                    p.register_post_accumulate_grad_hook(_round_to_bf16)
            trainer = observed_stock_trainer()(model=model, args=TrainingArguments(output_dir=out, **common),
                                               train_dataset=data, probe=probe)
        else:
            args = StreamTrainingArguments(output_dir=out, grad_sync=name, grad_bucket_mb="auto",
                                           grad_comm_dtype="bf16", prefetch_depth=2, **common)
            trainer = one_rank_trainer(group)(model=model, args=args, train_dataset=data, probe=probe)
        trainer.remove_callback(PrinterCallback)   # each step's log on stdout would bury a failure's output
        trainer.train()
    sync = getattr(trainer, "grad_sync", None)
    tuning = sync.tuning_result if sync is not None else None
    report = trainer.stream_report() if hasattr(trainer, "stream_report") else None
    return Run(params=[p.detach().clone() for p in trainer.model.parameters()],
               norms=_logged(trainer, "grad_norm"), losses=_logged(trainer, "loss"),
               mode=sync.mode if sync is not None else None, tuning=tuning,
               chosen_plan=tuple(tuple(b.names) for b in sync.plan_for(tuning.bucket_mb)) if tuning else (),
               report_mean=dict(report.get("mean") or {}) if report else {})


def _round_to_bf16(param) -> None:
    """A post-accumulate-grad hook (it must return None): the gradient rounded to bf16, kept in its dtype."""
    param.grad.copy_(param.grad.bfloat16())


def _logged(trainer, key: str) -> list[float]:
    return [h[key] for h in trainer.state.log_history if key in h and "train_runtime" not in h]


def _close(got: list[float], want: list[float]) -> float:
    """The largest relative difference of two lists (inf when their lengths differ)."""
    if len(got) != len(want):
        return math.inf
    return max([0.0] + [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(got, want)])


def _run(quick: bool, on_cpu: bool, dev, group) -> dict:
    import torch

    logging.getLogger("transformers").setLevel(logging.ERROR)
    logging.getLogger("hfstream").setLevel(logging.ERROR)
    size = trainer_sizes(quick, on_cpu)
    base, data = _model_and_data(size)
    look_at = 2   # after the arrival-order re-plan, while "auto" tries its first caps
    checks = Checks()
    numbers: dict[str, Any] = {"size": size, "max_grad_norm": MAX_GRAD_NORM, "param_atol": PARAM_ATOL}
    runs: dict[str, tuple[Run, RunProbe]] = {}
    for name in ("stock", "stock-bf16") + MODES:
        gc.collect()   # the last run's trainer (its cycles hold its model and optimizer) gone before this one starts
        probe = RunProbe(dev, look_at)
        runs[name] = (_train(name, base, data, size, on_cpu, group, probe), probe)
    (stock, stock_probe), (ref, _) = runs["stock"], runs["stock-bf16"]
    clipped = sum(1 for v in ref.norms if v > MAX_GRAD_NORM)
    checks.compare("the clip acts: the pre-clip norm above max_grad_norm (stock-bf16)", len(ref.norms), "logged norms",
                   clipped >= 1, f"{clipped} of {len(ref.norms)} steps above {MAX_GRAD_NORM}")
    stock_not_bf16 = sum(int((g != g.bfloat16().float()).sum()) for g in stock_probe.grads)
    numbers.update(clipped_steps=clipped, stock_grads_not_bf16=stock_not_bf16,
                   stock_vs_bf16_param_diff=max(float((a - b).abs().max()) for a, b in zip(stock.params, ref.params)))
    checks.compare("control: the stock run's gradients are not all bf16 values (the wire check can tell)",
                   sum(g.numel() for g in stock_probe.grads), "gradient elements", stock_not_bf16 > 0,
                   f"{stock_not_bf16} are not")
    backend = str(torch.distributed.get_backend(group))
    summary = []
    for mode in MODES:
        summary += _mode_checks(mode, *runs[mode], ref, size, backend, on_cpu, checks, numbers)
    first_mode = MODES[0]
    losses = runs[first_mode][0].losses
    first, last = losses[:3], losses[-3:]
    drop = (sum(first) / len(first), sum(last) / len(last)) if losses else (math.nan, math.nan)
    checks.compare(f"it trains: mean of the last 3 losses < 0.9 x the first 3 ({first_mode})",
                   min(len(first), len(last)) * 2, "losses",
                   all(math.isfinite(v) for v in losses) and drop[1] < 0.9 * drop[0], f"{drop[0]:.3f} -> {drop[1]:.3f}")
    mean = runs[first_mode][0].report_mean
    checks.add(f"stream_report() has a mean row with a step time ({first_mode})", mean.get("step_ms", 0) > 0, f"{mean}")
    summary.insert(0, f"GPT-2 {size['n_layer']}x{size['n_embd']}, {size['steps']} steps, bf16 wire, auto, clip "
                      f"{MAX_GRAD_NORM:g} ({clipped} steps clipped); loss {drop[0]:.3f} -> {drop[1]:.3f}; stock fp32 vs "
                      f"stock-bf16 params differ by {numbers['stock_vs_bf16_param_diff']:.1e}")
    if on_cpu:
        summary.append("memory row: n/a on CPU (the CUDA allocator's counters)")
    numbers["mean"] = mean
    return checks.result(summary, numbers)


def _mode_checks(mode: str, run: Run, probe: RunProbe, ref: Run, size: dict, backend: str, on_cpu: bool,
                 checks: Checks, numbers: dict) -> list[str]:
    """One OneRankTrainer run against stock-bf16's; returns its summary lines."""
    n_coll, n_buckets = probe.collectives
    checks.compare(f"{mode}: GradSync ran active in the Trainer on a one-rank {backend} group (every bucket a "
                   f"collective in the last step)", n_coll, "collectives", run.mode == mode and n_coll == n_buckets >= 1,
                   f"{n_coll} collectives, {n_buckets} buckets")
    result = run.tuning
    tried = len(result.scores_ms) if result is not None else 0
    checks.compare(f"{mode}: grad_bucket_mb='auto' tried caps, chose one and re-planned to it", len(probe.replans),
                   "re-plans", result is not None and tried >= 2 and probe.plans[-1:] == [run.chosen_plan],
                   f"re-planned at steps {probe.replans}; " + (
                       f"chose {result.bucket_mb:g} MiB of {tried} caps tried in {result.steps} steps"
                       if result is not None else "no choice made"))
    not_bf16 = sum(int((g != g.bfloat16().float()).sum()) for g in probe.grads)
    checks.compare(f"{mode}: the gradients the clip saw came through the bf16 wire (bf16 values)",
                   sum(g.numel() for g in probe.grads), "gradient elements", not_bf16 == 0,
                   f"step {probe.look_at}: {not_bf16} are not bf16 values")
    norm_diff, loss_diff = _close(run.norms, ref.norms), _close(run.losses, ref.losses)
    checks.compare(f"{mode}: the pre-clip norms equal stock-bf16's (rtol {NORM_RTOL:g})", len(run.norms),
                   "logged norms", norm_diff <= NORM_RTOL, f"max relative diff {norm_diff:.1e}")
    checks.compare(f"{mode}: the losses equal stock-bf16's (rtol {NORM_RTOL:g})", len(run.losses), "logged losses",
                   loss_diff <= NORM_RTOL and len(run.losses) == size["steps"], f"max relative diff {loss_diff:.1e}")
    diff = compare_tensors(checks, f"{mode}: parameters after the run equal stock-bf16's", run.params, ref.params,
                           PARAM_ATOL, "parameter tensors")
    memory = {} if on_cpu else memory_checks(checks, f"memory {mode}", probe.memory.steps, probe.replans)
    numbers[mode] = dict(replans=probe.replans, chosen_mb=result.bucket_mb if result else None,
                         scores_ms=result.scores_ms if result else None, param_diff=diff, norm_diff=norm_diff,
                         loss_diff=loss_diff, not_bf16=not_bf16, memory=memory, buckets=n_buckets)
    lines = [f"{mode}: {n_coll} collectives a step on {backend}, auto chose "
             + (f"{result.bucket_mb:g} MiB ({tried} caps, {len(probe.replans)} re-plans)" if result else "NOTHING")
             + f"; params vs stock-bf16 max |diff| {diff:.1e} (atol {PARAM_ATOL:g}), norms/losses "
             f"{norm_diff:.1e}/{loss_diff:.1e}"]
    if memory:
        lines.append(f"memory {mode} (MiB): peak step 1 {memory['step1_peak_mib']:.1f}, re-plans "
                     f"{memory['replan_peak_mib']:.1f}, steady (step {memory['steady_step']}) "
                     f"{memory['steady_peak_mib']:.1f}, step {memory['last_step']} {memory['last_peak_mib']:.1f}; "
                     f"growth {memory['growth_mib']:+.2f} (a bucket {memory['bucket_mib']:.2f})")
    return lines
