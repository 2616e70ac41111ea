"""The planner: step time, gradient communication and the ceiling for 1 .. 1024 devices, without running.

It predicts the quantities `hfstream.report.timeline` and `hfstream.cli.bench.run` measure (docs/design.md section
4) for a data-parallel step in which every device keeps its tokens per step (weak scaling):

    forward, backward   C = 6 P T FLOPs per device and step (+ 12 L d_attn s T with --seq-len),
                        forward C/3, backward 2C/3 (or a measured split: forward_share),
                        at R = peak FLOP/s x MFU
                        (Kaplan et al. 2020, "Scaling Laws for Neural Language Models",
                        arXiv:2001.08361, section 2.1: 2N FLOPs per token forward, twice that
                        backward; attention term and MFU: Chowdhery et al. 2022, "PaLM",
                        arXiv:2204.02311, appendix B, as in nanoGPT's ``estimate_mfu``)
    optimizer           P x bytes moved per parameter / memory bandwidth; default 28 B: fp32
                        AdamW reads param, grad, exp_avg, exp_avg_sq and writes three of them
    comm, per bucket    2(N-1)/N x b / B + 2(N-1) x alpha: ring all-reduce, a reduce-scatter
                        then an all-gather of 2(N-1) steps each (Thakur, Rabenseifner & Gropp
                        2005, "Optimization of Collective Communication Operations in MPICH";
                        the 2(N-1)/N is NCCL's "bus bandwidth" factor)
    comm busy           sum over buckets (the link reduces one bucket at a time)
    exposed, serial     comm busy: every bucket is reduced after backward
    exposed, overlap    a schedule: gradients appear at the rate backward does its FLOPs, in
                        reverse registration order (DDP's bucket order, Li et al. VLDB 2020);
                        a bucket starts when its last gradient exists and the link is free;
                        exposed = max(0, end of the last reduction - end of backward). The
                        last bucket is ready only when backward ends, so exposed >= its
                        reduction time, and exposed >= comm busy - backward
    ceiling             forward + max(backward, comm busy) + optimizer

    sharded             grad_sync="sharded" (docs/design.md section 7): each bucket is reduce-
                        scattered in backward and its updated slice all-gathered during the step;
                        each half carries (N-1)/N x b / B + (N-1) x alpha, the ring's halves.
                        The reduce-scatters follow the overlap schedule; the optimizer steps 1/N
                        of the parameters (optimizer / N) bucket by bucket in forward order, and
                        each bucket's all-gather starts as it is stepped (the engine's pipelined
                        step), one at a time on the link; the next forward waits for a bucket
                        only when it reaches its parameters (forward does its FLOPs in
                        registration order); a reduce-scatter waits for the link after the last
                        all-gather
    host contention     comm_host_ms_per_mib x MiB sent, added to the compute the collectives
                        overlap: overlap's all-reduces to backward, sharded's reduce-scatters
                        to backward and its all-gathers to forward (CPU training, where the
                        collectives' threads share the compute's cores; 0 by default: NCCL on
                        a GPU runs them on the device)
    cross-step limit    max(forward + backward + optimizer / N, comm busy)

P is the number of trainable parameters (tied ones once; in C, without embedding tables that
are only indexed, which cost no FLOPs), T the tokens per device per step,
N the world size, B the link bandwidth per device, alpha the latency of one ring step. With
``devices_per_node`` set, the collectives run by level (`links`: a ring inside each node at
``intra_node_gbs``, one across nodes on 1/g of the bytes at ``link_gbs``); without it, one flat
ring at one bandwidth. No contention on the link (the host contention above aside).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from hfstream.gradsync import DDP_BUCKET_MB
from hfstream.gradsync.buckets import MiB
from hfstream.gradsync.sharded.reduction import ShardedReduction
from hfstream.report.schedule import overlap_exposed, sharded_step
from hfstream.report.timeline import cross_step_limit

from .links import Links
from .shapes import ModelShape

DEFAULT_WORLD_SIZES = tuple(2**i for i in range(11))   # 1, 2, 4, ..., 1024
DDP_FIRST_BUCKET_MB = 1.0   # DDP's first bucket (_DEFAULT_FIRST_BUCKET_BYTES) when bucket_cap_mb is not given
SHARDED_LAST_BUCKET_MB = ShardedReduction.last_bucket_mb   # GradSync's default in sharded mode


# =============================================================================================
# Buckets and their readiness during backward
# =============================================================================================

def predict_buckets(shape: ModelShape, grad_bytes: int, bucket_mb: float,
                    first_bucket_mb: float | None = None,
                    last_bucket_mb: float | None = None) -> list[tuple[float, float]]:
    """``(bytes, ready)`` per bucket in launch order; ``ready`` is the fraction of backward done
    when the bucket's last gradient exists.

    The same cut as `hfstream.gradsync.plan_buckets`, but from a `ModelShape` (counts, not tensors)
    and with the time each bucket becomes ready, which the schedule in `predict_row` needs.
    With tensors known this is GradSync's (and DDP's) greedy plan: reverse registration order,
    a tensor never split, a bucket closed as soon as it holds at least its cap. Backward is
    assumed to produce gradients at the rate it does FLOPs (a matmul's backward costs in
    proportion to its parameters). With only a count, the gradient is cut into equal buckets
    (the remainder last) that are ready in proportion to their bytes.

    Args:
        bucket_mb: cap in MiB; 0 = one tensor per bucket (needs tensors); inf = one bucket.
        first_bucket_mb: a smaller cap for the first bucket (DDP's default 1 MiB), or None.
        last_bucket_mb: the cap the end of backward's order (at most one bucket's worth) is cut
            at (sharded mode's default 1 MiB, `hfstream.gradsync.plan_buckets`); or None.
    """
    if last_bucket_mb is not None:
        return _with_last_bucket(shape, grad_bytes, bucket_mb, first_bucket_mb, last_bucket_mb)
    total = shape.params * grad_bytes
    first = bucket_mb if first_bucket_mb is None else first_bucket_mb
    if not shape.tensors:
        if bucket_mb == 0:
            raise ValueError("bucket_mb=0 (one parameter per bucket) needs the model's tensors: "
                             "give a model, not a count")
        out, done = [], 0.0
        cap = first * MiB
        while total - done > 1e-6:
            b = min(cap, total - done) if math.isfinite(cap) else total - done
            done += b
            out.append((b, done / total))
            cap = bucket_mb * MiB
        return out
    return _cut(_readiness(shape, grad_bytes), bucket_mb, first_bucket_mb)


def _readiness(shape: ModelShape, grad_bytes: int) -> list[tuple[float, float]]:
    """``(bytes, ready)`` per tensor in backward order: ready as backward does its FLOPs."""
    flop_total = sum(n for _, n, kind in shape.tensors if kind != "lookup") or 1
    # A tied embedding's FLOPs (the output projection) are spent at the very start of backward.
    flops_done = sum(n for _, n, kind in shape.tensors if kind == "tied")
    order = []
    for _, n, kind in reversed(shape.tensors):
        if kind == "dense":
            flops_done += n
        order.append((n * grad_bytes, 1.0 if kind == "tied" else flops_done / flop_total))
    return order


def _with_last_bucket(shape: ModelShape, grad_bytes: int, bucket_mb: float, first_bucket_mb: float | None,
                      last_mb: float) -> list[tuple[float, float]]:
    """`predict_buckets` with the end of backward cut finer (`hfstream.gradsync.plan_buckets`' cut):
    the registration order's first tensors, at most ``bucket_mb`` of them, in buckets of ``last_mb``."""
    cap = bucket_mb * MiB
    if not math.isfinite(cap):
        return predict_buckets(shape, grad_bytes, bucket_mb, first_bucket_mb)
    if not shape.tensors:   # equal slices: the last bucket's worth in pieces of last_mb, ready as their bytes
        whole = predict_buckets(shape, grad_bytes, bucket_mb, first_bucket_mb)
        *head, (tail_bytes, _) = whole
        start = head[-1][1] if head else 0.0
        total, out, done = shape.params * grad_bytes, list(head), 0.0
        piece = last_mb * MiB if last_mb > 0 else tail_bytes
        while tail_bytes - done > 1e-6:
            b = min(piece, tail_bytes - done)
            done += b
            out.append((b, start + (1.0 - start) * done / tail_bytes))
        return out if total else whole
    order = _readiness(shape, grad_bytes)
    size, taken = 0.0, 0
    for nbytes, _ in reversed(order):   # from the end of backward, at most one bucket's worth
        if taken and size + nbytes > cap:
            break
        size, taken = size + nbytes, taken + 1
    head, tail = order[:len(order) - taken], order[len(order) - taken:]
    return _cut(head, bucket_mb, first_bucket_mb) + _cut(tail, last_mb, None)


def _cut(tensors: list[tuple[float, float]], bucket_mb: float, first_bucket_mb: float | None) -> list[tuple[float, float]]:
    """DDP's rule over ``(bytes, ready)`` in backward order: a bucket closes once it reaches its cap
    (the first bucket's cap is ``first_bucket_mb``; None = ``bucket_mb``)."""
    out, size, ready = [], 0.0, 0.0
    cap = (bucket_mb if first_bucket_mb is None else first_bucket_mb) * MiB
    for nbytes, ready in tensors:
        size += nbytes
        if size >= cap:
            out.append((size, ready))
            size, cap = 0.0, bucket_mb * MiB
    if size:
        out.append((size, ready))
    return out


# =============================================================================================
# The prediction
# =============================================================================================

@dataclass
class PlanConfig:
    """Hardware and run, one value per field (the flags of ``hfstream plan``)."""

    tokens_per_device: int = 8192
    """Tokens each device processes per optimizer step (micro-batch x sequence length)."""
    seq_len: int | None = None
    """Sequence length: adds the attention FLOPs 12 L d_attn s per token; None = 6 P only."""
    peak_tflops: float = 312.0
    """Peak dense FLOP/s of one device in TFLOP/s (default: A100 bf16)."""
    mfu: float = 0.4
    """Model-FLOPs utilisation: the share of the peak the model achieves."""
    compute_tflops: float | None = None
    """Achieved FLOP/s in TFLOP/s, replacing peak x MFU (e.g. calibrated from a measured backward)."""
    forward_share: float = 1 / 3
    """The share of forward + backward's time spent in forward: 1/3 by FLOPs (2N forward, 4N
    backward per token); a measured forward / (forward + backward) replaces it (`predict_bench`)."""
    comm_host_ms_per_mib: float = 0.0
    """Host CPU time communication takes per MiB a device sends, taken from the compute it
    overlaps (backward; sharded's all-gathers: forward): CPU training, where gloo's threads share the cores that compute (`predict_bench`
    calibrates it from the serial run's communication threads); 0 = communication off the
    compute cores (NCCL on a GPU)."""
    grad_bytes: int = 4
    """Bytes per gradient element on the wire (4 = fp32, the default of DDP and the Trainer; 2 = bf16)."""
    link_gbs: float = 25.0
    """Link bandwidth per device in GB/s (10**9 bytes/s); 25 = one 200 Gb/s InfiniBand port per GPU.
    With ``devices_per_node``, the bandwidth across nodes (`links.Links.inter_gbs`)."""
    devices_per_node: int | None = None
    """Devices on one node's fast links (8 in an HGX node); None = one flat ring at ``link_gbs``."""
    intra_node_gbs: float | None = None
    """Bus bandwidth of a ring inside a node in GB/s (H100 NVLink 4: 450); None = ``link_gbs``."""
    latency_us: float = 5.0
    """Latency of one ring step in microseconds (a ring all-reduce takes 2(N-1) steps)."""
    mem_bandwidth_gbs: float = 2000.0
    """Device memory bandwidth in GB/s for the optimizer (default: A100 80GB, ~2 TB/s)."""
    optimizer_bytes_per_param: float = 28.0
    """Bytes the optimizer step moves per parameter (fp32 AdamW: read 4 tensors, write 3)."""
    bucket_mb: float = DDP_BUCKET_MB
    """Gradient bucket cap in MiB (GradSync's and DDP's default 25); 0 = per tensor; inf = one bucket."""
    first_bucket_mb: float | None = None
    """A smaller first bucket in MiB (DDP uses 1 when bucket_cap_mb is not given); None = bucket_mb."""
    sharded_last_bucket_mb: float | None = SHARDED_LAST_BUCKET_MB
    """Sharded mode's cap for the buckets backward fills last (GradSync's default 1 MiB); None = not cut."""
    world_sizes: tuple[int, ...] = DEFAULT_WORLD_SIZES
    """The world sizes to predict."""

    def __post_init__(self):
        def check(name, ok, accepted):
            if not ok:
                raise ValueError(f"{name}={getattr(self, name)!r} is not valid; expected {accepted}")

        def pos(v):
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0

        check("tokens_per_device", pos(self.tokens_per_device), "a number > 0")
        check("seq_len", self.seq_len is None or pos(self.seq_len), "None or a number > 0")
        check("peak_tflops", pos(self.peak_tflops), "a number > 0")
        check("mfu", pos(self.mfu) and self.mfu <= 1, "a number in (0, 1]")
        check("compute_tflops", self.compute_tflops is None or pos(self.compute_tflops), "None or a number > 0")
        check("forward_share", pos(self.forward_share) and self.forward_share < 1, "a fraction in (0, 1)")
        check("comm_host_ms_per_mib", isinstance(self.comm_host_ms_per_mib, (int, float))
              and math.isfinite(self.comm_host_ms_per_mib) and self.comm_host_ms_per_mib >= 0, "a time >= 0 in ms")
        check("grad_bytes", pos(self.grad_bytes), "a number of bytes > 0 (4 = fp32, 2 = bf16)")
        check("link_gbs", pos(self.link_gbs), "a bandwidth > 0 in GB/s")
        check("devices_per_node", self.devices_per_node is None or (isinstance(self.devices_per_node, int)
              and self.devices_per_node >= 1), "None or an integer >= 1")
        check("intra_node_gbs", self.intra_node_gbs is None or pos(self.intra_node_gbs), "None or a bandwidth > 0 in GB/s")
        check("latency_us", isinstance(self.latency_us, (int, float)) and math.isfinite(self.latency_us)
              and self.latency_us >= 0, "a latency >= 0 in microseconds")
        check("mem_bandwidth_gbs", pos(self.mem_bandwidth_gbs), "a bandwidth > 0 in GB/s")
        check("optimizer_bytes_per_param", isinstance(self.optimizer_bytes_per_param, (int, float))
              and self.optimizer_bytes_per_param >= 0, "a number >= 0")
        check("bucket_mb", isinstance(self.bucket_mb, (int, float)) and self.bucket_mb >= 0, "MiB >= 0, or inf")
        check("first_bucket_mb", self.first_bucket_mb is None or pos(self.first_bucket_mb), "None or MiB > 0")
        self.world_sizes = tuple(int(n) for n in self.world_sizes)
        check("world_sizes", bool(self.world_sizes) and all(n >= 1 for n in self.world_sizes),
              "a non-empty list of integers >= 1")

    @property
    def links(self) -> Links:
        """The links the collectives run on (`links.Links`)."""
        return Links(self.link_gbs, self.latency_us, self.devices_per_node, self.intra_node_gbs)

    @property
    def compute_flops(self) -> float:
        """Achieved FLOP/s of one device."""
        return (self.compute_tflops if self.compute_tflops is not None else self.peak_tflops * self.mfu) * 1e12


def ring_factor(world_size: int) -> float:
    """2(N-1)/N: the bytes each device sends (and receives) per byte of a ring all-reduce."""
    return 2.0 * (world_size - 1) / world_size


def allreduce_s(nbytes: float, world_size: int, link_gbs: float, latency_us: float) -> float:
    """Seconds of one ring all-reduce of ``nbytes`` alone on a flat link: 2(N-1)/N b/B + 2(N-1) alpha
    (by level: `links.Links`)."""
    return Links(link_gbs, latency_us).all_reduce_s(nbytes, world_size)


def step_flops(shape: ModelShape, cfg: PlanConfig) -> float:
    """FLOPs of forward + backward per device and step: 6 P T (+ 12 L d_attn s T)."""
    per_token = 6.0 * shape.flop_params
    if cfg.seq_len is not None:
        if shape.n_layer is None or shape.d_attn is None:
            raise ValueError("seq_len (attention FLOPs) needs the model's layers and width: give a model, not a count")
        per_token += 12.0 * shape.n_layer * shape.d_attn * cfg.seq_len
    return per_token * cfg.tokens_per_device


def calibrated_tflops(shape: ModelShape, cfg: PlanConfig, measured_ms: float, part: str = "backward") -> float:
    """The achieved TFLOP/s that makes the predicted ``part`` take ``measured_ms``.

    Args:
        part: ``"backward"`` (``1 - cfg.forward_share`` of the step's FLOPs: the window that hides
            communication) or ``"compute"`` (forward + backward, all of them).
    """
    if not measured_ms > 0:
        raise ValueError(f"measured_ms={measured_ms!r} is not valid; expected a time > 0")
    share = {"backward": 1 - cfg.forward_share, "compute": 1.0}.get(part)
    if share is None:
        raise ValueError(f"part={part!r} is not valid; expected 'backward' or 'compute'")
    return step_flops(shape, cfg) * share / (measured_ms / 1e3) / 1e12


def calibrated_mem_bandwidth_gbs(shape: ModelShape, cfg: PlanConfig, optimizer_ms: float) -> float:
    """The memory bandwidth that makes the predicted optimizer step take ``optimizer_ms``."""
    if not optimizer_ms > 0:
        raise ValueError(f"optimizer_ms={optimizer_ms!r} is not valid; expected a time > 0")
    return shape.params * cfg.optimizer_bytes_per_param / (optimizer_ms / 1e3) / 1e9


def _none_if_nan(x: float) -> float | None:
    return None if isinstance(x, float) and math.isnan(x) else x


def predict_row(shape: ModelShape, cfg: PlanConfig, world_size: int,
                buckets: list[tuple[float, float]] | None = None) -> dict:
    """Every predicted quantity for one world size, in ms (see the module docstring)."""
    if buckets is None:
        buckets = predict_buckets(shape, cfg.grad_bytes, cfg.bucket_mb, cfg.first_bucket_mb)
    flops = step_flops(shape, cfg)
    fwd = flops * cfg.forward_share / cfg.compute_flops * 1e3
    bwd = flops * (1 - cfg.forward_share) / cfg.compute_flops * 1e3
    opt = shape.params * cfg.optimizer_bytes_per_param / (cfg.mem_bandwidth_gbs * 1e9) * 1e3
    links = cfg.links
    times = [links.all_reduce_s(b, world_size) * 1e3 for b, _ in buckets]
    busy = sum(times)
    sharded_buckets = buckets if cfg.sharded_last_bucket_mb is None else predict_buckets(
        shape, cfg.grad_bytes, cfg.bucket_mb, cfg.first_bucket_mb, cfg.sharded_last_bucket_mb)
    # What the collectives take on the host from the compute they overlap (0 off the compute
    # cores): overlap's all-reduces from backward; sharded's reduce-scatters from backward, its
    # all-gathers (each half the all-reduce's bytes) from the optimizer step and the forward.
    half_mib = shape.params * cfg.grad_bytes / MiB * (world_size - 1) / world_size
    bwd_overlap = bwd + cfg.comm_host_ms_per_mib * 2 * half_mib
    bwd_sharded = bwd + cfg.comm_host_ms_per_mib * half_mib
    fwd_sharded = fwd + cfg.comm_host_ms_per_mib * half_mib
    sharded = predict_sharded(sharded_buckets, world_size, cfg, fwd_sharded, bwd_sharded, opt)
    # The limit is the undisturbed compute's, as in the report and the bench (contention is a cost).
    sharded["cross_step_limit_ms"] = cross_step_limit(fwd, bwd, sharded["optimizer_sharded_ms"],
                                                      2 * sharded["reduce_scatter_busy_ms"])
    exposed_overlap = overlap_exposed(times, [ready for _, ready in buckets], bwd_overlap) if world_size > 1 else 0.0
    ideal = fwd + max(bwd, busy) + opt
    step_serial, step_overlap = fwd + bwd + busy + opt, fwd + bwd_overlap + exposed_overlap + opt
    single = fwd + bwd + opt
    return {
        "world_size": world_size, "ring_factor": ring_factor(world_size),
        "forward_ms": fwd, "backward_ms": bwd, "backward_overlap_ms": bwd_overlap,
        "forward_sharded_ms": fwd_sharded, "backward_sharded_ms": bwd_sharded, "optimizer_ms": opt,
        "comm_busy_ms": busy, "last_bucket_ms": times[-1] if times else 0.0,
        "exposed_serial_ms": busy, "exposed_overlap_ms": exposed_overlap,
        "step_serial_ms": step_serial, "step_overlap_ms": step_overlap, "ideal_ms": ideal,
        "efficiency_serial": ideal / step_serial, "efficiency_overlap": ideal / step_overlap,
        "overlap": _none_if_nan(1.0 - exposed_overlap / busy if busy > 0 else math.nan),
        "overlap_complete": busy <= bwd,
        "tokens_per_s_overlap": world_size * cfg.tokens_per_device / (step_overlap / 1e3),
        "scaling_efficiency_overlap": single / step_overlap,
        **sharded,
        "efficiency_sharded": sharded["cross_step_limit_ms"] / sharded["step_sharded_ms"],
        # Faster by more than rounding: with one bucket and a free optimizer the two are equal.
        "sharded_beats_overlap": sharded["step_sharded_ms"] < step_overlap * (1 - 1e-9),
    }


def predict_sharded(buckets: list[tuple[float, float]], world_size: int, cfg: PlanConfig,
                    fwd: float, bwd: float, opt: float) -> dict:
    """The sharded step in ms (module docstring): both halves' busy and exposed times, the step, the limit.

    Steady state, time 0 = the forward's start, the previous step's all-gathers launched then
    (the data wait and the optimizer's own tail hidden). ``buckets`` are in plan (backward) order.
    """
    links = cfg.links
    t = [links.reduce_scatter_s(b, world_size) * 1e3 for b, _ in buckets]
    return sharded_step(t, [r for _, r in buckets], world_size, fwd, bwd, opt)


def overlap_limit(shape: ModelShape, cfg: PlanConfig, buckets: list[tuple[float, float]] | None = None,
                  max_world_size: int = 2**40) -> int | None:
    """The smallest world size whose comm busy exceeds backward (overlap can no longer be
    complete), or None if that never happens up to ``max_world_size``.

    comm busy = 2(N-1)/N x bytes / B + 2(N-1) alpha x buckets grows with N (by level too:
    `links`), so bisect.
    """
    if buckets is None:
        buckets = predict_buckets(shape, cfg.grad_bytes, cfg.bucket_mb, cfg.first_bucket_mb)
    bwd = step_flops(shape, cfg) * (1 - cfg.forward_share) / cfg.compute_flops
    total = sum(b for b, _ in buckets)

    bandwidth = dataclasses.replace(cfg.links, latency_us=0.0)

    def busy(n):
        g, nodes = cfg.links.levels(n)
        return bandwidth.all_reduce_s(total, n) + 2 * (g - 1 + nodes - 1) * cfg.latency_us * 1e-6 * len(buckets)

    if busy(max_world_size) <= bwd:
        return None
    lo, hi = 1, max_world_size          # busy(lo) = 0 <= bwd < busy(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if busy(mid) <= bwd else (lo, mid)
    return hi


def plan(shape: ModelShape, cfg: PlanConfig) -> dict:
    """The planner's document: inputs, model, buckets, one row per world size, the overlap limit."""
    buckets = predict_buckets(shape, cfg.grad_bytes, cfg.bucket_mb, cfg.first_bucket_mb)
    rows = [predict_row(shape, cfg, n, buckets) for n in cfg.world_sizes]
    limit = overlap_limit(shape, cfg, buckets)
    wins = [r["world_size"] for r in rows if r["sharded_beats_overlap"]]
    inputs = dataclasses.asdict(cfg)
    inputs["world_sizes"] = list(cfg.world_sizes)
    for k in ("bucket_mb", "first_bucket_mb"):   # strict JSON has no Infinity
        if isinstance(inputs[k], float) and math.isinf(inputs[k]):
            inputs[k] = "inf"
    return {
        "hfstream_plan": 1,
        "inputs": inputs,
        "model": {"name": shape.name, "params": shape.params, "flop_params": shape.flop_params,
                  "tensors": len(shape.tensors) or None, "n_layer": shape.n_layer, "d_attn": shape.d_attn},
        "step_flops": step_flops(shape, cfg),
        "compute_tflops": cfg.compute_flops / 1e12,
        "grad_bytes_total": shape.params * cfg.grad_bytes,
        "buckets": {"count": len(buckets), "largest_bytes": max(b for b, _ in buckets),
                    "last_bytes": buckets[-1][0]},
        "overlap_incomplete_from": limit,
        "sharded_beats_overlap_at": wins,
        "rows": rows,
        "formulas": {
            "compute": "forward = forward_share x C, backward = the rest (forward_share = 1/3 by FLOPs), "
                       "C = 6 P T (+ 12 L d_attn s T) at peak x MFU "
                       "(Kaplan et al. 2020 sec. 2.1; Chowdhery et al. 2022 app. B)",
            "optimizer": "P x optimizer_bytes_per_param / memory bandwidth",
            "comm_per_bucket": "2(N-1)/N x bytes / link bandwidth + 2(N-1) x latency (ring all-reduce; "
                               "Thakur, Rabenseifner & Gropp 2005); with devices_per_node g: reduce-scatter "
                               "and all-gather inside the node at intra_node_gbs, all-reduce of bytes/g across "
                               "the N/g nodes at link_gbs (hierarchical all-reduce)",
            "exposed_overlap": "max(0, end of last reduction - end of backward), buckets ready as backward "
                               "does its FLOPs in reverse registration order, one reduction at a time",
            "ideal": "forward + max(backward, comm busy) + optimizer (docs/design.md section 4)",
            "sharded": "reduce-scatter and all-gather (N-1)/N x bytes / link bandwidth + (N-1) x latency each; "
                       "reduce-scatters as overlap, optimizer / N bucket by bucket in forward order, each bucket's "
                       "all-gather launched as it is stepped and waited for by the "
                       "next forward as it reaches each bucket (docs/design.md section 7)",
            "cross_step_limit": "max(forward + backward + optimizer / N, comm busy)",
        },
    }
