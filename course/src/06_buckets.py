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
# 1. take the parameters in **reverse registration order** (`reversed(model.parameters())`): the
#    order backward roughly produces their gradients, so the first bucket is the first to fill;
# 2. add each parameter, whole, to the open bucket; a parameter is **never split**;
# 3. **close the bucket once it has reached the cap** (`bytes >= cap`): buckets hold at least the
#    cap (all but the last), and a parameter larger than the cap is a bucket of its own;
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
# pairs in registration order (`list(model.named_parameters())`); return the buckets, in launch
# order, each a list of names. A parameter weighs `p.numel() * p.element_size()` bytes; the cap is
# `bucket_mb` MiB, `bucket_mb * 2**20` bytes. `bucket_mb=0` puts every parameter in a bucket of its
# own; `float("inf")` gives one bucket.
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
# (given) hooks every parameter and sets up the counters. Write:
#
# - `_launch(b)`: **flatten** bucket `b`'s gradients into one tensor
#   (`torch.cat([g.reshape(-1) for g in grads])`, zeros for a parameter without `.grad`), start
#   `dist.all_reduce(flat, async_op=True)`, and keep `(b, flat, work)` in `self.inflight`;
# - `_on_grad_ready(param)`: one gradient fewer for its bucket (`self.pending`); then launch every
#   complete bucket at the head of the plan (`self.next`), exactly like lesson 05's order rule,
#   with buckets instead of parameters;
# - `finish()`: launch what is left, in order; for each in-flight bucket `wait()`, divide by the
#   world size and **unflatten**: copy each slice of `flat` back into its parameter's `.grad`
#   (`flat[offset:offset + p.numel()].view_as(p)`); then reset `inflight`, `next` and `pending`.
#
# (`torch._utils._flatten_dense_tensors` / `_unflatten_dense_tensors` do the packing for DDP and
# for picotron; writing it once by hand shows there is nothing more to it.) The check runs 2 gloo
# processes for two plans, counts the collectives (one per bucket, in plan order, the first during
# backward) and compares every `.grad` with the serial mean.

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
# ## Sweep the cap on a link with latency and bandwidth
#
# Now the trade-off, measured. The next cell trains the tiny GPT-2 on 2 gloo processes with your
# `plan_buckets` and `BucketedSync` (hfstream's planner and `GradSync` while yours are not
# written), once per cap, the caps taking turns step by step so that a busy moment of this
# shared machine hits all of them alike.
#
# The link is lesson 05's simulated one (`hfstream.tools.bench.link.SimulatedLink`), now with a fixed
# cost per collective. Both are sized from this machine's own backward, so the picture does not
# depend on how fast your laptop is:
#
# - bandwidth: all gradients, in one transfer, take as long as backward (`bandwidth_ratio=1`);
# - latency: one collective per parameter would add up to another backward (`latency_ratio=1`).
#
# So the bytes alone could just hide under backward, if they start early enough and do not pay
# too many latencies. (The full benchmark, `hfstream bench`, runs the same comparison against
# real DDP through a rate-limited loopback when run as root; its `--quick` mode takes about two
# minutes, too long for this notebook.)

# %%
from course.checks.lesson06 import measure_sweep, sweep_figure

sweep = measure_sweep(globals())
by = sweep["by_cap"]
print(f"using {sweep['who']}")
print(f"{sweep['params']} parameters, {sweep['grad_mib']:.2f} MiB of gradients; backward {sweep['backward_ms']:.1f} ms; "
      f"link {sweep['rate_mbit']:.0f} Mbit/s + {sweep['latency_ms']:.2f} ms per collective")
print(f"{'cap MiB':>12} {'buckets':>8} {'step':>7} {'backward':>9} {'comm busy':>10} {'exposed':>8} {'ceiling':>8}")
for label in sweep["labels"]:
    r = by[label]
    print(f"{label:>12} {r['buckets']:>8.0f} {r['step_ms']:>7.1f} {r['backward_ms']:>9.1f} {r['comm_busy_ms']:>10.1f} "
          f"{r['exposed_comm_ms']:>8.1f} {r['ceiling_ms']:>8.1f}")
best = min((lb for lb in sweep["labels"] if lb != "DDP default"), key=lambda lb: by[lb]["step_ms"])
print(f"best cap {best} MiB: {by[best]['step_ms']:.1f} ms per step, "
      f"{by[best]['step_ms'] / by['DDP default']['step_ms']:.2f} x DDP's default plan")

# %% [markdown]
# ### The figure
#
# Read it from left to right. At cap 0 (one bucket per parameter) the reductions start early,
# but 52 latencies make the communication longer than backward: the *ceiling itself* is high,
# and the step with it. As the cap grows, latencies disappear and the step falls. Past the best
# cap the buckets get so big that the first one fills late and the last one is a long tail after
# backward: the ceiling stays low but the step drifts away from it. At 25 MiB the whole model is
# one bucket and nothing overlaps; DDP's default (the star) does better thanks to its 1 MiB
# first bucket, and a cap in between beats it. Each point is the median of a few steps on a
# machine that may be doing other things: if one point jumps out of the curve, run the cell again.

# %%
show(sweep_figure(sweep, figure_path("06_bucket_sweep.png")))

# %% tags=["hidden-check"]
assert all(by[lb]["collectives"] == by[lb]["buckets"] for lb in sweep["labels"]), by
assert by["0.0"]["buckets"] == sweep["params"] and by["25.0"]["buckets"] == 1
assert all(by[lb]["launched_in_backward"] > 0 for lb in sweep["labels"] if lb not in ("25.0",))

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
# ## What you have now
#
# - DDP's bucket plan: reverse registration order, whole parameters, close once the cap is reached;
# - a bucketed, overlapping gradient sync: one flat all-reduce per bucket, launched in plan order
#   from the hooks, unflattened in `finish()`; it is what `hfstream.GradSync` does, plus
#   compression, unused-parameter flags and GPU streams;
# - a measured sweep: too small a cap pays latency, too large a cap cannot overlap, and the
#   best cap for *this* model and link beats DDP's one-size default.
#
# In the Trainer the cap is `ddp_bucket_cap_mb` (native DDP) or `grad_bucket_mb` (hfstream, which
# can also tune it online with `"auto"`). Lesson 07 takes on the hard cases: gradient
# accumulation, tied and frozen parameters, clipping and mixed precision.
