# %% [markdown]
# # Lesson 05 — Overlap per parameter
#
# **Time:** 40 minutes. **Runs on:** any laptop (CPU, 2 gloo processes). **You will:** hook every
# parameter so its gradient's all-reduce starts the moment backward produces it, keep the
# reductions asynchronous so backward never waits for them, make the launch order survive
# parameters that got no gradient, and see communication run under backward on a measured
# timeline.
#
# ## Why: the gradient of the last layer is ready long before backward ends
#
# Lesson 04's data parallelism reduced every gradient *after* `loss.backward()` returned:
#
# $$\text{step} = \text{forward} + \text{backward} + \text{comm} + \text{optimizer}$$
#
# But backward does not produce the gradients all at once. It walks the graph from the loss
# back to the inputs, so the **last** layer's gradient is final first, and the first layer's
# last. Every gradient that is final can already be on the wire while backward computes the
# rest. If it is, communication hides behind backward and the step approaches lesson 00's
# ceiling, `forward + max(backward, comm_busy) + optimizer`.
#
# Two real APIs do all of it (no invented `torch.distributed.stream` needed):
#
# | job | API |
# |---|---|
# | run code when a parameter's gradient is final | `param.register_post_accumulate_grad_hook(hook)`: after backward has accumulated this parameter's gradient into `param.grad`, it calls `hook(param)`; returns a handle with `.remove()` (torch >= 2.1) |
# | start a reduction and keep going | `work = dist.all_reduce(tensor, async_op=True)` returns at once with a `Work`; `work.wait()` later waits for the result, written in place into `tensor` |
#
# Why the *post-accumulate* hook and not `tensor.register_hook(fn)`? `register_hook` fires with
# this backward's *incoming* gradient before it is added to `.grad`: at that moment `.grad` is
# still None (or holds the previous micro-steps' sum under gradient accumulation), so reducing it
# there reduces the wrong tensor. The post-accumulate hook fires once `.grad` holds the
# accumulated gradient, the tensor the optimizer will read. Autograd sums the contributions of a
# parameter used twice (GPT-2's tied input and output embedding) before either hook fires, so
# each fires once per backward.
#
# Where does the asynchronous reduction run? With gloo (CPU), on gloo's own threads, over TCP;
# with NCCL (GPU), as a kernel on NCCL's internal stream, ordered after the compute stream's work
# at launch. Either way the caller gets control back immediately.

# %%
import contextlib, math, os, queue, threading, time
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from course.lib import *

# %% [markdown]
# ### Watch the gradients arrive
#
# One process, no communication yet: a hook on every parameter of a 6-layer MLP notes when its
# gradient became final, measured from the start of `loss.backward()`.

# %%
model = TinyMLP(dim=256, hidden=256, layers=6)
x, y = random_regression(n=256, dim=256)
name_of = {p: n for n, p in model.named_parameters()}
arrivals = []


def note(param):                     # called by autograd, with the parameter, once .grad is final
    arrivals.append((time.perf_counter(), name_of[param]))


handles = [p.register_post_accumulate_grad_hook(note) for p in model.parameters()]
F.mse_loss(model(x), y).backward()   # warm-up
arrivals.clear()
loss = F.mse_loss(model(x), y)
t0 = time.perf_counter()
loss.backward()
t1 = time.perf_counter()
for h in handles:
    h.remove()                       # hooks stay until removed: a later lesson's model must not carry them
for t, name in arrivals:
    print(f"{(t - t0) * 1e3:6.2f} ms  {name}")
print(f"{(t1 - t0) * 1e3:6.2f} ms  backward returns")

# %% [markdown]
# `layers.5` (the last layer) is final almost immediately; `layers.0.weight` only at the very
# end. Reducing after backward makes the last layer's gradient wait all that time for nothing.
#
# ## Exercise 05.overlap_hook — a hook per parameter, an asynchronous all-reduce each
#
# Write `OverlapSync`:
#
# - `__init__`: register `self._on_grad_ready` as the post-accumulate hook of every parameter
#   that requires grad; keep the handles in `self.handles`.
# - `_on_grad_ready(param)`: start `dist.all_reduce(param.grad, async_op=True)` and keep
#   `(param, work)` in `self.works`. Return at once: the hook runs inside backward, and every
#   millisecond spent in it is a millisecond backward stops.
# - `finish()`, called after `loss.backward()`: `wait()` for each work, divide the sum by the
#   world size (all-reduce adds), and empty `self.works` for the next step.
#
# The check runs your class in 2 gloo processes for two steps and compares every `.grad` with
# lesson 04's serial result (all-reduce after backward, then divide). It also counts: one
# reduction per parameter, each launched *before* `loss.backward()` returned.

