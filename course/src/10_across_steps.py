# %% [markdown]
# # Lesson 10 — Across the step boundary
#
# **Time:** 70 minutes. **Runs on:** any laptop (CPU; 2 gloo processes for the measurements).
# **You will:** take an all-reduce apart into its two halves, build the first half yourself and
# measure it, write the optimizer step of a rank that owns only a slice of the model, make the
# forward wait for the second half layer by layer, and measure what that buys against DDP's best:
# the step's limit moves from `forward + max(backward, comm) + optimizer` to
# `max(forward + backward + optimizer/N, comm)`. Last, pipeline the optimizer step with the
# gathers, bucket by bucket, and measure when the parameters are complete.
#
# ## What DDP's ceiling leaves exposed
#
# Lesson 00 wrote the ceiling of a data-parallel step that overlaps its communication:
#
# $$\text{step} \ge \text{forward} + \max(\text{backward}, \text{comm}) + \text{optimizer}$$
#
# Buckets (lesson 06) let the all-reduce start during backward, so communication can hide under
# backward and *only* under backward: the optimizer needs the averaged gradients, so it waits for
# the last all-reduce; the next forward needs the updated parameters, so it waits for the
# optimizer. Forward and optimizer are always exposed, and lesson 09 showed where that bites: at
# scale `comm` grows past `backward`, and from there every extra millisecond of communication is
# a millisecond of step.
#
# The way out is to notice that the all-reduce is not one thing.
#
# ## An all-reduce is a reduce-scatter followed by an all-gather
#
# Cut each rank's gradient buffer (N·S elements) into N slices of S elements. The ring
# all-reduce (Patarasuk and Yuan, JPDC 2009; what NCCL and gloo run) does two passes:
#
# 1. **reduce-scatter**: afterwards rank r holds the *sum over all ranks of slice r*, and only
#    that: 1/N of the result. Each rank sends (N−1)/N of its buffer.
# 2. **all-gather**: each rank sends its finished slice to all the others; afterwards every rank
#    holds the whole result. Again (N−1)/N of the buffer per rank.
#
# Together, 2(N−1)/N of the buffer per rank, the `2(N-1)/N` of lesson 06's cost model. Nothing
# forces the two halves to run back to back. ZeRO (Rajbhandari et al., SC 2020, stage 1) and
# Megatron-LM's distributed optimizer split them: after the reduce-scatter, rank r has the mean
# gradient of slice r, which is all it needs to **step slice r of the parameters**; the
# all-gather then moves *parameters* instead of gradients, after the optimizer, and the next
# forward only has to wait for the layer it is about to run. The second half of the
# communication crosses the step boundary and hides under the next forward.
#
# You will build each piece: the reduce-scatter, the sharded step, the layer-by-layer wait.

# %%
import contextlib, math, os, queue, threading, time
import tempfile
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from course.lib import *

# %% [markdown]
# ## Exercise 10.reduce_scatter — the first half, from an all-to-all
#
# Write `reduce_scatter_mean(flat)`:
#
# - **in:** `flat`, a 1-D tensor of N·S elements: this rank's contribution (N is
#   `dist.get_world_size()`; the caller has padded it to a multiple of N). Slice j is
#   `flat[j*S:(j+1)*S]`.
# - **out:** S elements: the **mean over all ranks of slice `rank`** of their `flat`
#   (`rank` is `dist.get_rank()`).
# - **not allowed:** `dist.all_reduce` (that is the whole thing, twice the bytes) and
#   `dist.reduce_scatter_*` (the primitive you are building; on gloo it costs as much as a full
#   all-reduce, docs/design.md section 7). **Allowed:** `dist.all_to_all_single(output, input)`:
#   it cuts `input` into N equal chunks, sends chunk j to rank j, and fills chunk i of `output`
#   with what rank i sent; or the point-to-point `dist.isend` / `dist.irecv`, which return a
#   work to `wait()` on.
#
# Decide where the division by N goes, and keep the input's dtype. The check runs your function on
# 2, 3 and 4 ranks (threads of this process with an exchange that behaves like a process group and
# logs what each rank sent; measurements later use real gloo processes), with drawn slice sizes,
# float32, float64 and bfloat16 inputs, compares every rank's result with the mean of its slice and
# names what it got instead, then counts the bytes each rank put on the wire.

