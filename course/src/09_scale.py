# %% [markdown]
# # Lesson 09 — The ceiling at scale
#
# **Time:** 45 minutes. **Runs on:** any laptop (CPU; the lab at the end runs 2 gloo processes for
# about 10 seconds at a time). **You will:** predict communication, step time and the ceiling from
# 8 to 1024 devices with the planner (`hfstream plan`), write the ring all-reduce cost with its
# latency terms, find the world size from which overlap can no longer hide communication, and
# finish with a real 2-rank run over a slow link that you configure to get close to its ceiling.
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
# Each device sends 2(N-1) chunks of b/N bytes, and every step pays the link's latency α once:
#
# $$T(b, N) = \frac{2(N-1)}{N}\cdot\frac{b}{B} + 2(N-1)\,\alpha$$
#
# (Thakur, Rabenseifner and Gropp, "Optimization of Collective Communication Operations in MPICH",
# 2005; the factor 2(N-1)/N is what NCCL's tests call the *bus bandwidth* factor.) The two terms
# behave very differently:
#
# - the **bandwidth term saturates**: 2(N-1)/N is 1 at N = 2, 1.75 at N = 8 and 1.998 at N = 1024.
#   From 8 to 1024 devices each byte costs only 14 % more;
# - the **latency term grows linearly** with N, and it is paid once per all-reduce, that is once
#   per *bucket*. A model in 200 buckets pays 200 x 2(N-1) latencies per step.
#
# The link is busy for `comm_busy` = the sum of T over the buckets, and the ceiling is the one you
# wrote in lesson 00, `ideal = forward + max(backward, comm_busy) + optimizer`. The next cell prints
# both terms for one 25 MiB bucket on a 25 GB/s link with 5 µs per ring step (a 200 Gbit/s
# InfiniBand port per GPU).

# %%
import contextlib, math, os, queue, threading, time
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from course.lib import *
import dataclasses
from hfstream.tools.plan import (PlanConfig, ModelShape, load_model, plan, predict_buckets, predict_row, overlap_limit,
                                 allreduce_s, ring_factor, calibrated_tflops, calibrated_mem_bandwidth_gbs)
from hfstream.tools.plan import main as hfstream_plan   # `hfstream plan ...` on the command line

bucket = 25 * 2**20
print(f"{'N':>5} {'2(N-1)/N':>9} {'bandwidth ms':>13} {'latency ms':>11} {'all-reduce ms':>14}")
for n in (2, 8, 64, 256, 1024):
    bw_ms = allreduce_s(bucket, n, 25.0, 0.0) * 1e3
    total = allreduce_s(bucket, n, 25.0, 5.0) * 1e3
    print(f"{n:>5} {ring_factor(n):>9.3f} {bw_ms:>13.3f} {total - bw_ms:>11.3f} {total:>14.3f}")

# %% [markdown]
# At N = 1024 the latency of one 25 MiB all-reduce (10 ms) is five times its bandwidth term. That is
# why collective libraries switch to tree and hierarchical algorithms at scale (NCCL picks between
# ring and tree per message size), and why bucket size matters more, not less, on many devices.
#
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
# Read it row by row. Compute stays put (985 ms forward, 1970 ms backward on an A100 at 40 % MFU
# with 8192 tokens per device). Comm busy passes backward already at N = 5: from there on the
# ceiling is `forward + comm busy + optimizer`, it rises with N, and the serial step is 1.35 to 1.6
# times the ceiling. With overlap the step stays within a few percent of the ceiling, because
# only the tail of the communication is exposed; but the ceiling itself keeps climbing.
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
# The check compares you with `hfstream.tools.plan` for llama-8b's 194 buckets at N = 1, 2, 8, 64, 1024.

# %%
def ring_allreduce_ms(nbytes, world_size, link_gbs, latency_us):
    """One ring all-reduce: 2(N-1)/N x bytes / bandwidth + 2(N-1) x latency, in ms."""
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
# `hfstream.tools.plan.overlap_limit` in four situations and tests your bandwidth with the planner.

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
# N = 5. Each lever below changes one input and asks `overlap_limit` again:
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

