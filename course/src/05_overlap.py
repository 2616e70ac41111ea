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
# Two real APIs do all of it (no invented `torch.distributed.stream` needed); read their
# documentation before the exercise:
#
# | job | API (PyTorch documentation) |
# |---|---|
# | run code when a parameter's gradient is final | `Tensor.register_post_accumulate_grad_hook` (torch >= 2.1): once backward has accumulated this parameter's gradient into `.grad`, autograd calls your hook with the parameter; registering returns a handle whose `remove()` takes the hook off again |
# | start a reduction and keep going | the collectives of `torch.distributed` (`all_reduce` among them) have an asynchronous form, chosen by their `async_op` argument: the call returns at once with a `Work` you can wait on later; the result is written in place into the tensor you passed |
#
# Why the *post-accumulate* hook and not `Tensor.register_hook`? `register_hook` fires with
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
# One process, no communication yet: for every parameter of a 6-layer MLP, the moment its
# gradient became final, measured from the start of `loss.backward()` (by a post-accumulate hook
# per parameter: writing such hooks is the exercise below, so the helper hides how).

# %%
from course.checks.lesson05 import gradient_arrivals

model = TinyMLP(dim=256, hidden=256, layers=6)
x, y = random_regression(n=256, dim=256)
arrivals, returned_ms = gradient_arrivals(model, lambda: F.mse_loss(model(x), y))
for ms, name in arrivals:
    print(f"{ms:6.2f} ms  {name}")
print(f"{returned_ms:6.2f} ms  backward returns")

# %% [markdown]
# `layers.5` (the last layer) is final almost immediately; `layers.0.weight` only at the very
# end. Reducing after backward makes the last layer's gradient wait all that time for nothing.
#
# ## Exercise 05.overlap_hook — a hook per parameter, an asynchronous all-reduce each
#
# Write `OverlapSync`. What each part must do (how, with the two APIs above, is yours):
#
# - `__init__(model)`: from then on, every parameter of `model` that requires grad calls
#   `self._on_grad_ready(param)` as soon as its `.grad` is final in a backward. Keep what you need
#   to undo that in `self.handles` (`close()` uses it).
# - `_on_grad_ready(param)`: runs *inside* backward, once per parameter per step. It starts the
#   sum of `param.grad` over all ranks and returns **without waiting** for it: every millisecond
#   spent in the hook is a millisecond backward stands still. It keeps in `self.works` whatever
#   `finish()` will need to wait for that reduction.
# - `finish()`, called after `loss.backward()` returned: when it returns, every `.grad` holds the
#   **mean** over the ranks (a sum over ranks is not a mean), and nothing of this step is left in
#   `self.works`, so the next step starts clean.
#
# What must hold, and what the check measures in 2 gloo processes over two steps: exactly one
# reduction per parameter per step, every one launched *before* `loss.backward()` returned, and
# after `finish()` every `.grad` equal to lesson 04's serial result (all-reduce after backward,
# then divide). The reduction works in place, so no copy back is needed.

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
# `__init__` and `_launch(i)` are given (read them: `_launch` gives a parameter with no gradient
# a zero one, and starts its reduction). Write the two methods so that these rules hold:
#
# - `_on_grad_ready(i, param)`, the hook of `self.order[i]`: a parameter whose gradient is final
#   is *ready*; it is launched only when every parameter ahead of it in `self.order` has been
#   launched. So the hook records that `i` is ready, then launches, from the head of the order
#   (`self.next`), each parameter for as long as the head is ready. A ready parameter with an
#   unready one ahead of it waits; the hook that makes the head ready launches it and the ready
#   ones behind it.
# - `finish()`: every parameter not launched yet is launched, in order, whatever its hook did;
#   then every reduction of the step is waited for and turned into a mean. When `finish()`
#   returns, the per-step state (`self.works`, `self.next`, `self.ready`) is as `__init__` left it.
#
# Afterwards, both ranks have launched the same reductions in the same order, whichever
# parameters each one used.
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
# ## Measure it: serial against overlap on 2 ranks, first for real, then over a simulated link
#
# The next cell runs 2 gloo processes. Each trains two copies of a 6-layer MLP on its own data,
# taking turns step by step: one reduces after backward (lesson 04's serial way), one uses your
# `OverlapSync` (or hfstream's `GradSync(bucket_mb=0)`, the same idea, while yours is not
# written). It does so twice:
#
# 1. **For real**: gloo over this machine's loopback, nothing simulated. On one machine there is
#    no wire: gloo's all-reduce is memory copies and additions done by gloo's own threads on the
#    same CPU cores that run backward. What it costs is CPU time, not link time.
# 2. **Over a simulated link**, to see what overlap does when the link, not the CPU, is the
#    bottleneck: hfstream's `hfstream.testing.link.SimulatedLink` (docs/design.md section 5)
#    replaces `dist.all_reduce` by a function that launches the same real gloo reduction and
#    returns a `Work` that completes no earlier than `latency + 2(N-1)/N x bytes / bandwidth` after
#    launch (and after the previous transfer: the link carries one at a time). The delay is a
#    timer: the launch returns at once and no byte is slowed down. The bandwidth is sized from this
#    machine's own backward, so that sending every gradient takes 0.8 x backward, and the latency
#    is 0.2 ms per collective: communication fits under backward, if it starts early enough.
#
# What the simulation leaves out: there is no real network. Each rank times its own private link,
# so there is no contention (between the ranks, with other traffic, in a switch), no NIC (no TCP or
# RDMA behaviour, no congestion control, no packet loss, no full-duplex sends and receives), and
# bandwidth and latency are constants. The real gloo reduction still runs underneath, over
# loopback, so its CPU cost is still paid, on the same cores. (As root, `hfstream bench` can
# instead rate-limit a private loopback with `tc tbf`, a real if simple wire.)

