"""The planner: step time, gradient communication and the ceiling for 1 .. 1024 devices, without running.

It predicts the quantities `hfstream.timeline` and `hfstream.tools.bench.run` measure (DESIGN.md section
4) for a data-parallel step in which every device keeps its tokens per step (weak scaling):

    forward, backward   C = 6 P T FLOPs per device and step (+ 12 L d_attn s T with --seq-len),
                        forward C/3, backward 2C/3, at R = peak FLOP/s x MFU
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

P is the number of trainable parameters (tied ones once; in C, without embedding tables that
are only indexed, which cost no FLOPs), T the tokens per device per step,
N the world size, B the link bandwidth per device, alpha the latency of one ring step. The
model is one flat ring at one bandwidth: no intra-node fast path, no contention, no
hierarchical all-reduce.

    python -m hfstream.tools.plan.predict --model llama-8b                       # presets need no hub access
    python -m hfstream.tools.plan.predict --model path/to/config.json --seq-len 4096 --plot plan.png
    python -m hfstream.tools.plan.predict --params 1.3B --peak-tflops 989 --link-gbs 50 --json plan.json
    python -m hfstream.tools.plan.predict --compare bench.json        # predicted vs `hfstream bench --json`
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

MiB = 2**20

# Architecture numbers of well-known models, in `config.json` spelling (no hub access).
PRESETS: dict[str, dict] = {
    "gpt2-124m": {"model_type": "gpt2", "vocab_size": 50257, "n_positions": 1024, "n_embd": 768,
                  "n_layer": 12, "n_head": 12},
    # Llama 3.2 1B, Llama 3.1 8B, Llama 3.1 70B.
    "llama-1b": {"model_type": "llama", "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192,
                 "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
                 "tie_word_embeddings": True},
    "llama-8b": {"model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
                 "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                 "tie_word_embeddings": False},
    "llama-70b": {"model_type": "llama", "vocab_size": 128256, "hidden_size": 8192, "intermediate_size": 28672,
                  "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
                  "tie_word_embeddings": False},
}
DEFAULT_WORLD_SIZES = tuple(2**i for i in range(11))   # 1, 2, 4, ..., 1024


# =============================================================================================
# The model: how many parameters, in which tensors, and which of them cost FLOPs
# =============================================================================================

@dataclass
class ModelShape:
    """What the planner needs to know about a model.

    Args:
        name: a preset name, a config path, or ``"<count> params"``.
        params: trainable parameters, a tied tensor counted once.
        tensors: ``(name, numel, kind)`` in registration order, or empty when only the count is
            known. ``kind`` is ``"dense"`` (takes part in matmuls: 6 FLOPs per token per
            parameter), ``"lookup"`` (an embedding table that is only indexed: no FLOPs) or
            ``"tied"`` (the input embedding that is also the output projection: its FLOPs are
            spent first in backward, its gradient is complete only at the end).
        n_layer, d_attn: for the attention FLOPs (``--seq-len``); None when unknown.
    """

    name: str
    params: int
    tensors: tuple[tuple[str, int, str], ...] = ()
    n_layer: int | None = None
    d_attn: int | None = None

    @property
    def flop_params(self) -> int:
        """Parameters that cost 6 FLOPs per token (lookup-only embeddings cost none)."""
        if not self.tensors:
            return self.params
        return sum(n for _, n, kind in self.tensors if kind != "lookup")


def shape_from_params(params: int) -> ModelShape:
    """A model known only by its parameter count: buckets are then equal slices of it."""
    return ModelShape(name=f"{_count_str(params)} params", params=int(params))


def shape_from_config(config: dict, name: str = "config") -> ModelShape:
    """The tensors of a causal LM from its ``config.json`` dictionary.

    GPT-2 and Llama-style (llama, mistral, qwen2) are counted from their architecture numbers,
    with the exact tensor names and order of ``model.named_parameters()`` in transformers; other
    model types are built on the meta device by transformers (no weights, no hub).

    Raises:
        ValueError: a number the architecture needs is missing, or the type is unknown.
    """
    mt = config.get("model_type")

    def get(*keys, default=None):
        for k in keys:
            if config.get(k) is not None:
                return config[k]
        if default is None:
            raise ValueError(f"{name}: model_type {mt!r} needs {keys[0]!r} in the config")
        return default

    t: list[tuple[str, int, str]] = []
    if mt == "gpt2":
        V, P = get("vocab_size"), get("n_positions", "max_position_embeddings")
        d, L = get("n_embd", "hidden_size"), get("n_layer", "num_hidden_layers")
        inner = config.get("n_inner") or 4 * d
        tie = config.get("tie_word_embeddings", True)
        t += [("transformer.wte.weight", V * d, "tied" if tie else "lookup"),
              ("transformer.wpe.weight", P * d, "lookup")]
        for i in range(L):
            p = f"transformer.h.{i}."
            t += [(p + "ln_1.weight", d, "dense"), (p + "ln_1.bias", d, "dense"),
                  (p + "attn.c_attn.weight", d * 3 * d, "dense"), (p + "attn.c_attn.bias", 3 * d, "dense"),
                  (p + "attn.c_proj.weight", d * d, "dense"), (p + "attn.c_proj.bias", d, "dense"),
                  (p + "ln_2.weight", d, "dense"), (p + "ln_2.bias", d, "dense"),
                  (p + "mlp.c_fc.weight", d * inner, "dense"), (p + "mlp.c_fc.bias", inner, "dense"),
                  (p + "mlp.c_proj.weight", inner * d, "dense"), (p + "mlp.c_proj.bias", d, "dense")]
        t += [("transformer.ln_f.weight", d, "dense"), ("transformer.ln_f.bias", d, "dense")]
        if not tie:
            t.append(("lm_head.weight", V * d, "dense"))
        return ModelShape(name, sum(n for _, n, _ in t), tuple(t), n_layer=L, d_attn=d)
    if mt in ("llama", "mistral", "qwen2"):
        V, d, ffn, L = get("vocab_size"), get("hidden_size"), get("intermediate_size"), get("num_hidden_layers")
        H = get("num_attention_heads")
        kv = config.get("num_key_value_heads") or H
        hd = config.get("head_dim") or d // H
        tie = bool(config.get("tie_word_embeddings", False))
        qkv_bias = config.get("attention_bias", False) or mt == "qwen2"
        o_bias, mlp_bias = bool(config.get("attention_bias", False)), bool(config.get("mlp_bias", False))
        t.append(("model.embed_tokens.weight", V * d, "tied" if tie else "lookup"))
        for i in range(L):
            p = f"model.layers.{i}."
            for proj, out in (("q", H * hd), ("k", kv * hd), ("v", kv * hd)):
                t.append((p + f"self_attn.{proj}_proj.weight", out * d, "dense"))
                if qkv_bias:
                    t.append((p + f"self_attn.{proj}_proj.bias", out, "dense"))
            t.append((p + "self_attn.o_proj.weight", d * H * hd, "dense"))
            if o_bias:
                t.append((p + "self_attn.o_proj.bias", d, "dense"))
            for proj, shape in (("gate", (ffn, d)), ("up", (ffn, d)), ("down", (d, ffn))):
                t.append((p + f"mlp.{proj}_proj.weight", shape[0] * shape[1], "dense"))
                if mlp_bias:
                    t.append((p + f"mlp.{proj}_proj.bias", shape[0], "dense"))
            t += [(p + "input_layernorm.weight", d, "dense"), (p + "post_attention_layernorm.weight", d, "dense")]
        t.append(("model.norm.weight", d, "dense"))
        if not tie:
            t.append(("lm_head.weight", V * d, "dense"))
        return ModelShape(name, sum(n for _, n, _ in t), tuple(t), n_layer=L, d_attn=H * hd)
    return _shape_from_meta_model(config, name)


def _shape_from_meta_model(config: dict, name: str) -> ModelShape:
    """Any causal LM transformers knows, built on the meta device (shapes only, no memory)."""
    try:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError as exc:   # pragma: no cover - transformers is a dependency
        raise ValueError(f"{name}: model_type {config.get('model_type')!r} needs transformers ({exc})") from None
    cfg = {k: v for k, v in config.items() if k != "model_type"}
    try:
        hf_config = AutoConfig.for_model(config.get("model_type"), **cfg)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config)
    except (ValueError, KeyError, TypeError) as exc:
        reason = str(exc).split(". Should contain")[0][:200]     # not transformers' list of every type
        raise ValueError(f"{name}: cannot build model_type {config.get('model_type')!r} ({reason}); "
                         f"use --params COUNT instead") from None
    emb_in, emb_out = model.get_input_embeddings(), model.get_output_embeddings()
    w_in = getattr(emb_in, "weight", None)
    w_out = getattr(emb_out, "weight", None) if emb_out is not None else None
    tensors = []
    for n, p in model.named_parameters():
        if not p.requires_grad:
            continue
        kind = ("tied" if p is w_out else "lookup") if p is w_in else "dense"
        tensors.append((n, p.numel(), kind))
    L = getattr(hf_config, "num_hidden_layers", None)
    d = getattr(hf_config, "hidden_size", None)
    return ModelShape(name, sum(n for _, n, _ in tensors), tuple(tensors), n_layer=L, d_attn=d)


def load_model(spec: str) -> ModelShape:
    """A preset name (see `PRESETS`) or the path of a transformers ``config.json``."""
    if spec in PRESETS:
        return shape_from_config(PRESETS[spec], name=spec)
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"{spec!r} is neither a preset ({', '.join(PRESETS)}) nor a config.json file")
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {path} as JSON: {exc}") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise ValueError(f"{path} has no 'model_type'; is it a transformers config.json?")
    return shape_from_config(config, name=str(spec))


# =============================================================================================
# Buckets and their readiness during backward
# =============================================================================================

def plan_buckets(shape: ModelShape, grad_bytes: int, bucket_mb: float,
                 first_bucket_mb: float | None = None) -> list[tuple[float, float]]:
    """``(bytes, ready)`` per bucket in launch order; ``ready`` is the fraction of backward done
    when the bucket's last gradient exists.

    With tensors known this is GradSync's (and DDP's) greedy plan: reverse registration order,
    a tensor never split, a bucket closed as soon as it holds at least its cap. Backward is
    assumed to produce gradients at the rate it does FLOPs (a matmul's backward costs in
    proportion to its parameters). With only a count, the gradient is cut into equal buckets
    (the remainder last) that are ready in proportion to their bytes.

    Args:
        bucket_mb: cap in MiB; 0 = one tensor per bucket (needs tensors); inf = one bucket.
        first_bucket_mb: a smaller cap for the first bucket (DDP's default 1 MiB), or None.
    """
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
    flop_total = sum(n for _, n, kind in shape.tensors if kind != "lookup") or 1
    # A tied embedding's FLOPs (the output projection) are spent at the very start of backward.
    flops_done = sum(n for _, n, kind in shape.tensors if kind == "tied")
    out: list[tuple[float, float]] = []
    cap, size = first * MiB, 0.0
    for _, n, kind in reversed(shape.tensors):
        if kind == "dense":
            flops_done += n
        ready = 1.0 if kind == "tied" else flops_done / flop_total
        size += n * grad_bytes
        if size >= cap:             # DDP's rule: close once the cap is reached
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
    grad_bytes: int = 4
    """Bytes per gradient element on the wire (4 = fp32, the default of DDP and the Trainer; 2 = bf16)."""
    link_gbs: float = 25.0
    """Link bandwidth per device in GB/s (10**9 bytes/s); 25 = one 200 Gb/s InfiniBand port per GPU."""
    latency_us: float = 5.0
    """Latency of one ring step in microseconds (a ring all-reduce takes 2(N-1) steps)."""
    mem_bandwidth_gbs: float = 2000.0
    """Device memory bandwidth in GB/s for the optimizer (default: A100 80GB, ~2 TB/s)."""
    optimizer_bytes_per_param: float = 28.0
    """Bytes the optimizer step moves per parameter (fp32 AdamW: read 4 tensors, write 3)."""
    bucket_mb: float = 25.0
    """Gradient bucket cap in MiB (GradSync's and DDP's default 25); 0 = per tensor; inf = one bucket."""
    first_bucket_mb: float | None = None
    """A smaller first bucket in MiB (DDP uses 1 when bucket_cap_mb is not given); None = bucket_mb."""
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
        check("grad_bytes", pos(self.grad_bytes), "a number of bytes > 0 (4 = fp32, 2 = bf16)")
        check("link_gbs", pos(self.link_gbs), "a bandwidth > 0 in GB/s")
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
    def compute_flops(self) -> float:
        """Achieved FLOP/s of one device."""
        return (self.compute_tflops if self.compute_tflops is not None else self.peak_tflops * self.mfu) * 1e12


def ring_factor(world_size: int) -> float:
    """2(N-1)/N: the bytes each device sends (and receives) per byte of a ring all-reduce."""
    return 2.0 * (world_size - 1) / world_size


def allreduce_s(nbytes: float, world_size: int, link_gbs: float, latency_us: float) -> float:
    """Seconds of one ring all-reduce of ``nbytes`` alone on the link: 2(N-1)/N b/B + 2(N-1) alpha."""
    if world_size <= 1:
        return 0.0
    return ring_factor(world_size) * nbytes / (link_gbs * 1e9) + 2 * (world_size - 1) * latency_us * 1e-6


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
        part: ``"backward"`` (2/3 of the step's FLOPs: the window that hides communication) or
            ``"compute"`` (forward + backward, all of them).
    """
    if not measured_ms > 0:
        raise ValueError(f"measured_ms={measured_ms!r} is not valid; expected a time > 0")
    share = {"backward": 2 / 3, "compute": 1.0}.get(part)
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
        buckets = plan_buckets(shape, cfg.grad_bytes, cfg.bucket_mb, cfg.first_bucket_mb)
    flops = step_flops(shape, cfg)
    fwd = flops / 3 / cfg.compute_flops * 1e3
    bwd = flops * 2 / 3 / cfg.compute_flops * 1e3
    opt = shape.params * cfg.optimizer_bytes_per_param / (cfg.mem_bandwidth_gbs * 1e9) * 1e3
    times = [allreduce_s(b, world_size, cfg.link_gbs, cfg.latency_us) * 1e3 for b, _ in buckets]
    busy = sum(times)
    # Overlap: one reduction at a time on the link, each starting when its bucket is ready.
    end = 0.0
    for t, (_, ready) in zip(times, buckets):
        end = max(ready * bwd, end) + t
    exposed_overlap = max(0.0, end - bwd) if world_size > 1 else 0.0
    ideal = fwd + max(bwd, busy) + opt
    step_serial, step_overlap = fwd + bwd + busy + opt, fwd + bwd + exposed_overlap + opt
    single = fwd + bwd + opt
    return {
        "world_size": world_size, "ring_factor": ring_factor(world_size),
        "forward_ms": fwd, "backward_ms": bwd, "optimizer_ms": opt,
        "comm_busy_ms": busy, "last_bucket_ms": times[-1] if times else 0.0,
        "exposed_serial_ms": busy, "exposed_overlap_ms": exposed_overlap,
        "step_serial_ms": step_serial, "step_overlap_ms": step_overlap, "ideal_ms": ideal,
        "efficiency_serial": ideal / step_serial, "efficiency_overlap": ideal / step_overlap,
        "overlap": _none_if_nan(1.0 - exposed_overlap / busy if busy > 0 else math.nan),
        "overlap_complete": busy <= bwd,
        "tokens_per_s_overlap": world_size * cfg.tokens_per_device / (step_overlap / 1e3),
        "scaling_efficiency_overlap": single / step_overlap,
    }


def overlap_limit(shape: ModelShape, cfg: PlanConfig, buckets: list[tuple[float, float]] | None = None,
                  max_world_size: int = 2**40) -> int | None:
    """The smallest world size whose comm busy exceeds backward (overlap can no longer be
    complete), or None if that never happens up to ``max_world_size``.

    comm busy = 2(N-1)/N x bytes / B + 2(N-1) alpha x buckets grows with N, so bisect.
    """
    if buckets is None:
        buckets = plan_buckets(shape, cfg.grad_bytes, cfg.bucket_mb, cfg.first_bucket_mb)
    bwd = step_flops(shape, cfg) * 2 / 3 / cfg.compute_flops
    total = sum(b for b, _ in buckets)

    def busy(n):
        return allreduce_s(total, n, cfg.link_gbs, 0.0) + 2 * (n - 1) * cfg.latency_us * 1e-6 * len(buckets)

    if busy(max_world_size) <= bwd:
        return None
    lo, hi = 1, max_world_size          # busy(lo) = 0 <= bwd < busy(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if busy(mid) <= bwd else (lo, mid)
    return hi


def plan(shape: ModelShape, cfg: PlanConfig) -> dict:
    """The planner's document: inputs, model, buckets, one row per world size, the overlap limit."""
    buckets = plan_buckets(shape, cfg.grad_bytes, cfg.bucket_mb, cfg.first_bucket_mb)
    rows = [predict_row(shape, cfg, n, buckets) for n in cfg.world_sizes]
    limit = overlap_limit(shape, cfg, buckets)
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
        "rows": rows,
        "formulas": {
            "compute": "forward = C/3, backward = 2C/3, C = 6 P T (+ 12 L d_attn s T) at peak x MFU "
                       "(Kaplan et al. 2020 sec. 2.1; Chowdhery et al. 2022 app. B)",
            "optimizer": "P x optimizer_bytes_per_param / memory bandwidth",
            "comm_per_bucket": "2(N-1)/N x bytes / link bandwidth + 2(N-1) x latency (ring all-reduce; "
                               "Thakur, Rabenseifner & Gropp 2005)",
            "exposed_overlap": "max(0, end of last reduction - end of backward), buckets ready as backward "
                               "does its FLOPs in reverse registration order, one reduction at a time",
            "ideal": "forward + max(backward, comm busy) + optimizer (DESIGN.md section 4)",
        },
    }


