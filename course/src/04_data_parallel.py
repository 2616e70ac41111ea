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
# initialises gloo in each, runs `fn(rank, world_size, ...)` and returns every rank's result.
#
# **What a rank sees of this notebook.** A new process cannot receive a function defined in a
# notebook, so the functions are written to a file that each rank imports. The file holds:
#
# 1. the course's standard imports, the ones the first code cell below starts with (`contextlib`,
#    `math`, `os`, `queue`, `threading`, `time`, `torch`, `nn`, `F`, `dist`, and all of
#    `course.lib`), not the rest of that cell;
# 2. the **cells that define the functions handed over**: for `on_ranks(fn, ..., also=[g, h])`, the
#    cell of `fn` and the cells of `g` and `h`; for a check, the cells that define the names the
#    exercise lists (04.average_gradients: `broadcast_parameters`, `average_gradients`;
#    04.train_parity: `train_data_parallel` and `sgd_step`, **and** the cell of 04.average_gradients,
#    whose two functions your training loop calls);
# 3. of each such cell, only its definitions: imports, `def`, `class`, and assignments whose calls
#    reach only builtins, imported names or `course.lib` (`SCALE = 2.0`, `model = TinyMLP()`). A
#    call you left in the cell (`print(...)`, a test run, `out = train(...)`) stays behind, so it
#    does not run again, or spawn ranks of its own, in every rank.
#
# Anything else (a helper in another cell, a variable set by running a cell) does not exist in the
# ranks: put a helper in the same cell as the function that calls it.

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
# Write the two functions every data-parallel trainer is built on. Every rank calls each of them,
# at the same point of its program. What they must do:
#
# | function | called | afterwards, on every rank |
# |---|---|---|
# | `broadcast_parameters(model)` | once, before the first step | each parameter of *this rank's* `model` holds rank 0's values (the same model object, not a new one) |
# | `average_gradients(model)` | after `loss.backward()` | each parameter's `.grad` holds the mean of that gradient over the ranks; the parameters themselves are unchanged; a parameter without a gradient (`.grad is None`: frozen, or unused) is left as it is |
#
# What you need to know about the collectives, beyond the table above (their whole interface here):
#
# - a collective writes **in place** into the tensor you pass it, so the result lands only where
#   the tensor's storage is: a copy gets the result and is thrown away;
# - autograd refuses in-place writes into a tensor it tracks, such as a parameter that requires
#   grad ("a leaf Variable that requires grad is being used in an in-place operation");
#   `p.data` is the same storage without autograd's tracking, and `torch.no_grad()` turns the
#   tracking off for a block;
# - there is no mean on every backend (`ReduceOp.AVG` exists on NCCL and recent gloo only): build
#   it from the sum the table gives you.
#
# DDP also broadcasts the buffers (BatchNorm's running statistics); `TinyMLP` has none. The check
# runs your two functions on two ranks whose models were built with different seeds and whose
# gradients differ, and says which of the behaviours above is missing.
#
# Once it passes, think about the cost of your scheme: how many messages per step, and when the
# first one can start. Lesson 05 starts each gradient's reduction as soon as backward produces it,
# lesson 06 packs small gradients into buckets.

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
# Write `train_data_parallel(model, x, y, steps, lr)`: data-parallel training with the two
# functions of 04.average_gradients.
#
# **Interface.** It runs on every rank of an initialised group (`dist.get_rank()`,
# `dist.get_world_size()`). `model` is a `TinyMLP` that this rank built itself, **with its own
# seed**, as independent processes do (the check builds rank r's with `TinyMLP(seed=r)`). `x, y`
# is the whole batch, the same on every rank, as if each rank could read the dataset. It trains
# for `steps` steps of MSE loss with `sgd_step(model, lr)` (given below) and returns a list of
# `steps` floats: this rank's loss at each step.
#
# **Behaviour the check measures** (on two gloo processes):
#
# - the reference is one process training `TinyMLP(seed=0)` on the whole batch with the ordinary
#   loop: each step's gradient starts from zero, then the loss, backward, `sgd_step`;
# - after your run every rank holds the same parameters, equal to the reference's within
#   $10^{-5}$;
# - each rank computes its loss and gradient on **its own shard** only: `world_size` equal,
#   disjoint parts of the batch, rank 0's made of the first rows (so the mean of the two ranks'
#   first losses is the reference's first loss);
# - the losses returned are this rank's own shard losses, not an average over ranks.
#
# The math at the top of the lesson says what each rank must add to the ordinary loop so that
# every rank takes the reference's step; the design is yours. Your function may call
# `sgd_step`, `broadcast_parameters` and `average_gradients`: the ranks get this cell and the cell
# of 04.average_gradients (see "What a rank sees of this notebook" above).
#
# `sgd_step` is plain SGD, `p -= lr * p.grad`: what `torch.optim.SGD(params, lr)` does without
# momentum. It is written out because a process that builds its first `torch.optim` optimizer
# spends seconds importing `torch._dynamo`, and the checks start fresh processes; in a real
# script, use `torch.optim`.

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
# `record_run` runs on both ranks, so `on_ranks` is handed the functions it calls
# (`also=[train_data_parallel, average_gradients]`: their cells carry `sgd_step` and
# `broadcast_parameters` along). It trains with your `train_data_parallel` one step at a time
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
