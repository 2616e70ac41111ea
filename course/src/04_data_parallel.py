# %% [markdown]
# # Lesson 04 — Data parallel from scratch
#
# **Time:** 40 minutes. **Runs on:** any laptop (two gloo processes on the CPU). **You will:** run
# collectives in two real processes, write the two functions data parallelism is made of
# (broadcast the starting weights, average the gradients after backward), train on two ranks and
# show that the result equals one process trained on the full batch, step for step; then measure
# the all-reduce that every step now waits for, which lesson 05 hides behind backward.
#
# ## Why averaging gradients is exact
#
# Take a batch of $B$ examples and a loss that is their mean, $L = \frac{1}{B}\sum_i \ell_i$. Split
# the batch into $W$ shards of $B/W$ examples, one per process (a *rank*), and let $L_r$ be the
# mean loss of shard $r$. Then
#
# $$L = \frac{1}{W}\sum_{r} L_r \qquad\Rightarrow\qquad \nabla L = \frac{1}{W}\sum_r \nabla L_r .$$
#
# Each rank computes $\nabla L_r$ on its shard, at the same time as the others; an **all-reduce**
# sums the $W$ gradients and leaves the sum on every rank; dividing by $W$ gives every rank the
# full batch's gradient. Every rank then takes the *same* optimizer step from the *same* weights,
# so the replicas stay identical without ever sending the weights again. Three conditions, and
# each one is a classic bug when it is missing:
#
# 1. **the same start**: each process builds its own model, so rank 0's weights are
#    **broadcast** to all before the first step (DDP does it in its constructor);
# 2. **the mean, not the sum**: `all_reduce` sums; without the division every step is $W$ times
#    too large, as if the learning rate grew with the number of GPUs;
# 3. **equal, disjoint shards** with a mean loss: then the mean of the shard means is the full
#    batch's mean (`DistributedSampler` hands each rank its own indices).
#
# The result matches one process up to the order of floating-point additions (about $10^{-7}$
# relative in float32), and this lesson measures exactly that.
#
# ## Processes, ranks, collectives
#
# `torchrun --nproc-per-node 2 train.py` (or `accelerate launch --num_processes 2 train.py`) starts
# two processes and gives each `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR` and `MASTER_PORT`;
# each one calls `dist.init_process_group("gloo")` (`"nccl"` on GPUs, one GPU per rank) and then:
#
# | call | on every rank, in place |
# |---|---|
# | `dist.all_reduce(t)` | `t` becomes the sum of every rank's `t` (`op=dist.ReduceOp.SUM`, the default) |
# | `dist.broadcast(t, src=0)` | `t` becomes rank 0's `t` |
# | `dist.get_rank()`, `dist.get_world_size()` | who am I, how many are we |
#
# A collective completes only when **every** rank has called it, in the same order: one that only
# some ranks reach waits forever (here, until the group's timeout).
#
# In this notebook, `on_ranks(fn, 2, ...)` does what `torchrun` does: it starts two processes,
# initialises gloo in each, runs `fn(rank, world_size, ...)` and returns every rank's result. A new
# process cannot receive a function defined in a notebook, so `on_ranks` writes the cell that
# defines `fn` to a file that each rank imports (the checks below do the same with your exercise
# cells). So a function that runs on the ranks may use only its own cell's definitions and the
# imports at the top of the notebook; keep such cells to definitions.

# %%
import contextlib, math, os, queue, threading, time
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from course.lib import *
from course.checks.lesson04 import on_ranks

torch.set_num_threads(1)     # the ranks run one compute thread each, on this machine's 2 cores

# %%
def hello_collectives(rank, world_size):
    t = torch.full((3,), float(rank + 1))
    dist.all_reduce(t)                          # every rank: the sum over ranks, 1 + 2
    w = torch.full((2,), float(10 * (rank + 1)))
    dist.broadcast(w, src=0)                    # every rank: rank 0's tensor
    return f"rank {dist.get_rank()} of {dist.get_world_size()}: all_reduce -> {t.tolist()}, broadcast -> {w.tolist()}"

# %%
for line in on_ranks(hello_collectives, 2):
    print(line)

# %% [markdown]
# ## Exercise 04.average_gradients — the same start, the mean gradient
#
# Write the two functions every data-parallel trainer is built on. Both run on every rank.
#
# - `broadcast_parameters(model)`: every parameter becomes rank 0's. Broadcast `p.data` (or work
#   under `torch.no_grad()`): a collective writes into the tensor in place, and autograd may refuse
#   in-place writes into a parameter that requires grad (`dist.all_reduce(p)` raises "a leaf
#   Variable that requires grad is being used in an in-place operation"). DDP broadcasts the
#   buffers too, e.g. BatchNorm's running statistics; `TinyMLP` has none.
# - `average_gradients(model)`, called after `loss.backward()`: every `p.grad` becomes the mean over
#   ranks. `dist.all_reduce` sums in place, then divide by `dist.get_world_size()` (NCCL, and gloo in
#   recent PyTorch, also offer `op=dist.ReduceOp.AVG`; sum-then-divide works on every backend).
#   Reduce the gradients, **not** the parameters, and skip parameters whose `.grad` is `None` (a
#   frozen layer has none).
#
# One `all_reduce` per parameter, all after backward, is the simplest correct scheme. It is also
# the slowest: many small messages (lesson 06 packs them into buckets) and none of them starts
# before backward has finished (lesson 05 starts each one as soon as its gradient exists).