# %% [markdown]
# Larger buckets do not move the crossover here: llama-8b at N = 5 is *bandwidth*-bound (30 GiB of
# gradients over 25 GB/s), and fewer latencies cannot fix a bandwidth problem (they do save 650 ms
# of latency at N = 1024). Halving the bytes or doubling the link does; so does giving backward
# more work per all-reduce. Which lever is yours to pull depends on what the planner says
# dominates: read the bandwidth and latency parts before tuning.
#
# ## The final challenge: a real run, graded against its ceiling
#
# Now measure. The **lab** trains a small MLP (8 layers of 128 x 128: 16 tensors, 0.5 MiB of fp32
# gradients) on **2 gloo ranks** of this machine, with the building blocks of lessons 03-06:
# `StreamPrefetcher` over a data source that takes a while per batch, `GradSync` for the
# gradients, and the step report (`hfstream.timeline.StepTimeline`) measuring every part. The
# ranks talk through `hfstream.tools.bench.link.SimulatedLink`: each all-reduce completes no earlier than
# latency + 2(N-1)/N x bytes / rate after its launch, one at a time, without blocking compute.
#
# So that the lab is in the same regime on a fast laptop and a loaded shared box, the link and the
# data follow the machine: before each step, the link is set so that all gradients in one
# all-reduce take **1.2 x backward** (0.05 x backward of it latency, per all-reduce), and a batch
# takes **0.6 x (forward + backward)** to produce (both from the run's last three steps). The lab
# therefore sits *past the crossover*, communication-bound, like llama-8b beyond N = 5: its ceiling
# is `forward + link + optimizer`, and the link's time is the floor no configuration can beat.
# What overlap can still do there is start the link early in backward and keep it busy to the end;
# a serial step leaves the link idle for the whole backward and the CPU idle for the whole
# reduction.
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
# First, three settings side by side, interleaved step by step on the same link:

# %%
from course.checks.lesson09 import run_lab, LAB, lab_tensors, NAIVE

explore = run_lab({"naive: serial, no prefetch": NAIVE,
                   "serial + prefetch 2": {"grad_sync": "serial", "bucket_mb": 25.0, "prefetch_depth": 2},
                   "overlap @ 25 MiB + prefetch 2": {"grad_sync": "overlap", "bucket_mb": 25.0, "prefetch_depth": 2}})
print(f"{'run':<31}{'buckets':>8}{'data':>7}{'fwd':>6}{'bwd':>6}{'link':>6}{'busy':>6}{'exposed':>8}{'opt':>5}"
      f"{'step':>7}{'ceiling':>8}{'efficiency':>11}")
for name, r in explore["runs"].items():
    print(f"{name:<31}{r['buckets']:>8}{r['data_wait_ms']:>7.1f}{r['forward_ms']:>6.1f}{r['backward_ms']:>6.1f}"
          f"{r['link_ms']:>6.1f}{r['comm_busy_ms']:>6.1f}{r['exposed_comm_ms']:>8.1f}{r['optimizer_ms']:>5.1f}"
          f"{r['step_ms']:>7.1f}{r['ceiling_ms']:>8.1f}{r['efficiency']:>11.2f}")

# %% [markdown]
# Prefetching removes the data wait. Overlap at the default 25 MiB cap changes nothing: the whole
# model is 0.5 MiB, so it travels in *one* bucket, which is complete only when backward ends,
# exactly like serial. The cap has to cut this model into several buckets: the smaller the first
# one, the earlier the link starts; but every bucket pays the latency again, and on a
# communication-bound step every latency adds straight to the step. The planner, calibrated to
# the measured run, prices each cap. Calibrating means choosing the FLOP/s that reproduce the
# measured backward and the memory bandwidth that reproduces the measured optimizer step (what
# `hfstream plan --compare bench.json` does with a benchmark); the link is the lab's, its
# per-all-reduce latency spread over the 2(N-1) = 2 ring steps of two ranks.

# %%
ref = explore["runs"]["serial + prefetch 2"]
lab_shape = ModelShape("lab MLP", sum(n for _, n in lab_tensors()),
                       tuple((name, n, "dense") for name, n in lab_tensors()))
lab_cfg = PlanConfig(tokens_per_device=LAB["batch"], link_gbs=ref["link"]["rate_mbit"] / 8000,
                     latency_us=ref["link"]["latency_ms"] * 1e3 / 2, world_sizes=(2,))
