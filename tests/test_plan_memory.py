"""The planner's memory (hfstream/plan/memory.py): bytes a model and its optimizer hold against
models built from their configs, activations against what autograd saves, and the verdict a user
reads from ``hfstream plan --device``."""

from __future__ import annotations

import json

import pytest
import torch

import hfstream.plan as P
from hfstream.plan.devices import DEVICES, parse_bytes
from hfstream.plan.memory import OPTIMIZERS, activation_bytes, memory_by_mode, memory_report
from hfstream.plan.shapes import PRESETS


def _hf_config(config: dict, **extra):
    from transformers import AutoConfig

    return AutoConfig.for_model(config["model_type"], **{k: v for k, v in config.items() if k != "model_type"},
                                **extra)


# ---------------------------------------------------------------------------------------------
# Parameters, gradients, optimizer state: exact counts
# ---------------------------------------------------------------------------------------------

def test_llama_8b_parameter_and_gradient_bytes_are_a_bf16_model_built_on_the_meta_device():
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(_hf_config(PRESETS["llama-8b"]), torch_dtype=torch.bfloat16)
    exact = sum(p.numel() * p.element_size() for p in model.parameters())
    shape = P.load_model("llama-8b")
    modes = memory_by_mode(shape, 8, OPTIMIZERS["adamw"], activations=0)
    assert modes["replicated"]["params"] == modes["replicated"]["grads"] == exact      # 2 B each, bf16
    assert modes["replicated"]["optimizer"] == 6 * exact                             # fp32 master, m, v: 12 B
    # 16 B a parameter, 128.5 GB for 8.03e9: more than an 80 GB device (the ZeRO paper's count).
    assert sum(modes["replicated"][k] for k in ("params", "grads", "optimizer")) == 16 * 8_030_261_248
    assert modes["sharded"]["optimizer"] == 6 * exact / 8
    assert modes["fsdp"]["params"] == exact / 8


