"""Memory per device: what each grad_sync mode keeps, whether it fits a device, and the smallest change that makes it fit.

Per device, for ``P`` trainable parameters, ``N`` devices and the bytes per parameter of the
optimizer (`OPTIMIZERS`; mixed-precision AdamW: 2 + 2 + 12 = 16, Rajbhandari et al. 2020,
"ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", arXiv:1910.02054, sec. 3.1):

    mode         parameters   gradients               optimizer state   buffers (+ 2 B a matmul weight:
                                                                        autocast's bf16 copies, adamw-amp)
    replicated   P p          P g                     P k               P w if the wire's dtype is not
    (overlap,                                                           the gradient's (else .grad is a
     serial, DDP)                                                       view of the bucket: DDP's
                                                                        gradient_as_bucket_view)
    sharded      P p          P g, whole during       P k / N           the reduced slice P g / N
    (hfstream,                backward in the bucket
     ZeRO-1)                  buffers
    fsdp         P p / N      P g / N                 P k / N           gathered: 2 layers' parameters
    (ZeRO-3,                                                            (the one running, the prefetched;
     comparison)                                                        or the root's: embeddings, head),
                                                                        and one unit's gradients

plus the activations of one micro-batch (`activation_bytes`), the same in every mode. The peak
is taken as the sum (the ZeRO paper's count): gradients appear while activations are freed, so
it is an upper bound by at most the smaller of the two. A device's usable memory is
`USABLE_FRACTION` of its total: the CUDA context, the caching allocator's fragmentation and
temporaries take the rest (an assumption; ``torch.cuda.max_memory_reserved`` says it for a run).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..report.table import row, wrap
from .shapes import LayerDims, ModelShape
from .tables import WIDTH

USABLE_FRACTION = 0.9
MODES = ("replicated", "sharded", "fsdp")


@dataclass(frozen=True)
class OptimizerBytes:
    """Bytes per trainable parameter, by what holds them."""

    params: float
    """The parameters the model computes with."""
    grads: float
    """Their gradients."""
    state: float
    """The optimizer's state, an fp32 master copy included."""
    activation_bytes: int
    """Bytes of one activation element (2 = bf16/fp16 under mixed precision, 4 = fp32)."""
    what: str
    cast: float = 0
    """16-bit copies of the weights autocast makes in forward and the matmuls keep for backward."""


OPTIMIZERS: dict[str, OptimizerBytes] = {
    "adamw": OptimizerBytes(2, 2, 12, 2, "mixed-precision AdamW: 16-bit parameters and gradients, fp32 master, m, v "
                                         "(2 + 2 + 4 + 4 + 4 = 16 B, the ZeRO paper's K = 12)"),
    "adamw-fp32": OptimizerBytes(4, 4, 8, 4, "fp32 AdamW: parameters, gradients, m, v (4 + 4 + 4 + 4 = 16 B)"),
    "adamw-amp": OptimizerBytes(4, 4, 8, 2, "AdamW under torch.autocast (the Trainer's bf16=True): fp32 parameters, "
                                            "gradients, m, v (16 B) and bf16 weight copies kept for backward (2 B)",
                                cast=2),
    "sgd": OptimizerBytes(2, 2, 8, 2, "mixed-precision SGD with momentum: fp32 master and momentum (2 + 2 + 4 + 4 = 12 B)"),
    "sgd-fp32": OptimizerBytes(4, 4, 4, 4, "fp32 SGD with momentum (4 + 4 + 4 = 12 B)"),
}


# =============================================================================================
# Activations
# =============================================================================================

