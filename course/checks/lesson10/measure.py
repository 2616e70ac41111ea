"""The measurements behind lesson 10's figures, on real gloo processes: the learner's reduce-scatter
against all_reduce, and DDP's best vs overlap vs sharded against the cross-step limit.

The simulated link is `hfstream.tools.link.SimulatedLink` (all-reduce, all-to-all, all-gather).
"""

from __future__ import annotations

import collections
import contextlib
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from hfstream.timeline import cross_step_limit
from hfstream.tools.link import SimulatedLink

from .reduce_scatter import learner_reduce_scatter

MiB = 2**20


# =============================================================================================
# The simulated link, and the reduce-scatter measured on it and on the bare loopback
# =============================================================================================
class _PreallocatedReduceScatter:
    """hfstream's gloo reduce-scatter (all-to-all + local sum) into buffers allocated once, as
    `GradSync(mode="sharded")` keeps them; also what the measurement uses while yours is a stub."""

    def __init__(self):
        self.buffers = {}

    def __call__(self, flat: torch.Tensor) -> torch.Tensor:
        from hfstream.gradsync import collectives

        n = dist.get_world_size()
        if flat.numel() not in self.buffers:
            self.buffers[flat.numel()] = (torch.empty_like(flat), torch.empty(flat.numel() // n, dtype=flat.dtype))
        received, out = self.buffers[flat.numel()]
        collectives.launch_reduce_scatter(flat, received, None, local_sum=True).wait()
        collectives.sum_received(received, out, n)
        return out.div_(n)


def _time(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _rs_measure_rank(rank, world_size, path, real_mib, sim_mib, rate_mbit, reps):
    from course.grading import load_module

    library = _PreallocatedReduceScatter()
    rs = load_module(path).reduce_scatter_mean if path else library
    out = {}
    for label, mib, link in (("loopback", real_mib, None), ("simulated", sim_mib, SimulatedLink(rate_mbit, record=True))):
        flat = torch.randn(int(mib * MiB / 4) // world_size * world_size)
        buf = flat.clone()
        fns = {"all_reduce_ms": lambda: dist.all_reduce(buf.copy_(flat)), "reduce_scatter_ms": lambda: rs(flat),
               "preallocated_ms": lambda: library(flat)}
        with link.installed() if link else contextlib.nullcontext():
            for fn in fns.values():
                fn()                                             # warm-up: connections, buffers
            best = collections.defaultdict(list)
            for _ in range(2):                                   # alternate: a busy moment hits them all
                for key, fn in fns.items():
                    best[key].append(_time(fn, reps))
        out[label] = {key: min(v) for key, v in best.items()} | {"mib": mib}
    link = SimulatedLink(rate_mbit)
    out["predicted"] = {"all_reduce_ms": link.wire_s(2 * (world_size - 1) / world_size * sim_mib * MiB) * 1e3,
                        "reduce_scatter_ms": link.wire_s((world_size - 1) / world_size * sim_mib * MiB) * 1e3}
    return out


def measure_reduce_scatter(namespace: dict, real_mib: float = 16.0, sim_mib: float = 4.0, rate_mbit: float = 1000.0,
                           reps: int = 3) -> dict:
    """The learner's reduce_scatter_mean against dist.all_reduce on 2 gloo ranks: on the bare loopback
    (real, unsimulated) and on a simulated ``rate_mbit`` link (`SimulatedLink`)."""
    from hfstream.testing import run_on_ranks

    path = learner_reduce_scatter(namespace)
    out = run_on_ranks(_rs_measure_rank, 2, path, real_mib, sim_mib, rate_mbit, reps, timeout=120, pg_timeout_s=60)
    res = {k: {m: max(r[k][m] for r in out) for m in out[0][k]} for k in out[0]}
    res["who"] = "your reduce_scatter_mean" if path else "hfstream's reduce-scatter (yours is not written yet)"
    res["rate_mbit"] = rate_mbit
    return res


def rs_figure(m: dict, path) -> Path:
    """Two panels: the simulated link (with what its byte model predicts), and the real loopback."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.8, 3.4))
    left, right = fig.subplots(1, 2)
    sim, real, pred = m["simulated"], m["loopback"], m["predicted"]
    yours = m["who"].startswith("your")
    mine = "reduce-scatter\n(yours)" if yours else "reduce-scatter\n(hfstream's)"
    panels = ((left, sim, ["all_reduce_ms", "reduce_scatter_ms"],
               f"SIMULATED link: {m['rate_mbit']:.0f} Mbit/s, bandwidth only\n{sim['mib']:g} MiB, 2 gloo ranks; "
               f"black ticks: bytes / bandwidth"),
              (right, real, ["all_reduce_ms", "reduce_scatter_ms"] + (["preallocated_ms"] if yours else []),
               f"REAL loopback, not shaped, not simulated\n{real['mib']:g} MiB, 2 gloo ranks on this machine"))
    labels = {"all_reduce_ms": "all_reduce", "reduce_scatter_ms": mine,
              "preallocated_ms": "hfstream's\n(buffers reused)"}
    colors = {"all_reduce_ms": "#c44e52", "reduce_scatter_ms": "#4c72b0", "preallocated_ms": "#8172b2"}
    for ax, data, keys, title in panels:
        vals = [data[k] for k in keys]
        bars = ax.bar([labels[k] for k in keys], vals, color=[colors[k] for k in keys])
        ax.bar_label(bars, fmt="%.1f ms", fontsize=8)
        ax.set_title(title, fontsize=8)
        ax.set_ylabel("ms (median)")
        ax.tick_params(axis="x", labelsize=7)
        ax.set_ylim(0, max(vals) * 1.25)
    left.scatter([0, 1], [pred["all_reduce_ms"], pred["reduce_scatter_ms"]], marker="_", s=700, color="black",
                 zorder=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return Path(path)


# =============================================================================================
# The last figure: DDP's best vs overlap vs sharded vs the cross-step limit, measured
# =============================================================================================
def _block_names(model) -> dict[int, str]:
    """Modules to time in the forward: embeddings, each block, the final norm (GPT-2)."""
    out = {}
    for name, m in model.named_modules():
        if name in ("transformer.wte", "transformer.ln_f") or (name.startswith("transformer.h.") and name.count(".") == 2):
            out[id(m)] = name.replace("transformer.", "")
    return out


def _compute_step(model, ids, opt) -> tuple[float, float, float]:
    """One step with no communication at all: (forward, backward, clip + AdamW) in seconds."""
    t0 = time.perf_counter()
    loss = model(input_ids=ids, labels=ids).loss
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return t1 - t0, t2 - t1, time.perf_counter() - t2


def _modes_rank(rank, world_size, steps, rounds, comm_ratio, bucket_mb, layers, width):
    import transformers

    from course.lib import tiny_gpt2
    from hfstream.gradsync import GradSync

    transformers.logging.set_verbosity_error()
    ids = torch.randint(0, 257, (4, 64), generator=torch.Generator().manual_seed(100 + rank))

    def build():
        model = tiny_gpt2(layers=layers, width=width)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, foreach=True)

    # Size the link from a first look at the compute: one all-reduce of every gradient takes
    # comm_ratio x (forward + backward). The parts the formulas use are measured again below,
    # in the same rounds as the modes, so that a busy moment of the machine hits them all.
    model, opt = build()
    probe = [_compute_step(model, ids, opt) for _ in range(4)][1:]
    agreed = torch.tensor([statistics.median(p[0] + p[1] for p in probe)])
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    comm = comm_ratio * agreed.item()
    link = SimulatedLink(2 * (world_size - 1) / world_size * grad_bytes * 8 / comm / 1e6, record=True)
    runs = {"compute": (model, opt, None)}
    for mode in ("overlap", "sharded"):
        model, opt = build()
        sync = GradSync(model, mode=mode, bucket_mb=bucket_mb)
        if mode == "sharded":
            opt = sync.shard_optimizer(opt)
        runs[mode] = (model, opt, sync)
    timeline = None
    steps_ms, parts = collections.defaultdict(list), collections.defaultdict(list)
    with link.installed():
        for round_ in range(rounds):                # blocks of consecutive steps, the modes taking turns
            for mode, (model, opt, sync) in runs.items():
                dist.barrier()
                if sync is None:
                    for _ in range(steps):
                        for k, v in zip(("forward", "backward", "optimizer"), _compute_step(model, ids, opt)):
                            parts[k].append(v * 1e3)
                    continue
                sync.wait_for_params()
                starts, marks = [], []
                record = mode == "sharded" and round_ == rounds - 1
                hooks = []
                if record:
                    names = _block_names(model)
                    for m in model.modules():
                        if id(m) in names:
                            hooks.append(m.register_forward_pre_hook(
                                lambda mod, args, name=names[id(m)]: marks.append((name, time.perf_counter()))))
                for i in range(steps + 2):
                    starts.append(time.perf_counter())
                    if record and i == steps:
                        link.events.clear()
                        marks.clear()
                    loss = model(input_ids=ids, labels=ids).loss
                    if record and i == steps:
                        marks.append(("backward", time.perf_counter()))
                    if record and i == steps + 1:
                        marks.append(("next forward end", time.perf_counter()))
                    loss.backward()
                    sync.finish()
                    sync.clip_grad_norm_(1.0)           # the global norm in "sharded", clip_grad_norm_ otherwise
                    if record and i == steps:
                        marks.append(("optimizer", time.perf_counter()))
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    if record and i == steps:
                        marks.append(("step end", time.perf_counter()))
                if record:
                    # The step recorded, up to the end of the next step's forward that waits for its gathers.
                    t0 = starts[steps]
                    timeline = {"marks": [(n, t - t0) for n, t in marks],
                                "transfers": [{**e, "launch": e["launch"] - t0, "start": e["start"] - t0,
                                               "done": e["done"] - t0} for e in link.events],
                                "next_step": starts[steps + 1] - t0}
                    for h in hooks:
                        h.remove()
                steps_ms[mode] += [(b - a) * 1e3 for a, b in zip(starts[1:-1], starts[2:])]
        for _, _, sync in runs.values():
            if sync is not None:
                sync.close()
    return {"parts": dict(parts), "comm_ms": comm * 1e3, "rate_mbit": link.rate_mbit, "grad_mib": grad_bytes / MiB,
            "steps_ms": dict(steps_ms), "timeline": timeline, "buckets": len(runs["sharded"][2].buckets)}


def measure_modes(steps: int = 3, rounds: int = 2, comm_ratio: float = 1.0, bucket_mb: float = 0.25,
                  layers: int = 4, width: int = 128) -> dict:
    """A tiny GPT-2 on 2 gloo ranks on a simulated link (`SimulatedLink`) sized so that one all-reduce of
    every gradient takes about ``comm_ratio`` x (forward + backward): GradSync ``"overlap"`` and
    ``"sharded"`` measured; DDP's ceiling and the cross-step limit computed from forward, backward
    and optimizer measured without communication in the same rounds, and the link's all-reduce time."""
    from hfstream.testing import run_on_ranks

    out = run_on_ranks(_modes_rank, 2, steps, rounds, comm_ratio, bucket_mb, layers, width, timeout=150,
                       pg_timeout_s=60)
    n = len(out)
    f, b, o = (max(statistics.median(r["parts"][k]) for r in out) for k in ("forward", "backward", "optimizer"))
    c = out[0]["comm_ms"]
    step = {mode: statistics.median(max(x) for x in zip(*(r["steps_ms"][mode] for r in out)))
            for mode in out[0]["steps_ms"]}
    return {**{k: out[0][k] for k in ("comm_ms", "rate_mbit", "grad_mib", "timeline", "buckets")},
            "forward_ms": f, "backward_ms": b, "optimizer_ms": o, "world_size": n,
            "overlap_ms": step["overlap"], "sharded_ms": step["sharded"],
            "ddp_ceiling_ms": f + max(b, c) + o, "limit_ms": cross_step_limit(f, b, o / n, c)}


def modes_figure(m: dict, path) -> Path:
    """Four bars: DDP's ceiling and the cross-step limit (computed, light), overlap and sharded (measured)."""
    from matplotlib.figure import Figure

    bars = [("DDP's best\nfwd + max(bwd, comm) + opt", m["ddp_ceiling_ms"], "computed"),
            ("overlap", m["overlap_ms"], "measured"), ("sharded", m["sharded_ms"], "measured"),
            ("cross-step limit\nmax(fwd + bwd + opt/N, comm)", m["limit_ms"], "computed")]
    fig = Figure(figsize=(6.8, 3.5))
    ax = fig.subplots()
    style = {"computed": dict(color="#c9d6ea", edgecolor="#4c72b0", hatch="//"), "measured": dict(color="#4c72b0")}
    for kind in ("computed", "measured"):
        xs = [i for i, bar in enumerate(bars) if bar[2] == kind]
        drawn = ax.bar(xs, [bars[i][1] for i in xs], label=kind, **style[kind])
        ax.bar_label(drawn, fmt="%.1f ms", fontsize=8)
    ax.set_xticks(range(len(bars)), [bar[0] for bar in bars], fontsize=7)
    ax.set_ylim(0, max(bar[1] for bar in bars) * 1.18)
    ax.set_ylabel("ms per step (2 ranks)")
    ratio = m["comm_ms"] / (m["forward_ms"] + m["backward_ms"])
    ax.set_title(f"tiny GPT-2, 2 gloo ranks, SIMULATED {m['rate_mbit']:.0f} Mbit/s link: an all-reduce of all "
                 f"gradients\n= {m['comm_ms']:.0f} ms = {ratio:.2f} x (forward + backward); medians of a few steps",
                 fontsize=8)
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return Path(path)


def timeline_figure(m: dict, path) -> Path:
    """One sharded step on rank 0: compute phases and module starts above, transfers on the link below."""
    from matplotlib.figure import Figure

    tl = m["timeline"]
    fig = Figure(figsize=(7.6, 3.4))
    ax = fig.subplots()
    marks = tl["marks"]
    at = {n: t for n, t in marks if n in ("backward", "optimizer", "step end", "next forward end")}
    nxt = tl["next_step"]
    phases = [("forward", 0.0, at["backward"]), ("backward", at["backward"], at["optimizer"]),
              ("clip+step", at["optimizer"], at["step end"]), ("next forward", nxt, at["next forward end"])]
    colors = {"forward": "#55a868", "backward": "#4c72b0", "clip+step": "#8172b2", "next forward": "#8fd19e"}
    for name, a, b in phases:
        ax.barh(2, (b - a) * 1e3, left=a * 1e3, color=colors[name], height=0.6)
        ax.text((a + b) / 2 * 1e3, 2, name, ha="center", va="center", fontsize=7)
    for n, t in marks:
        if n not in at and (t <= at["backward"] or nxt <= t <= at["next forward end"]):
            ax.plot([t * 1e3, t * 1e3], [1.65, 2.35], color="black", linewidth=0.6)
    end = at["next forward end"]
    kinds = {"all_to_all": (1, "#dd8452", "reduce-scatter"), "all_gather": (0, "#c44e52", "all-gather"),
             "all_reduce": (1, "#999999", "all-reduce (norm)")}
    shown = set()
    for e in tl["transfers"]:
        row, color, label = kinds.get(e["kind"], (1, "#999999", e["kind"]))
        if e["bytes"] < 64 or e["launch"] > end:   # the clip's one-scalar all-reduce; the next backward's
            continue
        ax.barh(row, max((e["done"] - e["start"]) * 1e3, 0.2), left=e["start"] * 1e3, color=color, height=0.5,
                edgecolor="white", linewidth=0.5, label=None if label in shown else label)
        shown.add(label)
    ax.set_yticks([0, 1, 2], ["all-gathers\n(link)", "reduce-scatters\n(link)", "compute\n(rank 0)"], fontsize=7)
    ax.set_xlabel("ms from the start of the step (ticks on the forward: a block starts)")
    ax.set_title("one sharded step on a SIMULATED link: the gathers launched after the step travel under the "
                 "next forward", fontsize=8)
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return Path(path)