lab_cfg.compute_tflops = calibrated_tflops(lab_shape, lab_cfg, ref["backward_ms"])
lab_cfg.mem_bandwidth_gbs = calibrated_mem_bandwidth_gbs(lab_shape, lab_cfg, ref["optimizer_ms"])


def predict_lab(config, world_size=2):
    """The planner's step / ceiling for one lab configuration (data hidden when prefetching)."""
    c = dataclasses.replace(lab_cfg, bucket_mb=config["bucket_mb"])
    row = predict_row(lab_shape, c, world_size)
    ceiling = predict_row(lab_shape, dataclasses.replace(lab_cfg, bucket_mb=math.inf), world_size)["ideal_ms"]
    step = row["step_overlap_ms"] if config["grad_sync"] == "overlap" else row["step_serial_ms"]
    if config["prefetch_depth"] == 0:
        step += ref["link"]["data_ms"]
    return step / ceiling, len(predict_buckets(lab_shape, 4, config["bucket_mb"])), row


print(f"{'bucket_mb':>10}{'buckets':>8}{'comm busy':>10}{'exposed':>9}{'pred. step/ceiling':>19}")
candidates = {}
for cap in (0, 1 / 16, 1 / 8, 3 / 16, 1 / 4, 1 / 2, 25.0):
    ratio, nb, row = predict_lab({"grad_sync": "overlap", "bucket_mb": cap, "prefetch_depth": 2})
    candidates[cap] = ratio
    print(f"{cap:>10.4g}{nb:>8}{row['comm_busy_ms']:>10.1f}{row['exposed_overlap_ms']:>9.1f}{ratio:>19.2f}")
planner_best_mb = min(candidates, key=candidates.get)
print(f"the planner's choice: bucket_mb = {planner_best_mb:g}")

# %% [markdown]
# ## Exercise 09.final_challenge — get a real run close to its ceiling
#
# `final_run_config()` returns the settings of your run: `grad_sync` (`"serial"` or `"overlap"`),
# `bucket_mb` (MiB; 0 = one tensor per bucket, `float("inf")` = one bucket) and `prefetch_depth`
# (0 = none). The check runs the lab with them on 2 ranks and passes when the measured
# **efficiency = ceiling / step is at least 0.72**; its detail line prints what it measured. A
# result just below the line (within 0.08) is measured once more, and the median over the steps of
# both runs counts.
#
# What the author measured on the course's shared 2-core machine (each row: the median of 20 steps,
# the range over 6 runs interleaved with each other, at load averages of 3 to 5, i.e. with other
# jobs running):
#
# | setting | efficiency |
# |---|---|
# | naive: serial, 25 MiB, no prefetch | 0.45 - 0.49 |
# | serial, prefetch 2 | 0.61 - 0.69 |
# | overlap at 25 MiB (one bucket), prefetch 2 | 0.62 - 0.68 |
# | overlap, one tensor per bucket (16 buckets), prefetch 2 | 0.64 - 0.66 |
# | overlap at 1/16 MiB (8 buckets), prefetch 2 | 0.74 - 0.79 |
# | overlap at 1/8 MiB (4 buckets), prefetch 2 | 0.75 - 0.80 |
# | overlap at 3/16 MiB (3 buckets), prefetch 2 | 0.71 - 0.79 |
# | overlap at 1/4 MiB (2 buckets), prefetch 2 | 0.71 - 0.79 |
# | overlap at 1/8 MiB (4 buckets), no prefetch | 0.52 - 0.57 |
#
# The line at 0.72 sits between the best serial or one-bucket run (0.69) and the worst run of the
# planner's choice (0.75); under heavier load (load average 8 to 11) every row drops by up to 0.05,
# which the second measurement absorbs. The planner predicts a little more than the lab measures
# (about 0.84 for 4 buckets): it does not know that on a CPU gloo's threads take compute time from
# backward while they reduce, with the lab's 2 ranks sharing 2 cores. On a GPU, NCCL reduces on the
# device and the host only launches, and the planner comes closer.

# %%
def final_run_config():
    """Your lab run: {'grad_sync': ..., 'bucket_mb': ..., 'prefetch_depth': ...}."""
    # BEGIN SOLUTION
    return {"grad_sync": "overlap", "bucket_mb": planner_best_mb, "prefetch_depth": 2}
    # END SOLUTION