# %%
def reduce_scatter_mean(flat):
    """This rank's slice of the mean over the ranks of `flat`: the first half of an all-reduce.

    Args:
        flat: 1-D tensor of N*S elements, this rank's contribution.

    Returns:
        S elements: the mean over all ranks of slice `rank` (flat[rank*S:(rank+1)*S]).
    """
    # BEGIN SOLUTION
    n = dist.get_world_size()
    received = torch.empty_like(flat)
    dist.all_to_all_single(received, flat)        # chunk i of received: what rank i holds for my slice
    return received.view(n, -1).sum(0) / n
    # END SOLUTION

# %%
check("10.reduce_scatter")

# %% [markdown]
# ### Half the bytes: on a simulated link, and on the real loopback
#
# The check counted bytes. Time is what matters, so the next cell runs your function on **two
# real gloo processes** against `dist.all_reduce`, twice:
#
# - on a **simulated** 1 Gbit/s link. There is no real slow network on one laptop (as root,
#   `hfstream.cli.bench.netns` can rate-limit a real loopback; that needs privileges this
#   course does not assume). The simulation (`hfstream.testing.link.SimulatedLink`) runs every
#   transfer for real and then holds its completion until the bytes this rank sends would have
#   crossed a link of that bandwidth, one transfer after the other. What it leaves out:
#   per-message latency (a ring's 2(N−1) steps each pay one, so real small transfers cost more
#   than this), congestion and switches, and the CPU a real network card would take off the
#   host. On this link the bytes decide, by construction;
# - on the **real loopback, not shaped, not simulated**: two processes on this machine. Here
#   memory copies and gloo's own work decide, so the ratio can differ from the byte count.

# %%
from course.checks.lesson10 import measure_reduce_scatter, rs_figure

rs = measure_reduce_scatter(globals())
sim, real, pred = rs["simulated"], rs["loopback"], rs["predicted"]
print(f"measured with {rs['who']}")
print(f"simulated {rs['rate_mbit']:.0f} Mbit/s link, {sim['mib']:g} MiB: all_reduce {sim['all_reduce_ms']:.1f} ms, "
      f"reduce-scatter {sim['reduce_scatter_ms']:.1f} ms ({sim['reduce_scatter_ms'] / sim['all_reduce_ms']:.2f} x); "
      f"the byte model predicts {pred['all_reduce_ms']:.1f} and {pred['reduce_scatter_ms']:.1f} ms")
print(f"real loopback, {real['mib']:g} MiB: all_reduce {real['all_reduce_ms']:.1f} ms, "
      f"reduce-scatter {real['reduce_scatter_ms']:.1f} ms ({real['reduce_scatter_ms'] / real['all_reduce_ms']:.2f} x), "
      f"hfstream's with its buffers reused {real['preallocated_ms']:.1f} ms "
      f"({real['preallocated_ms'] / real['all_reduce_ms']:.2f} x)")

# %%
show(rs_figure(rs, figure_path("10_reduce_scatter.png")))