def activation_bytes(layer: LayerDims, n_layer: int, seq_len: int, micro_batch: int, act_bytes: int = 2,
                     checkpointing: bool = False, attention: str = "sdpa") -> dict:
    """Bytes autograd keeps for backward for one micro-batch of ``micro_batch`` sequences of ``seq_len``.

    Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
    (arXiv:2205.05198), sec. 4.1, count every tensor a layer saves for backward, once: for GPT
    with 16-bit activations and 1-byte dropout masks, ``s b h (34 + 5 a s / h)`` bytes per layer
    (attention 11 s b h + 5 a s^2 b, MLP 19 s b h, two LayerNorms 4 s b h). The same count is
    made here for the layer transformers builds (per token, e = ``act_bytes``, a heads of width d):

        norms        2 x e h (LayerNorm's input); RMSNorm: 2 x (4 + e) h (its fp32 input and
                     the normalised output)
        attention    e h (the projections' input) + 3 e a d (Q, K, V; Llama's eager repeats K
                     and V to all heads) + e a d (the output projection's input)
                     eager: + e a s (softmax output; fp32: 4 a s, + e a s cast back when e != 4)
                            + 1 a s + e a s (dropout's mask and output, when dropout is on)
                     sdpa (a flash / memory-efficient kernel): no s^2 term; + e a d (its output)
                            + 4 a (log-sum-exp)
        MLP          e h (input) + 2 e f (activation's input and output; gated: 4 e f, gate,
                     activation, up and their product)
        dropout      1 h after attention and after the MLP, when dropout is on
        outside      final norm, the LM head's input e h, and 4 V: transformers' loss takes the
                     log-softmax of the logits in fp32

    For GPT (LayerNorm, d a = h, f = 4h, dropout, eager, e = 2) this is Korthikanti's
    ``34 h + 5 a s`` per token exactly. With full checkpointing (each layer recomputed in
    backward) a layer keeps only its input, ``e h`` per token (Korthikanti: 2 s b h), and the
    layer being recomputed holds its whole set once. Measured against
    ``torch.autograd.graph.saved_tensors_hooks`` in tests/test_plan_memory.py (eager, no dropout:
    CPU dropout keeps its mask in the activations' dtype, CUDA's in one byte).

    Args:
        layer: the layer's widths (`ModelShape.layer`).
        attention: ``"eager"`` (transformers' eager attention: the s^2 probabilities kept) or
            ``"sdpa"`` (a fused kernel, transformers' default on GPUs).

    Returns:
        ``per_layer``, ``layers`` (all of them, or the checkpointed inputs plus one recomputed
        layer), ``outside`` and ``total`` in bytes.
    """
    if attention not in ("eager", "sdpa"):
        raise ValueError(f"attention={attention!r} is not valid; expected 'eager' or 'sdpa'")
    e, h, a, d, f, s = act_bytes, layer.hidden, layer.heads, layer.head_dim, layer.ffn, seq_len
    norm = (4 + e) * h if layer.rms_norm else e * h
    attn = e * h + 3 * e * a * d + e * a * d
    if attention == "eager":
        attn += (4 * a * s + (e * a * s if e != 4 else 0)) if layer.softmax_fp32 else e * a * s
        if layer.dropout:
            attn += a * s + e * a * s
    else:
        attn += e * a * d + 4 * a
    mlp = e * h + (4 if layer.gated_mlp else 2) * e * f
    masks = 2 * h if layer.dropout else 0
    tokens = seq_len * micro_batch
    per_layer = tokens * (2 * norm + attn + mlp + masks)
    outside = tokens * (norm + e * h + 4 * layer.vocab + (h if layer.dropout else 0))
    layers = n_layer * tokens * e * h + per_layer if checkpointing else n_layer * per_layer
    return {"per_layer": per_layer, "layers": layers, "outside": outside, "total": layers + outside}


# =============================================================================================
# Per mode
# =============================================================================================

def _units(shape: ModelShape) -> tuple[list[int], int]:
    """Parameters per FSDP unit: each decoder layer (``.<i>.`` in the name), and the rest (the root)."""
    layers: dict[str, int] = {}
    root = 0
    for name, n, _ in shape.tensors:
        m = re.search(r"\.(\d+)\.", name)
        if m:
            layers[m.group(1)] = layers.get(m.group(1), 0) + n
        else:
            root += n
    if not shape.tensors:
        return [], shape.params
    return list(layers.values()), root


def _matmul_params(shape: ModelShape) -> int:
    """Parameters autocast casts for a matmul and autograd keeps for backward: weights that are
    not a lookup table nor a norm's (biases are added, not kept)."""
    if not shape.tensors:
        return shape.params
    return sum(n for name, n, kind in shape.tensors
               if kind != "lookup" and name.endswith("weight") and "norm" not in name and ".ln_" not in name)


