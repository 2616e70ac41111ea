"""Tiny models and datasets built from configs (no hub): shared by the trainer tests."""

from __future__ import annotations

import torch
from transformers import TrainerCallback


def tiny_causal_lm(kind: str = "gpt2", vocab: int = 64, seed: int = 0, dropout: float = 0.0):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    if kind == "gpt2":
        cfg = GPT2Config(vocab_size=vocab, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                         resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
                         bos_token_id=0, eos_token_id=0)
        return GPT2LMHeadModel(cfg)
    if kind == "llama":
        cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                          attention_dropout=dropout, bos_token_id=0, eos_token_id=0, pad_token_id=0)
        return LlamaForCausalLM(cfg)
    raise ValueError(kind)


def tiny_bert_classifier(vocab: int = 64, num_labels: int = 3, seed: int = 0):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=2, max_position_embeddings=32, num_labels=num_labels,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return BertForSequenceClassification(cfg)


def lm_dataset(n: int = 96, seq: int = 16, vocab: int = 64, seed: int = 1):
    import datasets

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (n, seq), generator=g)
    return datasets.Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})


def cls_dataset(n: int = 96, seq: int = 16, vocab: int = 64, num_labels: int = 3, seed: int = 2):
    import datasets

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (n, seq), generator=g)
    labels = torch.randint(0, num_labels, (n,), generator=g)
    return datasets.Dataset.from_dict({"input_ids": ids.tolist(), "labels": labels.tolist()})


def train_args(cls, out_dir, **overrides):
    """Deterministic, quiet, CPU-only arguments shared by every trainer test."""
    kw = dict(output_dir=str(out_dir), max_steps=20, per_device_train_batch_size=4, learning_rate=1e-3,
              logging_steps=1, save_strategy="no", report_to=[], seed=0, use_cpu=True,
              disable_tqdm=True, dataloader_num_workers=0, lr_scheduler_type="constant")
    kw.update(overrides)
    return cls(**kw)


def losses(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class ReportedLogs(TrainerCallback):
    """What the reporters (TensorBoard, W&B, the console) receive through ``on_log``."""

    def __init__(self):
        self.logs: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs or {}))


def reported(trainer) -> list[dict]:
    """The logs the reporters got (a `ReportedLogs` callback is added on first use, before train())."""
    for cb in trainer.callback_handler.callbacks:
        if isinstance(cb, ReportedLogs):
            return cb.logs
    cb = ReportedLogs()
    trainer.add_callback(cb)
    return cb.logs
