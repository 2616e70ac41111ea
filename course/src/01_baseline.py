# %% [markdown]
# # Lesson 01 — Single-stream baseline
#
# **Time:** 35 minutes. **Runs on:** any laptop (CPU). **You will:** train a small GPT-2 with the
# Hugging Face `Trainer` and read where each step's time goes, write the tool every later lesson
# measures with (a *span recorder*), time a plain training loop phase by phase, and draw its
# timeline: one lane, every phase after the one before.
#
# ## What "single-stream" means
#
# A stock training step does its work one thing after another:
#
# 1. **data**: the `DataLoader` fetches and collates a batch, and the Trainer moves it to the device;
# 2. **forward**: the model computes the loss;
# 3. **backward**: autograd computes the gradients (with several ranks, DDP's all-reduce runs in here);
# 4. **optimizer**: `optimizer.step()` and `optimizer.zero_grad()`.
#
# On a GPU all four are queued on one stream, the *default stream*, which runs them in order; on a
# CPU they run on one thread. Each phase starts when the previous one ends, so a step takes the
# **sum** of its parts, plus the gaps between them. That is the baseline the rest of the course
# improves on, and the first rule of improving it is: **measure phases, not steps**. A step time
# alone says nothing about which part could hide behind which.
#
# The second rule: **on a GPU the host clock lies**. `time.perf_counter()` around `model(x)` measures
# how long the host took to *queue* the kernels, not how long they ran. Either synchronize before
# reading the clock (`torch.accelerator.synchronize()`, which changes what you measure: the host
# stops running ahead), or record `torch.Event(enable_timing=True)` on the stream and read
# `start.elapsed_time(end)` later. hfstream's `StepTimeline` does the latter. On this course's CPU
# machine, the host clock is the truth.

# %%
import contextlib, math, os, queue, threading, time
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from course.lib import *

import tempfile

import datasets
from hfstream import StreamTrainer, StreamTrainingArguments
from hfstream.cli.plot import plot_breakdown, plot_timeline

# %% [markdown]
# ## A Trainer run, timed phase by phase
#
# `StreamTrainer` is `transformers.Trainer` plus hfstream's step report. With `prefetch_depth=0`
# (no prefetching) and `grad_sync="native"` (gradients handled exactly as Accelerate would) it
# trains **exactly like the stock Trainer**; the only addition is a `StepTimeline` that marks the
# phases of every optimizer step from a few well-placed hooks:
#
# | mark | where in the Trainer |
# |---|---|
# | step begins, data ready | around `Trainer.get_batch_samples` (the loader's `next`) |
# | forward starts / ends | start of `training_step` / a forward hook on the model |
# | backward ends | end of `training_step` (which calls `accelerator.backward`) |
# | optimizer ends | the `on_step_end` callback, after `optimizer.step()` and `zero_grad()` |
#
# The model is built from a config (no download), the data is random tokens, and everything runs
# on the CPU: `use_cpu=True`, `report_to=[]` (no logging service), a dozen steps.

# %%
SEQ, BATCH, STEPS = 32, 8, 10
gen = torch.Generator().manual_seed(0)
ids = torch.randint(0, 257, (BATCH * STEPS, SEQ), generator=gen)
train_ds = datasets.Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})

args = StreamTrainingArguments(
    output_dir=tempfile.mkdtemp(prefix="lesson01-"),
    prefetch_depth=0, grad_sync="native",          # = the stock Trainer: one stream, nothing overlapped
    max_steps=STEPS, per_device_train_batch_size=BATCH, learning_rate=1e-3, seed=0,
    use_cpu=True, report_to=[], logging_steps=STEPS // 2, save_strategy="no", disable_tqdm=True,
    dataloader_num_workers=0,
)
trainer = StreamTrainer(model=tiny_gpt2(layers=2, width=64), args=args, train_dataset=train_ds)
t0 = time.perf_counter()
trainer.train()
print(f"{STEPS} steps in {time.perf_counter() - t0:.2f} s of wall clock (with the Trainer's setup)")
report = trainer.stream_report()
print(report)