@pytest.mark.parametrize("optimizer,make", [
    ("adamw-fp32", lambda ps: torch.optim.AdamW(ps, lr=1e-3)),
    ("sgd-fp32", lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9)),
])
def test_optimizer_state_is_what_torch_keeps_after_a_step(optimizer, make):
    from transformers import AutoModelForCausalLM

    config = {"model_type": "llama", "vocab_size": 97, "hidden_size": 32, "intermediate_size": 56,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    model = AutoModelForCausalLM.from_config(_hf_config(config))
    opt = make(list(model.parameters()))
    ids = torch.randint(0, 97, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    state = sum(t.numel() * t.element_size() for s in opt.state.values() for k, t in s.items()
                if torch.is_tensor(t) and k != "step")              # Adam's step counters: one scalar each
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters())
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    m = memory_by_mode(P.shape_from_config(config), 1, OPTIMIZERS[optimizer], activations=0)["replicated"]
    assert (m["params"], m["grads"], m["optimizer"]) == (params, grads, state)


# ---------------------------------------------------------------------------------------------
# Activations: Korthikanti et al.'s count, and what autograd saves
# ---------------------------------------------------------------------------------------------

def test_gpt_with_dropout_is_korthikanti_formula_exactly():
    # Korthikanti et al. 2022, sec. 4.1: s b h (34 + 5 a s / h) bytes per layer, 16-bit activations.
    s, b, h, a = 2048, 4, 1024, 16
    shape = P.shape_from_config({"model_type": "gpt2", "vocab_size": 50257, "n_positions": 2048, "n_embd": h,
                                 "n_layer": 24, "n_head": a})
    assert shape.layer.dropout
    act = activation_bytes(shape.layer, 24, s, b, act_bytes=2, attention="eager")
    assert act["per_layer"] == s * b * h * (34 + 5 * a * s / h)
    assert act["layers"] == 24 * act["per_layer"]
    ck = activation_bytes(shape.layer, 24, s, b, act_bytes=2, checkpointing=True, attention="eager")
    assert ck["layers"] == 24 * 2 * s * b * h + act["per_layer"]     # 2 s b h a layer, one layer recomputed


def _saved_bytes(model, ids) -> int:
    """Bytes of the distinct storages autograd saves for backward in one forward (parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen.setdefault(st.data_ptr(), st.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, labels=ids)
    return sum(seen.values())


# Eager attention (Korthikanti's count keeps the s^2 probabilities) and no dropout: CPU dropout
# keeps its mask in the activations' dtype, where CUDA's fused kernel keeps one byte.
GPT2_TINY = {"model_type": "gpt2", "vocab_size": 512, "n_positions": 256, "n_embd": 128, "n_layer": 2, "n_head": 4,
             "activation_function": "gelu_pytorch_tanh", "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
LLAMA_TINY = {"model_type": "llama", "vocab_size": 512, "hidden_size": 128, "intermediate_size": 352,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}


@pytest.mark.parametrize("config,dtype,checkpointing", [
    (GPT2_TINY, torch.bfloat16, False), (LLAMA_TINY, torch.bfloat16, False), (LLAMA_TINY, torch.float32, False),
    (LLAMA_TINY, torch.bfloat16, True),
], ids=["gpt2-bf16", "llama-bf16", "llama-fp32", "llama-bf16-checkpointed"])
def test_activation_bytes_within_10_percent_of_what_autograd_saves(config, dtype, checkpointing):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_hf_config(config, attn_implementation="eager")).to(dtype).train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    s, b = 128, 2
    measured = _saved_bytes(model, torch.randint(0, 512, (b, s)))
    shape = P.shape_from_config(config)
    act = activation_bytes(shape.layer, shape.n_layer, s, b, act_bytes=torch.finfo(dtype).bits // 8,
                           checkpointing=checkpointing, attention="eager")
    # A forward saves the checkpointed layers' inputs; the layer recomputed in backward comes later.
    predicted = act["total"] - act["per_layer"] if checkpointing else act["total"]
    assert predicted == pytest.approx(measured, rel=0.10)


# ---------------------------------------------------------------------------------------------
# The verdict
# ---------------------------------------------------------------------------------------------

def test_llama_8b_on_8_h100_says_replicated_adamw_does_not_fit_and_what_does(tmp_path, capsys):
    out_json = tmp_path / "plan.json"
    assert P.main(["--model", "llama-8b", "--devices", "8", "--device", "h100-80gb", "--json", str(out_json)]) == 0
    raw = capsys.readouterr().out
    assert max(len(line) for line in raw.splitlines()) <= 100
    out = " ".join(raw.split())     # the table's lines wrapped at 100 columns
    assert "replicated adamw does not fit h100-80gb" in out
    assert "smallest change that fits: grad_sync='sharded' + gradient checkpointing" in out
    mem = json.loads(out_json.read_text())["memory"]
    assert mem["world_size"] == 8 and mem["device_bytes"] == DEVICES["h100-80gb"].memory_bytes
    rep = mem["modes"]["replicated"]
    assert rep["params"] + rep["grads"] + rep["optimizer"] == 16 * 8_030_261_248 and not rep["fits"]
    assert mem["modes_checkpointed"]["sharded"]["fits"]
    assert mem["smallest_change"]["setting"] == {"mode": "sharded", "checkpointing": True, "micro_batch": 1}
    assert set(mem["activations"]) == {"per_layer", "layers", "outside", "total"}


def test_the_cheapest_change_is_named_first():
    shape = P.load_model("llama-1b")
    # Replicated needs 16 B x 1.24e9 = 19.8 GB + activations; sharded on 8 about 7.4 GB + activations.
    fits_sharded = memory_report(shape, 8, "adamw", 1024, 4, device_bytes=parse_bytes("24GiB"))
    assert not fits_sharded["fits"] and fits_sharded["smallest_change"]["change"] == "grad_sync='sharded'"
    roomy = memory_report(shape, 8, "adamw", 1024, 4, device_bytes=parse_bytes("141GB"))
    assert roomy["fits"] and roomy["smallest_change"] is None
    # Too big for anything tried: says so rather than name a change.
    none = memory_report(P.load_model("llama-70b"), 1, "adamw", 4096, 1, device_bytes=parse_bytes("24GB"))
    assert none["smallest_change"] is None and not none["fits"]


def test_a_smaller_micro_batch_is_named_when_only_activations_overflow():
    shape = P.load_model("gpt2-124m")
    r = memory_report(shape, 1, "adamw", 1024, 64, device_bytes=parse_bytes("24GiB"), attention="eager")
    assert not r["fits"]
    assert r["smallest_change"]["change"].startswith("micro-batch ")
    assert r["smallest_change"]["total"] <= r["usable_bytes"]


@pytest.mark.parametrize("argv,flag", [
    (["--params", "8B", "--devices", "8"], "--model"),
    (["--model", "llama-8b", "--devices", "8", "--seq-len", "4096", "--micro-batch-size", "4"], "--micro-batch-size"),
])
def test_memory_flags_that_cannot_be_met_name_the_flag(argv, flag, capsys):
    assert P.main(argv) == 2
    assert flag in capsys.readouterr().err


@pytest.mark.parametrize("flag,value", [("--device", "h100"), ("--device-memory", "lots"), ("--device-memory", "0GB"),
                                        ("--optimizer", "adam"), ("--micro-batch-size", "0"), ("--devices", "0")])
def test_bad_memory_values_fail_naming_the_flag(flag, value, capsys):
    with pytest.raises(SystemExit) as exc:
        P.main([flag, value])
    assert exc.value.code == 2
    assert f"argument {flag}" in capsys.readouterr().err


def test_device_memory_sizes():
    assert parse_bytes("80GB") == 80 * 10**9
    assert parse_bytes("80GiB") == parse_bytes("80G") == 80 * 2**30
    assert parse_bytes("85899345920") == 80 * 2**30


@pytest.mark.parametrize("config", [GPT2_TINY, LLAMA_TINY], ids=["gpt2", "llama"])
def test_autocast_weight_copies_are_what_autograd_keeps_under_the_trainers_bf16(config):
    # The Trainer's bf16=True runs forward under torch.autocast: fp32 parameters, and a bf16 copy of
    # every matmul weight that the matmul keeps for backward (adamw-amp's extra 2 B a weight).
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(_hf_config(config, attn_implementation="eager")).train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    sizes = {2 * p.numel() for p in model.parameters() if p.dim() == 2}
    copies: dict[int, int] = {}

    def pack(t):   # a bf16 storage the size of a weight (100 tokens: no activation has that size)
        st = t.untyped_storage()
        if st.data_ptr() not in params and t.dtype == torch.bfloat16 and st.nbytes() in sizes:
            copies.setdefault(st.data_ptr(), st.nbytes())
        return t

    ids = torch.randint(0, 512, (2, 50))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=ids, labels=ids)
    m = memory_by_mode(P.shape_from_config(config), 1, OPTIMIZERS["adamw-amp"], activations=0)["replicated"]
    assert m["buffers"] == pytest.approx(sum(copies.values()), rel=0.10)
    assert (m["params"], m["grads"], m["optimizer"]) == tuple(b * P.shape_from_config(config).params for b in (4, 4, 8))
