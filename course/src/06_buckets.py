# %% [markdown]
# # Lesson 06 — Buckets
#
# **Time:** 45 minutes. **Runs on:** any laptop (CPU, 2 gloo processes). **You will:** plan
# gradient buckets with PyTorch DDP's rule, write an overlapping sync that reduces one flat
# tensor per bucket, then sweep the bucket cap on a link with both latency and bandwidth and find
# a cap that beats DDP's default.
#
# ## Why: every collective pays a fixed price
#
# Lesson 05 launched one all-reduce per parameter. A collective costs roughly
#
# $$t(\text{bytes}) = \alpha + \frac{2(N-1)}{N}\cdot\frac{\text{bytes}}{\beta}$$
#
# where $\beta$ is the link's bandwidth and $\alpha$ a fixed cost paid however small the tensor:
# the ring's $2(N-1)$ message round trips, a kernel launch and a synchronisation on a GPU, a
# scheduling step in gloo. A transformer has many small parameters (every LayerNorm weight and
# bias, every bias vector): GPT-2 small has 148 parameters, so per-parameter overlap pays
# $148\,\alpha$ per step, which on a real network can be more than the bytes themselves.
#
# The other extreme, one all-reduce for all gradients, pays $\alpha$ once, but it can only start
# when the *last* gradient exists, when backward is over: nothing overlaps.
#
# **Buckets** sit between the two: gradients are grouped into buckets of about `bucket_cap_mb`
# MiB; each bucket is flattened into one tensor and reduced with one collective as soon as its
# last gradient exists. Fewer buckets, less latency; smaller buckets, an earlier first launch and a
# shorter tail after backward. The best cap depends on the model, the link and the world size,
# which is why `DistributedDataParallel(bucket_cap_mb=...)` and the Trainer's
# `TrainingArguments(ddp_bucket_cap_mb=...)` expose it.
#
# ## DDP's rule
#
# PyTorch DDP's reducer (Li et al., "PyTorch Distributed: Experiences on Accelerating Data
# Parallel Training", VLDB 2020; `torch.distributed._compute_bucket_assignment_by_size`) plans
# buckets like this, and hfstream's `GradSync` (`hfstream/gradsync/buckets.py`) does the same:
#
# 1. take the parameters in **reverse registration order** (the reverse of `model.parameters()`):
#    the order backward roughly produces their gradients, so the first bucket is the first to fill;
# 2. add each parameter, whole, to the open bucket; a parameter is **never split**;
# 3. **close the bucket once it has reached the cap** (its bytes equal or pass it): buckets hold
#    at least the cap (all but the last), and a parameter larger than the cap is a bucket of its own;
# 4. one plan per (dtype, device), since a flat buffer has one dtype and lives on one device (all
#    parameters share both in this lesson).
#
# Two details of the real DDP: its default cap is 25 MiB but its *first* bucket is capped at 1 MiB
# (`_DEFAULT_FIRST_BUCKET_BYTES`), so the last layers' gradients leave early; and after the first
# iteration it may rebuild the buckets in the order the gradients really arrived.

# %%
import contextlib, math, os, queue, threading, time
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from course.lib import *

# %% [markdown]
# ## Exercise 06.plan_buckets — DDP's plan
#
# Write `plan_buckets(named_params, bucket_mb)`: `named_params` is a list of `(name, parameter)`
# pairs in registration order (what `model.named_parameters()` yields); return the buckets, in
# launch order, each a list of names, following DDP's rule above. A parameter weighs what its
# gradient weighs in bytes (its number of elements times the bytes of one element: see
# `Tensor.numel` and `Tensor.element_size`); the cap is in MiB, like DDP's `bucket_cap_mb`.
# Cap 0 puts every parameter in a bucket of its own; an infinite cap gives one bucket.
#
# The check compares your plans with hfstream's planner on a toy model at caps chosen so that the
# classic slips give different plans (forward order, `>` for `>=`, closing *before* a bucket would
# overflow, elements for bytes, MB for MiB, a lost last bucket), then on a GPT-2.

