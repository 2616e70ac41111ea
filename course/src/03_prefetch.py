# %% [markdown]
# # Lesson 03 — Prefetching
#
# **Time:** 40 minutes. **Runs on:** any laptop (CPU: a background thread); a GPU adds copies on a
# side stream. **You will:** measure how long a training loop waits for its data, build a depth-N
# prefetcher (a thread, a bounded queue, errors delivered at the right step, a clean stop), predict
# how deep it must be, and measure it against the stock loop, `hfstream.StreamPrefetcher` and the
# ceiling.
#
# ## Where the stock loop waits
#
# ```python
# for batch in loader:          # next(iterator): fetch samples, collate them, (copy to the device)
#     loss = train_step(batch)  # forward, backward, optimizer
# ```
#
# With `DataLoader(num_workers=0)` — and `Trainer`'s default `dataloader_num_workers=0` — the
# `for` statement fetches and collates each batch **in the training process, between two steps**.
# Nothing else runs meanwhile: on a GPU the device sits idle while the host decodes, augments or
# tokenizes. A step then costs `collate + compute`, although the two do not depend on each other:
# batch *k+1* can be prepared while step *k* computes, and then a step costs `max(collate, compute)`.
# That is the ceiling of lesson 00 with the data wait hidden.
#
# The real tools that do this, and what each costs:
#
# | tool | what runs ahead | cost |
# |---|---|---|
# | `DataLoader(num_workers=N, prefetch_factor=2)`; Trainer's `dataloader_num_workers`, `dataloader_prefetch_factor` | N worker *processes*, each `prefetch_factor` batches ahead | a process per worker (started every epoch unless `persistent_workers=True`), every batch pickled through shared memory, a copy of the dataset object per worker |
# | `DataLoader(pin_memory=True)`; Trainer's `dataloader_pin_memory` | a thread that copies each batch into page-locked memory | only what a non-blocking copy to the GPU needs; it does not hide collate |
# | a background **thread** and a bounded queue (this lesson; `StreamPrefetcher`'s CPU path) | one thread, `depth` batches ahead | nothing to start or pickle, but threads share the GIL: it hides work that releases the GIL (I/O, `time.sleep`, torch ops, Rust tokenizers), not pure-Python loops |
# | copies on a side stream (lesson 02; `StreamPrefetcher`'s accelerator path) | host→device copies of the next `depth` batches | pinned memory, one event per batch |
#
# ## The workload
#
# A real `DataLoader` over a small regression set, whose `collate_fn` stacks the samples and then
# **sleeps** `COLLATE_MS`: it stands for decoding, augmenting or tokenizing, work that releases the
# GIL. A training step is a real `TinyMLP` step padded with a sleep to `COMPUTE_MS`: the sleep stands
# for an accelerator busy with the step while the host waits for it, which is exactly when a host
# thread can prepare the next batch for free. Sleeps keep the measurement honest on a laptop whose
# cores are busy with other work: a sleeping thread needs no core.

# %%
import contextlib, math, os, queue, threading, time
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from course.lib import *
import statistics
from hfstream import StreamPrefetcher

torch.set_num_threads(1)     # one core computes; the other stays free for the prefetch thread
COLLATE_MS, COMPUTE_MS, BATCH, STEPS = 25.0, 25.0, 16, 12


class SlowCollate:
    """Stack samples into a batch, then sleep `ms`: stands for decoding, augmenting, tokenizing."""

    def __init__(self, ms):
        self.ms = ms

    def __call__(self, samples):
        time.sleep(self.ms / 1e3)
        xs, ys = zip(*samples)
        return {"x": torch.stack(xs), "y": torch.stack(ys)}


x_all, y_all = random_regression(n=BATCH * STEPS, dim=32)
dataset = torch.utils.data.TensorDataset(x_all, y_all)


def make_loader(collate_ms=COLLATE_MS):
    return torch.utils.data.DataLoader(dataset, batch_size=BATCH, collate_fn=SlowCollate(collate_ms))


model = TinyMLP()
opt = torch.optim.SGD(model.parameters(), lr=0.05)


def train_step(batch):
    """One real training step, padded with a sleep to COMPUTE_MS (an accelerator busy with the step)."""
    t0 = time.perf_counter()
    loss = F.mse_loss(model(batch["x"]), batch["y"])
    loss.backward()
    opt.step()
    opt.zero_grad()
    rest = COMPUTE_MS / 1e3 - (time.perf_counter() - t0)
    if rest > 0:
        time.sleep(rest)
    return loss.item()


print(f"{len(make_loader())} batches of {BATCH}; collate {COLLATE_MS:.0f} ms, compute {COMPUTE_MS:.0f} ms per step")

