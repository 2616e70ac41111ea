"""Train a small causal language model from config with `StreamTrainer` — hfstream's main job.

The corpus is built at run time from this Python's standard library sources (or your own
``--data_files``), the tokenizer is byte-level (or a BPE trained here), the model is a
GPT-2-style or Llama-style network from a config: nothing is downloaded.

It ships inside the package as what ``hfstream demo`` trains (with its accelerate configs, in
``accelerate/`` beside it); in a clone, ``recipes/train_clm.py`` runs it and ``recipes/accelerate/``
holds the configs. Launch from a clone:

    # CPU, 2 processes over gloo (what `make demo` runs on a machine without a GPU)
    accelerate launch --config_file recipes/accelerate/cpu_2proc.yaml --num_cpu_threads_per_process 1 \
        recipes/train_clm.py --output_dir runs/demo

    # one GPU
    accelerate launch --config_file recipes/accelerate/1gpu.yaml recipes/train_clm.py --output_dir runs/1gpu --bf16

    # one node, 8 GPUs
    accelerate launch --config_file recipes/accelerate/8gpu.yaml recipes/train_clm.py --output_dir runs/8gpu --bf16

    # two nodes, 8 GPUs each: run on each node, with its own --machine_rank and the first node's address
    accelerate launch --config_file recipes/accelerate/2node.yaml --machine_rank 0 --main_process_ip 10.0.0.1 \
        recipes/train_clm.py --output_dir runs/2node --bf16
    accelerate launch --config_file recipes/accelerate/2node.yaml --machine_rank 1 --main_process_ip 10.0.0.1 \
        recipes/train_clm.py --output_dir runs/2node --bf16

    # the same under torchrun, or plain python for one process
    torchrun --nproc_per_node 2 recipes/train_clm.py --output_dir runs/torchrun
    python recipes/train_clm.py --output_dir runs/single --max_steps 50

Every `StreamTrainingArguments` field is a flag (``--prefetch_depth 2 --grad_sync overlap``
``--grad_bucket_mb 4``); ``--help`` lists them all.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

from transformers import GPT2Config, GPT2LMHeadModel, HfArgumentParser, LlamaConfig, LlamaForCausalLM

from hfstream import StreamTrainer, StreamTrainingArguments
from hfstream.cli.data import build_stdlib_corpus, byte_tokenizer, load_text_dataset, train_bpe_tokenizer
from hfstream.cli.plot import plot_breakdown, plot_loss, plot_timeline
from hfstream.cli.trace import TraceSteps, parse_step_range


@dataclass
class ModelArguments:
    model_type: str = field(default="gpt2", metadata={"help": "Architecture built from config: 'gpt2' or 'llama'.",
                                                      "choices": ["gpt2", "llama"]})
    n_layer: int = field(default=4, metadata={"help": "Transformer blocks."})
    n_embd: int = field(default=128, metadata={"help": "Hidden size."})
    n_head: int = field(default=4, metadata={"help": "Attention heads."})
    tokenizer: str = field(default="bytes", metadata={"help": "'bytes' (257 ids, nothing to train) or 'bpe' "
                                                               "(byte-level BPE trained on the corpus here).",
                                                       "choices": ["bytes", "bpe"]})
    bpe_vocab_size: int = field(default=2048, metadata={"help": "Vocabulary size with --tokenizer bpe."})


@dataclass
class DataArguments:
    data_files: list[str] = field(default_factory=list, metadata={
        "help": "Local text files to train on. Default: a corpus built from the Python standard library."})
    corpus_bytes: int = field(default=2_000_000, metadata={"help": "Size of the standard-library corpus."})
    block_size: int = field(default=128, metadata={"help": "Tokens per training sequence."})
    validation_fraction: float = field(default=0.02, metadata={"help": "Share of blocks held out for evaluation."})
    trace_steps: str = field(default="", metadata={
        "help": "Optimizer steps to record as a torch.profiler Chrome trace, e.g. 10-12 (empty: none)."})


DEMO_DEFAULTS = dict(max_steps=150, per_device_train_batch_size=8, per_device_eval_batch_size=16,
                     learning_rate=3e-3, warmup_steps=10, logging_steps=25, save_strategy="no",
                     report_to="none", eval_strategy="no", disable_tqdm=True, seed=0)


def build_model(m: ModelArguments, tokenizer, block_size: int):
    # The special ids come from the tokenizer: GPT2Config's defaults (50256) lie outside a
    # 257-id vocabulary and LlamaConfig's (1, 2) name ordinary bytes, and transformers warns
    # about both, at the config and again when the Trainer aligns them with the tokenizer.
    ids = dict(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
               eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    if m.model_type == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(**ids, n_positions=block_size, n_embd=m.n_embd,
                                           n_layer=m.n_layer, n_head=m.n_head))
        # The loss transformers picks anyway; named, because the class name ("LMHead", not
        # "ForCausalLM") does not name it and transformers warns "loss_type=None ... unrecognized".
        model.loss_type = "ForCausalLM"
        return model
    return LlamaForCausalLM(LlamaConfig(**ids, hidden_size=m.n_embd, intermediate_size=4 * m.n_embd,
                                        num_hidden_layers=m.n_layer, num_attention_heads=m.n_head,
                                        num_key_value_heads=m.n_head, max_position_embeddings=block_size))


def parse(argv: list[str]):
    parser = HfArgumentParser((ModelArguments, DataArguments, StreamTrainingArguments))
    parser.set_defaults(**DEMO_DEFAULTS)
    if not any(a == "--output_dir" or a.startswith("--output_dir=") for a in argv):
        argv = [*argv, "--output_dir", "runs/demo"]
    return parser.parse_args_into_dataclasses(args=argv)


def main(argv: list[str] | None = None) -> dict:
    model_args, data_args, args = parse(sys.argv[1:] if argv is None else argv)
    out = Path(args.output_dir)

    with args.main_process_first(desc="building the corpus and the dataset"):
        try:
            files = data_args.data_files or [str(build_stdlib_corpus(out / "data", data_args.corpus_bytes))]
            tokenizer = (byte_tokenizer() if model_args.tokenizer == "bytes"
                         else train_bpe_tokenizer(files, vocab_size=model_args.bpe_vocab_size))
            splits = load_text_dataset(files, tokenizer, block_size=data_args.block_size,
                                       validation_fraction=data_args.validation_fraction, seed=args.seed)
        except (FileNotFoundError, ValueError) as err:   # bad input: say so, no traceback
            raise SystemExit(f"train_clm.py: error: {err}") from None
    train_ds = splits["train"] if data_args.validation_fraction > 0 else splits
    eval_ds = splits["validation"] if data_args.validation_fraction > 0 else None

    try:
        trace = TraceSteps(*parse_step_range(data_args.trace_steps), out) if data_args.trace_steps else None
    except ValueError as err:
        raise SystemExit(f"train_clm.py: error: {err}") from None
    model = build_model(model_args, tokenizer, data_args.block_size)
    trainer = StreamTrainer(model=model, args=args, train_dataset=train_ds, eval_dataset=eval_ds,
                            processing_class=tokenizer, callbacks=[trace] if trace else None)
    trainer.train()
    report = trainer.stream_report()
    metrics = trainer.evaluate() if eval_ds is not None else {}

    if trainer.is_world_process_zero():
        trainer.save_model(str(out / "model"))
        (out / "stream_report.json").write_text(report.to_json())
        (out / "log_history.json").write_text(json.dumps(trainer.state.log_history, indent=2))
        pictures = [plot_breakdown(report, out / "breakdown.png",
                                   title=f"{args.world_size} rank(s), grad_sync={trainer.grad_sync_mode}"),
                    plot_loss(trainer.state.log_history, out / "loss.png")]
        if report.get("spans"):
            pictures.append(plot_timeline(report["spans"], out / "timeline.png"))
        print("\n" + str(report))
        if "eval_loss" in metrics:
            print(f"\neval loss {metrics['eval_loss']:.3f} (perplexity {math.exp(min(metrics['eval_loss'], 50)):.1f})")
        print(f"\nrun:      {out.resolve()}")
        print(f"model:    {(out / 'model').resolve()}")
        print(f"logs:     {(out / 'log_history.json').resolve()}  (report: stream_report.json)")
        print("pictures: " + "  ".join(str(p.resolve()) for p in pictures))
        if trace is not None and trace.path is not None:
            print(f"trace:    {trace.path.resolve()}  (chrome://tracing or ui.perfetto.dev)")
    return {"report": dict(report), "metrics": metrics}


def leave() -> None:
    """Leave a finished run: every rank waits for its peers, gloo's threads stop, no teardown.

    After a successful run only: wait for every rank (a rank that leaves while a peer is still in
    the last collective fails it: "Connection closed by peer"), stop gloo's threads
    (destroy_process_group), then leave without the interpreter's teardown. A process that
    reaches teardown with gloo threads still alive can abort there ("terminate called without an
    active exception", pytorch/pytorch#190489):
    measured on this project's CPU machine, 10 of 15 bare all-reduce scripts without the
    destroy, and about 1 Trainer run in 10 even with it. An abort after a finished run makes
    the launcher report a failure. After an error the exception propagates as usual.
    """
    import logging
    import os
    import sys

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()                 # nobody leaves while a peer still finishes the last collective
        dist.destroy_process_group()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
    leave()
