# %% [markdown]
# # Lesson 09 — The ceiling at scale
#
# **Time:** 60 minutes. **Runs on:** any laptop (CPU; the lab at the end runs 2 gloo processes,
# 10 to 40 seconds at a time). **You will:** predict communication, step time and the ceiling from
# 8 to 1024 devices with the planner (`hfstream plan`), write the ring all-reduce cost with its
# latency terms, find the world size from which overlap can no longer hide communication, and
# finish with a real 2-rank run over a simulated slow link, its buckets chosen by a planner of the
# overlapped schedule that you write, graded on how close it gets to its ceiling.
#
# ## From two ranks to a thousand
#
# Every lesson so far measured two ranks. Real jobs run on 8, 64, 1024 devices, and the question
# that decides their speed is the one this course started with: does communication fit behind
# backward? The planner answers it without a single GPU, from a few numbers and one formula.
#
# Data-parallel training usually scales *weakly*: each device keeps its micro-batch, so the
# compute per device and step stays the same as N grows. What changes is the all-reduce. In a
# **ring all-reduce** (what NCCL and gloo run for large buffers) the N devices form a ring and the
# buffer is cut into N chunks:
#
# 1. a **reduce-scatter**: N-1 steps; in each, every device sends one chunk to its neighbour and
#    adds the chunk it receives. Afterwards each device holds one fully summed chunk;
# 2. an **all-gather**: N-1 more steps that pass the summed chunks around the ring.
#
# In every step of either pass a device sends one chunk over a link of bandwidth B, and every step
# pays the link's latency α once. Count the steps and the bytes, and you have the time T(b, N) of
# one all-reduce of b bytes: the first exercise (Thakur, Rabenseifner and Gropp, "Optimization of
# Collective Communication Operations in MPICH", 2005, derive it; NCCL's tests call its bytes
# factor the *bus bandwidth* factor). It has two terms, and they behave very differently:
#
# - the **bandwidth term saturates**: from 8 to 1024 devices each byte costs only 14 % more;
# - the **latency term grows linearly** with N, and it is paid once per all-reduce, that is once
#   per *bucket*: a model in 200 buckets pays it 200 times over per step.
#
# The link is busy for `comm_busy` = the sum of T over the buckets, and the ceiling is the one you
# wrote in lesson 00, `ideal = forward + max(backward, comm_busy) + optimizer`. After the exercise,
# a cell prints both terms for one 25 MiB bucket on a 25 GB/s link with 5 µs per ring step (a
# 200 Gbit/s InfiniBand port per GPU), from your function.

# %%
import contextlib, math, os, queue, threading, time
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from course.lib import *
import dataclasses
from hfstream.plan import (PlanConfig, ModelShape, load_model, plan, predict_buckets, predict_row, overlap_limit,
                           allreduce_s, ring_factor, calibrated_tflops, calibrated_mem_bandwidth_gbs)
from hfstream.plan import main as hfstream_plan   # `hfstream plan ...` on the command line

# %% [markdown]
# ## The planner
#
# `hfstream plan` predicts a whole data-parallel step for N = 1 .. 1024 devices:
#
# - **compute**: a transformer step costs C = 6 P T FLOPs per device (P parameters, T tokens per
#   device; Kaplan et al. 2020), forward C/3 and backward 2C/3, at the device's peak FLOP/s times
#   the model-FLOPs utilisation (MFU);
# - **optimizer**: the bytes AdamW moves per parameter over the memory bandwidth;
# - **buckets**: exactly as `GradSync` and DDP plan them (reverse registration order, a bucket
#   closes once it reaches the cap); a bucket is *ready* when backward has done the FLOPs that
#   produce its last gradient;
# - **communication**: T(b, N) per bucket, one bucket at a time on the link; with overlap a bucket
#   starts when it is ready and the link is free, and whatever runs past the end of backward is
#   exposed.
#
# On the command line: `hfstream plan --model llama-8b --world-sizes 1,8,64,512,1024` (add
# `--plot plan.png`, `--json plan.json`, `--link-gbs`, `--latency-us`, `--bucket-mb`,
# `--grad-bytes 2` for bf16 on the wire, `--compare bench.json` to check it against a measured
# `hfstream bench`). The next cell calls the same entry point.

# %%
hfstream_plan(["--model", "llama-8b", "--world-sizes", "1,8,64,512,1024"])

# %% [markdown]
# Read it row by row; the next cell picks out, from the same plan, the numbers this paragraph
# talks about. Compute stays put as N grows (weak scaling). Comm busy passes backward at a small
# N already: from there on the ceiling is `forward + comm busy + optimizer`, it rises with N, and
# the serial step is far above it. With overlap the step stays within a few percent of the
# ceiling, because only the tail of the communication is exposed; but the ceiling itself keeps
# climbing.