# =============================================================================================
# Reading it: table, figure
# =============================================================================================

def _count_str(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:g}"


def _ms(v: float) -> str:
    return f"{v:.3g}" if v < 10 else f"{v:.1f}" if v < 1e4 else f"{v:.3g}"


def format_table(doc: dict) -> str:
    """The human-readable table of a `plan` document."""
    inp, m, b = doc["inputs"], doc["model"], doc["buckets"]
    compute = (f"{doc['compute_tflops']:.4g} TFLOP/s achieved" if inp["compute_tflops"] is not None
               else f"{inp['peak_tflops']:g} TFLOP/s peak x {inp['mfu']:g} MFU")
    lines = [
        f"hfstream plan | {m['name']}: {_count_str(m['params'])} params, {doc['grad_bytes_total'] / 2**30:.3g} GiB of "
        f"{inp['grad_bytes']}-byte gradients in {b['count']} bucket(s) (cap {inp['bucket_mb']} MiB"
        + (f", first {inp['first_bucket_mb']:g}" if inp["first_bucket_mb"] else "") + ")",
        f"{inp['tokens_per_device']:,} tokens per device per step; {doc['step_flops']:.3g} FLOP per device per step "
        f"at {compute} | link {inp['link_gbs']:g} GB/s per device, {inp['latency_us']:g} us per ring step | "
        f"optimizer {inp['optimizer_bytes_per_param']:g} B/param at {inp['mem_bandwidth_gbs']:.4g} GB/s",
        "ms per step; exposed = communication the step waits for; eff = ceiling / step",
        "",
        f"{'N':>5}{'2(N-1)/N':>9}{'fwd':>8}{'bwd':>8}{'opt':>7}{'comm busy':>10}{'last bkt':>9}"
        f"{'exp serial':>11}{'exp overlap':>12}{'step serial':>12}{'step overlap':>13}{'ceiling':>9}"
        f"{'eff ser':>8}{'eff ovl':>8}",
    ]
    for r in doc["rows"]:
        lines.append(
            f"{r['world_size']:>5}{r['ring_factor']:>9.3f}{_ms(r['forward_ms']):>8}{_ms(r['backward_ms']):>8}"
            f"{_ms(r['optimizer_ms']):>7}{_ms(r['comm_busy_ms']):>10}{_ms(r['last_bucket_ms']):>9}"
            f"{_ms(r['exposed_serial_ms']):>11}{_ms(r['exposed_overlap_ms']):>12}{_ms(r['step_serial_ms']):>12}"
            f"{_ms(r['step_overlap_ms']):>13}{_ms(r['ideal_ms']):>9}{r['efficiency_serial']:>8.2f}"
            f"{r['efficiency_overlap']:>8.2f}" + ("" if r["overlap_complete"] else "  comm > bwd"))
    limit = doc["overlap_incomplete_from"]
    if limit is None:
        lines.append("comm busy stays below backward at every world size: overlap can hide it all but the last bucket")
    else:
        upto = f"overlap complete up to N = {limit - 1:,}" if limit > 2 else "already with two devices"
        lines.append(f"comm busy exceeds backward from N = {limit:,} ({upto}); from there on the ceiling is set "
                     f"by the link, not by compute")
    lines.append("the last bucket's reduction starts when backward ends, so even with overlap it is always exposed")
    return "\n".join(lines)


