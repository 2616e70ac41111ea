# %% [markdown]
# # Lesson 00 — The map
#
# **Time:** 30 minutes. **Runs on:** any laptop (CPU). **You will:** learn what "stream-based
# training" really means, sort the real APIs from the invented ones by asking the installed
# packages, and write the formula every later lesson is measured against: the step's *ceiling*.
#
# ## Three things a training step waits for
#
# A data-parallel training step does three kinds of work:
#
# | work | runs on (GPU) | runs on (this course's CPU laptop) |
# |---|---|---|
# | **data**: fetch, collate, copy host → device | a copy engine, driven from a *side stream* | a background thread |
# | **compute**: forward, backward, optimizer | the *default (compute) stream* | the main thread |
# | **communication**: average gradients over ranks | NCCL's own internal stream | gloo's threads, over TCP |
#
# On a GPU a *stream* is an ordered queue of work; work on different streams may run at the same
# time, and *events* order one stream after a point in another. "Stream-based training" is no more
# (and no less) than keeping all three kinds of work busy at once: the next batch is copied while
# this one computes, and each gradient bucket is averaged while backward still produces the next.
#
# Nothing new is needed from PyTorch for that. Every job has a real, documented API:
#
# | job | the real API |
# |---|---|
# | a side stream, and ordering between streams | `torch.cuda.Stream` / device-agnostic `torch.Stream`, `stream.wait_stream(other)`, `torch.Event` + `event.wait(stream)` |
# | copies that do not block the host | `tensor.pin_memory()` then `tensor.to(device, non_blocking=True)` |
# | keeping memory alive for another stream | `tensor.record_stream(stream)` |
# | start a reduction and keep computing | `torch.distributed.all_reduce(t, async_op=True)` returns a `Work`; `work.wait()` later |
# | know when a gradient is ready | `param.register_post_accumulate_grad_hook(fn)` |
# | skip sync on accumulation steps | `DistributedDataParallel.no_sync()`; Accelerate's `accumulate` |
# | bucket size | `DistributedDataParallel(bucket_cap_mb=...)`; Trainer's `ddp_bucket_cap_mb` |
# | launch N processes | `torchrun --nproc-per-node N`, `accelerate launch --num_processes N` |
#
# ## The invented ones
#
# Popular write-ups about "stream training" cite APIs that **do not exist**:
# `torch.distributed.stream`, a `--stream` flag of `torchrun`, `ncclStreamCreate`/`ncclStreamWait`,
# Horovod's `--allreduce_batch_size`, a Trainer `stream_scheduler` argument, TensorRT-LLM
# `stream_balance`, tf.data `stream_mode`. Code that calls them fails; advice built on them is
# wrong. Do not take this lesson's word for it either: the next cell asks the installed packages.

# %%
import contextlib, math, os, queue, threading, time
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from course.lib import *
from course.checks.lesson00 import api_exists

for spec in ["torch.Stream", "torch.Event", "torch.Tensor.record_stream", "torch.Tensor.pin_memory",
             "torch.Tensor.register_post_accumulate_grad_hook", "torch.distributed.all_reduce",
             "torch.distributed.stream", "torchrun --nproc-per-node", "torchrun --stream",
             "transformers.TrainingArguments.ddp_bucket_cap_mb",
             "transformers.TrainingArguments.stream_scheduler"]:
    print(f"{'exists ' if api_exists(spec) else 'MISSING'}  {spec}")

# %% [markdown]
# ## Exercise 00.real_apis — ask the packages, not the blog posts
#
# Fill `is_real` with `True` or `False` for every name. `api_exists(spec)` (imported above)
# resolves a dotted name by importing and `getattr`, a `torchrun --flag` by reading torchrun's own
# argument parser, and a `TrainingArguments` field by reading the dataclass. You may reason, or
# call it: either way, the check compares your answers with the installed packages.

# %%
is_real = {
    "torch.cuda.Stream": None,
    "torch.Tensor.record_stream": None,
    "torch.distributed.stream": None,
    "torch.distributed.all_reduce": None,
    "torch.Tensor.register_post_accumulate_grad_hook": None,
    "torchrun --stream": None,
    "torchrun --nproc-per-node": None,
    "transformers.TrainingArguments.stream_scheduler": None,
    "transformers.TrainingArguments.dataloader_pin_memory": None,
    "torch.nn.parallel.DistributedDataParallel.no_sync": None,
}
# BEGIN SOLUTION
is_real = {name: api_exists(name) for name in is_real}
# END SOLUTION

# %%
check("00.real_apis")

# %% [markdown]
# ## The ceiling
#
# A data-parallel step is *data wait + forward + backward + exposed communication + optimizer*.
# Three facts decide the best achievable step time:
#
# 1. **Data can be hidden completely**: the next batch can be prepared while this step computes.
# 2. **Communication can hide only behind backward**: a gradient exists only once backward has
#    produced it, and the optimizer needs all of them averaged. Forward and optimizer cannot hide it.
# 3. **Compute cannot hide behind anything**: it is the work itself.
#
# So the ceiling (best achievable step) is
#
# $$\text{ideal} = \text{forward} + \max(\text{backward},\ \text{comm\_busy}) + \text{optimizer}$$
#
# where `comm_busy` is the time the reductions need on their own. The report of every later lesson
# divides: `efficiency = ideal / step`, and `overlap = 1 - exposed_comm / comm_busy`.
#
# ## Exercise 00.ceiling — write the formula
#
# `ceiling_ms` takes a step's measured parts (milliseconds) and returns the ideal step time.
# `efficiency` returns `ideal / step`. Every argument is a plain float.

