"""The model as the planner sees it: how many parameters, in which tensors, which cost FLOPs.

A `ModelShape` comes from a preset (`PRESETS`, no hub access), a transformers ``config.json``
(`shape_from_config`, `load_model`) or a bare parameter count (`shape_from_params`). GPT-2 and
Llama-style models are counted from their architecture numbers; other types are built on the
meta device by transformers, so no weights are ever allocated.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

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


def _count_str(n: float) -> str:
    """124M, 8.03B: a count with its unit."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:g}"



@dataclass(frozen=True)
class LayerDims:
    """A decoder layer's widths, for the activation memory (`memory.activation_bytes`)."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    """The MLP's inner width."""
    vocab: int
    gated_mlp: bool
    """SwiGLU (Llama: gate, up, down) rather than one activation between two matmuls (GPT-2)."""
    rms_norm: bool
    """Llama's RMSNorm (computed in fp32) rather than LayerNorm."""
    dropout: bool
    """Dropout after attention and in the residual branches (GPT-2's default 0.1)."""
    softmax_fp32: bool
    """Attention's softmax computed in fp32 and cast back (transformers' eager Llama), not in the activations' dtype."""


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
        layer: a decoder layer's widths, for the activations (GPT-2 and Llama-style); None when unknown.
    """

    name: str
    params: int
    tensors: tuple[tuple[str, int, str], ...] = ()
    n_layer: int | None = None
    d_attn: int | None = None
    layer: LayerDims | None = None

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
        drop = any(config.get(k, 0.1) for k in ("resid_pdrop", "embd_pdrop", "attn_pdrop"))
        heads = config.get("n_head") or config.get("num_attention_heads")
        dims = None if not heads else LayerDims(hidden=d, heads=heads, kv_heads=heads, head_dim=d // heads, ffn=inner,
                                                vocab=V, gated_mlp=False, rms_norm=False, dropout=bool(drop),
                                                softmax_fp32=False)
        return ModelShape(name, sum(n for _, n, _ in t), tuple(t), n_layer=L, d_attn=d, layer=dims)
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
        dims = LayerDims(hidden=d, heads=H, kv_heads=kv, head_dim=hd, ffn=ffn, vocab=V, gated_mlp=True, rms_norm=True,
                         dropout=bool(config.get("attention_dropout", 0.0)), softmax_fp32=True)
        return ModelShape(name, sum(n for _, n, _ in t), tuple(t), n_layer=L, d_attn=H * hd, layer=dims)
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
