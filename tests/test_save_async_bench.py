"""Exposed save time, blocking vs save_async=True, on CPU (docs/benchmarks.md's save rows).

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -m slow tests/test_save_async_bench.py -s

A GPT-2 from config (HFSTREAM_SAVE_BENCH_EMBD/LAYERS set its size), AdamW, a save every 4 steps
(HFSTREAM_SAVE_BENCH_EVERY), 5 of them and two steps after the last (the Trainer saves at its last
step too); one process, and 2 gloo ranks under grad_sync="overlap".
Prints, per rank 0: the training thread's time in each save (the first one allocates the snapshot's
host buffers, the later ones reuse them), the wait for the last write at the end of train() apart,
and the mean step time with and without a write behind.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback

from hfstream import StreamTrainer, StreamTrainingArguments
from tiny import lm_dataset, train_args

pytestmark = pytest.mark.slow

EVERY = int(os.environ.get("HFSTREAM_SAVE_BENCH_EVERY", 4))   # steps between saves
STEPS = 5 * EVERY + 2                                           # 5 saves in the loop, two steps after the last


class StepTimes(TrainerCallback):
    def __init__(self):
        self.t, self.times = None, []

    def on_step_begin(self, args, state, control, **kwargs):
        self.t = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append((state.global_step, time.perf_counter() - self.t))


def _run(out, save_async, grad_sync="native"):
    embd, layers = int(os.environ.get("HFSTREAM_SAVE_BENCH_EMBD", 512)), int(os.environ.get("HFSTREAM_SAVE_BENCH_LAYERS", 6))
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=8192, n_positions=64, n_embd=embd, n_layer=layers, n_head=8))
    trainer = StreamTrainer(model=model, train_dataset=lm_dataset(n=256, seq=32, vocab=8192),
                            args=train_args(StreamTrainingArguments, out, max_steps=STEPS, save_strategy="steps",
                                            save_steps=EVERY, save_async=save_async, prefetch_depth=0,
                                            grad_sync=grad_sync, per_device_train_batch_size=2, logging_steps=100,
                                            optim="adamw_torch", ddp_timeout=600))
    steps = StepTimes()
    trainer.add_callback(steps)
    per_save = []
    save_checkpoint = trainer._save_checkpoint

    def timed(*args, **kwargs):   # the training thread's time in each save (a wait for the previous write included)
        t0 = time.perf_counter()
        save_checkpoint(*args, **kwargs)
        per_save.append(time.perf_counter() - t0)

    trainer._save_checkpoint = timed
    trainer.train()
    folder = os.path.join(out, f"checkpoint-{EVERY}")
    size = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))
    params = sum(p.numel() for p in model.parameters())
    return dict(trainer.save_times), per_save, steps.times, size, params


def _line(save_async, times, per_save, steps, size, params) -> str:
    beside = [s for n, s in steps if n % EVERY in (1, 2) and n > EVERY]   # the steps a write runs behind (async)
    others = [s for n, s in steps if n % EVERY == 3]
    regular = per_save[1:-1]   # save_steps apart; the last save comes 2 steps after the one before it
    return (f"save_async={save_async}: {params / 1e6:.1f}M parameters, checkpoint {size / 1e9:.3f} GB, "
            f"{times['saves']} saves: exposed {times['exposed_s']:.3f} s in all, {times['drain_s']:.3f} s of it the end "
            f"of train(); per save {per_save[0]:.3f} s (first), {sum(regular) / len(regular):.3f} s (2nd-5th, mean), "
            f"{max(regular):.3f} s (2nd-5th, max), {per_save[-1]:.3f} s (the last, 2 steps after the 5th); "
            f"snapshot {times['snapshot_s']:.3f}, waits {times['wait_s']:.3f}, rename {times['commit_s']:.3f} s in all; "
            f"writer {times['write_s']:.3f} s; steps 1-2 after a save {1000 * sum(beside) / len(beside):.0f} ms, "
            f"step 3 after {1000 * sum(others) / len(others):.0f} ms")


def test_exposed_save_time_blocking_vs_async(tmp_path):
    for save_async in (False, True):
        print("\none process, " + _line(save_async, *_run(str(tmp_path / str(save_async)), save_async)))


def _ranks(rank, world_size, tmp):
    return [_line(save_async, *_run(f"{tmp}/{save_async}", save_async, grad_sync="overlap"))
            for save_async in (False, True)]


def test_exposed_save_time_blocking_vs_async_on_2_ranks(tmp_path):
    from hfstream.testing import run_on_ranks

    for rank, lines in enumerate(run_on_ranks(_ranks, 2, str(tmp_path), timeout=1800)):
        for line in lines:
            print(f"\nrank {rank} of 2, " + line)


def test_writer_thread_vs_forked_process_beside_training(tmp_path):
    """The same host snapshot written by a thread or by a forked process (copy-on-write: no second copy)
    while the training thread runs steps: the write's time and the steps' slowdown."""
    import multiprocessing
    import threading

    from safetensors.torch import save_file

    embd = int(os.environ.get("HFSTREAM_SAVE_BENCH_EMBD", 512))
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=8192, n_positions=64, n_embd=embd, n_layer=6, n_head=8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = torch.randint(0, 8192, (2, 32))

    def step():
        model(input_ids=batch, labels=batch).loss.backward()
        opt.step()
        opt.zero_grad()

    step()
    weights = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    optim = {k: {n: t.clone() if torch.is_tensor(t) else t for n, t in s.items()} for k, s in opt.state_dict()["state"].items()}

    def write(i):
        save_file(weights, str(tmp_path / f"model{i}.safetensors"))
        torch.save(optim, str(tmp_path / f"optimizer{i}.pt"))

    def steps_while(start, join, n=4):
        t0 = time.perf_counter()
        start()
        for _ in range(n):
            step()
        t_steps = time.perf_counter() - t0
        join()
        return t_steps / n, time.perf_counter() - t0

    def loop_rate(seconds):   # a pure-Python loop: it runs only while it holds the GIL
        t0, n = time.perf_counter(), 0
        while time.perf_counter() - t0 < seconds:
            n += 1
        return n / seconds

    alone, _ = steps_while(lambda: None, lambda: None)
    t0 = time.perf_counter(); write("blocking"); blocking = time.perf_counter() - t0
    thread = threading.Thread(target=write, args=("thread",))
    th_step, th_total = steps_while(thread.start, thread.join)
    rate_alone = loop_rate(0.5)
    thread = threading.Thread(target=write, args=("gil",))
    thread.start()
    rate_beside = loop_rate(0.5)
    thread.join()
    proc = multiprocessing.get_context("fork").Process(target=write, args=("process",))
    pr_step, pr_total = steps_while(proc.start, proc.join)
    assert proc.exitcode == 0
    print(f"\nwrite alone {blocking:.3f} s; step alone {1000 * alone:.0f} ms; "
          f"thread writer: step {1000 * th_step:.0f} ms (+{100 * (th_step / alone - 1):.0f} %), 4 steps + write "
          f"{th_total:.3f} s; forked writer: step {1000 * pr_step:.0f} ms (+{100 * (pr_step / alone - 1):.0f} %), "
          f"4 steps + write {pr_total:.3f} s; a Python loop beside the thread writer runs at "
          f"{rate_beside / rate_alone:.2f}x its rate alone (the writer's share of the GIL: "
          f"{max(0.0, 1 - rate_beside / rate_alone):.0%})")