# %% [markdown]
# ## Exercise 03.data_wait — measure the wait, and predict the step
#
# The **data wait** of a step is the time the loop spends inside `next(iterator)`: fetching and
# collating (or, with a prefetcher, waiting for a batch that is not ready yet). A `for` loop calls
# `next()` before your first line runs, so you cannot time it from inside the loop body: take the
# iterator yourself, `it = iter(batches)`, and call `next(it)` between two `time.perf_counter()`
# reads; the loop ends when `next` raises `StopIteration`.
#
# 1. `timed_epoch(batches, step, max_steps=None)` runs `step(batch)` on each batch and returns
#    `{"data_wait_ms": [...], "step_ms": [...]}`, one entry per step, in milliseconds. `step_ms`
#    is the whole step: from asking for the batch to the end of `step(batch)`. With `max_steps`,
#    stop after that many steps.
# 2. `expected_step_ms(collate_ms, compute_ms, depth)`: the step time to expect without a
#    prefetcher (`depth=0`) and with one (`depth >= 1`) that keeps up with a constant collate.

# %%
def timed_epoch(batches, step, max_steps=None):
    """Run `step(batch)` on every batch of `batches`; return per-step "data_wait_ms" and "step_ms" lists."""
    # BEGIN SOLUTION
    waits, steps = [], []
    it = iter(batches)
    while max_steps is None or len(steps) < max_steps:
        t0 = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            break
        t1 = time.perf_counter()
        step(batch)                        # the compute: everything after next() returned
        t2 = time.perf_counter()
        waits.append((t1 - t0) * 1e3)
        steps.append((t2 - t0) * 1e3)
    return {"data_wait_ms": waits, "step_ms": steps}
    # END SOLUTION


def expected_step_ms(collate_ms, compute_ms, depth):
    """Step time when collate and compute take constant times: no overlap at depth 0, full overlap above."""
    # BEGIN SOLUTION
    if depth == 0:
        return collate_ms + compute_ms
    return max(collate_ms, compute_ms)
    # END SOLUTION

# %%
check("03.data_wait")

# %% [markdown]
# ### The stock loop, measured
#
# The first step also pays for starting the iterator; the median of the others is the steady state.

# %%
stock = timed_epoch(make_loader(), train_step)
print(f"no prefetch: data wait {statistics.median(stock['data_wait_ms']):.1f} ms, "
      f"step {statistics.median(stock['step_ms'][1:]):.1f} ms "
      f"(expected {expected_step_ms(COLLATE_MS, COMPUTE_MS, 0):.0f} ms)")

# %% [markdown]
# ## Exercise 03.prefetcher — a depth-N prefetcher
#
# Write `prefetch(iterable, depth=2)`, a **generator** that yields the items of `iterable`, the
# same objects in the same order, while a background thread pulls the next ones from `iterable`.
# Four parts, each there because something breaks without it:
#
# 1. **A bounded queue**, `queue.Queue(maxsize=depth)`: the thread `put`s, the consumer `get`s. The
#    bound is what keeps memory flat: on a GPU every batch in flight holds device memory, and a fast
#    loader with an unbounded queue would stage the whole epoch. The thread then runs at most `depth`
#    batches ahead (plus the one in its hand, waiting for room). Careful: `Queue(maxsize=0)` is
#    *unbounded*; `depth` is at least 1 here.
# 2. **An end marker**: after the last item the thread puts a marker (a tagged tuple such as
#    `("end", None)`, or a unique `object()`; not `None`, which a loader may yield), and the
#    consumer returns when it gets it. Without it the consumer waits forever on an empty queue.
# 3. **Errors travel through the queue.** An exception in a thread ends that thread *silently*:
#    nobody sees it, and the consumer waits forever. Catch it in the thread, put it in the queue, and
#    `raise` it (the same exception object) in the consumer when it comes out. It then surfaces
#    *after* the batches before it, at the step that would have consumed the failing batch — where
#    the stock loop would have raised it.
# 4. **A clean stop.** When the training loop stops early (`break`, an exception in the step, the
#    end of `max_steps`), Python closes the generator, which runs its `finally:` block (`break` drops
#    the generator and CPython closes it at once; `gen.close()` does it explicitly). There, set a
#    `threading.Event` the thread checks, make sure a thread blocked in `put()` on a full queue
#    wakes up (`put(item, timeout=0.05)` in a loop that checks the event, or drain the queue after
#    setting it), then `join()` it. Make it a `daemon=True` thread too, so a stuck loader can never
#    keep Python from exiting.
#
# Pull from `iterable` only in the thread: two threads must never advance one iterator.
#
# ```
# consumer (training loop)            queue (maxsize=depth)             thread
#   next(gen) -> q.get()  <----------  [b3][b2]  <----------  q.put(b4) blocks until there is room
#   step(b1)                                                  b5 = next(source) when b4 is in
# ```