def plot_plan(doc: dict, path: str | os.PathLike, title: str | None = None) -> Path:
    """Step time with and without overlap, and the ceiling, against world size (log x)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    rows = doc["rows"]
    n = [r["world_size"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    ax.plot(n, [r["step_serial_ms"] for r in rows], "o-", color="#c44e52", label="step, serial (no overlap)")
    ax.plot(n, [r["step_overlap_ms"] for r in rows], "s-", color="#4c72b0", label="step, overlap")
    ax.plot(n, [r["ideal_ms"] for r in rows], "k--", label="ceiling: fwd + max(bwd, comm) + opt")
    ax.plot(n, [r["forward_ms"] + r["backward_ms"] + r["optimizer_ms"] for r in rows], ":", color="#55a868",
            label="compute only")
    limit = doc["overlap_incomplete_from"]
    if limit is not None and min(n) <= limit <= max(n):
        ax.axvline(limit, color="grey", lw=0.8)
        ax.text(limit, ax.get_ylim()[1], f" comm > bwd from N={limit}", fontsize=8, va="top", color="grey")
    ax.set_xscale("log", base=2)
    if len(n) <= 16:
        ax.set_xticks(n, [str(x) for x in n])
        ax.minorticks_off()
    ax.set_xlabel("world size N (devices)")
    ax.set_ylabel("ms per optimizer step")
    ax.set_ylim(bottom=0)
    ax.set_title(title or f"hfstream plan: {doc['model']['name']}, {doc['inputs']['tokens_per_device']:,} "
                          f"tokens/device, {doc['inputs']['link_gbs']:g} GB/s", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# =============================================================================================
# Against a measurement: `hfstream bench --json`
# =============================================================================================

def _bench_buckets(mode: dict) -> tuple[float, float | None]:
    """(bucket_mb, first_bucket_mb) a bench mode ran with."""
    if mode["kind"] == "ddp" and mode["bucket_mb"] is None:
        return 25.0, 1.0       # DDP without bucket_cap_mb: 25 MiB after a 1 MiB first bucket
    return float(mode["bucket_mb"]), None


def predict_bench(bench: dict, calibrate_from: str = "backward", use_measured_rate: bool = False) -> dict:
    """Predict every mode of a `hfstream.tools.bench.run` JSON document with the same model, tokens, link
    and world size.

    Calibrated from the serial mode (whose compute runs undisturbed): the achieved FLOP/s from its
    backward (``calibrate_from="backward"``) or its forward + backward (``"compute"``), and the
    memory bandwidth from its optimizer step. Forward, backward, communication, exposure and step
    time are then predicted, per mode at that mode's bucket size; the link is the configured rate
    (or the one the bench measured, with ``use_measured_rate``).

    Returns:
        ``{"modes": {mode: plan row}, "calibration": {...}}``.
    """
    spec, sh = bench["model"], bench["shaping"]
    world_size = int(bench["config"]["world_size"])
    shape = shape_from_config({"model_type": "gpt2", "vocab_size": spec["vocab_size"], "n_positions": spec["seq_len"],
                               "n_embd": spec["n_embd"], "n_layer": spec["n_layer"], "n_head": spec["n_head"]},
                              name=f"bench GPT-2 {spec['n_layer']}x{spec['n_embd']}")
    if "params" in spec and shape.params != spec["params"]:
        shape = shape_from_params(spec["params"])     # not the GPT-2 the planner knows: count only
    ref = bench["modes"].get("serial") or bench["ceiling"]
    rate = sh.get("measured", {}).get("effective_rate_mbit") if use_measured_rate else None
    rate = rate or sh["rate_mbit"]
    # Latency: the simulated link adds it once per all-reduce, i.e. per 2(N-1) ring steps; netem
    # adds it per packet, so roughly once per ring step.
    lat_ms = float(sh.get("latency_ms") or 0.0)
    latency_us = lat_ms * 1e3 / (2 * (world_size - 1)) if sh["kind"] == "simulated" else lat_ms * 1e3
    base = PlanConfig(tokens_per_device=spec["batch_size"] * spec["seq_len"], grad_bytes=4, link_gbs=rate / 8000,
                      latency_us=latency_us, world_sizes=(world_size,))
    measured_ms = ref["backward_ms"] + (ref["forward_ms"] if calibrate_from == "compute" else 0.0)
    base.compute_tflops = calibrated_tflops(shape, base, measured_ms, calibrate_from)
    base.mem_bandwidth_gbs = calibrated_mem_bandwidth_gbs(shape, base, ref["optimizer_ms"])
    modes = {}
    for name, mode in bench["modes"].items():
        bucket_mb, first = _bench_buckets(mode)
        cfg = dataclasses.replace(base, bucket_mb=bucket_mb, first_bucket_mb=first)
        modes[name] = {**predict_row(shape, cfg, world_size), "kind": mode["kind"], "bucket_mb": bucket_mb,
                       "first_bucket_mb": first,
                       "buckets": len(plan_buckets(shape, 4, bucket_mb, first))}
    return {"modes": modes, "calibration": {
        "source": "serial" if "serial" in bench["modes"] else "ceiling", "calibrate_from": calibrate_from,
        "params": shape.params,
        "tokens_per_device": base.tokens_per_device, "compute_tflops": base.compute_tflops,
        "mem_bandwidth_gbs": base.mem_bandwidth_gbs, "link_gbs": base.link_gbs, "latency_us": latency_us,
        "world_size": world_size}}


def _rel(pred: float, meas: float | None) -> float | None:
    if meas is None or not isinstance(meas, (int, float)) or math.isnan(meas) or meas == 0:
        return None
    return (pred - meas) / meas


def compare_with_measurement(pred: dict, measured: dict, tolerance: float = 0.25) -> dict:
    """Relative errors (predicted - measured) / measured of comm busy, backward, exposed and step.

    Args:
        pred: `predict_bench`'s result (``{"modes": {mode: row}}``), or one `predict_row` /
            `plan` row (then ``measured`` is one mode's dict from the bench JSON).
        measured: a `hfstream.tools.bench.run` JSON document, or one of its ``modes`` entries.
        tolerance: the relative error on comm busy and step that still counts as agreement.

    A serial measurement is compared with the predicted serial step, every other mode
    (GradSync overlap, DDP) with the predicted overlapped step.
    """
    if "modes" in pred and "modes" in measured:
        pairs = [(name, pred["modes"][name], measured["modes"][name]) for name in pred["modes"]
                 if name in measured["modes"]]
    else:
        pairs = [(measured.get("kind", "measured"), pred, measured)]
    out: dict = {"modes": {}, "tolerance": tolerance}
    for name, p, m in pairs:
        serial = m.get("kind") == "serial"
        predicted = {"forward_ms": p["forward_ms"], "backward_ms": p["backward_ms"], "comm_busy_ms": p["comm_busy_ms"],
                     "exposed_comm_ms": p["exposed_serial_ms"] if serial else p["exposed_overlap_ms"],
                     "step_ms": p["step_serial_ms"] if serial else p["step_overlap_ms"]}
        meas = {k: m.get(k) for k in predicted}
        out["modes"][name] = {"predicted": predicted, "measured": meas,
                              "rel_error": {k: _rel(predicted[k], meas[k]) for k in predicted}}
    errs = {k: [abs(v["rel_error"][k]) for v in out["modes"].values() if v["rel_error"][k] is not None]
            for k in ("comm_busy_ms", "backward_ms", "step_ms")}
    out["max_abs_rel_error"] = {k: max(v) if v else None for k, v in errs.items()}
    out["agree"] = all(v is not None and v <= tolerance for k, v in out["max_abs_rel_error"].items()
                       if k in ("comm_busy_ms", "step_ms"))
    return out


def format_comparison(comp: dict, calibration: dict | None = None) -> str:
    """The human-readable table of `compare_with_measurement`'s result."""
    lines = []
    if calibration:
        lines.append(f"calibrated from the {calibration['source']} run: {calibration['compute_tflops'] * 1e3:.3g} "
                     f"GFLOP/s ({calibration['calibrate_from']}), {calibration['mem_bandwidth_gbs']:.3g} GB/s "
                     f"(optimizer); link "
                     f"{calibration['link_gbs'] * 8000:g} Mbit/s, {calibration['world_size']} ranks, "
                     f"{_count_str(calibration['params'])} params, {calibration['tokens_per_device']} tokens/rank")
    lines.append(f"{'mode':<13}{'':>3}{'fwd':>7}{'bwd':>7}{'comm busy':>10}{'exposed':>9}{'step':>7}")

    def cell(v, w, pct=False):
        if v is None:
            return f"{'-':>{w}}"
        return f"{100 * v:>+{w - 1}.0f}%" if pct else f"{v:>{w}.0f}"

    keys = (("forward_ms", 7), ("backward_ms", 7), ("comm_busy_ms", 10), ("exposed_comm_ms", 9), ("step_ms", 7))
    for name, v in comp["modes"].items():
        for i, (label, src, pct) in enumerate((("pred", "predicted", False), ("meas", "measured", False),
                                               ("err", "rel_error", True))):
            lines.append(f"{name if i == 0 else '':<13}{label:>4}" + "".join(cell(v[src][k], w, pct) for k, w in keys))
    mx = comp["max_abs_rel_error"]
    fmt = lambda x: "-" if x is None else f"{100 * x:.0f}%"  # noqa: E731
    lines.append(f"largest |error|: comm busy {fmt(mx['comm_busy_ms'])}, backward {fmt(mx['backward_ms'])}, "
                 f"step {fmt(mx['step_ms'])} -> {'within' if comp['agree'] else 'NOT within'} "
                 f"{100 * comp['tolerance']:.0f}% on comm busy and step")
    return "\n".join(lines)


# =============================================================================================
# Command line
# =============================================================================================

def _number(kind, low: float, inclusive: bool, what: str, allow_inf: bool = False):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if isinstance(value, float) and (math.isnan(value) or (math.isinf(value) and not allow_inf)):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        if not (value >= low if inclusive else value > low):
            raise argparse.ArgumentTypeError(f"must be {'>=' if inclusive else '>'} {low:g}, got {text}")
        return value
    parse.__name__ = kind.__name__
    return parse


def _count(text: str) -> int:
    """``7e9``, ``124M``, ``1.3B``, ``70b`` -> an integer > 0."""
    t = text.strip().replace("_", "").replace(",", "")
    scale = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}.get(t[-1:].lower(), 1) if t else 1
    if scale != 1:
        t = t[:-1]
    try:
        value = float(t) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a parameter count such as 124M, 1.3B or 7e9, "
                                         f"got {text!r}") from None
    if not (math.isfinite(value) and value >= 1):
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text!r}")
    return int(round(value))


