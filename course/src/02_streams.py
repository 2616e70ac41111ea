# %% [markdown]
# # Lesson 02 — Streams and events
#
# **Time:** 40 minutes. **Runs on:** any laptop (CPU): a real race between threads, a simulated
# device for the exercises, and real streams in the GPU cells. **You will:** see a consumer read a
# buffer before its producer finished, learn the real APIs that order work across streams
# (`wait_stream`, `Event.record` / `Event.wait`), why copies need pinned memory to be
# asynchronous, and why the caching allocator needs `record_stream`; then write a prefetch loop and
# a side-stream gradient reduction that are both correct and overlapped.
#
# ## The host queues, the device runs
#
# On a GPU, `y = x @ w` computes nothing on the host: it **queues** a kernel and returns within
# microseconds. A **stream** is an in-order queue of such work: kernels on one stream run one after
# another, in the order queued. Work on **different** streams may run at the same time, and that is
# the point: a copy engine moves the next batch while the compute units run this one; NCCL reduces
# gradients on its own stream while backward goes on.
#
# Different streams have **no order between them unless you create one**. Nothing raises an error
# when a kernel on the compute stream reads a tensor whose copy on a side stream has not landed: it
# reads whatever bytes are there. The real tools, all device-agnostic since PyTorch 2.7
# (`torch.cuda.*` spells the same things for CUDA only):
#
# | you want | the real API | does the host wait? |
# |---|---|---|
# | the stream work goes to now | `torch.accelerator.current_stream()` | no |
# | a side stream, and queueing on it | `side = torch.Stream(device)` (or `torch.cuda.Stream()`), then `with side:` (`torch.cuda.stream(side)` before 2.7) | no |
# | B runs after **everything queued on A so far** | `B.wait_stream(A)` | no |
# | B runs after **one point** of A | `ev = torch.Event(); ev.record(A)` ... `ev.wait(B)` (same as `B.wait_event(ev)`) | no |
# | the host waits | `ev.synchronize()`, `A.synchronize()`, `torch.accelerator.synchronize()` | **yes** |
# | a copy that leaves the host free | `host.pin_memory()`, then `.to(device, non_blocking=True)` | no (pinned) |
# | memory used by a second stream | `tensor.record_stream(B)` | no |
#
# `wait_stream`, `Event.wait` and `record_stream` make a *stream* wait: the host keeps queuing work.
# That is what keeps the device busy. A host wait (`synchronize`) also orders things, but while the
# host waits it queues nothing, so whatever you wanted to overlap, does not.

# %%
import contextlib, math, os, queue, threading, time
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from course.lib import *
from course.checks.lesson02 import SimDevice, SimHost, draw_timelines

# %% [markdown]
# ## A race you can run on this laptop
#
# A CPU has no streams, but it has the same problem between threads. Below, a thread plays the
# copy engine: it fills `dst` from `src` a chunk at a time (a copy is never one atomic step). The
# main thread plays the compute stream and sums `dst`. Without anything ordering the sum after the
# copy, the sum sees whatever the copy has written so far.

# %%
src = torch.arange(1 << 22, dtype=torch.int64)          # 32 MiB
want = int(src.sum())


def copy_in_chunks(dst, src, done=None, chunks=64):
    """The 'copy engine': fill dst from src one chunk at a time, then signal `done`."""
    step = src.numel() // chunks
    for a in range(0, src.numel(), step):
        dst[a:a + step].copy_(src[a:a + step])
    if done is not None:
        done.set()


for delay_ms in (0, 2):
    dst = torch.zeros_like(src)
    copier = threading.Thread(target=copy_in_chunks, args=(dst, src))
    copier.start()
    time.sleep(delay_ms / 1e3)                          # some other work before reading
    early = int(dst.sum())                              # nothing orders this read after the copy
    copier.join()
    luck = "  <- right only because the copy happened to finish first" if early == want else ""
    print(f"read {delay_ms} ms after starting the copy, no wait: {early / want:6.1%} of the right sum{luck}")

dst, done = torch.zeros_like(src), threading.Event()
copier = threading.Thread(target=copy_in_chunks, args=(dst, src, done))
copier.start()
done.wait()                                             # the consumer waits for the producer's signal
print(f"read after done.wait():                 {int(dst.sum()) / want:6.1%} of the right sum")
copier.join()