# %%
_doc = plan(load_model("llama-8b"), PlanConfig(world_sizes=(1, 8, 64, 512, 1024)))
_rows = _doc["rows"]
_serial = [r["step_serial_ms"] / r["ideal_ms"] for r in _rows[1:]]
_over = [r["step_overlap_ms"] / r["ideal_ms"] - 1 for r in _rows[1:]]
print(f"compute per device and step: forward {_rows[0]['forward_ms']:.0f} ms, backward {_rows[0]['backward_ms']:.0f} ms "
      f"(A100 at {PlanConfig().mfu:.0%} MFU, {PlanConfig().tokens_per_device} tokens per device)")
print(f"comm busy exceeds backward from N = {_doc['overlap_incomplete_from']}")
print(f"N = 8 .. 1024: serial step / ceiling {min(_serial):.2f} to {max(_serial):.2f}; "
      f"overlapped step {min(_over):.1%} to {max(_over):.1%} above the ceiling")

# %% [markdown]
#
# In Python the same numbers come from `plan(shape, cfg)` (the whole table as a dict),
# `predict_row(shape, cfg, N)` (one world size) and `overlap_limit(shape, cfg)` (the crossover):

# %%
shape = load_model("llama-8b")                 # a preset, or the path of any transformers config.json
cfg = PlanConfig(link_gbs=25.0, latency_us=5.0, bucket_mb=25.0, tokens_per_device=8192)
buckets = predict_buckets(shape, cfg.grad_bytes, cfg.bucket_mb)       # [(bytes, ready fraction), ...]
row = predict_row(shape, cfg, 64, buckets)
print(f"{shape.name}: {shape.params / 1e9:.2f}B parameters in {len(buckets)} buckets")
print({k: round(v, 1) for k, v in row.items() if k.endswith("_ms")})
print("comm busy exceeds backward from N =", overlap_limit(shape, cfg, buckets))

# %% [markdown]
# ## Exercise 09.scaling — the cost of a ring all-reduce, and the ceiling at N devices
#
# Write the planner's communication model yourself:
#
# - `ring_allreduce_ms(nbytes, world_size, link_gbs, latency_us)`: one ring all-reduce of `nbytes`
#   alone on the link, in **milliseconds**. `link_gbs` is in GB/s (10⁹ bytes per second),
#   `latency_us` in microseconds per ring step. One device reduces with nobody: 0.
# - `predict_step(world_size, forward_ms, backward_ms, optimizer_ms, bucket_bytes, link_gbs, latency_us)`:
#   compute does not change with N (weak scaling); return a dict with `comm_busy_ms` (every bucket
#   is its own all-reduce, one after another), `step_serial_ms` (no overlap) and `ideal_ms` (the
#   ceiling).
#
# Derive `ring_allreduce_ms` from the two passes described at the top of the lesson. The check
# compares you with `hfstream.plan` for llama-8b's buckets (their count is printed above) at
# N = 1, 2, 8, 64, 1024.

# %%
def ring_allreduce_ms(nbytes, world_size, link_gbs, latency_us):
    """One ring all-reduce of `nbytes` alone on the link, in ms."""
    # BEGIN SOLUTION
    if world_size <= 1:
        return 0.0
    n = world_size
    return 2 * (n - 1) / n * nbytes / (link_gbs * 1e9) * 1e3 + 2 * (n - 1) * latency_us * 1e-3
    # END SOLUTION


def predict_step(world_size, forward_ms, backward_ms, optimizer_ms, bucket_bytes, link_gbs, latency_us):
    """{'comm_busy_ms', 'step_serial_ms', 'ideal_ms'} of one step on `world_size` devices."""
    # BEGIN SOLUTION
    busy = sum(ring_allreduce_ms(b, world_size, link_gbs, latency_us) for b in bucket_bytes)
    return {"comm_busy_ms": busy,
            "step_serial_ms": forward_ms + backward_ms + busy + optimizer_ms,
            "ideal_ms": forward_ms + max(backward_ms, busy) + optimizer_ms}
    # END SOLUTION

# %%
check("09.scaling")

# %% [markdown]
# Your function's two terms for one 25 MiB bucket on a 25 GB/s link with 5 µs per ring step:

# %%
bucket = 25 * 2**20
print(f"{'N':>5} {'bandwidth ms':>13} {'latency ms':>11} {'all-reduce ms':>14}")
for n in (2, 8, 64, 256, 1024):
    bw_ms = ring_allreduce_ms(bucket, n, 25.0, 0.0)
    total = ring_allreduce_ms(bucket, n, 25.0, 5.0)
    print(f"{n:>5} {bw_ms:>13.3f} {total - bw_ms:>11.3f} {total:>14.3f}")