def _mfu(text: str) -> float:
    value = _number(float, 0.0, False, "a fraction in (0, 1]")(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1] (a share of the peak), got {text}")
    return value


def _world_sizes(text: str) -> tuple[int, ...]:
    parse = _number(int, 1, True, "an integer >= 1")
    sizes = tuple(sorted({parse(t.strip()) for t in text.split(",") if t.strip()}))
    if not sizes:
        raise argparse.ArgumentTypeError("expected a comma-separated list of world sizes, e.g. 1,8,64,512")
    return sizes


def _model(text: str) -> ModelShape:
    try:
        return load_model(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the planner's flags to ``parser`` (``hfstream plan`` and ``python -m hfstream.tools.plan.predict``)."""
    d = PlanConfig()
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--model", type=_model, default=None, metavar="PRESET|config.json",
                      help=f"a preset ({', '.join(PRESETS)}) or a transformers config.json (default llama-8b)")
    what.add_argument("--params", type=_count, default=None, metavar="COUNT",
                      help="parameter count instead of a model, e.g. 1.3B or 7e9 (equal-sized buckets)")
    what.add_argument("--compare", metavar="BENCH_JSON", default=None,
                      help="predict the run of `hfstream bench --json BENCH_JSON` and compare (other flags ignored)")
    parser.add_argument("--tokens-per-device", type=_number(int, 1, True, "an integer >= 1"),
                        default=d.tokens_per_device, help=f"tokens per device per step (default {d.tokens_per_device})")
    parser.add_argument("--seq-len", type=_number(int, 1, True, "an integer >= 1"), default=None,
                        help="sequence length: adds attention FLOPs 12 L d s per token (needs --model)")
    parser.add_argument("--peak-tflops", type=_number(float, 0, False, "a number"), default=d.peak_tflops,
                        help=f"peak TFLOP/s of one device (default {d.peak_tflops:g}, A100 bf16 dense)")
    parser.add_argument("--mfu", type=_mfu, default=d.mfu, help=f"model-FLOPs utilisation (default {d.mfu:g})")
    parser.add_argument("--calibrate-backward-ms", type=_number(float, 0, False, "a time in ms"), default=None,
                        help="a measured backward time: sets the achieved FLOP/s instead of --peak-tflops x --mfu")
    parser.add_argument("--calibrate-compute-ms", type=_number(float, 0, False, "a time in ms"), default=None,
                        help="a measured forward + backward time: sets the achieved FLOP/s "
                             "(not with --calibrate-backward-ms)")
    parser.add_argument("--calibrate-from", choices=("backward", "compute"), default="backward",
                        help="with --compare: calibrate FLOP/s from the serial run's backward (default) "
                             "or its forward + backward")
    parser.add_argument("--calibrate-optimizer-ms", type=_number(float, 0, False, "a time in ms"), default=None,
                        help="a measured optimizer step: sets the memory bandwidth instead of --mem-bandwidth-gbs")
    parser.add_argument("--grad-bytes", type=_number(int, 1, True, "an integer >= 1"), default=d.grad_bytes,
                        help="bytes per gradient element on the wire (default 4 = fp32; 2 = bf16)")
    parser.add_argument("--link-gbs", type=_number(float, 0, False, "a bandwidth in GB/s"), default=d.link_gbs,
                        help=f"link bandwidth per device in GB/s (default {d.link_gbs:g})")
    parser.add_argument("--latency-us", type=_number(float, 0, True, "a latency in microseconds"),
                        default=d.latency_us, help=f"latency per ring step in us (default {d.latency_us:g})")
    parser.add_argument("--mem-bandwidth-gbs", type=_number(float, 0, False, "a bandwidth in GB/s"),
                        default=d.mem_bandwidth_gbs,
                        help=f"memory bandwidth in GB/s for the optimizer (default {d.mem_bandwidth_gbs:g})")
    parser.add_argument("--optimizer-bytes-per-param", type=_number(float, 0, True, "a number of bytes"),
                        default=d.optimizer_bytes_per_param,
                        help=f"bytes the optimizer moves per parameter "
                             f"(default {d.optimizer_bytes_per_param:g}, fp32 AdamW)")
    parser.add_argument("--bucket-mb", type=_number(float, 0, True, "MiB (or inf)", allow_inf=True),
                        default=d.bucket_mb, help="gradient bucket cap in MiB (default 25; 0 = per tensor; inf = one)")
    parser.add_argument("--first-bucket-mb", type=_number(float, 0, False, "MiB"), default=None,
                        help="a smaller first bucket in MiB (DDP's default is 1)")
    parser.add_argument("--world-sizes", type=_world_sizes, default=DEFAULT_WORLD_SIZES,
                        help="comma-separated world sizes (default 1,2,4,...,1024)")
    parser.add_argument("--plot", metavar="FILE", default=None, help="draw step times and the ceiling vs N to FILE")
    parser.add_argument("--json", metavar="FILE", default=None, help="also write the prediction as JSON to FILE")


