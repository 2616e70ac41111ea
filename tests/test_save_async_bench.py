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

    wait_for_copies = trainer._wait_for_snapshot_copies

    def timed_wait():   # on CPU the next step waits for the snapshot's copies before its optimizer step: the save's
        t0 = time.perf_counter()
        wait_for_copies()
        if per_save:
            per_save[-1] += time.perf_counter() - t0

    trainer._save_checkpoint = timed
    trainer._wait_for_snapshot_copies = timed_wait
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
            f"snapshot {times['snapshot_s']:.3f}, copy waits {times['copy_wait_s']:.3f}, waits {times['wait_s']:.3f}, rename {times['commit_s']:.3f} s in all; "
            f"writer {times['write_s']:.3f} s; each save {' '.join(f'{t:.2f}' for t in per_save)} s; steps 1-2 after a save {1000 * sum(beside) / len(beside):.0f} ms, "
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
        _write_snapshot(weights, optim, str(tmp_path), i)

    def steps(n=3):
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        return times

    def loop_rate(seconds):   # a pure-Python loop: it runs only while it holds the GIL
        t0, n = time.perf_counter(), 0
        while time.perf_counter() - t0 < seconds:
            n += 1
        return n / seconds

    t0 = time.perf_counter(); write("blocking"); blocking = time.perf_counter() - t0
    fork = multiprocessing.get_context("fork")
    # A spawned writer, started before and fed the snapshot once through shared memory (torchtitan's
    # way): no fork, no copy-on-write, no GIL shared with training.
    spawn = torch.multiprocessing.get_context("spawn")
    for t in [*weights.values(), *(v for st in optim.values() for v in st.values() if torch.is_tensor(v))]:
        t.share_memory_()
    go, stop_spawned, ready, done = spawn.Event(), spawn.Event(), spawn.Event(), spawn.Event()
    spawned = spawn.Process(target=_spawned_writer, args=(weights, optim, str(tmp_path), go, stop_spawned, ready, done))
    spawned.start()
    ready.wait(300)
    alone, beside_thread, beside_fork, beside_spawned, rates = [], [], [], [], []
    for _ in range(int(os.environ.get("HFSTREAM_SAVE_BENCH_ROUNDS", 6))):   # interleaved: the host drifts
        alone.append(steps(1)[0])
        thread = threading.Thread(target=write, args=("thread",))   # one save's write, as save_async's writer
        thread.start()
        beside_thread.append(steps(1)[0])   # the step the write starts beside
        thread.join()
        steps(2)
        proc = fork.Process(target=write, args=("process",))
        proc.start()
        beside_fork.append(steps(1)[0])   # the step the write starts beside
        proc.join()
        assert proc.exitcode == 0
        steps(2)
        done.clear()
        go.set()
        beside_spawned.append(steps(1)[0])   # the step the write starts beside
        done.wait(60)
        steps(2)   # the writes' tails settle before the next step alone
        rate_alone = loop_rate(0.25)
        thread = threading.Thread(target=write, args=("gil",))
        thread.start()
        rates.append(loop_rate(0.25) / rate_alone)
        thread.join()
    stop_spawned.set(); go.set(); spawned.join(60)
    med = lambda xs: sorted(xs)[len(xs) // 2]
    a, t, f, p = med(alone), med(beside_thread), med(beside_fork), med(beside_spawned)
    print(f"\nwrite alone {blocking:.3f} s; {len(alone)} steps of each kind, interleaved, medians of the step a write starts beside: alone "
          f"{1000 * a:.0f} ms; beside a thread writing one snapshot {1000 * t:.0f} ms ({100 * (t / a - 1):+.0f} %); beside "
          f"a forked process writing it {1000 * f:.0f} ms ({100 * (f / a - 1):+.0f} %); beside a spawned one "
          f"(started before, fed through shared memory) {1000 * p:.0f} ms ({100 * (p / a - 1):+.0f} %); a Python loop beside "
          f"the thread writer runs at {med(rates):.2f}x its rate alone (the writer's share of the GIL: "
          f"{max(0.0, 1 - med(rates)):.0%})")


def _write_snapshot(weights, optim, folder, i):
    from safetensors.torch import save_file

    save_file(weights, os.path.join(folder, f"model{i}.safetensors"))
    torch.save(optim, os.path.join(folder, f"optimizer{i}.pt"))


def _spawned_writer(weights, optim, folder, go, stop, ready, done):
    torch.set_num_threads(1)
    ready.set()
    while True:
        go.wait()
        go.clear()
        if stop.is_set():
            return
        _write_snapshot(weights, optim, folder, "spawned")
        done.set()