# %% [markdown]
# `threading.Event` plays two parts here that a GPU keeps apart. `done.set()` at the end of the
# copy is the **record**: it marks a point in the producer's work. `done.wait()` is a **host wait**:
# the main thread stops. On a GPU the same point is marked with `ev.record(side)`, and you have a
# better choice than stopping the host: `ev.wait(compute)` makes the *compute stream* wait, while
# the host goes on queuing the next copy, the next kernels, the next step.
#
# ## A simulated device to practise on
#
# Races on a real GPU depend on timing: a missing wait may give right answers a thousand times and
# garbage on the thousand-and-first. So the exercises run on `SimDevice`, a pretend accelerator
# (in `course/checks/lesson02.py`) with the same method names as PyTorch:
#
# | PyTorch | `SimDevice` |
# |---|---|
# | `torch.accelerator.current_stream()` | `sim.current_stream()` |
# | `torch.Stream(dev)`; `with side:` | `sim.Stream("copy")`; `with side:` |
# | `host.pin_memory()` | `SimHost("batch 0").pin_memory()` |
# | `x = host.to(dev, non_blocking=True)` (on the current stream) | `x = sim.copy_in(host)` |
# | a kernel reading `x`, writing a new tensor | `y = sim.compute("step", x)` |
# | a kernel on existing tensors | `sim.kernel("all-reduce", reads=[b], writes=[b])` |
# | `torch.Event()`, `ev.record(s)`, `ev.wait(s)`, `ev.synchronize()` | `sim.Event()`, same methods |
# | `B.wait_stream(A)`, `B.wait_event(ev)` | same methods |
# | `t.record_stream(s)`; the last reference dies | `t.record_stream(s)`; `t.free()` |
#
# Each operation takes a fixed simulated time (a copy 2 ms, a step 3 ms). The simulator does not
# look at timings to find races: it tracks *happens-before* (stream order, event waits, host
# waits), and two accesses to the same memory, one a write, with no happens-before between them are
# a race, whether or not this run's timing happened to be lucky. Here is the race from above, on the
# simulated device, then fixed:

# %%
def copy_then_step(sim, order):
    compute = sim.current_stream()
    side = sim.Stream("copy")
    with side:
        x = sim.copy_in(SimHost("batch 0").pin_memory())   # queued on the side stream
    if order:
        compute.wait_stream(side)                          # compute's later work waits for the copy
    sim.compute("step", x)                                 # queued on the compute stream
    return sim


for order in (False, True):
    sim = copy_then_step(SimDevice(), order)
    print(f"{'with' if order else 'without'} compute.wait_stream(side): {sim.first_race()}")

# %% [markdown]
# ## `wait_stream` or `Event.wait`?
#
# `B.wait_stream(A)` is shorthand for "record an event on A *now*, make B wait on it": B waits for
# **everything queued on A so far**. That is exactly right when A holds nothing else. A prefetcher
# is not that case: it queues the copy of batch *i+1* before the compute of batch *i* (that is how
# the copy gets to run under the compute). If the compute of batch *i* then calls
# `compute.wait_stream(side)`, it waits for batch *i+1*'s copy too, and the overlap is gone.
# An event per batch marks exactly the point you need:
#
# ```python
# with side:
#     x = host.to(device, non_blocking=True)
# ready = torch.Event(); ready.record(side)      # "batch i's copy is done" = this point of `side`
# ...                                            # queue the copy of batch i+1 on `side`
# ready.wait(compute)                            # compute waits for batch i only
# y = model(x)
# ```
#
# Three mistakes that look right: recording the event on the compute stream (it then marks a point
# of the wrong queue), recording it *before* the copy (it marks nothing), and waiting on the side
# stream (a stream waiting on itself orders nothing).
#
# ## Exercise 02.order — a prefetch loop that never reads early
#
# `prefetch_loop` (given) copies batch *i+1* on the side stream before stepping on batch *i*.
# Write its two halves:
#
# - `start_copy(sim, side, host)`: queue the copy of `host` on `side` and return `(x, ready)`,
#   where `ready` is an event that marks the end of this copy;
# - `consume(sim, compute, x, ready)`: make the compute stream wait for that copy (and nothing
#   later), then queue `sim.compute("step", x)` and return its result.
#
# The check looks for races, for host waits, and for steps that waited for a later batch's copy.