def _error(msg: str) -> int:
    print(f"hfstream plan: error: {msg}", file=sys.stderr)
    return 2


def run_from_args(ns: argparse.Namespace) -> int:
    """Plan (or compare) from parsed flags: table on stdout, files to --plot / --json."""
    for flag in ("plot", "json"):
        target = getattr(ns, flag)
        if target and not Path(target).resolve().parent.is_dir():
            return _error(f"--{flag}: directory {Path(target).resolve().parent} does not exist")
    if ns.compare:
        try:
            bench = json.loads(Path(ns.compare).read_text())
            prediction = predict_bench(bench, calibrate_from=ns.calibrate_from)
        except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            return _error(f"--compare: cannot use {ns.compare} as `hfstream bench --json` output: {exc!r}")
        comp = compare_with_measurement(prediction, bench)
        print(format_comparison(comp, prediction["calibration"]))
        if ns.json:
            Path(ns.json).write_text(json.dumps({"prediction": prediction, "comparison": comp}, indent=1))
        return 0
    if ns.model is not None:
        shape = ns.model
    else:
        shape = shape_from_params(ns.params) if ns.params else load_model("llama-8b")
    if ns.seq_len is not None and shape.n_layer is None:
        return _error("--seq-len needs the architecture: give --model (a preset or config.json), not --params")
    if ns.bucket_mb == 0 and not shape.tensors:
        return _error("--bucket-mb 0 (one tensor per bucket) needs the tensors: give --model, not --params")
    cfg = PlanConfig(tokens_per_device=ns.tokens_per_device, seq_len=ns.seq_len, peak_tflops=ns.peak_tflops,
                     mfu=ns.mfu, grad_bytes=ns.grad_bytes, link_gbs=ns.link_gbs, latency_us=ns.latency_us,
                     mem_bandwidth_gbs=ns.mem_bandwidth_gbs, optimizer_bytes_per_param=ns.optimizer_bytes_per_param,
                     bucket_mb=ns.bucket_mb, first_bucket_mb=ns.first_bucket_mb, world_sizes=ns.world_sizes)
    if ns.calibrate_backward_ms is not None and ns.calibrate_compute_ms is not None:
        return _error("--calibrate-backward-ms and --calibrate-compute-ms both set the FLOP/s: give one")
    if ns.calibrate_backward_ms is not None:
        cfg.compute_tflops = calibrated_tflops(shape, cfg, ns.calibrate_backward_ms, "backward")
    if ns.calibrate_compute_ms is not None:
        cfg.compute_tflops = calibrated_tflops(shape, cfg, ns.calibrate_compute_ms, "compute")
    if ns.calibrate_optimizer_ms is not None:
        if cfg.optimizer_bytes_per_param == 0:
            return _error("--calibrate-optimizer-ms needs --optimizer-bytes-per-param > 0")
        cfg.mem_bandwidth_gbs = calibrated_mem_bandwidth_gbs(shape, cfg, ns.calibrate_optimizer_ms)
    doc = plan(shape, cfg)
    print(format_table(doc))
    if ns.plot:
        print(f"[hfstream plan] wrote {plot_plan(doc, ns.plot)}", file=sys.stderr)
    if ns.json:
        Path(ns.json).write_text(json.dumps(doc, indent=1))
        print(f"[hfstream plan] wrote {ns.json}", file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hfstream.tools.plan.predict", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
