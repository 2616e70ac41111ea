"""A plain user script that falls off the end after train(): no destroy_process_group, no os._exit.

How often such a script's finished run aborts at interpreter teardown on CPU/gloo
("terminate called without an active exception") is counted in docs/benchmarks.md ("A finished
run exits 0"):

    for i in $(seq 50); do
        OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 --master_port $((20000 + RANDOM % 20000)) \
            tests/scripts/exit_after_train.py --trainer stream > /dev/null 2>&1 || echo failed
    done | grep -c failed
"""

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

parser = argparse.ArgumentParser()
parser.add_argument("--trainer", choices=["stock", "stream"], default="stream")
parser.add_argument("--steps", type=int, default=15)
parser.add_argument("--destroy", action="store_true", help="call destroy_process_group() at the end")
cli = parser.parse_args()

torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=64))
g = torch.Generator().manual_seed(1)
data = [{"input_ids": ids, "labels": ids.clone()} for ids in (torch.randint(0, 256, (32,), generator=g)
                                                            for _ in range(256))]
common = dict(output_dir=tempfile.mkdtemp(), max_steps=cli.steps, per_device_train_batch_size=4,
              learning_rate=1e-3, report_to="none", use_cpu=True, save_strategy="no", logging_steps=5,
              disable_tqdm=True)
if cli.trainer == "stock":
    from transformers import Trainer, TrainingArguments

    trainer = Trainer(model=model, args=TrainingArguments(**common), train_dataset=data)
else:
    from hfstream import StreamTrainer, StreamTrainingArguments

    trainer = StreamTrainer(model=model, args=StreamTrainingArguments(**common), train_dataset=data)
trainer.train()
print(f"rank {os.environ.get('RANK')} done", flush=True)
if cli.destroy:
    import torch.distributed as dist

    dist.destroy_process_group()