# %%
def plan_buckets(named_params, bucket_mb):
    """Group parameters into buckets with DDP's rule; returns lists of names in launch order.

    Args:
        named_params: (name, parameter) pairs in registration order.
        bucket_mb: cap in MiB; a bucket closes once it holds >= this many bytes of gradient.
    """
    # BEGIN SOLUTION
    cap = bucket_mb * 2**20
    buckets, current, size = [], [], 0
    for name, p in reversed(list(named_params)):
        current.append(name)
        size += p.numel() * p.element_size()
        if size >= cap:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets
    # END SOLUTION

# %%
check("06.plan_buckets")

# %% [markdown]
# ### What the plan looks like on a GPT-2
#
# hfstream's planner (the rule your function now follows) on the 4-layer GPT-2 this lesson trains,
# at three caps. Read the first bucket: it holds the final LayerNorm and the last block, the
# gradients backward produces first. The tied input/output embedding (`wte`) comes last: its
# gradient is only final once backward has gone through the input embedding too.

# %%
from hfstream.gradsync.buckets import format_plan, plan_buckets as library_plan_buckets

gpt2 = tiny_gpt2(layers=4, width=128)
named = list(gpt2.named_parameters())
print(f"{len(named)} parameters, {sum(p.numel() for _, p in named) * 4 / 2**20:.2f} MiB of float32 gradients")
for cap in (0.25, 1.0, 25.0):
    plan = library_plan_buckets(named, cap)
    print(f"\nbucket_mb={cap:g}: {len(plan)} buckets")
    print(format_plan(plan[:3]) + ("\n   ..." if len(plan) > 3 else ""))
print(f"\nDDP's default (25 MiB, first bucket 1 MiB): "
      f"{[f'{b.nbytes / 2**20:.2f} MiB' for b in library_plan_buckets(named, 25.0, first_bucket_mb=1.0)]}")

# %% [markdown]
# At 25 MiB this model is a single bucket: DDP's default cap was chosen for models of hundreds of
# MiB, and on a small model it leaves only the 1 MiB first bucket to overlap with backward.
#
# ## Exercise 06.bucketed_sync — one flat all-reduce per bucket, overlapped
#
# `BucketedSync(model, buckets)` takes a plan (lists of names, in launch order). Its constructor
# (given) hooks every parameter and sets up the counters. Write the three methods so that:
#
# - `_launch(b)` **packs** bucket `b`: its parameters' gradients, one after another in the
#   bucket's order, become one 1-D tensor, and one asynchronous all-reduce of that tensor starts
#   (lesson 05's kind). A parameter without `.grad` (backward did not reach it on this rank) still
#   takes its place, as zeros: every rank must reduce a tensor of the same size, element for
#   element the same parameters. `self.inflight` keeps `(b, flat tensor, Work)`.
# - `_on_grad_ready(param)`, the hook: one gradient fewer for its bucket (`self.pending`); then
#   every complete bucket at the head of the plan (`self.next`) is launched: lesson 05's order
#   rule, with buckets instead of parameters. A complete bucket behind an incomplete one waits.
# - `finish()`: every bucket not launched yet is launched, in plan order; then, for each bucket,
#   once its reduction is done, the sum becomes a mean and is **unpacked**: each parameter's part
#   of the flat tensor goes back into that parameter's `.grad`, in its shape; a parameter that had
#   no `.grad` gets one (rank 0 may have used what rank 1 did not: both must step it alike).
#   When `finish()` returns, `inflight`, `next` and `pending` are as `__init__` left them.
#
# DDP and picotron pack with `torch._utils._flatten_dense_tensors` and unpack with
# `_unflatten_dense_tensors`; writing it once by hand (slicing a 1-D tensor and viewing each slice
# in its parameter's shape) shows there is nothing more to it. The check runs 2 gloo processes for
# two plans, counts the collectives (one per bucket, in plan order, the first during backward) and
# compares every `.grad` with the serial mean; then a model whose `expert` layer rank 1 does not
# use and whose `spare` parameter nobody uses.