# %%
def ceiling_ms(data_wait_ms, forward_ms, backward_ms, comm_busy_ms, optimizer_ms):
    """The best achievable step: data hidden, communication hidden behind backward only."""
    # BEGIN SOLUTION
    return forward_ms + max(backward_ms, comm_busy_ms) + optimizer_ms
    # END SOLUTION


def efficiency(step_ms, data_wait_ms, forward_ms, backward_ms, comm_busy_ms, optimizer_ms):
    """How close a measured step came to its ceiling: ideal / step (1.0 = at the ceiling)."""
    # BEGIN SOLUTION
    return ceiling_ms(data_wait_ms, forward_ms, backward_ms, comm_busy_ms, optimizer_ms) / step_ms
    # END SOLUTION

# %%
check("00.ceiling")

# %% [markdown]
# ## Exercise 00.predict — predict a step's ceiling, then measure it
#
# Below, a small GPT-2 (built from a config, no download) takes one training step on this
# machine, and we time forward, backward and the optimizer. Suppose it trained on 8 ranks over a
# 10 Gbit/s link: a ring all-reduce moves $2(N-1)/N$ times the gradient bytes per rank, so
# `comm_busy` is that over the link's bytes per second.
#
# Write `predict_comm_ms(grad_bytes, world_size, link_gbit_s)` (milliseconds, latency ignored),
# then run the figure cell: it draws the serial step (every part added up) against your ceiling.

# %%
def predict_comm_ms(grad_bytes, world_size, link_gbit_s):
    """Ring all-reduce time in ms: 2 (N-1)/N x bytes over the link (bits per second / 8)."""
    # BEGIN SOLUTION
    if world_size <= 1:
        return 0.0
    return 2 * (world_size - 1) / world_size * grad_bytes / (link_gbit_s * 1e9 / 8) * 1e3
    # END SOLUTION

# %%
check("00.predict")

# %% [markdown]
# ### Measure: one step of a tiny GPT-2, timed phase by phase

# %%
model = tiny_gpt2(layers=4, width=128)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
ids = torch.randint(0, 257, (8, 64), generator=torch.Generator().manual_seed(0))


def timed_step():
    t0 = time.perf_counter()
    loss = model(input_ids=ids, labels=ids).loss
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    opt.step()
    opt.zero_grad()
    t3 = time.perf_counter()
    return {"forward": (t1 - t0) * 1e3, "backward": (t2 - t1) * 1e3, "optimizer": (t3 - t2) * 1e3}


timed_step()                                     # warm-up: first calls allocate and pick kernels
runs = [timed_step() for _ in range(5)]
parts = {k: sorted(r[k] for r in runs)[2] for k in runs[0]}   # the median of 5
grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
comm = predict_comm_ms(grad_bytes, world_size=8, link_gbit_s=10)
ideal = ceiling_ms(0.0, parts["forward"], parts["backward"], comm, parts["optimizer"])
serial = parts["forward"] + parts["backward"] + comm + parts["optimizer"]
print(f"{grad_bytes / 2**20:.1f} MiB of gradients; forward {parts['forward']:.1f} ms, "
      f"backward {parts['backward']:.1f} ms, optimizer {parts['optimizer']:.1f} ms, comm (predicted) {comm:.1f} ms")
print(f"serial step {serial:.1f} ms, ceiling {ideal:.1f} ms: overlap could save {serial - ideal:.1f} ms "
      f"({1 - ideal / serial:.0%})")

# %% [markdown]
# ### The figure: the serial step against its ceiling
#
# The bars add the parts up as a step with no overlap would; the dashed line is the ceiling.
# The gap between the last bar and the line is what the rest of this course wins back. On your
# laptop the numbers differ from the author's; the shape (comm hidden only behind backward) does
# not.

# %%
show(bar_chart({"forward": parts["forward"], "backward": parts["backward"], "comm (8 ranks, 10 Gb/s)": comm,
                "optimizer": parts["optimizer"], "serial step": serial},
               figure_path("00_ceiling.png"), title="one step, part by part, against its ceiling",
               reference=ideal))

# %% tags=["hidden-check"]
assert ideal <= serial and ideal >= parts["forward"] + parts["backward"] + parts["optimizer"] - 1e-9

# %% [markdown]
# ### On a GPU
#
# The same three parts exist on a GPU, in microseconds instead of milliseconds. The next cell
# times them with CUDA events (host timers would only measure the launch).

# %% tags=["gpu"]
# GPU: forward, backward and optimizer timed with device events; on an H100-class GPU each takes well under a millisecond for this model, so communication becomes the largest bar.
dev = accelerator_device()
gmodel = tiny_gpt2(layers=4, width=128).to(dev)
gopt = torch.optim.AdamW(gmodel.parameters(), lr=1e-3)
gids = ids.to(dev)
marks = [torch.Event(enable_timing=True) for _ in range(4)]
for _ in range(3):
    marks[0].record()
    gloss = gmodel(input_ids=gids, labels=gids).loss
    marks[1].record()
    gloss.backward()
    marks[2].record()
    gopt.step(); gopt.zero_grad()
    marks[3].record()
torch.accelerator.synchronize()
print({name: round(marks[i].elapsed_time(marks[i + 1]), 3) for i, name in enumerate(["forward", "backward", "optimizer"])})

# %% [markdown]
# ## What you have now
#
# - the real API for each job, and a way to check any claim against the installed packages;
# - the ceiling: `forward + max(backward, comm_busy) + optimizer`;
# - a first measured gap between a serial step and its ceiling.
#
# Next, lesson 01 measures a real Trainer step on one stream and draws where its time goes.