# %%
def broadcast_parameters(model):
    """Make every rank's parameters equal to rank 0's (call once, before the first step)."""
    # BEGIN SOLUTION
    for p in model.parameters():
        dist.broadcast(p.data, src=0)
    # END SOLUTION


def average_gradients(model):
    """After backward: make every parameter's .grad the mean of that gradient over all ranks."""
    # BEGIN SOLUTION
    world_size = dist.get_world_size()
    for p in model.parameters():
        if p.grad is None:
            continue
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
        p.grad /= world_size
    # END SOLUTION

# %%
check("04.average_gradients")

# %% [markdown]
# ## Exercise 04.train_parity — train on two ranks, match one process
#
# Write `train_data_parallel(model, x, y, steps, lr)`, which runs on every rank:
#
# - every rank receives the whole batch `x, y` (as if each could read the dataset) and a model it
#   built itself, **with its own seed** (as independent processes do: the check builds rank r's
#   model with `TinyMLP(seed=r)`);
# - take this rank's shard: `x.chunk(world_size)[rank]` and the same rows of `y` (rank 0 the first
#   half, rank 1 the second);
# - broadcast the parameters, then train for `steps` steps: zero the gradients
#   (`model.zero_grad()`), `F.mse_loss(model(x_shard), y_shard)`, backward, average the gradients,
#   and `sgd_step(model, lr)`;
# - return the list of this rank's own shard losses (`loss.item()` of every step).
#
# `sgd_step` (given, above your function) is plain SGD, `p -= lr * p.grad`: what
# `torch.optim.SGD(params, lr)` does without momentum. It is written out because a process that
# builds its first `torch.optim` optimizer spends seconds importing `torch._dynamo`, and
# the checks start fresh processes; in a real script, use `torch.optim`.
#
# The check runs it on two gloo processes and trains one process on the full batch with the same
# SGD: the ranks must agree with each other, their shards must differ, and the final parameters
# must match the single process's within $10^{-5}$.

# %%
def sgd_step(model, lr):
    """Plain SGD (torch.optim.SGD without momentum): p -= lr * p.grad for every parameter with a gradient."""
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= lr * p.grad


def train_data_parallel(model, x, y, steps, lr):
    """Data-parallel SGD on this rank's shard of (x, y); returns this rank's loss at every step."""
    # BEGIN SOLUTION
    rank, world_size = dist.get_rank(), dist.get_world_size()
    x_shard, y_shard = x.chunk(world_size)[rank], y.chunk(world_size)[rank]
    broadcast_parameters(model)                 # the same start on every rank
    losses = []
    for _ in range(steps):
        model.zero_grad()                       # backward adds to .grad
        loss = F.mse_loss(model(x_shard), y_shard)
        loss.backward()
        average_gradients(model)                # every rank: the full batch's gradient
        sgd_step(model, lr)                     # so every rank takes the same step
        losses.append(loss.item())              # this rank's shard loss
    return losses                               # one per step
    # END SOLUTION

# %%
check("04.train_parity")

# %% [markdown]
# ## Measure: parity step by step, and what the all-reduce costs
#
# `record_run` runs on both ranks. It trains with your `train_data_parallel` one step at a time
# (plain SGD keeps no state between steps, so 30 calls of one step are one run of 30 steps; each
# call broadcasts again, which changes nothing once the ranks agree) and keeps every step's loss
# and parameters. Then it times a larger model's step part by part: forward, backward, and your
# `average_gradients` after backward, the *serial* scheme. Below it, the same 30 steps in one
# process on the full batch.