# %% [markdown]
# On the simulated link the reduce-scatter takes about half an all-reduce, as its bytes say (the
# black ticks): the simulation was built to make bytes decide. On the real loopback nothing was
# built to decide, and the lines above give this run's numbers. Compare your bar with the purple
# one: both put the same bytes on the wire, so a gap between them is memory work, not the wire:
# a fresh N·S-element buffer on every call, one more pass to divide, one to sum.
# `GradSync(mode="sharded")` allocates its buffers once per bucket and sums in place; its
# probe (`python -m dev.bench.collectives`, docs/design.md section 7) is why it uses
# all-to-all plus a local sum on gloo (gloo's own reduce-scatter costs a whole all-reduce there)
# and NCCL's real reduce-scatter on GPUs.
#
# ## The optimizer step of a rank that owns 1/N of the model
#
# After the reduce-scatter, rank r holds the mean gradient of slice r and nothing else. So it
# steps slice r of the parameters and nothing else: the optimizer does 1/N of the work
# (`optimizer/N` in the limit), and an AdamW keeps its two state tensors for 1/N of the
# parameters (ZeRO stage 1: optimizer state sharded, 1/N of its memory per rank).
#
# One part of the step is not local: **gradient clipping**. `clip_grad_norm_(max_norm)` scales
# the gradient by `max_norm / (total_norm + 1e-6)` when that is below 1, where `total_norm` is the
# 2-norm of the *whole* gradient. No rank has the whole gradient any more.
#
# ## Exercise 10.sharded_step — step your slice, clipped by the global norm
#
# Write `sharded_sgd_step(flat_params, grad_buffer, lr, max_norm)`:
#
# - `flat_params`: every parameter in one 1-D tensor of N·S elements, the same on every rank;
#   update it **in place**.
# - `grad_buffer`: N·S elements; only slice `rank` holds the mean gradient (what your
#   reduce-scatter returned). The other slices still hold this rank's own, unreduced
#   contributions: they are not the mean and must not count.
# - the step: plain SGD, `parameter -= lr * gradient`, with the gradient clipped exactly as
#   `torch.nn.utils.clip_grad_norm_(…, max_norm)` would clip the whole mean gradient;
# - **returns** the total norm before clipping, as a float, the same on every rank (what
#   `clip_grad_norm_` returns);
# - afterwards only slice `rank` of `flat_params` has changed: the other slices are their
#   owners' to step (the next exercise brings them back).
#
# The check runs 2 and 4 ranks whose slices have very different norms, once with clipping active
# and once with a `max_norm` it does not reach; then drawn cases: 2, 3 and 4 ranks, drawn slice
# sizes, float32 and float64, every rank read.

# %%
def sharded_sgd_step(flat_params, grad_buffer, lr, max_norm):
    """One clipped SGD step of a ZeRO-1 rank, on the slice of `flat_params` it owns.

    Args:
        flat_params: N*S parameters (the same on every rank); slice `rank` is stepped in place.
        grad_buffer: N*S elements; slice `rank` holds the mean gradient.
        lr: learning rate.
        max_norm: the whole gradient's 2-norm is clipped to this, as clip_grad_norm_ does.

    Returns:
        The whole gradient's 2-norm before clipping (a float, equal on every rank).
    """
    # BEGIN SOLUTION
    n, rank = dist.get_world_size(), dist.get_rank()
    size = flat_params.numel() // n
    mine = slice(rank * size, (rank + 1) * size)
    g = grad_buffer[mine]
    squares = g.double().pow(2).sum().reshape(1)   # the slices are disjoint: their squares add up
    dist.all_reduce(squares)
    norm = squares.sqrt().item()
    coef = min(1.0, max_norm / (norm + 1e-6))
    flat_params[mine].add_(g, alpha=-lr * coef)
    return norm
    # END SOLUTION

# %%
check("10.sharded_step")

# %% [markdown]
# ## The second half, waited for by the forward
#
# After the step each rank holds its own updated slice of every layer. An all-gather of each
# layer's slices gives every rank the whole updated layer. Launched right after
# `optimizer.step()`, asynchronously, the gathers travel while the next step begins; the forward
# needs layer 0 first, then layer 1, and so on. So each layer waits, just before it runs, for
# **its own** gather and no other: while layer 0 computes, the parameters of layers 1, 2, …
# are still on the wire. `module.register_forward_pre_hook(fn)` runs `fn(module, args)` just
# before the module's forward: the place for the wait.
#
# ## Exercise 10.gather_hook — one gather per layer, each waited for where it is needed
#
# Write `ParamGather(model)`, all of it. Its layers are the modules of `model` that own
# parameters directly, in `model.modules()` order (the forward order of a sequential model). What
# the rest of a sharded step relies on, and what the check uses:
#
# - `self.layers`: those modules;
# - `self.mine[i]`: a 1-D tensor, **this rank's slice of layer i**. Flatten the layer's parameters
#   one after the other (in `module.parameters(recurse=False)` order) and cut the result into N
#   equal slices, slice `rank` being this rank's. The sharded step writes this rank's updated
#   values into `mine[i]` (in place), then calls `launch()`. A layer's size need not divide by N
#   (the check's first layer has 63 values on 2 ranks): decide what the slices hold then. Keep
#   the values in the parameters' dtype (the check draws float64 models too);
# - `launch()`: start every layer's all-gather, asynchronously:
#   `dist.all_gather_single(output, input, async_op=True)` fills `output` (N times the size of
#   `input`) with every rank's `input`, in rank order, and returns a work to `wait()` on;
# - `wait_for(i)`: make layer i current: if its gather is in flight, the layer's parameters must
#   hold what it gathered before the layer runs; with nothing in flight (a second forward, an
#   evaluation), do nothing;
# - every layer's forward starts with `wait_for(i)`: `module.register_forward_pre_hook(fn)` runs
#   `fn(module, args)` just before the module's forward; `close()` removes what you registered.
#
# Which buffers you keep (the gather's output, views into it, the works in flight) is yours to
# lay out. The check runs 2 ranks through two steps and logs every launch, every wait and every
# layer's start; then drawn cases (2, 3 and 4 ranks, layer sizes N does not divide, float32 and
# float64), every rank read. A gather's output is only the result once its work is waited for (as on a real
# process group, where reading it earlier reads whatever is there; the check's ranks leave NaN).