# %% [markdown]
# The dicts printed during training are the Trainer's own logs (every `logging_steps`); hfstream
# adds its `stream/*` keys to what the reporters receive, so TensorBoard or W&B would get the
# breakdown too, while `trainer.state.log_history` stays exactly the stock Trainer's. The table
# is `trainer.stream_report()`, averaged over the steps after the first.
#
# Read the table from the top. *data wait* is the time the step waited for its batch (here the
# loader collates on the main thread: `dataloader_num_workers=0`). *forward*, *backward* and
# *optimizer* are the compute. *comm* is n/a: one process has nothing to communicate. *step* is
# the wall time from the first mark to the last; it is a little more than the parts because the
# Trainer does bookkeeping between them (callbacks, loss accumulation, logging). The *ceiling* is
# lesson 00's formula, `forward + max(backward, comm) + optimizer`: data wait and the gaps are not
# in it, because a better pipeline could hide them. *efficiency* = ceiling / step.
#
# The same numbers as a picture, and the spans the timeline was drawn from:

# %%
show(plot_breakdown(report, figure_path("01_trainer_breakdown.png"),
                    title="stock Trainer step, one CPU process"))
print("the report's first spans (rank, lane, name, start s, end s):")
for span in report["spans"][:4]:
    print("  ", tuple(round(v, 4) if isinstance(v, float) else v for v in span))

# %% [markdown]
# ## Exercise 01.spans — a span recorder
#
# A **span** is one interval of a timeline: `(rank, lane, name, start, end)`, start and end in
# seconds. The *rank* says which process, the *lane* which kind of work (`"data"`, `"compute"`,
# `"comm"`: on a GPU, which stream), the *name* which phase. hfstream's timeline produces exactly
# these tuples, and `hfstream.cli.plot.plot_timeline(spans, path)` draws any list of them.
#
# Write `Spans.span(lane, name)`: a context manager (the `@contextlib.contextmanager` decorator is
# given) that reads `self.clock()` when the block starts and again when it ends, and appends
# `(self.rank, lane, name, start, end)` to `self.spans`. Two details matter:
#
# - use `self.clock`, not `time.perf_counter` directly: the check passes a fake clock, and a later
#   lesson could pass a device-event clock;
# - a block that raises must still leave its span (and the exception must still propagate): the step
#   that crashed is the one you most want to see on the timeline. `try: yield` / `finally:` does both.

# %%
class Spans:
    """Records ``(rank, lane, name, start, end)`` spans in seconds, the form `hfstream.report.timeline` uses.

    >>> rec = Spans()
    >>> with rec.span("compute", "forward"):
    ...     y = model(x)
    >>> rec.spans[-1]                     # (0, 'compute', 'forward', 8811.2034, 8811.2215)
    """

    def __init__(self, rank=0, clock=time.perf_counter):
        self.rank = rank
        self.clock = clock
        self.spans = []

    @contextlib.contextmanager
    def span(self, lane, name):
        """Time the ``with`` block on ``self.clock``; append one span when it ends, even if it raises."""
        # BEGIN SOLUTION
        start = self.clock()
        try:
            yield
        finally:
            self.spans.append((self.rank, lane, name, start, self.clock()))
        # END SOLUTION

# %%
check("01.spans")

# %% [markdown]
# ## Exercise 01.phases — instrument a training loop
#
# Now the loop the Trainer runs for you, written out. Write `train_loop` so that every phase of
# every step sits in its own span, with the lanes and names hfstream's `StepTimeline` uses (so the
# two timelines can be compared, and `plot_timeline` colours them):
#
# | phase | code | span |
# |---|---|---|
# | data | `batch = next(it)` | `("data", "data wait")` |
# | forward | `loss = model(**batch).loss` | `("compute", "forward")` |
# | backward | `loss.backward()` | `("compute", "backward")` |
# | optimizer | `optimizer.step(); optimizer.zero_grad()` | `("compute", "optimizer")` |
#
# A trap: `for batch in batches:` fetches the batch in the loop header, where no span can reach it.
# Take an iterator once (`it = iter(batches)`) and time `next(it)` yourself. Run exactly `steps`
# steps and return the losses (floats, or 0-d tensors). The check runs your loop on a probe model
# that notes when each phase really ran, so it can tell which of your spans covers which phase.