# %%
class BucketedSync:
    """Overlap per bucket: one flat all-reduce per bucket, launched once all its gradients exist.

    Args:
        model: the module whose gradients are averaged.
        buckets: lists of parameter names, in launch order (what plan_buckets returns).
    """

    def __init__(self, model, buckets):
        self.world_size = dist.get_world_size()
        params = dict(model.named_parameters())
        self.buckets = [[params[name] for name in names] for names in buckets]
        self.bucket_of = {p: b for b, members in enumerate(self.buckets) for p in members}
        # pending[b]: gradients bucket b still waits for; next: the next bucket to launch, in
        # plan order; inflight: (bucket index, flat tensor, Work) of the buckets launched
        self.pending = [len(m) for m in self.buckets]
        self.next = 0
        self.inflight = []
        self.handles = [p.register_post_accumulate_grad_hook(self._on_grad_ready)
                        for members in self.buckets for p in members]

    def _launch(self, b):
        """Pack bucket b's gradients into one flat tensor and start its all-reduce."""
        # BEGIN SOLUTION
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.buckets[b]]
        flat = torch.cat([g.reshape(-1) for g in grads])
        self.inflight.append((b, flat, dist.all_reduce(flat, async_op=True)))
        # END SOLUTION

    def _on_grad_ready(self, param):
        """The hook: one gradient fewer for its bucket; launch the complete buckets at the head."""
        # BEGIN SOLUTION
        self.pending[self.bucket_of[param]] -= 1
        while self.next < len(self.buckets) and self.pending[self.next] == 0:
            self._launch(self.next)
            self.next += 1
        # END SOLUTION

    def finish(self):
        """Launch the buckets left; wait for each, divide, copy the mean back into every .grad."""
        # BEGIN SOLUTION
        while self.next < len(self.buckets):
            self._launch(self.next)
            self.next += 1
        for b, flat, work in self.inflight:
            work.wait()
            flat.div_(self.world_size)
            offset = 0
            for p in self.buckets[b]:
                if p.grad is None:
                    p.grad = torch.empty_like(p)
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
        self.inflight, self.next = [], 0
        self.pending = [len(m) for m in self.buckets]
        # END SOLUTION

    def close(self):
        for h in self.handles:
            h.remove()

# %%
check("06.bucketed_sync")

# %% [markdown]
# ## Sweep the cap, for real and on a link with latency and bandwidth
#
# Now the trade-off, measured. The next cell trains the tiny GPT-2 on 2 gloo processes with your
# `plan_buckets` and `BucketedSync` (hfstream's planner and `GradSync` while yours are not
# written), once per cap, the caps taking turns step by step so that a busy moment of this
# shared machine hits all of them alike. It does so twice:
#
# 1. **For real**, over this machine's loopback, nothing simulated. Each collective's fixed cost
#    is real here (gloo's scheduling, a few socket round trips), but the bytes cost CPU time on
#    the cores that also run backward, not link time.
# 2. **Over lesson 05's simulated link** (`hfstream.testing.link.SimulatedLink`), now with a
#    fixed cost per collective too. Both are sized from this machine's own backward, so the
#    picture does not depend on how fast your laptop is:
#    - bandwidth: all gradients, in one transfer, take as long as backward (`bandwidth_ratio=1`);
#    - latency: one collective per parameter would add up to another backward (`latency_ratio=1`).
#
#    So the bytes alone could just hide under backward, if they start early enough and do not pay
#    too many latencies.
#
# The simulated link is a timer, not a network: each rank delays the completion of its own
# reductions (a private FIFO link, constant bandwidth and latency), so it leaves out contention
# between ranks and with other traffic, the NIC and its protocol (TCP or RDMA, congestion, full
# duplex), and the way real latency grows with the number of ranks (lesson 09's topic). The real
# gloo reduction still runs underneath, over loopback, and still costs CPU. (The full benchmark,
# `hfstream bench`, runs the same comparison against real DDP through a rate-limited loopback when
# run as root; its `--quick` mode takes about two minutes, too long for this notebook.)

# %%
from course.checks.lesson06 import measure_sweep, sweep_figure

sweep = measure_sweep(globals())
by, real = sweep["by_cap"], sweep["loopback"]
print(f"using {sweep['who']}")
print(f"{sweep['params']} parameters, {sweep['grad_mib']:.2f} MiB of gradients; backward {sweep['backward_ms']:.1f} ms; "
      f"simulated link {sweep['rate_mbit']:.0f} Mbit/s + {sweep['latency_ms']:.2f} ms per collective")