# %%
class ParamGather:
    """The all-gather after a sharded step, waited for layer by layer by the forward.

    Args:
        model: every module of it that owns parameters directly is a layer, in
            ``model.modules()`` order.
    """

    def __init__(self, model):
        n, rank = dist.get_world_size(), dist.get_rank()
        self.layers = [m for m in model.modules() if list(m.parameters(recurse=False))]
        # BEGIN SOLUTION
        self.full, self.mine, self.views = [], [], []
        for m in self.layers:
            params = list(m.parameters(recurse=False))
            size = -(-sum(p.numel() for p in params) // n)        # S = ceil(numel / N): N slices cover it
            full = torch.zeros(size * n, dtype=params[0].dtype)    # the gather's output; the tail is padding
            views, offset = [], 0
            for p in params:
                views.append(full[offset:offset + p.numel()].view(p.shape))
                offset += p.numel()
            self.full.append(full)
            self.views.append(views)
            self.mine.append(full[rank * size:(rank + 1) * size].clone())
        self.works = [None] * len(self.layers)
        self.handles = [m.register_forward_pre_hook(lambda module, args, i=i: self.wait_for(i))
                        for i, m in enumerate(self.layers)]
        # END SOLUTION

    def launch(self):
        """Start every layer's all-gather, asynchronously (called right after the optimizer step)."""
        # BEGIN SOLUTION
        for i in range(len(self.layers)):          # forward order: layer 0's values arrive first
            self.works[i] = dist.all_gather_single(self.full[i], self.mine[i], async_op=True)
        # END SOLUTION

    def wait_for(self, i):
        """Make layer i current: its gather, if one is in flight, waited for and its values in the layer."""
        # BEGIN SOLUTION
        work, self.works[i] = self.works[i], None
        if work is None:
            return
        work.wait()
        with torch.no_grad():
            for p, v in zip(self.layers[i].parameters(recurse=False), self.views[i]):
                p.copy_(v)
        # END SOLUTION

    def close(self):
        """Remove what __init__ registered."""
        # BEGIN SOLUTION
        for h in self.handles:
            h.remove()
        self.handles = []
        # END SOLUTION

# %%
check("10.gather_hook")

# %% [markdown]
# ## The limit across the step boundary
#
# Put the pieces together. During backward each bucket is reduce-scattered as soon as it is
# ready (lesson 06's rule, half the bytes of before). After backward each rank clips with the
# global norm and steps its slice: `optimizer/N`. Then the all-gathers go out, and the next
# forward waits for each layer's just in time. Communication is one stream of transfers that
# never has to stop at the step boundary: reduce-scatters under backward, all-gathers under the
# next forward (and, when the link is the bottleneck, on under the next backward, ahead of its
# reduce-scatters). When the link is not the bottleneck, the compute is the step; when it is,
# the link is:
#
# $$\text{step} \ge \max(\text{forward} + \text{backward} + \text{optimizer}/N,\ \text{comm})$$
#
# with `comm` the same ring all-reduce's time as before (its two halves now run at different
# places in the step). Against DDP's `forward + max(backward, comm) + optimizer`, the forward
# and most of the optimizer have left the exposed path. This is what `GradSync(mode="sharded")`
# builds (docs/design.md section 7): your three pieces plus buckets, param groups, AdamW,
# re-planning, tied parameters and errors that say what to do.
#
# ### Measured: DDP's best, overlap, sharded, and the limit
#
# The next cell trains a tiny GPT-2 on 2 gloo processes with hfstream's `GradSync` in
# `"overlap"` mode (lesson 06's buckets) and in `"sharded"` mode, with AdamW and clipping at
# 1.0, on the same **simulated** link as above (`hfstream.testing.link.SimulatedLink`: bandwidth
# only, no latency). It runs in rounds: each round first times a few steps with no
# communication at all (forward, backward, optimizer: the parts DDP's best and the limit are
# computed from), sizes the link from them, then runs a block of consecutive steps of each mode
# on each link, in an order shuffled every round. Two links: one on which an all-reduce of every
# gradient takes as long as forward + backward (where DDP's ceiling is fully exposed and the
# sharded limit is compute-bound again), and one twice as slow (communication-bound for both). A
# shared 2-core machine is noisy, and on it gloo's threads compete with the compute they should
# hide under; so the cell reports every round's spread, and the sentences below the figure are
# computed from this run's numbers: they say what *this* measurement shows, including when it
# does not show what the formula promises.

# %%
from course.checks.lesson10 import measure_modes, modes_figure, modes_sentences, timeline_figure, timeline_sentences

modes = measure_modes()
f, b, o = modes["forward_ms"], modes["backward_ms"], modes["optimizer_ms"]
print(f"tiny GPT-2, {modes['grad_mib']:.2f} MiB of gradients in {modes['buckets']} buckets; without communication: "
      f"forward {f:.1f} ms, backward {b:.1f} ms, clip + AdamW {o:.1f} ms (medians over {modes['rounds']} rounds)")
print(f"{'link':<28}{'DDP best':>9}{'overlap':>9}{'sharded':>9}{'limit':>8}   sharded < overlap in")
for ln in modes["links"]:
    print(f"{ln['comm_ratio']:g} x (fwd + bwd) = {ln['comm_ms']:5.0f} ms{'':<4}{ln['ddp_ceiling_ms']:>9.0f}"
          f"{ln['overlap_ms']:>9.0f}{ln['sharded_ms']:>9.0f}{ln['limit_ms']:>8.0f}   "
          f"{ln['sharded_wins']} of {len(ln['sharded_rounds'])} rounds")

# %%
show(modes_figure(modes, figure_path("10_modes.png")))

# %% [markdown]
# Read each group from left to right. The first bar is the best any DDP-style overlap can do on
# that link, computed; "overlap" is what lesson 06's buckets reach, measured (the last bucket's
# reduction still runs after backward, so it sits above its ceiling); "sharded" is measured; the
# last bar is the limit it is heading for, computed. What this run shows, in sentences computed
# from its numbers:

# %%
for sentence in modes_sentences(modes):
    print("-", sentence)

# %% [markdown]
# What lies between "sharded" and its limit: the first layers' gathers, which the first layers
# must wait for (nothing computes before them), the last bucket's reduce-scatter after backward,
# and the memory work of packing and unpacking the buckets that the formula does not count. On
# a 2-core machine one more thing: gloo moves the bytes on threads of the same two cores, so the
# transfers that should hide under the forward slow it down; the slower link leaves the
# forward more room, which is why the advantage, where the faster link does not show it, can show
# on the slower one. On a GPU, NCCL moves the bytes on the device's copy engines and the host only
# launches.
#
# ### Where the all-gather sits: one sharded step on rank 0
#
# The same run recorded one sharded step on the first link: when each phase ran on rank 0, when
# each block of the model started computing (the ticks), and when each transfer occupied the
# simulated link.

# %%
show(timeline_figure(modes, figure_path("10_timeline.png")))
for sentence in timeline_sentences(modes):
    print("-", sentence)

# %% [markdown]
# The reduce-scatters (orange) start during backward, bucket by bucket. The sharded engine steps
# the optimizer bucket by bucket too, and launches each bucket's all-gather (red) as soon as its
# slice is stepped, so the gathers start during clip + step and travel on while the next forward
# begins: each block starts as soon as *its own* parameters are in, and the forward and the
# gathers of the later blocks overlap. The lines under the figure count them in this run. Your
# `ParamGather.launch()` went out only after the whole step; the last section of this lesson
# pipelines it the way the engine does.

# %% tags=["hidden-check"]
assert all(ln["sharded_ms"] > 0.7 * ln["limit_ms"] for ln in modes["links"]), modes   # nothing beats its limit
transfers = modes["timeline"]["transfers"]
backward_end = next(t for n, t in modes["timeline"]["marks"] if n == "optimizer")
scatters = [e for e in transfers if e["kind"] == "all_to_all"]
gathers = [e for e in transfers if e["kind"] == "all_gather" and e["bytes"] >= 64]
assert len(scatters) >= modes["buckets"] and any(e["launch"] < backward_end for e in scatters), scatters[:2]
assert gathers and all(e["launch"] >= backward_end for e in gathers), gathers[:2]   # launched by the step, not before
assert any(e["done"] > modes["timeline"]["next_step"] for e in gathers), "a gather still in flight at the next forward"
assert rs["simulated"]["reduce_scatter_ms"] < 0.8 * rs["simulated"]["all_reduce_ms"], rs

# %% [markdown]
# ### On a GPU: the same step in `torch.profiler`
#
# On an accelerator the cell below runs one sharded step on 2 processes sharing it (gloo carries
# the collectives: NCCL refuses two ranks on one GPU) and records a `torch.profiler` trace of
# rank 0, with the device's kernels. It prints where the all-gathers start and end relative to
# the step's end and the next forward's first kernels, and saves the Chrome trace (open it in
# https://ui.perfetto.dev).

# %% tags=["gpu"]
# GPU: a torch.profiler trace of one sharded step on 2 ranks sharing this GPU, showing the all-gathers launched after optimizer.step() still in flight while the next forward's first kernels run.
from course.checks.lesson10 import profile_sharded_step

prof = profile_sharded_step(str(accelerator_device()), tempfile.mkdtemp(prefix="hfstream-l10-trace-"))
print(prof["summary"])
print(f"trace: {prof['trace']}")

# %% [markdown]
# ## In the Trainer: `grad_sync="sharded"`
#
# The same mode is one argument of `StreamTrainingArguments`. `StreamTrainer` shards the
# optimizer the Trainer builds, clips with the global norm (`max_grad_norm`), and waits for the
# gathers before evaluation, saving and the end of training. Two processes train a tiny GPT-2 for
# 8 steps, logging the loss of each; afterwards the replicas must agree exactly, and each rank's
# AdamW holds state for only its half of the parameters.

# %%
from course.checks.lesson10 import train_sharded

run = train_sharded(tempfile.mkdtemp(prefix="hfstream-l10-train-"))
state_share = [n / (2 * run["model_numel"]) for n in run["state_numel"]]
print(f"grad_sync={run['mode']!r}: losses {[round(x, 3) for x in run['losses']]}")
print(f"largest parameter difference between the two ranks: {run['max_rank_difference']:.1e}")
print(f"AdamW state per rank: {', '.join(f'{s:.2f}' for s in state_share)} of an unsharded AdamW's")

# %% tags=["hidden-check"]
assert run["max_rank_difference"] == 0.0, run
assert all(0.4 < s < 0.6 for s in state_share), state_share

# %% [markdown]
# ## The last piece: the step and the gathers, pipelined
#
# `ParamGather.launch()` started the gathers after `optimizer.step()` had stepped *every* slice.
# But bucket 0's gather needs only bucket 0's slice: while the optimizer steps the slices of
# buckets 1, 2, …, the link could already carry bucket 0. That is what `GradSync(mode="sharded")`
# does (its "[Note: pipelined step]" in `hfstream/gradsync/sharded/reduction.py`): it steps the optimizer
# bucket by bucket in forward order and launches each bucket's all-gather as soon as that
# bucket's slice is stepped, so the step itself hides under the gathers, except its first slice.
#
# ## Exercise 10.pipelined_step — step a slice, send it, step the next
#
# Write `pipelined_step(mine, gathered, step_slice)`:
#
# - `mine[i]`: this rank's slice of bucket i, a 1-D tensor; bucket 0 is the one the forward
#   needs first. `gathered[i]`: bucket i's all-gather output (N times `mine[i]`).
# - `step_slice(i)`: runs the optimizer on `mine[i]`, in place (the course's stand-in for the
#   optimizer's work on one bucket's slice).
# - **returns** the all-gathers in flight, one work per bucket, in bucket order: the next
#   forward's pre-hooks wait for them, each where it is needed (as your `wait_for(i)` did).
#
# The check runs it on 2 thread ranks and logs every step, launch and wait, then on drawn cases
# (2, 3 and 4 ranks, 1 to 6 buckets of drawn sizes, float32 and float64); then the cell after it
# times your schedule on rank 0 against "step everything, then gather", with each gather holding a
# simulated link for as long as one slice's step takes.

# %%
def pipelined_step(mine, gathered, step_slice):
    """Step this rank's slice of every bucket and start the buckets' all-gathers, pipelined.

    Args:
        mine: this rank's slice of each bucket (1-D tensors), bucket 0 first in the forward.
        gathered: each bucket's all-gather output, N x the size of its slice.
        step_slice: step_slice(i) steps mine[i] in place.

    Returns:
        The works of the all-gathers in flight, one per bucket, in bucket order.
    """
    # BEGIN SOLUTION
    works = []
    for i in range(len(mine)):
        step_slice(i)                 # bucket i's slice is final: its gather can leave now
        works.append(dist.all_gather_single(gathered[i], mine[i], async_op=True))
    return works
    # END SOLUTION

# %%
check("10.pipelined_step")

# %% [markdown]
# ### Measured: when the parameters are complete
#
# Two thread ranks (this process; no gloo) step 6 equal slices with a momentum update, once with
# your `pipelined_step` and once with `step_then_gather`, the schedule of `ParamGather`,
# interleaved 5 times. The steps run for real and are timed on rank 0; each gather then holds a
# simulated link (`SimulatedLink`'s rule: one transfer after the other, its bytes' time) for as
# long as one slice's step took, measured just before. With a link as fast as the step, the
# unpipelined schedule ends 2 x 6 slice-times after the step began; the pipelined one can end
# after 7. The figure shows the median run of each.

# %%
from course.checks.lesson10 import measure_pipelining, pipelining_figure, pipelining_sentences

pipe = measure_pipelining(globals())
for sentence in pipelining_sentences(pipe):
    print("-", sentence)
show(pipelining_figure(pipe, figure_path("10_pipelined.png")))

# %% tags=["hidden-check"]
yours, unpiped = pipe["runs"]["yours"], pipe["runs"]["step, then gather"]
assert yours["under_step"] == pipe["buckets"] - 1, yours      # every gather but the last left during the step
assert unpiped["under_step"] == 0, unpiped                       # and not before it, unpipelined
assert yours["last_arrival_ms"] < unpiped["last_arrival_ms"], (yours, unpiped)

# %% [markdown]
# On the figure the red bars of your schedule start under the purple ones: each gather leaves
# while the next slice is stepped. The lines above say how much sooner the parameters were
# complete, and how close that came to the most it could be, the steps of the 5 slices after the
# first. On a GPU the optimizer's kernels run on the compute stream and NCCL's gathers on their
# own, so the same order gives the same overlap without a host thread in between.

# %% [markdown]
# ## What you have now
#
# - an all-reduce taken apart: a reduce-scatter (yours: an all-to-all and a local sum, half the
#   bytes) and an all-gather;
# - the step of a rank that owns 1/N of the model, with clipping by the global norm from one
#   scalar all-reduce;
# - the all-gather moved past the step boundary, each layer waiting for its own parameters in a
#   forward pre-hook;
# - the limit that follows, `max(forward + backward + optimizer/N, comm)`, and a measurement of
#   how far this machine gets towards it against DDP's ceiling, on two links, with its spread.
# - the step and the gathers pipelined: each bucket's slice stepped, then its gather sent at once,
#   in forward order, so the optimizer step hides under the gathers too.
#
# What this does not do: shard the gradients themselves (ZeRO-2) or the parameters (ZeRO-3 and
# FSDP, which gather each layer's parameters before its forward *and* its backward, and free
# them after). Those trade more communication for memory; the split you built here is the piece
# they share.