# %%
def train_loop(model, batches, optimizer, spans, steps):
    """Run ``steps`` optimizer steps over ``batches`` (an iterable of dicts); one span per phase.

    Args:
        model: returns an object with ``.loss`` when called as ``model(**batch)`` (any HF model).
        batches: an iterable of dicts (e.g. a DataLoader); it may hold more batches than needed.
        optimizer: a ``torch.optim`` optimizer over the model's parameters.
        spans: a recorder with ``span(lane, name)``, like `Spans`.
        steps: how many optimizer steps to run.

    Returns:
        The loss of every step, in order.
    """
    # BEGIN SOLUTION
    it = iter(batches)
    losses = []
    for _ in range(steps):
        with spans.span("data", "data wait"):
            batch = next(it)
        with spans.span("compute", "forward"):
            loss = model(**batch).loss
        with spans.span("compute", "backward"):
            loss.backward()
        with spans.span("compute", "optimizer"):
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.detach())
    return losses
    # END SOLUTION

# %%
check("01.phases")

# %% [markdown]
# ## Exercise 01.breakdown — from spans to a step report
#
# Spans are the raw material; a report averages them. Write `breakdown(spans, warmup=1)` returning
# the mean milliseconds **per step** of each phase, with the keys of hfstream's step report:
# `data_wait_ms`, `forward_ms`, `backward_ms`, `optimizer_ms`, and `step_ms`.
#
# - **Group** the spans into steps: sort them by start time (they arrive in the order their blocks
#   *close*), and start a new step at each `"data wait"` span.
# - **Skip** the first `warmup` steps: the first step pays one-time costs (memory allocation, lazy
#   initialisation, kernel selection on a GPU) that say nothing about the steady state.
# - Per step, **sum** each phase's `(end - start)` (with gradient accumulation a step holds several
#   forward and backward spans), then **average** over the kept steps, in milliseconds.
# - `step_ms` is the step's wall time: the last span's end minus the first span's start. It is more
#   than the sum of the parts: the gaps between phases are time the step really took.

# %%
def breakdown(spans, warmup=1):
    """Mean ms per step of each phase (and of the whole step) over the steps after ``warmup``.

    Args:
        spans: ``(rank, lane, name, start, end)`` tuples of one rank, seconds, any order.
        warmup: how many leading steps to leave out.

    Returns:
        ``{"data_wait_ms", "forward_ms", "backward_ms", "optimizer_ms", "step_ms"}`` -> float.
    """
    # BEGIN SOLUTION
    steps = []
    for s in sorted(spans, key=lambda s: s[3]):
        if s[2] == "data wait" or not steps:
            steps.append([])
        steps[-1].append(s)
    kept = steps[warmup:] or steps
    out = {}
    for name, key in (("data wait", "data_wait_ms"), ("forward", "forward_ms"),
                      ("backward", "backward_ms"), ("optimizer", "optimizer_ms")):
        out[key] = sum((s[4] - s[3]) * 1e3 for step in kept for s in step if s[2] == name) / len(kept)
    out["step_ms"] = sum((max(s[4] for s in step) - step[0][3]) * 1e3 for step in kept) / len(kept)
    return out
    # END SOLUTION

# %%
check("01.breakdown")

# %% [markdown]
# ## Measure: your loop against the Trainer
#
# The same model, the same data, the same batch size: once through your loop with your recorder,
# and compared with the Trainer's report above. The `DataLoader` collates on the main thread, like
# the Trainer's with `dataloader_num_workers=0`, so the data wait is real (if small).

# %%
def collate(examples):
    """Lists of token ids -> tensors, on the main thread (the data phase of every step)."""
    ids = torch.tensor([e["input_ids"] for e in examples])
    return {"input_ids": ids, "labels": ids.clone()}


loop_model = tiny_gpt2(layers=2, width=64)
loop_opt = torch.optim.AdamW(loop_model.parameters(), lr=1e-3)
loader = torch.utils.data.DataLoader(train_ds, batch_size=BATCH, collate_fn=collate)
rec = Spans()
losses = train_loop(loop_model, loader, loop_opt, rec, steps=STEPS)
mine = breakdown(rec.spans, warmup=1)
theirs = report["mean"]
print(f"{'':<14}{'your loop':>12}{'Trainer':>12}")
for key in ("data_wait_ms", "forward_ms", "backward_ms", "optimizer_ms", "step_ms"):
    print(f"{key:<14}{mine[key]:>12.2f}{theirs[key]:>12.2f}")