# %%
def record_run(rank, world_size, steps, lr):
    x, y = random_regression(n=32, dim=32, seed=3)
    model = TinyMLP(seed=rank)
    losses, params = [], []
    for _ in range(steps):
        losses += train_data_parallel(model, x, y, steps=1, lr=lr)
        params.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    big = TinyMLP(dim=256, hidden=768, layers=6, seed=0)           # 2.8 M parameters, 11 MB of gradients
    bx, by = random_regression(n=64, dim=256, seed=rank)
    parts = []
    for _ in range(5):
        t0 = time.perf_counter()
        loss = F.mse_loss(big(bx), by)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        average_gradients(big)
        t3 = time.perf_counter()
        big.zero_grad()
        parts.append(((t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3))
    return losses, params, parts[1:]                                 # the first step warms up

# %%
STEPS, LR = 30, 0.2
ranks = on_ranks(record_run, 2, STEPS, LR, also=[train_data_parallel, average_gradients])

x, y = random_regression(n=32, dim=32, seed=3)
ref_model = TinyMLP(seed=0)                      # one process, the full batch, the same SGD
ref_losses, ref_params = [], []
for _ in range(STEPS):
    ref_model.zero_grad()
    loss = F.mse_loss(ref_model(x), y)
    loss.backward()
    sgd_step(ref_model, LR)
    ref_losses.append(loss.item())
    ref_params.append(torch.cat([p.detach().reshape(-1) for p in ref_model.parameters()]))

(losses0, params0, parts0), (losses1, params1, parts1) = ranks
gap_ref = [float((a - b).abs().max()) for a, b in zip(params0, ref_params)]
gap_ranks = [float((a - b).abs().max()) for a, b in zip(params0, params1)]
print(f"after {STEPS} steps: rank 0 vs one process: max |difference| {gap_ref[-1]:.2g} "
      f"(largest over all steps {max(gap_ref):.2g}); rank 0 vs rank 1: {max(gap_ranks):.2g}")

# %% [markdown]
# ### The figure: one process and two ranks, step by step
#
# Left: the shard losses differ (each rank sees different examples) but their mean lies on the
# single process's curve. Right: how far rank 0's parameters are from the single process's after
# each step, on a log scale, against float32's machine epsilon: the ranks add the same numbers in a
# different order, nothing more. Forget the division, the broadcast or the all-reduce (try it), and
# the right panel jumps by orders of magnitude.

# %%
from matplotlib.figure import Figure

steps = list(range(1, STEPS + 1))
fig = Figure(figsize=(10, 3.4))
ax1, ax2 = fig.subplots(1, 2)
ax1.plot(steps, ref_losses, color="#4c72b0", linewidth=4, alpha=0.4, label="1 process, full batch")
ax1.plot(steps, [(a + b) / 2 for a, b in zip(losses0, losses1)], "--", color="#c44e52", label="2 ranks: mean of shard losses")
ax1.plot(steps, losses0, ":", color="#55a868", label="rank 0's shard")
ax1.plot(steps, losses1, ":", color="#8172b2", label="rank 1's shard")
ax1.set_xlabel("step")
ax1.set_ylabel("MSE loss")
ax1.set_title("loss", fontsize=10)
ax1.legend(fontsize=8)
ax2.semilogy(steps, [max(g, 1e-12) for g in gap_ref], marker="o", markersize=3, label="max |rank 0 - 1 process|")
ax2.axhline(torch.finfo(torch.float32).eps, color="#c44e52", linestyle="--", label="float32 epsilon")
ax2.set_ylim(1e-12, max(1e-3, 10 * max(gap_ref)))
ax2.set_xlabel("step")
ax2.set_ylabel("parameter difference")
ax2.set_title("parameters: data parallel vs one process", fontsize=10)
ax2.legend(fontsize=8)
fig.tight_layout()
fig.savefig(figure_path("04_parity.png"), dpi=110)
show(figure_path("04_parity.png"))

# %% tags=["hidden-check"]
assert max(gap_ref) < 1e-5 and max(gap_ranks) < 1e-7, (max(gap_ref), max(gap_ranks))
assert abs((losses0[0] + losses1[0]) / 2 - ref_losses[0]) < 1e-5

# %% [markdown]
# ### What every step now waits for
#
# The larger model's step, part by part (median over four steps, mean of the two ranks). The
# all-reduce starts only once backward has finished, so it adds to every step. Lesson 00's ceiling
# says it could hide behind backward: `forward + max(backward, comm)`, the dashed line. On this
# laptop gloo moves the 11 MB over loopback with the same two cores that compute, so the ratio is
# not a GPU cluster's; the shape (a serial step pays for every byte) is the same.

# %%
import statistics

def median_parts(parts):
    return [statistics.median(p[i] for p in parts) for i in range(3)]

fwd, bwd, comm = [(a + b) / 2 for a, b in zip(median_parts(parts0), median_parts(parts1))]
print(f"forward {fwd:.1f} ms, backward {bwd:.1f} ms, all-reduce {comm:.1f} ms: serial step {fwd + bwd + comm:.1f} ms, "
      f"ceiling {fwd + max(bwd, comm):.1f} ms")
show(bar_chart({"forward": fwd, "backward": bwd, "all-reduce\n(after backward)": comm, "serial step": fwd + bwd + comm},
               figure_path("04_serial_step.png"), title="2 ranks, 2.8 M parameters: the serial all-reduce adds to the step",
               reference=fwd + max(bwd, comm), reference_label="forward + max(backward, comm)"))

# %% [markdown]
# ## What you have now
#
# - collectives in two real processes: `all_reduce`, `broadcast`, and the rule that every rank
#   calls them in the same order;
# - the two functions that make data parallelism: broadcast the start, average the gradients;
# - a two-rank training run that equals one process on the full batch to float32 precision;
# - the cost that remains: an all-reduce that waits for the whole backward.
#
# The library's version of your two functions is `hfstream.GradSync(model, mode="serial")`: its
# constructor broadcasts rank 0's parameters and buffers, and `sync.finish()` after backward leaves
# the mean gradient in every `.grad` (with buckets, lesson 06). Lesson 05 switches it to
# `mode="overlap"`: each gradient's all-reduce starts from a hook the moment backward produces it.
