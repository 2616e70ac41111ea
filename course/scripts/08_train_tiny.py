"""Lesson 08's launch target: a tiny GPT-2 trained by `StreamTrainer`, sized to finish in seconds.

Every process prints who it is (rank, local rank, node); rank 0 prints the step report and
writes it, with the largest weight difference between ranks, to ``OUTPUT_DIR/result.json``.
Nothing is downloaded: the model comes from a config, the data are random token ids.

    # one machine, two processes (gloo on CPU)
    accelerate launch --config_file recipes/accelerate/cpu_2proc.yaml --num_cpu_threads_per_process 1 \
        course/scripts/08_train_tiny.py --output_dir runs/l08

    # with your migration from exercise 08.migrate (a file that defines
    # stream_trainer(model, train_dataset, output_dir))
    accelerate launch ... course/scripts/08_train_tiny.py --output_dir runs/l08 --builder my_migration.py

    # two "nodes" on one machine, one process each: run both commands at once
    accelerate launch --config_file recipes/accelerate/cpu_2proc.yaml --num_machines 2 --num_processes 2 \
        --machine_rank 0 --main_process_ip 127.0.0.1 --main_process_port 29555 course/scripts/08_train_tiny.py ...
    accelerate launch ... --machine_rank 1 ...            (the same, with the other machine rank)

    # torchrun says the same with its own names (and one thread per process: on a busy CPU two
    # OpenMP threads per rank wait for each other and a tiny step takes 10-100x longer)
    OMP_NUM_THREADS=1 torchrun --nnodes 2 --node-rank 0 --nproc-per-node 1 --master-addr 127.0.0.1 \
        --master-port 29555 course/scripts/08_train_tiny.py --output_dir runs/l08
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))          # `course` and `hfstream` from this checkout


def who_am_i() -> str:
    """What the launcher told this process, through the environment (torchrun's variables)."""
    env = os.environ
    return (f"node {env.get('GROUP_RANK', '?')}: rank {env.get('RANK', '0')} of {env.get('WORLD_SIZE', '1')}, "
            f"local rank {env.get('LOCAL_RANK', '0')} of {env.get('LOCAL_WORLD_SIZE', '1')}, "
            f"rendezvous {env.get('MASTER_ADDR', '-')}:{env.get('MASTER_PORT', '-')}")


def default_trainer(model, train_dataset, output_dir: str, max_steps: int, use_cpu: bool = True):
    from hfstream import StreamTrainer, StreamTrainingArguments

    args = StreamTrainingArguments(
        output_dir=output_dir, max_steps=max_steps, per_device_train_batch_size=4, learning_rate=3e-3,
        logging_steps=max(1, max_steps // 2), seed=0, report_to="none", save_strategy="no",
        disable_tqdm=True, use_cpu=use_cpu,
        prefetch_depth=2, grad_sync="overlap", grad_bucket_mb=0.25,   # hfstream's three knobs
    )
    return StreamTrainer(model=model, args=args, train_dataset=train_dataset)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--builder", help="a .py file defining stream_trainer(model, train_dataset, output_dir)")
    parser.add_argument("--max_steps", type=int, default=8, help="optimizer steps (without --builder)")
    parser.add_argument("--device", choices=("cpu", "auto"), default="cpu",
                        help="cpu (default), or auto: the accelerator when there is one (without --builder)")
    ns = parser.parse_args(argv)

    import torch
    import torch.distributed as dist

    from course.checks.lesson08 import tiny_dataset
    from course.lib import tiny_gpt2

    print(who_am_i(), flush=True)
    torch.manual_seed(0)
    model = tiny_gpt2(layers=2, width=64, positions=32)
    data = tiny_dataset()
    if ns.builder:
        from course.grading import load_module

        trainer = load_module(ns.builder, "migration").stream_trainer(model, data, ns.output_dir)
    else:
        trainer = default_trainer(model, data, ns.output_dir, ns.max_steps, use_cpu=ns.device == "cpu")
    trainer.train()
    report = trainer.stream_report()

    # Data parallel means every rank ends with the same weights: measure how far apart they are.
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    spread = 0.0
    if dist.is_available() and dist.is_initialized():
        hi, lo = flat.clone(), flat.clone()
        dist.all_reduce(hi, op=dist.ReduceOp.MAX)
        dist.all_reduce(lo, op=dist.ReduceOp.MIN)
        spread = (hi - lo).abs().max().item()
    if trainer.is_world_process_zero():
        print(report, flush=True)
        print(f"largest weight difference between ranks: {spread:.3g}", flush=True)
        out = Path(ns.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        result = {"report": json.loads(report.to_json()), "weight_spread": spread,
                  "world_size": trainer.args.world_size, "grad_sync": trainer.grad_sync_mode,
                  "steps": trainer.state.global_step}
        (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
    # After a successful run only: wait for every rank (a rank that leaves while a peer is still in
    # the last collective fails it: "Connection closed by peer"), stop gloo's threads
    # (destroy_process_group), then leave without the interpreter's teardown. A process that reaches teardown with gloo threads still alive
    # can abort there ("terminate called without an active exception", pytorch/pytorch#190489):
    # measured on this project's CPU machine, 10 of 15 bare all-reduce scripts without the
    # destroy, and about 1 Trainer run in 10 even with it. An abort after a finished run makes
    # the launcher report a failure. After an error the exception propagates as usual.
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