print(f"loss {float(losses[0]):.3f} -> {float(losses[-1]):.3f} over {STEPS} steps")

# %% tags=["hidden-check"]
parts = sum(mine[k] for k in ("data_wait_ms", "forward_ms", "backward_ms", "optimizer_ms"))
assert len(rec.spans) == 4 * STEPS and parts <= mine["step_ms"] + 1e-6, (parts, mine)
assert all(mine[k] > 0 for k in mine) and theirs["step_ms"] > 0
assert sorted({s[1] for s in rec.spans}) == ["compute", "data"]

# %% [markdown]
# The two columns should tell the same story, within the noise of a shared CPU. Two things to
# notice. First, for a model this tiny the forward is dominated by Python overhead (module calls,
# Hugging Face's input handling), so it may even come out longer than the backward; in a real
# model the backward takes about twice the forward, since it computes gradients with respect to
# both the activations and the weights. Second, the Trainer's numbers usually run a little
# higher: its forward span starts at `training_step` (input preparation, the autocast context)
# and its step also holds callbacks and loss bookkeeping. Run the cell again: the numbers move,
# the shape does not. That is why every report in this course averages steps after a warm-up.

# %% [markdown]
# ### On a GPU: the host clock measures launches
#
# The next cell times the same work three ways on a GPU: a host timer alone (only the launches),
# a host timer after `torch.accelerator.synchronize()` (the real time, but the host stopped running
# ahead), and device events (the real time, and the host never waited until it read them).

# %% tags=["gpu"]
# GPU: a host timer around forward reports only the launch time (a fraction of a millisecond), while a synchronized timer and torch.Event timing both report the real kernel time, many times longer.
dev = accelerator_device()
mlp = nn.Sequential(*[nn.Linear(4096, 4096, device=dev) for _ in range(8)])
x = torch.randn(4096, 4096, device=dev)
for _ in range(3):                                 # warm-up: allocation and kernel selection
    mlp(x).sum().backward()
torch.accelerator.synchronize()

t0 = time.perf_counter()
y = mlp(x)
host_only_ms = (time.perf_counter() - t0) * 1e3      # the host queued 8 matmuls and went on
torch.accelerator.synchronize()

t0 = time.perf_counter()
y = mlp(x)
torch.accelerator.synchronize()
synced_ms = (time.perf_counter() - t0) * 1e3

start, end = torch.Event(enable_timing=True), torch.Event(enable_timing=True)
start.record()
y = mlp(x)
end.record()
end.synchronize()                                   # only now does the host wait, to read the result
print(f"host timer only {host_only_ms:.3f} ms | host timer + synchronize {synced_ms:.3f} ms | "
      f"events {start.elapsed_time(end):.3f} ms")

# %% [markdown]
# ### The figure: one stream, one lane at a time
#
# Your loop's last four steps, drawn from your spans. Every bar starts where the previous one
# ends: while the batch is fetched nothing computes, and while the model computes the next batch
# waits. The data lane is nearly empty here: collating random tokens takes a fraction of a
# millisecond, so its slivers hardly show. Lesson 03 gives the loader a realistic, slow collate,
# and then this lane is the one to hide. Lesson 02 introduces the tool that lets two lanes work at once (streams and events), and
# lesson 03 uses it to move the data lane under the compute lane.

# %%
last_four = sorted(rec.spans, key=lambda s: s[3])[-16:]
show(plot_timeline(last_four, figure_path("01_single_stream.png"),
                   title="your training loop, last 4 steps: one stream, every phase waits for the previous"))

# %% [markdown]
# ## What you have now
#
# - a span recorder whose tuples are hfstream's, and `plot_timeline` to draw them;
# - a loop timed phase by phase, and a breakdown that agrees with the Trainer's report;
# - the baseline: on one stream a step is the sum of its parts, gaps included.
#
# Next, lesson 02: streams and events, the real APIs that let a copy and a kernel run at once, and
# the races you get when you use them carelessly.