# %%
check("09.final_challenge")

# %% [markdown]
# ## The figure: step / ceiling from 2 to 1024 devices, and where your run landed
#
# Left: the planner for llama-8b on the A100 cluster above. The serial step's distance from the
# ceiling stays large at every N; overlap stays close to it, but past the crossover (grey line) the
# ceiling itself climbs away from the compute-only step (dashed: ceiling / compute-only step, 1.8 at
# N = 1024): that is the cost of being communication-bound. Right: the lab's runs measured on this
# machine (filled; your final-challenge run is the star) next to what the planner calibrated to the
# lab predicted for each (hollow). A measured point above its prediction is what the planner does
# not model: here, CPU contention between compute and gloo's threads, and a shared machine's noise.

# %%
from matplotlib.figure import Figure
from course.checks.lesson09 import LAST_CHALLENGE, THRESHOLD

sizes = [2**i for i in range(1, 11)]
doc = plan(shape, dataclasses.replace(cfg, world_sizes=tuple(sizes)))
fig = Figure(figsize=(11, 4.0))
ax1, ax2 = fig.subplots(1, 2)
rows = doc["rows"]
compute_only = rows[0]["forward_ms"] + rows[0]["backward_ms"] + rows[0]["optimizer_ms"]
ax1.plot(sizes, [r["step_serial_ms"] / r["ideal_ms"] for r in rows], "o-", color="#c44e52", label="serial step / ceiling")
ax1.plot(sizes, [r["step_overlap_ms"] / r["ideal_ms"] for r in rows], "s-", color="#4c72b0", label="overlap step / ceiling")
ax1.plot(sizes, [r["ideal_ms"] / compute_only for r in rows], "k--", label="ceiling / compute-only step")
ax1.axhline(1.0, color="#55a868", lw=1, ls=":")
if doc["overlap_incomplete_from"]:
    ax1.axvline(doc["overlap_incomplete_from"], color="grey", lw=0.8)
ax1.set_title(f"planner: {shape.name}, {cfg.link_gbs:g} GB/s, {cfg.latency_us:g} us, 25 MiB buckets", fontsize=9)

runs = {name: (explore["runs"][name], explore["runs"][name]["config"]) for name in explore["runs"]}
mine = LAST_CHALLENGE or None          # your graded run, once the check has measured it
if mine is not None:
    runs["your run"] = (mine, mine["config"])
labels = [name.replace(": ", ":\n").replace(" + ", "\n+ ") for name in runs]
xs = range(len(runs))
ax2.plot(xs, [predict_lab(config)[0] for _, config in runs.values()], "o", mfc="none", mec="black", ms=10,
         label="planner, calibrated to the lab")
for x, (name, (measured, _)) in zip(xs, runs.items()):
    ax2.plot([x], [1 / measured["efficiency"]], "*" if name == "your run" else "o", ms=16 if name == "your run" else 9,
             color="#4c72b0" if name == "your run" else "#c44e52",
             label="your run, measured" if name == "your run" else ("measured" if x == 0 else None))
    ax2.annotate(f"{measured['efficiency']:.2f}", (x, 1 / measured["efficiency"]), textcoords="offset points",
                 xytext=(10, -3), fontsize=8)
ax2.axhline(1 / THRESHOLD, color="grey", ls="--", lw=0.8, label=f"pass line: efficiency {THRESHOLD:.2f}")
ax2.axhline(1.0, color="#55a868", lw=1, ls=":")
ax2.set_xticks(list(xs), labels, fontsize=7)
ax2.set_xlim(-0.5, len(runs) - 0.5)
ax2.set_title("the lab at N = 2: planner (hollow) vs measured here (filled, efficiency printed)", fontsize=9)
ax2.set_ylabel("step / ceiling (1 = at the ceiling)")
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
# - a real run over a slow link, configured from a calibrated prediction and measured against its
#   ceiling.
#
# That is the course: from the map of lesson 00 to a measured step near its ceiling. The library
# you used in every lesson is the one you can put in your own training:
# `StreamTrainer(args=StreamTrainingArguments(prefetch_depth=2, grad_sync="overlap"))`, with
# `trainer.stream_report()` telling you, step by step, how far from the ceiling you are.