# %%
class OverlapSync:
    """Average every gradient over the ranks, each launched by its own hook while backward runs.

    Args:
        model: the module whose parameters (those that require grad) are averaged.
    """

    def __init__(self, model):
        self.world_size = dist.get_world_size()
        # (parameter, Work) for each reduction launched this step, and the hooks' handles
        self.works = []
        self.handles = []
        # BEGIN SOLUTION
        for p in model.parameters():
            if p.requires_grad:
                self.handles.append(p.register_post_accumulate_grad_hook(self._on_grad_ready))
        # END SOLUTION

    def _on_grad_ready(self, param):
        """The hook: param.grad is final for this backward; start its all-reduce and return."""
        # BEGIN SOLUTION
        self.works.append((param, dist.all_reduce(param.grad, async_op=True)))
        # END SOLUTION

    def finish(self):
        """Wait for every reduction launched this step; turn each sum into a mean."""
        # BEGIN SOLUTION
        for param, work in self.works:
            work.wait()
            param.grad.div_(self.world_size)
        self.works = []
        # END SOLUTION

    def close(self):
        for h in self.handles:
            h.remove()

# %%
check("05.overlap_hook")

# %% [markdown]
# ## What goes wrong: a rank that did not use a parameter
#
# Collectives have no names. gloo and NCCL match the *k*-th all-reduce of rank 0 with the *k*-th
# all-reduce of rank 1, whatever tensors they carry. `OverlapSync` is right only because every
# rank fires the same hooks in the same order. That stops being true as soon as a parameter gets
# no gradient on some rank:
#
# - a mixture-of-experts layer whose router sent none of this rank's tokens to expert 3;
# - a branch taken only for some inputs; a head the loss does not use (BERT's pooler under a
#   masked-LM loss); a frozen-then-unfrozen layer.
#
# Then its hook never fires on that rank. With `OverlapSync`, rank 0 launches the expert's
# all-reduce and rank 1 never does: rank 0's reduction is paired with the wrong tensor of rank 1,
# or waits forever. Launching the missing ones in `finish()` is not enough either: rank 0 sent
# the expert *during* backward, rank 1 sends it *after*, so the order differs and the pairs are
# still wrong (gloo reports "Received data size doesn't match", or hangs).
#
# The fix is the one PyTorch DDP and hfstream's `GradSync` use: **one launch order, the same on
# every rank**, decided from the model alone (reverse registration order, roughly the order
# backward produces gradients). A hook only marks its parameter ready; parameters are launched
# from the head of the order as long as the head is ready. A parameter that is ready early waits
# for the ones ahead of it. `finish()` launches whatever is left, in order, with zeros for a
# parameter that has no gradient here, so every rank launches every reduction, in the same order.
#
# The price: an unused parameter holds back everything behind it until `finish()`. DDP's
# `find_unused_parameters=True` avoids that by walking the autograd graph after forward and
# marking the unused ones ready early (at the cost of that walk every step); lesson 07 returns
# to it.
#
# ## Exercise 05.finish — one launch order on every rank, unused parameters included
#
# `__init__` and `_launch(i)` are given. Write:
#
# - `_on_grad_ready(i, param)`: mark `self.order[i]` ready, then launch (`self._launch`) every
#   ready parameter at the head of the order, advancing `self.next`.
# - `finish()`: launch every parameter not launched yet, in order; wait for each work and divide;
#   then reset `self.works`, `self.next` and `self.ready` for the next step.
#
# The check first plays two ranks in this process with a stand-in all-reduce that only records
# (rank 1 skips the `expert` layer; a `spare` parameter is used by nobody), so a wrong order is
# reported instead of hanging; then it runs 2 real gloo processes and compares the gradients.