print(f"at N = 1024 the latency terms of one 25 MiB all-reduce take {total - bw_ms:.1f} ms, "
      f"{(total - bw_ms) / bw_ms:.1f} x its bandwidth term")

# %% [markdown]
# At N = 1024 the latency terms outweigh the bandwidth term (the cell's last line says by how
# much). That is why collective libraries switch to tree and hierarchical algorithms at scale
# (NCCL picks between ring and tree per message size), and why bucket size matters more, not
# less, on many devices.

# %% [markdown]
# ## Where overlap stops helping
#
# Overlap hides communication *behind backward*. While `comm_busy <= backward`, a well-bucketed
# step can come close to `forward + backward + optimizer`, the compute alone: adding devices is
# then almost free. Past the world size where `comm_busy > backward` the step is
# **communication-bound**: the link is the bottleneck, the ceiling is
# `forward + comm_busy + optimizer` and grows with every device, and the best overlap can do is
# keep the link busy from early in backward to the end. An efficiency (ceiling / step) near 1 then
# no longer means the job scales well; it means the job runs as fast as a link that is too slow
# allows.
#
# Because the bandwidth term saturates at 2 x bytes / B, a link with `2 x bytes / B < backward` and
# no latency would hide communication at *any* N. The latency terms are what eventually cross
# backward on a fast link: 2(N-1) α per bucket grows without bound.
#
# ## Exercise 09.crossover — find the crossover, and the link that avoids it
#
# - `crossover_world_size(backward_ms, bucket_bytes, link_gbs, latency_us, max_world_size=2**40)`:
#   the **smallest** N whose comm busy exceeds backward, or `None` if no N up to
#   `max_world_size` does. Comm busy grows monotonically with N, so bisect; do not walk a trillion
#   integers one by one.
# - `min_link_gbs(world_size, backward_ms, bucket_bytes, latency_us)`: the slowest link (GB/s) with
#   which comm busy still fits in backward at that N: solve comm busy = backward for the bandwidth.
#   If the latency terms alone exceed backward no bandwidth helps: return `math.inf`. One device
#   needs no link: 0.
#
# You may call your `ring_allreduce_ms` and `predict_step` from above. The check compares with
# `hfstream.plan.overlap_limit` in four situations and tests your bandwidth with the planner.

# %%
def crossover_world_size(backward_ms, bucket_bytes, link_gbs, latency_us, max_world_size=2**40):
    """The first N with comm busy > backward (overlap can no longer be complete), or None."""
    # BEGIN SOLUTION
    def busy(n):
        return sum(ring_allreduce_ms(b, n, link_gbs, latency_us) for b in bucket_bytes)

    if busy(max_world_size) <= backward_ms:
        return None
    lo, hi = 1, max_world_size          # busy(lo) <= backward < busy(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if busy(mid) <= backward_ms else (lo, mid)
    return hi
    # END SOLUTION


def min_link_gbs(world_size, backward_ms, bucket_bytes, latency_us):
    """The slowest link in GB/s whose comm busy still fits in backward at `world_size` devices."""
    # BEGIN SOLUTION
    n = world_size
    if n <= 1:
        return 0.0
    left_ms = backward_ms - 2 * (n - 1) * latency_us * 1e-3 * len(bucket_bytes)
    if left_ms <= 0:
        return math.inf
    return 2 * (n - 1) / n * sum(bucket_bytes) / (left_ms / 1e3) / 1e9
    # END SOLUTION

# %%
check("09.crossover")

# %% [markdown]
# ## The ceiling rises: four ways to push the crossover out
#
# The planner makes the levers concrete. For llama-8b on the default A100 cluster the crossover is
# the N printed above. Each lever below changes one input and asks `overlap_limit` again:
#
# | lever | in hfstream / Hugging Face | what it changes |
# |---|---|---|
# | a faster link | the hardware (or fewer GPUs per NIC) | B |
# | bf16 on the wire | `GradSync(comm_dtype="bf16")`, `StreamTrainingArguments(grad_comm_dtype="bf16")` | bytes / 2 |
# | more tokens per optimizer step | a larger micro-batch, or gradient accumulation: `no_sync()` on all but the last micro-step (lesson 07) | backward x k, one all-reduce |
# | larger buckets | `bucket_mb` / `grad_bucket_mb` / DDP's `bucket_cap_mb` | fewer latencies |

# %%
levers = {"as is (25 GB/s, fp32, 8k tokens, 25 MiB buckets)": cfg,
          "link 50 GB/s": dataclasses.replace(cfg, link_gbs=50.0),
          "bf16 gradients on the wire": dataclasses.replace(cfg, grad_bytes=2),
          "4 micro-batches per step (no_sync)": dataclasses.replace(cfg, tokens_per_device=4 * 8192),
          "100 MiB buckets": dataclasses.replace(cfg, bucket_mb=100.0)}