# %%
def start_copy(sim, side, host):
    """Queue ``host``'s copy on ``side``; return ``(device tensor, event marking the copy's end)``."""
    # BEGIN SOLUTION
    with side:
        x = sim.copy_in(host)
    ready = sim.Event()
    ready.record(side)
    return x, ready
    # END SOLUTION


def consume(sim, compute, x, ready):
    """Make ``compute`` wait for ``ready`` (not for later copies), then queue the step on ``x``."""
    # BEGIN SOLUTION
    ready.wait(compute)
    return sim.compute("step", x)
    # END SOLUTION


def prefetch_loop(sim, host_batches, start=None, use=None):
    """Copy batch i+1 on a side stream while the compute stream steps on batch i; return the outputs."""
    start, use = start or start_copy, use or consume
    compute = sim.current_stream()
    side = sim.Stream("copy")
    outs, nxt = [], start(sim, side, host_batches[0])
    for i in range(len(host_batches)):
        cur = nxt
        if i + 1 < len(host_batches):
            nxt = start(sim, side, host_batches[i + 1])   # queued before this step: it runs under it
        outs.append(use(sim, compute, *cur))
    return outs

# %%
check("02.order")

# %% [markdown]
# ## Pinned memory and `non_blocking`
#
# A host-to-device copy is done by the GPU's DMA engine, which reads host memory by physical
# address. Ordinary (*pageable*) memory may be moved or swapped by the OS at any time, so the driver
# cannot hand it to the DMA engine: it first copies your data into a pinned staging buffer of its
# own, **on the host, while your Python thread waits**, then DMAs from there. `non_blocking=True`
# cannot change that; from pageable memory the call returns only once the copy is (nearly) done.
#
# `tensor.pin_memory()` returns a copy in page-locked memory that the DMA engine can read directly:
# `.to(device, non_blocking=True)` then queues the copy and returns at once, and the copy runs at
# the link's full bandwidth. That is what `DataLoader(pin_memory=True)` (the Trainer's
# `dataloader_pin_memory`, on by default) does for you, on a pinning thread when the loader has
# workers. Pinned memory is a scarce resource (it cannot be swapped), so pin batches, not datasets.
#
# And the other direction: `y.to("cpu", non_blocking=True)` into pinned memory returns before the
# data has arrived. Reading it on the host needs a host wait first (`ev.synchronize()`).
#
# The simulator models the host being held: with pageable batches the host cannot queue the step on
# batch *i* until the copy of batch *i+1* has run. Your loop, both ways, with copies (4 ms) longer
# than steps (3 ms):

# %%
slow_copies = {"copy": 4.0, "step": 3.0}
runs = {}
for pinned in (True, False):
    sim = SimDevice(slow_copies)
    prefetch_loop(sim, [SimHost(f"batch {i}", pinned=pinned) for i in range(6)])
    runs[pinned] = sim
    print(f"{'pinned  ' if pinned else 'pageable'} host batches: {sim.elapsed_ms():.0f} simulated ms "
          f"for 6 steps, races: {len(sim.races)}")

# %% [markdown]
# ## The caching allocator and `record_stream`
#
# `cudaMalloc` is slow and synchronizing, so PyTorch keeps freed blocks in a cache and hands them
# out again. It keeps **one pool per stream**: a block freed by a tensor allocated on stream A is
# given to the next allocation on stream A at once, because any later kernel on A runs after
# everything A already had queued, the old tensor's last use included. That reasoning only covers
# stream A. If the tensor was also used on stream B, the allocator does not know, and B may still
# be reading the block when A's next kernel overwrites it.
#
# `tensor.record_stream(B)` tells it: when this tensor is freed, record an event on B, and keep the
# block out of the pool until B's work queued up to the free has run. Two common cases:
#
# - a **prefetcher**: batches are allocated on the side stream (the copy) and used on the compute
#   stream; `x.record_stream(compute)` after the wait (hfstream's `StreamPrefetcher` does this);
# - a **communication stream**: a gradient bucket is allocated and filled on the compute stream and
#   reduced on the comm stream; `bucket.record_stream(comm)` before the last reference dies.
#
# The alternative is to keep a reference yourself until an event recorded after the last use has
# completed (a deferred-free ring). Either way: memory used by two streams needs someone to say so.
#
# ## Exercise 02.lifetime — reduce gradient buckets on a side stream
#
# Lesson 05 reduces gradients on a communication stream while backward goes on. Here is its memory
# and ordering skeleton on the simulated device. For each gradient `g` (computed on the compute
# stream), `reduce_buckets` must:
#
# 1. pack it into a new bucket on the compute stream: `bucket = sim.compute("pack", g)` (given);
# 2. make the comm stream wait for that pack: the bucket is written on compute, read on comm;
# 3. on the comm stream, queue `sim.kernel("all-reduce", reads=[bucket], writes=[bucket])` and
#    `sim.kernel("unpack", reads=[bucket], writes=[g])`;
# 4. let the bucket go at once, `bucket.free()` (given), safely: the comm stream still uses it;
#
# and return one event, recorded on the comm stream after the last unpack, which the optimizer
# (on the compute stream) will wait on. The compute stream must never wait for the comm stream
# inside the loop, and the host must never wait: packing bucket *i+1* runs while bucket *i* reduces.
# Here `wait_stream` is the right tool for step 2: the compute stream holds nothing you would not
# want to wait for.