def memory_by_mode(shape: ModelShape, world_size: int, optimizer: OptimizerBytes, activations: float,
                   wire_bytes: float | None = None) -> dict[str, dict]:
    """Bytes per device in each mode (module docstring): ``params``, ``grads``, ``optimizer``,
    ``buffers``, ``activations`` and ``total``.

    Args:
        wire_bytes: bytes per gradient element on the wire; None = the gradient's own.
    """
    P, N, o = shape.params, world_size, optimizer
    wire = o.grads if wire_bytes is None else wire_bytes
    layers, root = _units(shape)
    cast = _matmul_params(shape) * o.cast
    gathered = max(2 * max(layers, default=0), root) * o.params + max(layers + [root]) * o.grads
    modes = {
        "replicated": {"params": P * o.params, "grads": P * o.grads, "optimizer": P * o.state,
                       "buffers": cast + (0 if wire == o.grads or N == 1 else P * wire)},
        "sharded": {"params": P * o.params, "grads": P * (o.grads if N == 1 else wire), "optimizer": P * o.state / N,
                    "buffers": cast + (0 if N == 1 else P * o.grads / N)},
        "fsdp": {"params": P * o.params / N, "grads": P * o.grads / N, "optimizer": P * o.state / N,
                 "buffers": 0 if N == 1 else gathered},
    }
    for m in modes.values():
        m["activations"] = activations
        m["total"] = m["params"] + m["grads"] + m["optimizer"] + m["buffers"] + activations
    return modes


@dataclass(frozen=True)
class Setting:
    """One way to run: the mode, checkpointing and the micro-batch."""

    mode: str
    checkpointing: bool
    micro_batch: int

    def describe(self) -> str:
        mode = {"replicated": "replicated (grad_sync='overlap', DDP)", "sharded": "grad_sync='sharded' (ZeRO-1)",
                "fsdp": "FSDP / ZeRO-3"}[self.mode]
        return (f"{mode}, " + ("gradient checkpointing" if self.checkpointing else "no checkpointing")
                + f", micro-batch {self.micro_batch}")