for name, c in levers.items():
    r1024 = predict_row(shape, c, 1024)
    print(f"{name:<50} crossover N = {overlap_limit(shape, c)!s:>5} | at N=1024: comm {r1024['comm_busy_ms']:6.0f} ms, "
          f"backward {r1024['backward_ms']:6.0f} ms, step/compute {r1024['step_overlap_ms'] / predict_row(shape, c, 1)['step_overlap_ms']:.2f}")

# %%
_limit = overlap_limit(shape, cfg)
_grad_gib = shape.params * cfg.grad_bytes / 2**30
_big = dataclasses.replace(cfg, bucket_mb=100.0)
_saved = (predict_row(shape, cfg, 1024)["comm_busy_ms"] - predict_row(shape, _big, 1024)["comm_busy_ms"])
print(f"at the crossover (N = {_limit}) the bandwidth term alone needs "
      f"{ring_factor(_limit) * shape.params * cfg.grad_bytes / (cfg.link_gbs * 1e9) * 1e3:.0f} ms for "
      f"{_grad_gib:.1f} GiB of gradients over {cfg.link_gbs:g} GB/s; backward is "
      f"{predict_row(shape, cfg, _limit)['backward_ms']:.0f} ms")
print(f"100 MiB instead of 25 MiB buckets save {_saved:.0f} ms of latency at N = 1024")

# %% [markdown]
# Larger buckets do not move the crossover here: past it llama-8b is *bandwidth*-bound (the cell
# above prints the bandwidth term against backward), and fewer latencies cannot fix a bandwidth
# problem, though they do save latency at N = 1024. Halving the bytes or doubling the link does;
# so does giving backward more work per all-reduce. Which lever is yours to pull depends on what
# the planner says dominates: read the bandwidth and latency parts before tuning.
#
# ## The final challenge: a real run, graded against its ceiling
#
# Now measure. The **lab** trains a small MLP (8 layers of 128 x 128: 16 tensors, 0.5 MiB of fp32
# gradients) on **2 gloo ranks** of this machine, with the building blocks of lessons 03-06:
# `StreamPrefetcher` over a data source that takes a while per batch, `GradSync` for the
# gradients, and the step report (`hfstream.report.timeline.StepTimeline`) measuring every part.
#
# ### First, the real thing: nothing simulated
#
# Two settings of the lab over this machine's own loopback: real gloo all-reduces, batches that
# cost nothing to produce, 10 steps each. This is the one measurement of the lesson in which nothing is
# simulated; see what communication costs here.

# %%
from course.checks.lesson09 import run_lab, LAB, lab_tensors, NAIVE

real = run_lab({"real loopback: serial, one bucket": {"grad_sync": "serial", "bucket_mb": 25.0, "prefetch_depth": 0},
                "real loopback: overlap, 1/4 MiB": {"grad_sync": "overlap", "bucket_mb": 0.25, "prefetch_depth": 0}},
               simulate=False, lab={"data_share": 0.0, "steps": 10})
for name, r in real["runs"].items():
    print(f"{name:<36} backward {r['backward_ms']:6.1f} ms, comm busy {r['comm_busy_ms']:5.1f} ms, exposed "
          f"{r['exposed_comm_ms']:5.1f} ms, step {r['step_ms']:6.1f} ms, ceiling / step {r['efficiency']:.2f}")
_r = real["runs"]["real loopback: serial, one bucket"]
print(f"on this machine's loopback, reducing all {real['grad_bytes'] / 2**20:.2f} MiB of gradients keeps the link busy "
      f"{_r['comm_busy_ms']:.1f} ms, {_r['comm_busy_ms'] / _r['backward_ms']:.0%} of backward")

# %% [markdown]
# On one machine the loopback moves gigabytes per second, so communication is a small share of
# backward (the last line above) and there is little to hide: the regime of a small model on a
# fast interconnect, *before* the crossover. Real clusters at scale sit past it, as the planner
# showed for llama-8b. To study that regime on a laptop, the rest of the lab slows the link down.
#
# ### A simulated slow link
#
# From here on the ranks talk through `hfstream.testing.link.SimulatedLink`: the real gloo
# all-reduce runs, and its completion is delayed until latency + 2(N-1)/N x bytes / rate after its
# launch, one all-reduce at a time on the link, without blocking compute. So that the lab is in
# the same regime on a fast laptop and a loaded shared box, the link and the data follow the
# machine: before each step the link is set so that all gradients in one all-reduce take
# **1.2 x backward** (0.05 x backward of it latency, per all-reduce), and a batch takes
# **0.6 x (forward + backward)** to produce (a sleep, from the run's last three steps). The lab
# therefore sits *past the crossover*, communication-bound: its ceiling is
# `forward + link + optimizer`, and the link's time is the floor no configuration can beat.
#
# What the simulation leaves out: a real link's speed does not follow your backward; it has no
# congestion from other jobs, no jitter, no retransmits; and moving the bytes costs no CPU or
# memory bandwidth beyond gloo's loopback copy. Its results are about *scheduling* (when buckets
# start, what waits for what), not about any real network.
#
# Each run is graded on
#
# $$\text{efficiency} = \frac{\text{ceiling}}{\text{step}},\qquad
# \text{ceiling} = \text{forward} + \max(\text{backward},\ \text{link time of all gradients in one all-reduce}) + \text{optimizer}$$
#
# per step from the report, then the median over 20 steps. The ceiling is the report's, with one
# change: comm busy is replaced by what the link needs for your gradients in one piece, the least
# any bucketing can need. Otherwise splitting the model into many buckets (each paying the latency
# again) would raise your own ceiling and flatter your efficiency.
#
# Three settings side by side, interleaved step by step on the same simulated link:

# %%
explore = run_lab({"naive: serial, no prefetch": NAIVE,
                   "serial + prefetch 2": {"grad_sync": "serial", "bucket_mb": 25.0, "prefetch_depth": 2},
                   "overlap @ 25 MiB + prefetch 2": {"grad_sync": "overlap", "bucket_mb": 25.0, "prefetch_depth": 2}})


def print_runs(runs):
    print(f"{'run':<36}{'buckets':>8}{'data':>7}{'fwd':>6}{'bwd':>6}{'link':>6}{'busy':>6}{'exposed':>8}{'opt':>5}"
          f"{'step':>7}{'ceiling':>8}{'efficiency':>11}")
    for name, r in runs.items():
        print(f"{name:<36}{r['buckets']:>8}{r['data_wait_ms']:>7.1f}{r['forward_ms']:>6.1f}{r['backward_ms']:>6.1f}"
              f"{r['link_ms']:>6.1f}{r['comm_busy_ms']:>6.1f}{r['exposed_comm_ms']:>8.1f}{r['optimizer_ms']:>5.1f}"
              f"{r['step_ms']:>7.1f}{r['ceiling_ms']:>8.1f}{r['efficiency']:>11.2f}")


print_runs(explore["runs"])

# %% [markdown]
# Prefetching removes the data wait. Overlap at the default 25 MiB cap changes little: the whole
# model is 0.5 MiB, so it travels in *one* bucket, which is complete only when backward ends,
# exactly like serial. The cap has to cut this model into several buckets: the smaller the first
# one, the earlier the link starts; but every bucket pays the latency again, and on a
# communication-bound step every latency adds straight to the step. Which cap is best is a
# question for a planner, and this time the planner is yours.
#
# Its inputs come from the measured run: the lab's parts (forward, backward, optimizer of the
# serial + prefetch run), its link at the end of that run (the per-all-reduce latency spread over
# the 2(N-1) = 2 ring steps of two ranks, so that your `ring_allreduce_ms` prices it), and the
# buckets each cap makes, `lab_buckets(cap)`: `[(bytes, ready), ...]` in launch order, `ready`
# being the fraction of backward done when the bucket's last gradient exists (the cut GradSync
# makes, from `hfstream.plan.predict_buckets`).

# %%
ref = explore["runs"]["serial + prefetch 2"]
lab_shape = ModelShape("lab MLP", sum(n for _, n in lab_tensors()),
                       tuple((name, n, "dense") for name, n in lab_tensors()))
lab_parts = {"forward_ms": ref["forward_ms"], "backward_ms": ref["backward_ms"], "optimizer_ms": ref["optimizer_ms"]}
lab_link_gbs = ref["link"]["rate_mbit"] / 8000
lab_latency_us = ref["link"]["latency_ms"] * 1e3 / 2


def lab_buckets(cap):
    """The lab model's buckets at `cap` MiB: [(bytes, ready fraction of backward), ...] in launch order."""
    return predict_buckets(lab_shape, 4, cap)


print({k: round(v, 1) for k, v in lab_parts.items()}, f"link {lab_link_gbs * 1e3:.1f} MB/s, {lab_latency_us:.0f} us per ring step")
for cap in (0, 3 / 8, 25.0):
    print(f"lab_buckets({cap:g}): {len(lab_buckets(cap))} buckets, the first ready at "
          f"{lab_buckets(cap)[0][1]:.0%} of backward")