# %%
def prefetch(iterable, depth=2):
    """Yield the items of `iterable`, in order, while a background thread prepares up to `depth` ahead."""
    # BEGIN SOLUTION
    q = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item):
        # Never a bare put(): once the consumer stops reading, it would block forever.
        while not stop.is_set():
            try:
                q.put(item, timeout=0.05)
                return True
            except queue.Full:
                pass
        return False

    def produce():
        try:
            for item in iterable:
                if not put(("batch", item)):
                    return
        except BaseException as exc:          # delivered to the consumer, at its step
            put(("error", exc))
            return
        put(("end", None))

    thread = threading.Thread(target=produce, name="prefetch", daemon=True)
    thread.start()
    try:
        while True:
            kind, payload = q.get()
            if kind == "end":
                return
            if kind == "error":
                raise payload
            yield payload
    finally:
        stop.set()
        thread.join()
    # END SOLUTION

# %%
check("03.prefetcher")

# %% [markdown]
# ### Your prefetcher against the stock loop, `StreamPrefetcher` and the ceiling
#
# The same loader and the same steps, three ways (each run twice, the better run kept: other
# programs share this machine's cores). `StreamPrefetcher(loader, device="cpu", depth=2)`
# is the library's version: on CPU the same thread and bounded queue as yours (plus batches moved
# to `device`, counters in `.stats`); on an accelerator, copies on a side stream. The dashed line is
# the ceiling `max(collate, compute)`: a prefetcher cannot do better, because the thread cannot
# produce batches faster than the collate and the step cannot run faster than the compute.

# %%
def median_step(make_batches):
    """Median step and data wait after the first step; the better of two runs (the machine is shared)."""
    runs = []
    for _ in range(2):
        times = timed_epoch(make_batches(), train_step)
        runs.append((statistics.median(times["step_ms"][1:]), statistics.median(times["data_wait_ms"][1:])))
    return min(runs)


measured = {
    "no prefetch": median_step(lambda: make_loader()),
    "your prefetch": median_step(lambda: prefetch(make_loader(), depth=2)),
    "StreamPrefetcher": median_step(lambda: StreamPrefetcher(make_loader(), device="cpu", depth=2)),
}
ceiling = expected_step_ms(COLLATE_MS, COMPUTE_MS, depth=2)
for name, (step_ms, wait_ms) in measured.items():
    print(f"{name:<18} step {step_ms:5.1f} ms   data wait {wait_ms:5.1f} ms")
print(f"{'ceiling':<18} step {ceiling:5.1f} ms   = max(collate, compute)")
show(bar_chart({**{k: v[0] for k, v in measured.items()}, "ceiling": ceiling}, figure_path("03_prefetch.png"),
               title=f"median step: collate {COLLATE_MS:.0f} ms, compute {COMPUTE_MS:.0f} ms, depth 2",
               reference=ceiling, reference_label="max(collate, compute)"))

# %% tags=["hidden-check"]
assert measured["your prefetch"][0] < 0.8 * measured["no prefetch"][0], measured
assert measured["StreamPrefetcher"][0] < 0.8 * measured["no prefetch"][0], measured

# %% [markdown]
# ## Exercise 03.depth — how deep must the prefetcher be?
#
# With a constant collate no faster than the step, `depth=1` already hides it all. Real loaders are
# bursty: most batches are quick, then one is slow (a long document, a cold file, a big image). On
# average the thread keeps up, so when the slow batch begins the queue is full: `depth` batches wait
# in it, and the thread finishes the one in its hand first. Those `depth + 1` ready batches keep the
# loop busy for `(depth + 1) * compute_ms` while the slow batch is prepared; if that is not long
# enough, the loop waits for the rest.
#
# Write `longest_wait_ms(worst_collate_ms, compute_ms, depth)`, the data wait of the step that
# receives the slow batch, for `depth >= 1` (a prefetcher that was full when the slow batch began),
# and for `depth=0` (no prefetcher: that step waits for the whole collate). Then
# `depth_needed(worst_collate_ms, compute_ms)`: the smallest `depth >= 1` whose longest wait is 0.