def memory_report(shape: ModelShape, world_size: int, optimizer: str, seq_len: int, micro_batch: int,
                  device_bytes: int | None, checkpointing: bool = False, attention: str = "sdpa",
                  wire_bytes: float | None = None) -> dict:
    """Every memory figure for ``world_size`` devices, the verdict per mode against ``device_bytes``,
    and the smallest change that fits.

    The changes are tried in the order of their cost: grad_sync='sharded' (none: the step is no
    slower, `predict`), a smaller micro-batch with gradient accumulation (the same tokens per
    step in more, smaller passes), gradient checkpointing (one more forward, about a third more
    compute), then their pairs, then all three; FSDP / ZeRO-3 is named when only it fits.

    Raises:
        ValueError: the model's layers are unknown (a bare parameter count), or a bad name.
    """
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r} is not valid; expected one of {', '.join(OPTIMIZERS)}")
    if shape.layer is None or shape.n_layer is None:
        raise ValueError("memory needs the model's layers (activations): give --model (a GPT-2 or Llama-style "
                         "preset or config.json), not --params")
    opt = OPTIMIZERS[optimizer]

    def acts(ckpt: bool, mb: int) -> dict:
        return activation_bytes(shape.layer, shape.n_layer, seq_len, mb, opt.activation_bytes, ckpt, attention)

    def total(st: Setting) -> float:
        return memory_by_mode(shape, world_size, opt, acts(st.checkpointing, st.micro_batch)["total"],
                              wire_bytes)[st.mode]["total"]

    act = acts(checkpointing, micro_batch)
    modes = memory_by_mode(shape, world_size, opt, act["total"], wire_bytes)
    usable = None if device_bytes is None else device_bytes * USABLE_FRACTION
    doc = {"world_size": world_size, "optimizer": optimizer, "optimizer_bytes": opt.__dict__,
           "seq_len": seq_len, "micro_batch": micro_batch, "checkpointing": checkpointing, "attention": attention,
           "activations": act, "modes": modes, "device_bytes": device_bytes, "usable_bytes": usable,
           "usable_fraction": USABLE_FRACTION}
    if usable is None:
        return doc
    for m in modes.values():
        m["fits"] = m["total"] <= usable
    if not checkpointing:   # what each mode needs with checkpointing: the table's second half
        doc["modes_checkpointed"] = memory_by_mode(shape, world_size, opt, acts(True, micro_batch)["total"], wire_bytes)
        for m in doc["modes_checkpointed"].values():
            m["fits"] = m["total"] <= usable
    asked = Setting("replicated", checkpointing, micro_batch)
    smaller = [mb for mb in (micro_batch // 2**i for i in range(1, 20)) if mb >= 1]
    candidates: list[tuple[str, Setting]] = [("grad_sync='sharded'", Setting("sharded", checkpointing, micro_batch))]
    candidates += [(f"micro-batch {mb} (gradient accumulation x {micro_batch // mb})",
                    Setting("replicated", checkpointing, mb)) for mb in smaller]
    if not checkpointing:
        candidates.append(("gradient checkpointing", Setting("replicated", True, micro_batch)))
        candidates.append(("grad_sync='sharded' + gradient checkpointing", Setting("sharded", True, micro_batch)))
    candidates += [(f"grad_sync='sharded' + micro-batch {mb}", Setting("sharded", checkpointing, mb)) for mb in smaller]
    if not checkpointing:
        candidates += [(f"gradient checkpointing + micro-batch {mb}", Setting("replicated", True, mb)) for mb in smaller]
        candidates += [(f"grad_sync='sharded' + gradient checkpointing + micro-batch {mb}", Setting("sharded", True, mb))
                       for mb in smaller]
    candidates += [("FSDP / ZeRO-3 (not an hfstream mode)", Setting("fsdp", ck, mb))
                   for ck in ((checkpointing, True) if not checkpointing else (True,)) for mb in [micro_batch] + smaller]
    fix = None
    if total(asked) > usable:
        for what, st in candidates:
            t = total(st)
            if t <= usable:
                fix = {"change": what, "setting": st.__dict__, "describe": st.describe(), "total": t}
                break
    doc["fits"] = total(asked) <= usable
    doc["smallest_change"] = fix
    return doc


def _gb(n: float) -> str:
    return f"{n / 2**30:.1f}"


def format_memory(doc: dict, device: str) -> list[str]:
    """The memory lines of ``hfstream plan`` (GiB per device)."""
    o = doc["optimizer_bytes"]
    a = doc["activations"]
    head = [f"memory per device at N = {doc['world_size']:,} (GiB) | {doc['optimizer']}: {o['what']} | activations: "
             f"micro-batch {doc['micro_batch']} x {doc['seq_len']:,} tokens, {o['activation_bytes']}-byte, "
             f"{doc['attention']} attention, " + ("gradient checkpointing" if doc["checkpointing"] else "no checkpointing")
             + f" (Korthikanti et al. 2022 count; {_gb(a['per_layer'])} GiB a layer)"
             + (f" | fits = at most {_gb(doc['usable_bytes'])} of {device}'s {_gb(doc['device_bytes'])} GiB "
                f"({doc['usable_fraction']:.0%}: the CUDA context and the allocator take the rest)"
                if doc["device_bytes"] else "")]
    tail = []
    widths = (-17, 8, 8, 8, 9, 8, 8)
    lines = [row(["mode", "params", "grads", "optim", "buffers", "activ", "total"], widths)
             + ("  fits" if doc["device_bytes"] else "")]
    rows = [(name, m) for name, m in doc["modes"].items()]
    rows += [(name + " +ckpt", m) for name, m in doc.get("modes_checkpointed", {}).items()]
    for name, m in rows:
        verdict = "" if "fits" not in m else ("  yes" if m["fits"] else "  NO")
        parts = ("params", "grads", "optimizer", "buffers", "activations", "total")
        lines.append(row([name, *(_gb(m[k]) for k in parts)], widths) + verdict)
    if doc["device_bytes"]:
        if doc["fits"]:
            tail.append(f"replicated (overlap) fits {device} as asked")
        elif doc["smallest_change"] is None:
            tail.append(f"replicated (overlap) does not fit {device}, and no change tried here makes it fit "
                         f"(tensor or pipeline parallelism, CPU offload)")
        else:
            fix = doc["smallest_change"]
            tail.append(f"replicated {doc['optimizer']} does not fit {device}; smallest change that fits: {fix['change']} "
                         f"({_gb(fix['total'])} GiB per device)")
    return wrap(head, WIDTH) + lines + wrap(tail, WIDTH)