# %%
def reduce_buckets(sim, comm, grads):
    """Pack each gradient on the compute stream, reduce and unpack it on ``comm``; free the bucket.

    Returns:
        An event recorded on ``comm`` after the last unpack (the optimizer waits on it).
    """
    compute = sim.current_stream()
    for g in grads:
        bucket = sim.compute("pack", g)            # allocated and written on the compute stream
        # BEGIN SOLUTION
        comm.wait_stream(compute)                  # the all-reduce reads what pack wrote
        with comm:
            sim.kernel("all-reduce", reads=[bucket], writes=[bucket])
            sim.kernel("unpack", reads=[bucket], writes=[g])
        bucket.record_stream(comm)                 # comm still uses it after the free below
        # END SOLUTION
        bucket.free()                              # in PyTorch: the last reference dies here
    # BEGIN SOLUTION
    done = sim.Event()
    done.record(comm)
    return done
    # END SOLUTION

# %%
check("02.lifetime")

# %% [markdown]
# ## On a GPU: the same race, and the same fixes, for real
#
# The next three cells run only on an accelerator. The first copies 64 MiB of ones on a side stream
# and sums them on the compute stream: without a wait the sum runs while the copy is still landing.

# %% tags=["gpu"]
# GPU: a side-stream copy summed on the compute stream without a wait gives a wrong sum (the sum runs while the copy is landing); with compute.wait_stream(side) or ready.wait(compute) every sum is exact.
dev = accelerator_device()
compute = torch.accelerator.current_stream()           # the stream work goes to now
side = torch.Stream(device=dev)
n = 1 << 24                                           # 16 Mi int32 = 64 MiB: a copy of a few ms
host = torch.ones(n, dtype=torch.int32).pin_memory()


def copy_then_sum(how):
    dst = torch.zeros(n, dtype=torch.int32, device=dev)   # zeros queued on the compute stream
    side.wait_stream(compute)                             # the copy must land after the zeros
    with side:
        dst.copy_(host, non_blocking=True)
    ready = torch.Event(device=dev)
    ready.record(side)
    if how == "wait_stream":
        compute.wait_stream(side)
    elif how == "event":
        ready.wait(compute)
    total = dst.sum()                                     # queued on the compute stream
    dst.record_stream(side)                               # allocated on compute, written on side
    return total


for how in ("no wait", "wait_stream", "event"):
    sums = [copy_then_sum(how) for _ in range(5)]
    torch.accelerator.synchronize()
    wrong = sum(int(s.item()) != n for s in sums)
    print(f"{how:>12}: {wrong} of 5 sums wrong; sums {[int(s.item()) for s in sums]} (want {n})")

# %% [markdown]
# The second shows the allocator handing out a block that another stream is still reading. `x`
# is allocated on the side stream and summed on the compute stream, behind a long matmul. `del x`
# returns its block to the side stream's pool; the next allocation there gets it, and its
# `fill_(7)` runs long before the compute stream reaches the sum.

# %% tags=["gpu"]
# GPU: without record_stream the next allocation on the side stream reuses x's block (same data_ptr) and overwrites it before the compute stream sums it (a sum of 7s instead of 1s); with x.record_stream(compute) the block is held back and the sum is right.
def early_reuse(record):
    with side:
        x = torch.empty(n, dtype=torch.int32, device=dev)   # from the side stream's pool
        x.fill_(1)
    compute.wait_stream(side)
    a = torch.randn(4096, 4096, device=dev)
    for _ in range(10):                                   # keep the compute stream busy for a while
        a = a @ a
    total = x.sum()                                       # queued behind the matmuls
    if record:
        x.record_stream(compute)
    ptr = x.data_ptr()
    del x                                                 # the block goes back to the side stream's pool
    with side:
        y = torch.empty(n, dtype=torch.int32, device=dev)
        y.fill_(7)                                        # runs at once: the side stream is idle
    torch.accelerator.synchronize()
    return y.data_ptr() == ptr, int(total.item())