# %%
import functools


class OrderedOverlapSync:
    """Per-parameter overlap with one launch order on every rank, unused parameters included."""

    def __init__(self, model):
        self.world_size = dist.get_world_size()
        # Reverse registration order, about the order backward produces gradients. Every rank
        # computes the same list from the same model, whatever its data does.
        self.order = [p for p in model.parameters() if p.requires_grad][::-1]
        # ready[i]: order[i]'s gradient is final this step; order[next] is the next parameter to
        # launch; works: (parameter, Work), in launch order
        self.ready = [False] * len(self.order)
        self.next = 0
        self.works = []
        self.handles = [p.register_post_accumulate_grad_hook(functools.partial(self._on_grad_ready, i))
                        for i, p in enumerate(self.order)]

    def _launch(self, i):
        """Start the all-reduce of order[i]'s gradient (zeros if this rank has none)."""
        p = self.order[i]
        if p.grad is None:
            p.grad = torch.zeros_like(p)   # unused on this rank: it contributes zeros to the mean
        self.works.append((p, dist.all_reduce(p.grad, async_op=True)))

    def _on_grad_ready(self, i, param):
        """The hook of order[i]: mark it ready, then launch every ready parameter at the head."""
        # BEGIN SOLUTION
        self.ready[i] = True
        while self.next < len(self.order) and self.ready[self.next]:
            self._launch(self.next)
            self.next += 1
        # END SOLUTION

    def finish(self):
        """Launch what is left (in order), wait for all, divide; reset for the next step."""
        # BEGIN SOLUTION
        while self.next < len(self.order):
            self._launch(self.next)
            self.next += 1
        for p, work in self.works:
            work.wait()
            p.grad.div_(self.world_size)
        self.works, self.next = [], 0
        self.ready = [False] * len(self.order)
        # END SOLUTION

    def close(self):
        for h in self.handles:
            h.remove()

# %%
check("05.finish")

# %% [markdown]
# ## Measure it: serial against overlap, on 2 ranks over a slow link
#
# On one machine, loopback moves gigabytes per second: the all-reduce of a few MiB is over before
# it could be worth hiding, and what it does cost is CPU time taken from compute. To study overlap
# on a laptop, the link must be slow but must not steal compute. hfstream's benchmark has one for
# exactly that (`hfstream.tools.bench.link.SimulatedLink`, docs/design.md section 5): it wraps
# `dist.all_reduce`, launches the real gloo reduction at once, and makes the returned work
# complete no earlier than `latency + 2(N-1)/N x bytes / bandwidth` after launch (and after the
# previous transfer: a link carries one at a time). The launch returns immediately, so compute is
# never blocked by the simulation. (As root, `hfstream bench` can instead rate-limit a private
# loopback with `tc tbf`.)
#
# The next cell runs 2 gloo processes. Each trains two copies of a 6-layer MLP on its own data,
# step by step in turn: one reduces after backward (lesson 04's serial way), one uses your
# `OverlapSync` (or hfstream's `GradSync(bucket_mb=0)`, the same idea, while yours is not
# written). The link is sized from this machine's own backward, so that sending all gradients
# takes 0.8 x backward: comm fits under backward, if it starts early enough.

# %%
from course.checks.lesson05 import measure_overlap
from hfstream.tools.plot import plot_timeline

run = measure_overlap(globals())
s, o = run["summary"]["serial"], run["summary"]["overlap"]
print(f"using {run['who']}")
print(f"{run['params']} parameters, {run['grad_mib']:.1f} MiB of gradients, link {run['rate_mbit']:.0f} Mbit/s per rank")
for label, r in (("serial", s), ("overlap", o)):
    print(f"{label:8s} step {r['step_ms']:6.1f} ms = forward {r['forward_ms']:5.1f} + backward {r['backward_ms']:5.1f}"
          f" + exposed comm {r['exposed_comm_ms']:5.1f} + optimizer {r['optimizer_ms']:4.1f}"
          f" | comm busy {r['comm_busy_ms']:5.1f} ms, {r['launched_in_backward']:.0f} of {r['collectives']:.0f}"
          f" reductions launched during backward")