print(f"{'':>21} | {'real loopback':^18} | {'simulated link':^49}")
print(f"{'cap MiB':>12} {'buckets':>8} | {'step':>9} {'exposed':>8} | {'step':>9} {'backward':>9} "
      f"{'comm busy':>10} {'exposed':>8} {'ceiling':>8}")
for label in sweep["labels"]:
    r, q = by[label], real[label]
    print(f"{label:>12} {r['buckets']:>8.0f} | {q['step_ms']:>9.1f} {q['exposed_comm_ms']:>8.1f} | {r['step_ms']:>9.1f} "
          f"{r['backward_ms']:>9.1f} {r['comm_busy_ms']:>10.1f} {r['exposed_comm_ms']:>8.1f} {r['ceiling_ms']:>8.1f}")
caps = [lb for lb in sweep["labels"] if lb != "DDP default"]
best = min(caps, key=lambda lb: by[lb]["step_ms"])
print(f"simulated link: best cap {best} MiB, {by[best]['step_ms']:.1f} ms per step, "
      f"{by[best]['step_ms'] / by['DDP default']['step_ms']:.2f} x DDP's default plan")
best_real = min(caps, key=lambda lb: real[lb]["step_ms"])
print(f"real loopback: best cap {best_real} MiB, {real[best_real]['step_ms']:.1f} ms per step; the slowest cap "
      f"{max(real[c]['step_ms'] for c in caps) - real[best_real]['step_ms']:.1f} ms slower")

# %% [markdown]
# ### Reading the numbers
#
# **Backward is not the same at every cap**, although the model and the batch are: with gloo,
# every reduction that overlaps backward is CPU work on gloo's threads, done on the cores that
# run autograd (lesson 05 measured it), and the simulated link still runs the real reduction
# underneath. With 2 ranks on a small machine, that work takes CPU time from backward: part of it
# per byte, part per collective (each launch, each wake-up of gloo's thread), so the more
# collectives run beside backward, the more it grows. The next cell prints, per cap, how far
# backward moved from the undisturbed one the link was sized from (compare cap 0 with 25 MiB; a
# shared machine adds its own noise). On a GPU with NCCL the reduction runs on the device and
# the NIC instead.
#
# **The step stays above the ceiling.** The ceiling (`forward + max(backward, comm busy) +
# optimizer`) assumes every byte hides under backward. But the last bucket closes only when
# backward ends (it holds the first layers and, last of all, the tied embedding), so its
# reduction is exposed whatever the cap, and the bigger the bucket, the longer: the next cell
# prints, per cap, the gap, the comm left after backward and the least time the last bucket needs
# on this link.
#
# **The real loopback columns** are what this machine's own gloo does, nothing simulated. Bytes
# are cheap there (memory copies, no wire), and each collective's fixed cost, paid on the cores
# backward uses, is not: compare cap 0 with the largest caps, and the best cap on loopback
# (printed above) with the best on the simulated link. Which cap is best depends on the link.

# %%
print(f"{'cap MiB':>12} {'step - ceiling':>15} {'exposed comm':>13} {'last bucket needs':>18} {'backward vs probe':>18}")
for label in sweep["labels"]:
    r = by[label]
    print(f"{label:>12} {r['step_ms'] - r['ceiling_ms']:>+15.1f} {r['exposed_comm_ms']:>13.1f} "
          f"{r['tail_floor_ms']:>18.1f} {r['backward_ms'] - sweep['backward_ms']:>+18.1f}")
print(f"(backward vs probe: this cap's median backward minus the undisturbed one the link was sized from, "
      f"{sweep['backward_ms']:.1f} ms)")

# %% [markdown]
# ### The figure
#
# Read the simulated line from left to right. At cap 0 (one bucket per parameter) the reductions
# start early, but one latency per parameter makes the communication longer than backward: the
# *ceiling itself* is high, and the step with it. As the cap grows, latencies disappear and the
# step falls. Past the best cap the buckets get so big that the first one fills late and the last
# one is a long tail after backward: the ceiling stays low but the step drifts away from it. At
# 25 MiB the whole model is one bucket and nothing overlaps; DDP's default (the star) does better
# thanks to its 1 MiB first bucket. Whether a cap in between beats it, and by how much, the
# printout above says for this run. The grey line is the real loopback run, nothing simulated.
# Each point is the median of a few steps on a machine that may be doing other things: if one
# point jumps out of the curve, run the cell again.