for record in (False, True):
    reused, total = early_reuse(record)
    print(f"record_stream={record!s:>5}: block reused {reused!s:>5}, sum {total} (want {n})")

# %% [markdown]
# The third measures what pinning buys: bandwidth on the device clock, and how long the host was
# held by a `non_blocking=True` call.

# %% tags=["gpu"]
# GPU: a 256 MiB copy from pinned memory runs at full link speed and returns to the host at once; from pageable memory it is slower and non_blocking=True still holds the host for most of the copy.
size = 1 << 28
pageable = torch.ones(size, dtype=torch.uint8)           # written once, so its pages exist
pinned = pageable.pin_memory()
for name, src_host in (("pageable", pageable), ("pinned", pinned)):
    src_host.to(dev, non_blocking=True)                  # warm-up
    torch.accelerator.synchronize()
    start, end = torch.Event(device=dev, enable_timing=True), torch.Event(device=dev, enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    on_device = src_host.to(dev, non_blocking=True)
    end.record()
    host_ms = (time.perf_counter() - t0) * 1e3
    end.synchronize()
    copy_ms = start.elapsed_time(end)
    print(f"{name:>9}: {size / copy_ms / 1e6:6.1f} GB/s; the host was held {host_ms:7.3f} ms of a {copy_ms:.3f} ms copy")

# %% [markdown]
# ## Measure: a copy lane under a compute lane, on this CPU
#
# Back to real hardware you have. `ThreadStream` is the CPU's stand-in for a side stream: one
# thread that runs submitted work in order, and `record()` returns a `threading.Event` that is set
# once everything submitted before it has run (`torch.Event.record` on a stream). Below, six
# batches are copied (64 MiB into one of two buffers) and stepped on (a few matmuls): once on one
# thread, copy then step, and once with the copies on the `ThreadStream`, one batch ahead, exactly
# like `prefetch_loop`. The consumer's `ready.wait()` is a host wait here: a CPU has no stream to
# hand the wait to. (`torch.set_num_threads(1)` during the measurement gives each thread one core
# instead of letting the matmuls take both.)

# %%
class ThreadStream:
    """An in-order queue of work run by one thread: the CPU's stand-in for a side stream."""

    def __init__(self):
        self.work = queue.Queue()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while (fn := self.work.get()) is not None:
            fn()

    def submit(self, fn):
        self.work.put(fn)

    def record(self):
        """An event set once everything submitted so far has run (like ``torch.Event.record``)."""
        ev = threading.Event()
        self.work.put(ev.set)
        return ev

    def close(self):
        self.work.put(None)
        self.thread.join()


host = torch.ones(1 << 24)                          # a 64 MiB host batch (its values do not matter here)
slots = [torch.empty_like(host) for _ in range(2)]  # two destination buffers, used in turn
weight = torch.randn(256, 256)
N_BATCHES = 6


def copy_batch(i):
    return slots[i % 2].copy_(host)


def step_on(x):
    y = x[:256 * 256].view(256, 256)
    for _ in range(12):
        y = torch.tanh(y @ weight)
    return y.sum()


def measured_run(overlap):
    spans = []

    def timed(lane, name, fn):
        t0 = time.perf_counter()
        out = fn()
        spans.append((0, lane, name, t0, time.perf_counter()))
        return out

    if not overlap:
        for i in range(N_BATCHES):
            x = timed("data", "copy", lambda: copy_batch(i))
            timed("compute", "step", lambda: step_on(x))
        return spans
    side_thread = ThreadStream()

    def start(i):
        side_thread.submit(lambda: timed("data", "copy", lambda: copy_batch(i)))
        return slots[i % 2], side_thread.record()

    nxt = start(0)
    for i in range(N_BATCHES):
        x, ready = nxt
        if i + 1 < N_BATCHES:
            # Queued before this step, so it runs under it. Its slot is the one step i-1 used, and
            # step i-1 has finished: this thread ran it before getting here (lifetime, by order).
            nxt = start(i + 1)
        ready.wait()                                    # this batch's copy only
        timed("compute", "step", lambda: step_on(x))
    side_thread.close()
    return spans


threads_before = torch.get_num_threads()
torch.set_num_threads(1)
try:
    measured_run(False), measured_run(True)             # warm-up: first touches of the buffers
    measured = {"one thread: copy, then step": measured_run(False),
                "copy thread one batch ahead": measured_run(True)}
finally:
    torch.set_num_threads(threads_before)
walls = {}
for name, spans in measured.items():
    walls[name] = (max(s[4] for s in spans) - min(s[3] for s in spans)) * 1e3
    copy_ms = sum((s[4] - s[3]) * 1e3 for s in spans if s[2] == "copy")
    step_ms = sum((s[4] - s[3]) * 1e3 for s in spans if s[2] == "step")
    print(f"{name:<30} {walls[name]:6.1f} ms wall; copies {copy_ms:5.1f} ms, steps {step_ms:5.1f} ms in all")
serial, overlapped = walls.values()
print(f"overlapped / serial wall time: {overlapped / serial:.2f}")

# %% [markdown]
# How much the copy thread wins depends on the machine. On an idle machine with two free cores the
# overlapped run approaches one `max(copy, step)` per batch instead of `copy + step`. On a busy one
# (this course's machine is shared) the two threads compete for the same cores and the same memory
# bandwidth: each piece slows down (compare the totals above with the serial run's) and the gain
# shrinks or vanishes. That is the general rule: **overlap hides work only when the two lanes use
# different resources**. On a GPU they do: the copy engine moves bytes over PCIe or NVLink while
# the SMs compute, which is why a pinned, side-stream copy hides almost for free there.
#
# ### The figures
#
# First the simulated device: your `prefetch_loop` with no wait (the race, hatched in red), with
# `wait_stream` (safe, but each step waits for the next copy too), with your events, and with your
# events on pageable batches (the host is held during each copy, so it cannot queue step *i*
# until copy *i+1* is done: the same cost as the over-wait). Then, last, the measured CPU run.

# %%
def copy_only(sim, side, host):
    """A start_copy without an event: the consumer gets the side stream itself."""
    with side:
        x = sim.copy_in(host)
    return x, side


def no_wait(sim, compute, x, side):
    return sim.compute("step", x)


def over_wait(sim, compute, x, side):
    compute.wait_stream(side)                           # everything queued on the side stream so far
    return sim.compute("step", x)


panels = {}
for title, start, use in (("no wait: a race", copy_only, no_wait),
                          ("compute.wait_stream(side)", copy_only, over_wait),
                          ("Event per batch (yours)", None, None)):
    sim = SimDevice(slow_copies)
    prefetch_loop(sim, [SimHost(f"batch {i}").pin_memory() for i in range(6)], start=start, use=use)
    panels[f"{title}: {sim.elapsed_ms():.0f} ms, {len(sim.races)} races"] = sim
panels[f"Event per batch, pageable batches: {runs[False].elapsed_ms():.0f} ms"] = runs[False]
show(draw_timelines(panels, figure_path("02_simulated_streams.png"),
                    title="simulated device, 6 batches: copy 4 ms, step 3 ms"))

# %%
show(draw_timelines(measured, figure_path("02_measured_overlap.png"),
                    title="measured on this CPU: a copy thread as a side stream (6 batches)"))

# %% tags=["hidden-check"]
sims = list(panels.values())
assert sims[0].races and not sims[1].races and not sims[2].races, [len(s.races) for s in sims]
assert sims[2].elapsed_ms() < sims[1].elapsed_ms() <= sims[3].elapsed_ms() + 1e-9
for spans in measured.values():
    assert sorted(s[2] for s in spans).count("copy") == 6 and len(spans) == 12

# %% [markdown]
# ## What you have now
#
# - streams run in order inside, in any order between; the host only queues;
# - `Event.record` + `Event.wait` order one precise point, `wait_stream` orders everything queued so
#   far, and neither stops the host; `synchronize` does;
# - `pin_memory()` makes `non_blocking=True` real; from pageable memory the host waits anyway;
# - the caching allocator follows one stream per block; `record_stream` tells it about the others.
#
# Next, lesson 03 builds a depth-N prefetcher from these pieces and measures it against a slow
# collate: the data lane moves under the compute lane for real.