# %% [markdown]
# ## Exercise 09.final_challenge — plan the buckets, then get a real run close to its ceiling
#
# Two functions:
#
# - `overlap_step_ms(buckets, forward_ms, backward_ms, optimizer_ms, world_size, link_gbs, latency_us)`:
#   the step with overlap, as the planner schedules it. Backward produces the buckets in the
#   order given; a bucket's all-reduce can start once backward has produced its last gradient
#   (its `ready` fraction of backward) *and* the link has finished the previous bucket; the link
#   reduces one bucket at a time, each priced by your `ring_allreduce_ms`; the optimizer starts
#   when backward has ended and the last reduction is done. The check compares it with
#   `hfstream.plan.predict_row` on llama-8b, llama-1b and the lab model.
# - `final_run_config()`: the settings of your graded run, `grad_sync` (`"serial"` or
#   `"overlap"`), `bucket_mb` (MiB; 0 = one tensor per bucket, `float("inf")` = one bucket) and
#   `prefetch_depth` (0 = none). Choose the cap with your planner on the lab's inputs above;
#   which caps are worth asking about is for you to find out.
#
# The check runs the lab with your settings on 2 ranks and passes when the measured
# **efficiency = ceiling / step is at least** the pass line printed below; its detail line prints
# what it measured. A result just below the line (within 0.08) is measured once more, and the
# median over the steps of both runs counts. Your planner knows nothing of this CPU's contention
# (gloo's threads and the ranks share two cores), so the measured efficiency lands below what it
# predicts; the pass line leaves room for that.

# %%
from course.checks.lesson09 import THRESHOLD
print(f"pass line: ceiling / step >= {THRESHOLD:.2f}")


def overlap_step_ms(buckets, forward_ms, backward_ms, optimizer_ms, world_size, link_gbs, latency_us):
    """The overlapped step (ms): buckets reduced one at a time, each from when it is ready."""
    # BEGIN SOLUTION
    end = 0.0                                    # when the link finishes its last reduction so far
    for nbytes, ready in buckets:
        end = max(ready * backward_ms, end) + ring_allreduce_ms(nbytes, world_size, link_gbs, latency_us)
    return forward_ms + max(backward_ms, end) + optimizer_ms
    # END SOLUTION


def final_run_config():
    """Your lab run: {'grad_sync': ..., 'bucket_mb': ..., 'prefetch_depth': ...}."""
    # BEGIN SOLUTION
    caps = [0, 1 / 32, 1 / 16, 1 / 8, 3 / 16, 1 / 4, 1 / 2, math.inf]
    best = min(caps, key=lambda cap: overlap_step_ms(lab_buckets(cap), **lab_parts, world_size=2,
                                                     link_gbs=lab_link_gbs, latency_us=lab_latency_us))
    return {"grad_sync": "overlap", "bucket_mb": best, "prefetch_depth": 2}
    # END SOLUTION

# %%
check("09.final_challenge")

# %% [markdown]
# ## The sweep, now that you have chosen
#
# The planner's prices for a range of caps (hfstream's, calibrated to the measured run the way
# `hfstream plan --compare bench.json --calibrate-from backward` calibrates to a benchmark: the
# FLOP/s that reproduce the measured backward, the memory bandwidth that reproduces the optimizer
# step; a cap changes only what backward hides), next to yours, and
# then the lab measured at several of them, interleaved on the same simulated link (15 steps each,
# so a little noisier than the graded run).

# %%
lab_cfg = PlanConfig(tokens_per_device=LAB["batch"], link_gbs=lab_link_gbs, latency_us=lab_latency_us, world_sizes=(2,))
lab_cfg.compute_tflops = calibrated_tflops(lab_shape, lab_cfg, ref["backward_ms"])
lab_cfg.mem_bandwidth_gbs = calibrated_mem_bandwidth_gbs(lab_shape, lab_cfg, ref["optimizer_ms"])
lab_ceiling = predict_row(lab_shape, dataclasses.replace(lab_cfg, bucket_mb=math.inf), 2)["ideal_ms"]


def predict_lab(config):
    """hfstream's planner: predicted step / ceiling for one lab configuration (data hidden when prefetching)."""
    row = predict_row(lab_shape, dataclasses.replace(lab_cfg, bucket_mb=config["bucket_mb"]), 2)
    step = row["step_overlap_ms"] if config["grad_sync"] == "overlap" else row["step_serial_ms"]
    if config["prefetch_depth"] == 0:
        step += ref["link"]["data_ms"]
    return step / lab_ceiling


yours = final_run_config()
print(f"{'bucket_mb':>10}{'buckets':>8}{'comm busy':>10}{'exposed':>9}{'planner step/ceiling':>21}{'your step (ms)':>15}")
for cap in sorted({0, 1 / 16, 1 / 8, 3 / 16, 1 / 4, 1 / 2, 25.0, yours["bucket_mb"]}):
    row = predict_row(lab_shape, dataclasses.replace(lab_cfg, bucket_mb=cap), 2)
    mine = overlap_step_ms(lab_buckets(cap), **lab_parts, world_size=2, link_gbs=lab_link_gbs, latency_us=lab_latency_us)
    print(f"{cap:>10.4g}{len(lab_buckets(cap)):>8}{row['comm_busy_ms']:>10.1f}{row['exposed_overlap_ms']:>9.1f}"
          f"{predict_lab({'grad_sync': 'overlap', 'bucket_mb': cap, 'prefetch_depth': 2}):>21.2f}{mine:>15.1f}"
          + ("   <- your choice" if cap == yours["bucket_mb"] else ""))