# %%
from course.checks.lesson05 import measure_overlap
from hfstream.cli.plot import plot_timeline


def parts(label, r):
    print(f"  {label:8s} step {r['step_ms']:6.1f} ms = forward {r['forward_ms']:5.1f} + backward {r['backward_ms']:5.1f}"
          f" + exposed comm {r['exposed_comm_ms']:5.1f} + optimizer {r['optimizer_ms']:4.1f}"
          f" | comm busy {r['comm_busy_ms']:5.1f} ms, {r['launched_in_backward']:.0f} of {r['collectives']:.0f}"
          f" launched during backward")


run = measure_overlap(globals())
lb, sim = run["loopback"], run["simulated"]
print(f"using {run['who']}; {run['params']} parameters, {run['grad_mib']:.1f} MiB of gradients; "
      f"{os.cpu_count()} CPU cores for 2 ranks")
print("1. real: gloo over loopback, nothing simulated")
for mode in ("serial", "overlap"):
    parts(mode, lb[mode])
real_comm = lb["serial"]["exposed_comm_ms"]
grow = lb["overlap"]["backward_ms"] - lb["serial"]["backward_ms"]
print(f"  the real reductions, alone after backward, take {real_comm:.1f} ms "
      f"({real_comm / lb['serial']['backward_ms']:.0%} of backward)")
if grow > 0.25 * real_comm:
    print(f"  under overlap, backward took {grow:.1f} ms longer than in the serial step ({grow / real_comm:.0%} of what "
          f"the reductions cost alone): gloo's threads ran on the cores autograd needed")
else:
    print(f"  under overlap, backward did not grow much here ({grow:+.1f} ms): gloo's threads did not take their CPU "
          f"time from autograd in this run (spare cores? other programs' noise? rerun on an idle machine)")
print(f"2. simulated link: {run['rate_mbit']:.0f} Mbit/s per rank + {run['latency_ms']:.1f} ms per collective "
      f"(all gradients = {run['link_ratio']} x a backward of {run['probe_backward_ms']:.1f} ms)")
for mode in ("serial", "overlap"):
    parts(mode, sim[mode])
print(f"  ceiling {sim['ceiling_ms']:.1f} ms (forward + max(backward, comm busy) + optimizer, from the serial steps)")

# %% [markdown]
# ### Reading the numbers
#
# **The real run.** Compare the last line of part 1: the time the reductions take alone (the
# serial step's exposed comm) and how much longer backward got under overlap. Overlap does not
# make the reduction free on a CPU: with gloo, the reduction is CPU work on gloo's threads, and
# under overlap those threads run *while* autograd computes. With 2 ranks on a small machine
# (the core count is printed above) there is no idle core to run them on, so they take their CPU
# time from backward, and backward grows, by up to what the reductions cost alone (the cell
# prints both). Part of that is paid per collective, whatever its size (each launch, each wake-up
# of gloo's thread, on a core autograd was using), part per byte: lesson 06 is about the first
# part. What overlap still saves is what the reductions spent *waiting* (for the other rank, on
# the socket) rather than computing. On a GPU with NCCL the reduction runs on the device and the NIC, not on the cores
# that run backward (its kernels do take a few of the GPU's SMs from compute): there, the
# simulated picture below is the closer one.
#
# **The simulated run.** The overlap step beats the serial one but stays above the ceiling. The
# next cell splits the gap into its parts, measured: the ceiling assumes every byte hides under
# backward, but backward itself grows under overlap (the real gloo reductions still run
# underneath the simulation, on the same cores, as in part 1), and the first layer's gradients
# are final only when backward ends, so their reductions are exposed whatever you do: the cell
# prints the least time they need on this link.

# %%
s, o = sim["serial"], sim["overlap"]
gap = o["step_ms"] - sim["ceiling_ms"]
print(f"overlap step {o['step_ms']:.1f} ms - ceiling {sim['ceiling_ms']:.1f} ms = {gap:+.1f} ms, made of:")
print(f"  backward under overlap {o['backward_ms']:.1f} ms against max(serial backward, comm busy) "
      f"{max(s['backward_ms'], s['comm_busy_ms']):.1f} ms: {o['backward_ms'] - max(s['backward_ms'], s['comm_busy_ms']):+.1f} ms")