print(f"ceiling {run['ceiling_ms']:.1f} ms (forward + max(backward, comm busy) + optimizer, from the serial steps)")

# %% [markdown]
# ### The timeline
#
# One serial step, then one overlap step, on each rank (each rank's clock starts at its own first
# span; the data lanes stay empty because the batch is already in memory, lesson 03's topic). In the serial step the comm lane starts where backward ends, and the compute lane sits in
# red (exposed comm) until the last reduction lands. In the overlap step the comm lane starts
# under backward: the last layer's gradient leaves first, and only the first layer's reduction,
# launched when backward ends, is left to wait for.

# %%
show(plot_timeline(run["spans"], figure_path("05_timeline.png"),
                   title="serial step, then per-parameter overlap step: 2 gloo ranks, simulated link"))

# %%
show(bar_chart({"serial (reduce after backward)": s["step_ms"], "overlap (a hook per parameter)": o["step_ms"]},
               figure_path("05_steps.png"), title="median step on 2 ranks, against the ceiling",
               reference=run["ceiling_ms"]))

# %% tags=["hidden-check"]
assert o["launched_in_backward"] > 0 and s["launched_in_backward"] == 0
assert o["collectives"] == run["params"] == s["collectives"]
assert any(lane == "comm" for _, lane, *_ in run["spans"]) and any(lane == "compute" for _, lane, *_ in run["spans"])

# %% [markdown]
# ### On a GPU: the hook runs when the work is *queued*
#
# On a GPU the host only queues kernels. A post-accumulate hook runs on the host when the
# gradient's kernels have been *queued*, usually long before the device has run them. That is why
# NCCL's all-reduce, launched from the hook, is ordered on the device after the compute stream
# (ProcessGroupNCCL makes its stream wait for the current stream at launch), and why `work.wait()`
# on a GPU makes the *current stream* wait instead of blocking the host. The next cell records,
# for each gradient, the host time its hook ran and, with a device event recorded in the hook,
# the time its kernels really finished.

# %% tags=["gpu"]
# GPU: each hook runs on the host well before its gradient is computed on the device: the host times bunch up early in backward while the device times spread over it, which is why reductions are ordered on streams, not by host time.
dev = accelerator_device()
gmodel = TinyMLP(dim=1024, hidden=4096, layers=8).to(dev)
gx = torch.randn(8192, 1024, device=dev)
marks = []


def gpu_note(param):
    ev = torch.Event(enable_timing=True)
    ev.record()                                   # on the stream backward uses for this gradient
    marks.append((time.perf_counter(), ev))


ghandles = [p.register_post_accumulate_grad_hook(gpu_note) for p in gmodel.parameters()]
for _ in range(2):                                # the second backward is the one shown
    marks.clear()
    gloss = gmodel(gx).square().mean()
    torch.accelerator.synchronize()
    start = torch.Event(enable_timing=True)
    start.record()
    h0 = time.perf_counter()
    gloss.backward()
    h1 = time.perf_counter()
    torch.accelerator.synchronize()
for h in ghandles:
    h.remove()
for i, (t, ev) in enumerate(marks):
    print(f"gradient {i:2d}: hook ran on the host at {(t - h0) * 1e3:7.3f} ms, device finished it at "
          f"{start.elapsed_time(ev):7.3f} ms")
print(f"loss.backward() returned on the host at {(h1 - h0) * 1e3:.3f} ms")

# %% [markdown]
# ## What you have now
#
# - a hook per parameter (`register_post_accumulate_grad_hook`) that starts an asynchronous
#   all-reduce (`async_op=True`) the moment a gradient is final, and a `finish()` that waits;
# - the rule that keeps ranks from hanging: one launch order from the model alone, unused
#   parameters launched in `finish()` with zeros;
# - a measured timeline where communication runs under backward.
#
# The price of "per parameter": one collective per parameter. This MLP has 12; GPT-2 small has
# 148, a 7B Llama 291, and every collective pays a fixed latency (a round trip, a kernel launch,
# a synchronisation) however small its tensor. Lesson 06 groups gradients into *buckets*: fewer
# collectives, still early enough to overlap.