sweep = run_lab({f"overlap @ {cap:g} MiB + prefetch 2": {"grad_sync": "overlap", "bucket_mb": cap, "prefetch_depth": 2}
                 for cap in (0, 1 / 16, 1 / 4)}, lab={"steps": 15})
print_runs(sweep["runs"])
measured_runs = {**explore["runs"], **sweep["runs"]}
for name, r in measured_runs.items():
    print(f"{name:<36} measured {r['efficiency']:.2f}, planner {1 / predict_lab(r['config']):.2f}: "
          f"{'passes' if r['efficiency'] >= THRESHOLD else 'below'} the line")

# %% [markdown]
# Where the planner predicts a higher efficiency than the lab measures (compare the last lines
# above), that is what it does not model: on a CPU gloo's threads take compute time from backward
# while they reduce, with the lab's 2 ranks sharing 2 cores, and a shared machine has slow seconds.
# On a GPU, NCCL reduces on the device and the host only launches, and the planner comes closer.
#
# ## The figure: step / ceiling from 2 to 1024 devices, and where your run landed
#
# Left: the planner for llama-8b on the A100 cluster above (a model: nothing on it is measured).
# The serial step's distance from the ceiling stays large at every N; overlap stays close to it,
# but past the crossover (grey line) the ceiling itself climbs away from the compute-only step
# (dashed: ceiling / compute-only step, the cell prints its value at N = 1024): that is the cost of
# being communication-bound. Right: the lab's runs measured on this machine over the **simulated**
# link (filled; your final-challenge run is the star) next to what hfstream's planner, calibrated
# to the lab, predicted for each (hollow), and the two real loopback runs (squares), where nothing
# is simulated and communication is small. A measured point above its prediction is what the
# planner does not model: here, CPU contention between compute and gloo's threads, and a shared
# machine's noise.

# %%
from fractions import Fraction
from matplotlib.figure import Figure
from course.checks.lesson09 import LAST_CHALLENGE

sizes = [2**i for i in range(1, 11)]
doc = plan(shape, dataclasses.replace(cfg, world_sizes=tuple(sizes)))
fig = Figure(figsize=(12, 4.6))
ax1, ax2 = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1, 1.4]})
rows = doc["rows"]
compute_only = rows[0]["forward_ms"] + rows[0]["backward_ms"] + rows[0]["optimizer_ms"]
ax1.plot(sizes, [r["step_serial_ms"] / r["ideal_ms"] for r in rows], "o-", color="#c44e52", label="serial step / ceiling")
ax1.plot(sizes, [r["step_overlap_ms"] / r["ideal_ms"] for r in rows], "s-", color="#4c72b0", label="overlap step / ceiling")
ax1.plot(sizes, [r["ideal_ms"] / compute_only for r in rows], "k--", label="ceiling / compute-only step")
ax1.axhline(1.0, color="#55a868", lw=1, ls=":")
if doc["overlap_incomplete_from"]:
    ax1.axvline(doc["overlap_incomplete_from"], color="grey", lw=0.8,
                label=f"crossover: comm busy > backward from N = {doc['overlap_incomplete_from']}")
ax1.set_title(f"planner (a model): {shape.name}, {cfg.link_gbs:g} GB/s, {cfg.latency_us:g} us, 25 MiB buckets", fontsize=9)
print(f"ceiling / compute-only step at N = {sizes[-1]}: {rows[-1]['ideal_ms'] / compute_only:.2f}")

runs = {name: r for name, r in measured_runs.items()}
mine = LAST_CHALLENGE or None          # your graded run, once the check has measured it
if mine is not None:
    runs["your run"] = mine
def short(config):
    """A tick label: 'overlap\n1/16 MiB\nprefetch 2'."""
    cap = config["bucket_mb"]
    cap = "one bucket" if cap >= 0.5 else "per tensor" if cap == 0 else f"{Fraction(cap).limit_denominator(64)} MiB"
    return f"{config['grad_sync']}\n{cap}\nprefetch {config['prefetch_depth']}"


labels = [("your run:\n" if name == "your run" else "") + short(r["config"]) for name, r in runs.items()]
xs = list(range(len(runs)))
ax2.plot(xs, [predict_lab(r["config"]) for r in runs.values()], "o", mfc="none", mec="black", ms=10,
         label="hfstream planner, calibrated to the lab")