print(f"  comm still running after backward: {o['exposed_comm_ms']:.1f} ms (the first layer's two reductions, "
      f"launched when backward ends, need at least {run['tail_floor_ms']:.1f} ms on this link)")
rest = gap - (o["backward_ms"] - max(s["backward_ms"], s["comm_busy_ms"])) - o["exposed_comm_ms"]
print(f"  forward, optimizer and the slower of the two ranks: {rest:+.1f} ms")

# %% [markdown]
# ### The timeline (simulated link)
#
# One serial step, then one overlap step, on each rank, from the simulated run (each rank's
# clock starts at its own first span; the data lanes stay empty because the batch is already in
# memory, lesson 03's topic). The comm lane shows each reduction from its launch to the moment
# the *simulated* link completes it. In the serial step the comm lane starts where backward
# ends, and the compute lane sits in red (exposed comm) until the last reduction lands. In the
# overlap step the comm lane starts under backward: the last layer's gradient leaves first, and
# only the first layer's reductions, launched when backward ends, are left to wait for.

# %%
show(plot_timeline(run["spans"], figure_path("05_timeline.png"),
                   title="serial step, then per-parameter overlap step, 2 gloo ranks; comm on a SIMULATED link\n"
                         f"(timer-delayed completion, all gradients = {run['link_ratio']} x backward; "
                         "no contention, no NIC; real gloo runs underneath)"))

# %%
show(bar_chart({"serial\nreal loopback": lb["serial"]["step_ms"], "overlap\nreal loopback": lb["overlap"]["step_ms"],
                "serial\nsimulated link": s["step_ms"], "overlap\nsimulated link": o["step_ms"]},
               figure_path("05_steps.png"),
               title="median step on 2 gloo ranks: real loopback, then a SIMULATED link\n"
                     "(timer-delayed completion sized from this machine's backward; no contention, no NIC)",
               reference=sim["ceiling_ms"], reference_label="ceiling on the simulated link"))

# %% tags=["hidden-check"]
for phase in (lb, sim):
    assert phase["overlap"]["launched_in_backward"] > 0 and phase["serial"]["launched_in_backward"] == 0
    assert phase["overlap"]["collectives"] == run["params"] == phase["serial"]["collectives"]
assert o["exposed_comm_ms"] < s["exposed_comm_ms"], (o, s)
assert run["tail_floor_ms"] > 0
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
# ### On a GPU: where the all-reduce runs, in a profiler trace
#
# The timeline above is hfstream's own record. `torch.profiler` shows what is underneath: every
# operator on the host and every kernel on the device, with the stream it ran on. The next cell
# profiles one step of your kind of overlap (a hook per parameter launching an asynchronous
# all-reduce) on a process group of one rank (NCCL on CUDA): one rank has no partner, so each
# reduction is short; the trace shows *where* it runs (NCCL's own stream) and *when* (while
# backward's kernels still run on the compute stream), not what a real link costs. No simulation
# here. The Trainer equivalent is `hfstream.cli.trace.TraceSteps`. The trace file opens in
# https://ui.perfetto.dev.

# %% tags=["gpu"]
# GPU: a torch.profiler trace of one step on a one-rank NCCL group: backward's kernels on the compute stream and each gradient's all-reduce on NCCL's own stream, with how many of them start before backward's last kernel ends; above them, the host launching each reduction from its hook.
from course.checks.lesson05 import trace_figure, trace_findings, trace_overlap_step

dev = accelerator_device()
if dev.type != "cuda":
    print(f"this cell needs NCCL (CUDA); {dev.type} has no NCCL backend, so it is skipped")
else:
    found = trace_overlap_step(dev, figure_path("05_trace.json"), bucket_mb=0.0)
    print(f"backend {found['backend']}, {found['buckets']} all-reduces (one per parameter); trace: {found['path']}")
    print("\n".join(trace_findings(found)))
    show(trace_figure(found, figure_path("05_trace.png"),
                      title="one step, profiled (real, not simulated): one-rank NCCL all-reduce per parameter"))

# %% [markdown]
# ## What you have now
#
# - a hook per parameter (`register_post_accumulate_grad_hook`) that starts an asynchronous
#   all-reduce the moment a gradient is final, and a `finish()` that waits and averages;
# - the rule that keeps ranks from hanging: one launch order from the model alone, unused
#   parameters launched in `finish()` with zeros;
# - a measured timeline where communication runs under backward (on a simulated link), and the
#   real measurement beside it: on a CPU, gloo's reductions share the cores with backward.
#
# The price of "per parameter": one collective per parameter. This MLP has 12; GPT-2 small has
# 148, a 7B Llama 291, and every collective pays a fixed latency (a round trip, a kernel launch,
# a synchronisation) however small its tensor. Lesson 06 groups gradients into *buckets*: fewer
# collectives, still early enough to overlap.