# %%
def longest_wait_ms(worst_collate_ms, compute_ms, depth):
    """The data wait of the step that gets the slowest batch, with `depth` batches prefetched."""
    # BEGIN SOLUTION
    if depth == 0:
        return worst_collate_ms
    return max(0.0, worst_collate_ms - (depth + 1) * compute_ms)
    # END SOLUTION


def depth_needed(worst_collate_ms, compute_ms):
    """The smallest depth >= 1 that hides the slowest batch completely."""
    # BEGIN SOLUTION
    return max(1, math.ceil(worst_collate_ms / compute_ms) - 1)
    # END SOLUTION

# %%
check("03.depth")

# %% [markdown]
# ### Measure it: a bursty loader at depth 0 to 4
#
# Seven batches take 2 ms to collate, the eighth 100 ms; each step computes for 25 ms. The loader is
# a generator (any iterable will do); the first eight steps fill the queue and are left out. The
# dots are measured with your `prefetch` and `timed_epoch`, the line is your prediction.

# %%
BURST = [2.0] * 7 + [100.0]
BURST_COMPUTE_MS = 25.0


def bursty_loader(n):
    for i in range(n):
        time.sleep(BURST[i % len(BURST)] / 1e3)
        yield i


def sleep_step(batch):
    time.sleep(BURST_COMPUTE_MS / 1e3)


sweep = {}
for depth in (0, 1, 2, 3, 4):
    source = bursty_loader(32)
    times = timed_epoch(source if depth == 0 else prefetch(source, depth), sleep_step)
    sweep[depth] = max(times["data_wait_ms"][8:])
predicted = {d: longest_wait_ms(max(BURST), BURST_COMPUTE_MS, d) for d in sweep}
for d in sweep:
    print(f"depth {d}: longest data wait {sweep[d]:5.1f} ms (predicted {predicted[d]:5.1f} ms)")
print(f"depth_needed -> {depth_needed(max(BURST), BURST_COMPUTE_MS)}")
show(line_chart({"measured (your prefetch)": sorted(sweep.items()), "predicted": sorted(predicted.items())},
                figure_path("03_depth.png"), title="a 100 ms batch among 2 ms ones, 25 ms steps",
                xlabel="depth (batches prefetched)", ylabel="longest data wait (ms)"))

# %% tags=["hidden-check"]
assert sweep[0] > 80 and sweep[4] < 15, sweep
assert all(abs(sweep[d] - predicted[d]) < 20 for d in sweep), (sweep, predicted)

# %% [markdown]
# ### On a GPU
#
# On an accelerator the part worth hiding is the host→device copy. `StreamPrefetcher` copies the
# next `depth` batches from pinned memory on a side stream and makes the compute stream wait on
# each batch's event (lesson 02). The cell below times steps whose batch is large next to their
# compute, at depth 0 (copy on the compute stream, in line) and depth 2 (copy overlapped).

# %% tags=["gpu"]
# GPU: at depth 0 each step pays its host-to-device copy in line; at depth 2 the copy runs on a side stream under the previous step's matmuls, so the step time drops toward the compute alone and stats.copy_gbps shows the pinned-copy bandwidth.
dev = accelerator_device()
host_batches = [{"x": torch.randn(4096, 4096).pin_memory()} for _ in range(12)]   # 64 MiB each, pinned once
weight = torch.randn(4096, 4096, device=dev)


def gpu_epoch(depth):
    pf = StreamPrefetcher(host_batches, device=dev, depth=depth, time_copies=True)
    torch.accelerator.synchronize()
    t0 = time.perf_counter()
    for batch in pf:
        y = batch["x"]
        for _ in range(2):
            y = torch.tanh(y @ weight)
    torch.accelerator.synchronize()
    return (time.perf_counter() - t0) * 1e3 / len(host_batches), pf.stats


gpu_epoch(2)                                                               # warm-up
for depth in (0, 2):
    ms, stats = gpu_epoch(depth)
    copy = f", last copy {stats.copy_ms:.2f} ms at {stats.copy_gbps:.1f} GB/s" if stats.copy_ms and stats.copy_gbps else ""
    print(f"depth {depth}: {ms:.2f} ms per step, data wait {stats.mean_data_wait_ms:.2f} ms{copy}")

# %% [markdown]
# ## What you have now
#
# - the data wait, measured where it happens: inside `next()`;
# - a prefetcher with the four parts every real one has: a bounded queue, an end marker, errors
#   delivered at their step, and a stop that leaves no thread behind;
# - the rule for its depth: `depth + 1` steps of compute must cover the slowest batch;
# - a measured step at the ceiling `max(collate, compute)`, and `StreamPrefetcher` doing the same.
#
# Next, lesson 04 leaves one process behind: data parallelism from scratch, with gloo.