for x, (name, measured) in zip(xs, runs.items()):
    ax2.plot([x], [1 / measured["efficiency"]], "*" if name == "your run" else "o", ms=16 if name == "your run" else 9,
             color="#4c72b0" if name == "your run" else "#c44e52",
             label="your run, measured" if name == "your run" else ("measured, simulated link" if x == 0 else None))
    ax2.annotate(f"{1 / measured['efficiency']:.2f}", (x, 1 / measured["efficiency"]), textcoords="offset points",
                 xytext=(10, -3), fontsize=8)
xr = len(runs)
ax2.axvline(xr - 0.5, color="black", lw=0.6)
for k, (name, r) in enumerate(real["runs"].items()):
    ax2.plot([xr + k], [1 / r["efficiency"]], "s", ms=9, color="#55a868",
             label="measured, real loopback (nothing simulated)" if k == 0 else None)
    ax2.annotate(f"{1 / r['efficiency']:.2f}", (xr + k, 1 / r["efficiency"]), textcoords="offset points", xytext=(10, -3), fontsize=8)
    labels.append("real loopback:\n" + short(r["config"]))
ax2.axhline(1 / THRESHOLD, color="grey", ls="--", lw=0.8,
            label=f"pass line: step / ceiling {1 / THRESHOLD:.2f} (efficiency = ceiling / step {THRESHOLD:.2f})")
ax2.axhline(1.0, color="#55a868", lw=1, ls=":")
ax2.set_xticks(range(len(labels)), labels, fontsize=6.5)
ax2.set_xlim(-0.5, len(labels) - 0.5)
ax2.set_title("the lab at N = 2. SIMULATED link: its speed is set each step from this machine's backward\n"
              "(1.2 x backward per all-reduce); no congestion, no jitter, no network CPU cost", fontsize=8)
ax2.set_ylabel("step / ceiling (1 = at the ceiling; labels: its value)")
ax2.legend(fontsize=7)
ax1.set_xscale("log", base=2)
ax1.set_xlabel("world size N")
ax1.set_ylabel("step / ceiling (1 = at the ceiling)")
ax1.legend(fontsize=7)
fig.tight_layout()
fig.savefig(figure_path("09_scale.png"), dpi=110)
show(figure_path("09_scale.png"))

# %% tags=["hidden-check"]
assert mine is not None and mine["efficiency"] > explore["runs"]["naive: serial, no prefetch"]["efficiency"], mine
assert explore["runs"]["naive: serial, no prefetch"]["efficiency"] < THRESHOLD
assert all(r["step_serial_ms"] >= r["ideal_ms"] - 1e-9 for r in rows)
assert all(r["comm_busy_ms"] < r["backward_ms"] for r in real["runs"].values()), real["runs"]

# %% [markdown]
# ### On a GPU
#
# The planner's compute input is the device's FLOP/s. The cell below measures a bf16 matmul on the
# accelerator and plans llama-8b at half of it (a typical MFU) instead of the A100 default.

# %% tags=["gpu"]
# GPU: a bf16 matmul timed with device events gives this GPU's FLOP/s; on an H100/H200 it is roughly 600-900 TFLOP/s, so backward shrinks and the planner's crossover moves to a smaller N than on the A100 default.
dev = accelerator_device()
a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
for _ in range(3):
    a @ b
torch.accelerator.synchronize()
t0, t1 = torch.Event(enable_timing=True), torch.Event(enable_timing=True)
t0.record()
for _ in range(20):
    a @ b
t1.record()
t1.synchronize()
matmul_tflops = 20 * 2 * 8192**3 / (t0.elapsed_time(t1) / 1e3) / 1e12
gpu_cfg = dataclasses.replace(cfg, compute_tflops=0.5 * matmul_tflops)
print(f"bf16 matmul: {matmul_tflops:.0f} TFLOP/s; llama-8b at half of it: comm exceeds backward from "
      f"N = {overlap_limit(shape, gpu_cfg)} (A100 default: N = {overlap_limit(shape, cfg)})")

# %% [markdown]
# ## What you have now
#
# - the ring all-reduce cost, `2(N-1)/N x bytes / B + 2(N-1) x latency` per bucket, and why the
#   first term saturates while the second grows;
# - the crossover where comm busy passes backward: before it overlap makes devices almost free,
#   after it the link sets the ceiling and the ceiling rises with N;
# - the levers that move it (link, bytes on the wire, work per all-reduce, buckets) and the
#   planner to price each one before buying hardware: `hfstream plan`;
# - your own planner of the overlapped schedule, and a real run over a simulated slow link,
#   configured from it and measured against its ceiling (and one run where nothing is simulated).
#
# That is the course: from the map of lesson 00 to a measured step near its ceiling. The library
# you used in every lesson is the one you can put in your own training:
# `StreamTrainer(args=StreamTrainingArguments(prefetch_depth=2, grad_sync="overlap"))`, with
# `trainer.stream_report()` telling you, step by step, how far from the ceiling you are.