# %%
show(sweep_figure(sweep, figure_path("06_bucket_sweep.png")))

# %% tags=["hidden-check"]
assert all(by[lb]["collectives"] == by[lb]["buckets"] for lb in sweep["labels"]), by
assert all(real[lb]["collectives"] == real[lb]["buckets"] for lb in sweep["labels"]), real
assert by["0.0"]["buckets"] == sweep["params"] and by["25.0"]["buckets"] == 1
assert all(by[lb]["launched_in_backward"] > 0 for lb in sweep["labels"] if lb not in ("25.0",))
assert all(by[lb]["tail_floor_ms"] > 0 for lb in sweep["labels"])

# %% [markdown]
# ### On a GPU: the price of flattening
#
# Bucketing is not free: packing a bucket is a device copy, and so is writing the mean back.
# On a GPU the copy is cheap next to the latency of the collectives it saves; DDP even avoids the
# unpacking by making each `.grad` a *view* into its bucket (`gradient_as_bucket_view=True`).

# %% tags=["gpu"]
# GPU: packing 85M gradients (about 330 MiB) into one flat buffer takes well under a millisecond on a modern GPU, small next to the fixed cost of the hundred-odd collectives that per-parameter reduction would pay.
dev = accelerator_device()
big = tiny_gpt2(layers=12, width=768)
grads = [torch.randn(p.shape, device=dev) for p in big.parameters()]
flat = torch.empty(sum(g.numel() for g in grads), device=dev)
start, end = torch.Event(enable_timing=True), torch.Event(enable_timing=True)
for _ in range(3):                      # the last of three is reported (the first ones warm up)
    start.record()
    torch.cat([g.reshape(-1) for g in grads], out=flat)
    end.record()
torch.accelerator.synchronize()
print(f"{len(grads)} gradients, {flat.numel() * 4 / 2**20:.0f} MiB packed into one buffer in "
      f"{start.elapsed_time(end):.3f} ms")

# %% [markdown]
# ### On a GPU: the buckets in a profiler trace
#
# Lesson 05's trace, with DDP's buckets (1 MiB) instead of one reduction per parameter, on a
# process group of one rank (NCCL on CUDA), nothing simulated: on the compute stream the packing
# copies between backward's kernels, on NCCL's stream one all-reduce per bucket, the first ones
# while backward still runs.

# %% tags=["gpu"]
# GPU: a torch.profiler trace of one bucketed step on a one-rank NCCL group: the packing copies on the compute stream between backward's kernels, one all-reduce per bucket on NCCL's own stream, and how many of them start before backward's last kernel ends.
from course.checks.lesson05 import trace_figure, trace_findings, trace_overlap_step

dev = accelerator_device()
if dev.type != "cuda":
    print(f"this cell needs NCCL (CUDA); {dev.type} has no NCCL backend, so it is skipped")
else:
    found = trace_overlap_step(dev, figure_path("06_trace.json"), bucket_mb=1.0)
    print(f"backend {found['backend']}, {found['buckets']} buckets of about 1 MiB; trace: {found['path']}")
    print("\n".join(trace_findings(found)))
    show(trace_figure(found, figure_path("06_trace.png"),
                      title="one bucketed step, profiled (real, not simulated): one-rank NCCL, 1 MiB buckets"))

# %% [markdown]
# ## What you have now
#
# - DDP's bucket plan: reverse registration order, whole parameters, close once the cap is reached;
# - a bucketed, overlapping gradient sync: one flat all-reduce per bucket, launched in plan order
#   from the hooks, unpacked in `finish()`; it is what `hfstream.GradSync` does, plus
#   compression, unused-parameter flags and GPU streams;
# - a measured sweep, on a simulated link and for real on loopback: too small a cap pays latency,
#   too large a cap cannot overlap, and the best cap depends on *this* model and link.
#
# In the Trainer the cap is `ddp_bucket_cap_mb` (native DDP) or `grad_bucket_mb` (hfstream, which
# can also tune it online with `"auto"`). Lesson 07 takes on the hard cases: gradient
# accumulation, tied and frozen parameters, clipping and mixed precision.
