# %% [markdown]
# # Lesson 08 — Into the Trainer
#
# **Time:** 50 minutes. **Runs on:** any laptop (CPU: `accelerate launch` with 2 gloo processes,
# and two one-process "nodes" on one machine). **You will:** migrate a stock `Trainer` script to
# hfstream's `StreamTrainer`, launch it the way real jobs are launched, read its step report, and
# run a two-node job on one machine, and check the report's advice by measuring it.
#
# ## Where your building blocks went
#
# Lessons 03–07 built three things by hand: a prefetcher, an overlapped gradient sync, and the step
# breakdown against the ceiling. `StreamTrainer` puts them into the Hugging Face `Trainer` through
# a mixin that overrides a handful of methods and copies none:
#
# | `StreamTrainerMixin` method | what it adds | lesson |
# |---|---|---|
# | `get_train_dataloader`, `get_batch_samples` | batches pulled through a `StreamPrefetcher`, `prefetch_depth` ahead, across accumulation boundaries | 03 |
# | `_wrap_model` | Accelerate places the model but does not wrap it in DDP; `GradSync` hooks it in place (state-dict keys, `save_pretrained` untouched) | 05, 06 |
# | `training_step` | `require_backward_grad_sync` follows `accelerator.sync_gradients` (no communication on accumulation micro-steps), and `finish()` right after the syncing backward, so clipping sees averaged gradients | 07 |
# | `log` | the step breakdown against the ceiling as `stream/*` entries of what the reporters get (TensorBoard, W&B, ...), kept out of `state.log_history` | 00, 01 |
# | `train` | watches every phase for a stopped peer (lesson 07's timeouts, for the whole run) and, at the end, closes what it opened | 07 |
#
# The whole migration is two names: `Trainer` → `StreamTrainer`, `TrainingArguments` →
# `StreamTrainingArguments`. With `prefetch_depth=0, grad_sync="native"` it behaves exactly like the
# stock Trainer. The next cell reads the fields hfstream adds straight from the dataclass: each one
# is also a command-line flag (`--prefetch_depth 2`) through `HfArgumentParser`.

# %%
import contextlib, math, os, queue, threading, time
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from course.lib import *
import dataclasses, json, signal, subprocess, sys, tempfile
from pathlib import Path
from transformers import Trainer, TrainingArguments
from hfstream import StreamTrainer, StreamTrainingArguments
from hfstream.cli.plot import plot_breakdown, plot_timeline
from hfstream.testing import free_port
from course.checks.lesson08 import STOCK, migration_file, tiny_dataset
from course.grading import is_stub

stock_fields = {f.name for f in dataclasses.fields(TrainingArguments)}
for f in dataclasses.fields(StreamTrainingArguments):
    if f.name not in stock_fields:
        print(f"--{f.name:<22} default {f.default!r:<8} {f.metadata.get('help', '').split('. ')[0]}")

# %% [markdown]
# They meet the existing fields without duplicating them: `ddp_bucket_cap_mb` still sets DDP's
# buckets under `grad_sync="native"`, and under `"overlap"`/`"serial"` it sets hfstream's when
# `grad_bucket_mb` is left at its default; `ddp_timeout` bounds how long a reduction may wait for a
# dead peer; `ddp_find_unused_parameters` is not needed — `GradSync.finish()` always handles unused
# parameters (lesson 07); and with several processes and no accelerator, `use_cpu` is switched on
# so that the CPU ranks train as one job over gloo.
#
# ## The stock script
#
# Here is the training function of a stock script (a tiny GPT-2 built from a config, random token
# ids as data). Notice three settings that matter for data parallelism: 2 accumulation micro-steps,
# 1 MiB DDP buckets, and the CPU.

# %%
def stock_trainer(model, train_dataset, output_dir):
    args = TrainingArguments(
        output_dir=output_dir, max_steps=6, per_device_train_batch_size=4, gradient_accumulation_steps=2,
        learning_rate=3e-3, lr_scheduler_type="constant", logging_steps=3, seed=0, ddp_bucket_cap_mb=1,
        report_to="none", save_strategy="no", disable_tqdm=True, use_cpu=True,
    )
    return Trainer(model=model, args=args, train_dataset=train_dataset)

# %% tags=["hidden-check"]
_stock = stock_trainer(tiny_gpt2(layers=1, width=32, positions=32), tiny_dataset(8), tempfile.mkdtemp())
assert all(getattr(_stock.args, k) == getattr(TrainingArguments(output_dir="x", **STOCK), k) for k in STOCK), \
    "the stock_trainer cell and course/checks/lesson08.py STOCK disagree"

# %% [markdown]
# ## Exercise 08.migrate — the two-name migration, and three knobs
#
# Write `stream_trainer(model, train_dataset, output_dir)`: the same trainer as `stock_trainer`,
# built with `StreamTrainer` and `StreamTrainingArguments`, keeping **every** stock setting, and
# asking hfstream for:
#
# - 2 batches prefetched (`prefetch_depth`);
# - its own overlapped sync (`grad_sync="overlap"`);
# - buckets of 1 MiB, like the stock script's DDP buckets (think about which field carries that).
#
# The check builds your trainer on a tiny GPT-2 and trains it here, in one process; then, on
# tiny GPT-2s and datasets of drawn sizes, it compares every setting that decides what the run
# computes with the stock script's, and the weights after the run with the stock Trainer's (in one
# process nothing is communicated, so they must be equal). The launch after it runs the same
# function on two processes.

# %%
def stream_trainer(model, train_dataset, output_dir):
    """`stock_trainer`, migrated to hfstream: prefetch 2, overlapped sync, 1 MiB buckets."""
    # BEGIN SOLUTION
    args = StreamTrainingArguments(
        output_dir=output_dir, max_steps=6, per_device_train_batch_size=4, gradient_accumulation_steps=2,
        learning_rate=3e-3, lr_scheduler_type="constant", logging_steps=3, seed=0, ddp_bucket_cap_mb=1,
        report_to="none", save_strategy="no", disable_tqdm=True, use_cpu=True,
        prefetch_depth=2, grad_sync="overlap",      # ddp_bucket_cap_mb=1 sizes hfstream's buckets too
    )
    return StreamTrainer(model=model, args=args, train_dataset=train_dataset)
    # END SOLUTION

# %%
check("08.migrate")

# %% [markdown]
# ## What `accelerate launch` does
#
# A training script does not start its own processes. A launcher starts one process per device,
# and tells each who it is through the environment, the contract `torchrun` defined: `RANK` (this
# process among all), `WORLD_SIZE` (how many), `LOCAL_RANK` (this process on its machine: which
# device it takes), `MASTER_ADDR`/`MASTER_PORT` (where everyone meets). `accelerate launch` reads a
# config file, adds its own variables (`ACCELERATE_USE_CPU`, mixed precision, ...) and starts the
# processes through torchrun's own machinery (`torch.distributed.run`). Inside each process the
# Trainer creates an `Accelerator`, which calls `init_process_group` (gloo on CPU, NCCL on NVIDIA
# GPUs) from those variables. The config for this lesson:

# %%
ROOT = Path(sys.modules["course"].__file__).resolve().parents[1]
print((ROOT / "recipes/accelerate/cpu_2proc.yaml").read_text())

# %% [markdown]
# `course/scripts/08_train_tiny.py` is the launch target: it builds the tiny GPT-2 and data, takes
# its trainer from a file (`--builder`, here: your `stream_trainer`) or builds its own, trains,
# and prints who each process is and, on rank 0, the step report and the largest weight difference
# between the ranks (data parallelism means the same weights everywhere: it must be 0).
# `--num_cpu_threads_per_process 1` (for torchrun: `OMP_NUM_THREADS=1`) keeps two processes on two
# cores from fighting over them: with two OpenMP threads per rank on a busy CPU, a tiny step gets
# 10-100x slower. Each launch is bounded by a timeout; it takes about 10 seconds on a 2-core laptop.

# %%
SCRIPT = ROOT / "course/scripts/08_train_tiny.py"
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def accelerate_cmd(*launch_args, script_args=()):
    return [sys.executable, "-m", "accelerate.commands.launch",
            "--config_file", str(ROOT / "recipes/accelerate/cpu_2proc.yaml"), "--num_cpu_threads_per_process", "1",
            *launch_args, str(SCRIPT), *script_args]


def run_all(commands, timeout=120):
    """Start every command at once (one per "node") and wait for all. If one fails, or time runs
    out, kill them all (a peer left alone would wait for its partner until the process group's
    timeout) and show why.

    Output goes to files, not pipes: a process blocked on a full pipe that nobody reads would stall
    its rank, and with it every other rank at the next all-reduce.
    """
    logs = [(tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")) for _ in commands]
    procs = [subprocess.Popen(c, cwd=ROOT, env=ENV, stdout=o, stderr=e, text=True, start_new_session=True)
             for c, (o, e) in zip(commands, logs)]
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if any(p.poll() not in (None, 0) for p in procs):
            break
        time.sleep(0.1)
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)      # the launcher and the ranks it started
            p.wait()
    outs = []
    for p, (o, e) in zip(procs, logs):
        o.seek(0), e.seek(0)
        outs.append((p.returncode, o.read(), e.read()))
    for rc, out, err in sorted(outs, key=lambda o: o[0] < 0):   # a process that failed before one we killed
        if rc != 0:
            why = "timed out" if time.monotonic() >= deadline else f"exit {rc}"
            raise RuntimeError(f"launch failed ({why}):\n" + "\n".join(err.strip().splitlines()[-8:]))
    return outs


def show_run(out):
    """The lines that matter: who each process is, the report, the ranks' agreement (not the logs)."""
    for line in out.splitlines():
        if not line.startswith("{"):
            print(line)

# %% [markdown]
# ### One machine, two processes: your migration
#
# `--builder` gets your `stream_trainer` cell written to a file; both processes import it.

# %%
run_dir = Path(tempfile.mkdtemp(prefix="hfstream-l08-"))
report_1node = None
if is_stub(stream_trainer):
    print("Write stream_trainer (exercise 08.migrate) first: this launch runs your function.")
else:
    t0 = time.perf_counter()
    (rc, out, err), = run_all([accelerate_cmd("--num_processes", "2", "--main_process_port", str(free_port()),
                                              script_args=("--output_dir", str(run_dir / "one"),
                                                           "--builder", migration_file(globals())))])
    show_run(out)
    report_1node = json.loads((run_dir / "one" / "result.json").read_text())["report"]
    print(f"(launch took {time.perf_counter() - t0:.1f} s)")

# %% [markdown]
# Read the two lines before the report: two processes, `RANK` 0 and 1, on one machine, so `LOCAL_RANK`
# equals `RANK`. The report's mean is over both ranks, and the ranks ended with identical weights.
#
# ## Two "nodes" on one machine
#
# A multi-node job is the same launch run once per machine, each told how many machines there are,
# which one it is, and where machine 0 listens. Nothing else changes: the script is identical. Two
# launches on one machine, one process each, meeting on 127.0.0.1, are a faithful small model of it
# (the 2-node config in `recipes/accelerate/2node.yaml` is the real thing, with 8 GPUs per node):
#
# | | Accelerate | torchrun |
# |---|---|---|
# | machines | `--num_machines 2` | `--nnodes 2` |
# | this machine | `--machine_rank 0` / `1` | `--node-rank 0` / `1` |
# | processes | `--num_processes 2` (all machines together) | `--nproc-per-node 1` (per machine) |
# | where to meet | `--main_process_ip 127.0.0.1 --main_process_port P` | `--master-addr 127.0.0.1 --master-port P` |
#
# Watch `LOCAL_RANK`: both processes are local rank 0 *on their node* (each would take GPU 0 of its
# machine) while `RANK` tells them apart. Code that picks a device by `RANK` works on one node and
# fails on two. By default the Trainer logs on each node's first process (`log_on_each_node`); the
# report gathers every rank's timings to rank 0 at the end of training.
#
# This launch runs the script's own trainer (8 steps, 0.25 MiB buckets), so it works before you
# finish the exercises.

# %%
port = free_port()
nodes = [accelerate_cmd("--num_machines", "2", "--num_processes", "2", "--machine_rank", str(node),
                        "--main_process_ip", "127.0.0.1", "--main_process_port", str(port),
                        script_args=("--output_dir", str(run_dir / "nodes")))
         for node in (0, 1)]
t0 = time.perf_counter()
outs = run_all(nodes)
for node, (rc, out, err) in enumerate(outs):
    print(f"===== machine_rank {node} =====")
    show_run(out)
result = json.loads((run_dir / "nodes" / "result.json").read_text())
report = result["report"]
print(f"(two launches took {time.perf_counter() - t0:.1f} s)")

# %% [markdown]
# ## Reading the report
#
# Each row is a mean over the optimizer steps after the first (the warm-up), on each rank, and the
# `mean` column averages the ranks' *times*; the ratios are recomputed from them:
#
# - `data wait`: the step waited for its batch — prefetching should make it ~0 (lesson 03);
# - `forward`, `backward`, `optimizer`: the work itself;
# - `comm busy`: how long at least one reduction was on the wire; `exposed comm`: how long the step
#   waited in `finish()` for them — the part backward did not hide (lessons 05, 06);
# - `ideal = forward + max(backward, comm busy) + optimizer`, the ceiling, and
#   `efficiency = ideal / step` (lesson 00); `overlap = 1 − exposed comm / comm busy`.
#
# A row's label is its key without the unit: `exposed comm` is `report["mean"]["exposed_comm_ms"]`,
# and the Trainer logs it as `stream/exposed_comm_ms` (TensorBoard shows `train/stream/exposed_comm_ms`).
#
# What the parts do not account for — the step time minus data wait, forward, backward, exposed
# communication and optimizer — is Python and Trainer work between the measured phases: callbacks,
# moving inputs, the optimizer's bookkeeping, logging. On a tiny model on a CPU it is not small.
#
# The report (`StreamReport`) is a typed object that reads as a mapping of its set fields
# (`report["mean"]`, `dict(report)`, JSON as before), so a script or a test can read it:

# %%
print(json.dumps({k: report[k] for k in ("grad_sync", "prefetch_depth")}), "| mean:",
      {k: round(v, 2) for k, v in report["mean"].items()})

# %% [markdown]
# ## Exercise 08.read_report — where would you look first?
#
# Write `read_report(report)` for a report dict (`mean`, `per_rank`, as above). Return a dict:
#
# - `"efficiency"`: ceiling / step of the mean over ranks;
# - `"headroom_ms"`: how many milliseconds the mean step is above its ceiling;
# - `"biggest"`: the largest cost the ceiling leaves out — one of `"data_wait_ms"`,
#   `"exposed_comm_ms"`, or `"other"` (the step time the five measured parts do not account for);
# - `"slowest_rank"`: the index of the rank with the longest step — in data parallelism every
#   all-reduce waits for it, so it sets everyone's pace.
#
# The check reads reports recorded from this lesson's launches, variants where another part
# dominates, and the report your own launch produced; then drawn reports of 2, 3 and 4 ranks in
# which each cost is the largest in turn and a drawn rank is the slowest.

# %%
def read_report(report):
    """Efficiency, headroom, the biggest cost above the ceiling, the slowest rank."""
    # BEGIN SOLUTION
    m = report["mean"]
    other = m["step_ms"] - sum(m[k] for k in ("data_wait_ms", "forward_ms", "backward_ms", "exposed_comm_ms",
                                              "optimizer_ms"))
    costs = {"data_wait_ms": m["data_wait_ms"], "exposed_comm_ms": m["exposed_comm_ms"], "other": other}
    steps = [r["step_ms"] for r in report["per_rank"]]
    return {"efficiency": m["ideal_ms"] / m["step_ms"], "headroom_ms": m["step_ms"] - m["ideal_ms"],
            "biggest": max(costs, key=costs.get), "slowest_rank": steps.index(max(steps))}
    # END SOLUTION

# %%
check("08.read_report")

# %% [markdown]
# ## The figures: the two-node run, measured
#
# `hfstream.cli.plot.plot_breakdown` stacks each rank's parts against its ceiling (dashed);
# `plot_timeline` draws the report's `spans` — each rank's last steps, lane by lane: data, compute,
# and the reductions of each bucket on the comm lane, overlapping backward where overlap works.

# %%
print(f"two nodes: efficiency {report['mean']['efficiency']:.0%}, overlap {report['mean']['overlap']:.0%}, "
      f"weight difference between ranks {result['weight_spread']:.1g}")
if not is_stub(read_report):
    print("read_report:", read_report(report))
show(plot_breakdown(report, figure_path("08_breakdown.png"), title="two nodes x 1 process, grad_sync=overlap"))
show(plot_timeline(report["spans"], figure_path("08_timeline.png")))

# %% tags=["hidden-check"]
assert result["world_size"] == 2 and result["grad_sync"] == "overlap" and result["weight_spread"] == 0.0
assert len(report["per_rank"]) == 2 and report["mean"]["steps"] >= 1
assert report_1node is not None and len(report_1node["per_rank"]) == 2

# %% [markdown]
# On the timeline, the comm lane's bars start inside backward: those are the buckets launched from
# the gradient hooks. What sticks out past backward is the exposed communication of the report.
# On two CPU cores both ranks and gloo's threads share the same two cores, so expect little real
# overlap here; lesson 06's shaped link and a GPU show the difference clearly.
#
# ### On a GPU
#
# The same script under `recipes/accelerate/1gpu.yaml`: one process, so `GradSync` has nothing to
# reduce, but the prefetcher copies on a side stream and the report's times come from CUDA events.

# %% tags=["gpu"]
# GPU: the same tiny run on one GPU, where forward and backward take well under a millisecond, times measured with CUDA events, and the prefetcher's host-to-device copies hidden on a side stream.
gpu_cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ROOT / "recipes/accelerate/1gpu.yaml"),
           "--mixed_precision", "no", "--main_process_port", str(free_port()), str(SCRIPT),
           "--output_dir", str(run_dir / "gpu"), "--device", "auto"]
(rc, out, err), = run_all([gpu_cmd], timeout=300)
show_run(out)

# %% [markdown]
# ## The report's advice, checked by measurement
#
# At the end of `train()` the report says what to change, when a change is predicted to save at
# least 5 % of the step: `report["advice"]`, a list, best first, of `{"setting", "value",
# "predicted_step_ms", "reason", "changes_results"}`, printed under the table as `advice: set
# <setting>=<value>: ...`, written to `stream_report.json` in the last checkpoint (or in `output_dir` without one) (`python -m hfstream doctor
# OUTPUT_DIR` prints it again). Each prediction is the run's own measured parts put through a
# model of the step (docs/design.md section 4, "Advice"). A prediction is a claim; measure it.
#
# The next cell trains a tiny GPT-2 in this process, one process, behind a loader that spends
# 40 ms on every batch (`SlowStorage`: a read from slow storage, which waits without using a
# core) and no prefetching: a deliberately data-bound run. Its report, in its printed names:

# %%
from course.checks.lesson08 import advice_figure, advice_sentences, data_bound_run
from hfstream.report.format import format_report

before = data_bound_run()
print(format_report(before, title="data-bound run (prefetch_depth=0)"))

# %% [markdown]
# ## Exercise 08.check_advice — apply the advice, measure, and predict it yourself
#
# Write `check_advice(report, rerun)`:
#
# - `report`: the report of a data-bound run, as above; `rerun(**settings)` trains the same run
#   again with those `StreamTrainingArguments` fields changed and returns its report (in the
#   lesson it is `data_bound_run`);
# - apply the report's **first** piece of advice, and only it, with one call of `rerun`;
# - return a dict: `"applied"` (the settings you passed to `rerun`), `"predicted_ms"` (what the
#   advice predicted), `"measured_ms"` (the mean step of the run after the change), `"error"`
#   (how far the prediction was from the measurement, as a fraction of the measured step,
#   negative when the advice promised a faster step than was measured), and `"mine_ms"`: **your
#   own** prediction of the step once the batches are prefetched, from `report["mean"]` alone
#   (what did lesson 03 say a producer beside the step can and cannot hide?).
#
# The check runs your function on made-up reports (a loader slower than the rest of the step, and
# one faster) with a stand-in for `rerun` that records what it was asked; the cell after it runs
# it for real.

# %%
def check_advice(report, rerun):
    """Apply the report's first advice, measure the step again, and compare it with two predictions."""
    # BEGIN SOLUTION
    advice = report["advice"][0]
    applied = {advice["setting"]: advice["value"]}
    after = rerun(**applied)
    wait = report["mean"]["data_wait_ms"]
    rest = report["mean"]["step_ms"] - wait            # the step's own work, which the loader can run beside
    measured = after["mean"]["step_ms"]
    return {"applied": applied, "mine_ms": max(rest, wait), "predicted_ms": advice["predicted_step_ms"],
            "measured_ms": measured, "error": (advice["predicted_step_ms"] - measured) / measured}
    # END SOLUTION

# %%
check("08.check_advice")

# %% [markdown]
# ### Measured: the advice applied

# %%
checked = None
if not before.get("advice"):
    print("This run's report has no advice: nothing to check.")
elif is_stub(check_advice):
    print("Write check_advice (exercise 08.check_advice) first: this cell runs your function.")
else:
    runs = []
    checked = check_advice(before, lambda **changes: runs.append(data_bound_run(**changes)) or runs[-1])
    for sentence in advice_sentences(before, checked, runs[-1] if runs else None):
        print("-", sentence)
    show(advice_figure(before, checked, figure_path("08_advice.png")))

# %% tags=["hidden-check"]
assert checked is not None and before["advice"][0]["setting"] == "prefetch_depth", before.get("advice")
assert checked["measured_ms"] < 0.9 * before["mean"]["step_ms"], checked          # prefetching paid
assert abs(checked["mine_ms"] - checked["predicted_ms"]) < 0.15 * checked["predicted_ms"], checked

# %% [markdown]
# Your prediction and the advice's come from the same model, a producer beside the step that hides
# what the rest of the step leaves it time for; the advice's number also carries what the model
# does not see, the bookkeeping between the report's marks. The sentences above say how far this
# run's measurement landed from both. A shared machine moves a step by a few milliseconds from
# run to run, so one run settles the direction, not the last digit. The new run's own line says
# what is left: with a loader slower than the rest of the step, prefetching alone cannot make the
# step shorter than a batch takes to load.

# %% [markdown]
# ## The save as a stream, measured
#
# A checkpoint is the Trainer's one big write: the model, the optimizer's state (twice the
# model again for AdamW), the scheduler, the RNG states. The stock `Trainer` writes it on the
# training thread, and the step waits until the last byte is on disk. `StreamTrainingArguments(
# save_async=True)` makes the save a stream, the same shape as the prefetcher of lesson 03: at a
# save step each rank **copies** what the stock save would write into host memory (the snapshot),
# a writer in the background writes the very same files from those copies while the next steps
# run, and once every rank's files are complete the staging folder is renamed to `checkpoint-N` (a
# crash before that leaves no half-written `checkpoint-N`). `hfstream/trainer/save_async.py` says
# how. The writer is a process of its own that reads the copies from shared memory (/dev/shm), not a
# thread: a thread would share the training thread's GIL, and the stock writes take it in many
# short bursts (pickling, a copy per tensor); the step a write starts beside ran 6-18 % longer
# beside a thread, 0 % beside the process (`docs/benchmarks.md`, "The writer").
#
# Below, one process trains a tiny GPT-2 for 12 steps with a save every 4, once with the blocking
# save and once with `save_async=True`; the step report's `save` entry says how long the training
# thread spent in the saves (`exposed_s`) and, for the asynchronous one, how long the writer
# took (`write_s`). A checkpoint this small is written in milliseconds, so the difference
# is small here; it grows with the bytes (7B parameters and AdamW's two moments, all in float32,
# are 84 GB).

# %%
import io
from course.checks.lesson08 import one_thread


def saving_run(save_async):
    out = tempfile.mkdtemp(prefix="hfstream-l08-save-")
    args = StreamTrainingArguments(
        output_dir=out, max_steps=12, per_device_train_batch_size=4, learning_rate=3e-3, seed=0,
        save_strategy="steps", save_steps=4, save_async=save_async, report_to="none", disable_tqdm=True,
        use_cpu=True, logging_steps=100, prefetch_depth=0,
    )
    trainer = StreamTrainer(model=tiny_gpt2(layers=2, width=64, positions=32), args=args,
                            train_dataset=tiny_dataset(64))
    t0 = time.perf_counter()
    with one_thread(), contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        trainer.train()
    return time.perf_counter() - t0, trainer.stream_report()["save"], sorted(os.listdir(out))


for save_async in (False, True):
    run_s, save, files = saving_run(save_async)
    print(f"save_async={save_async!s:<5}: run {run_s:.2f} s, {save['saves']} saves of "
          f"{save['bytes'] / 1e6:.1f} MB, the training thread in them {1e3 * save['exposed_s']:.0f} ms "
          f"({1e3 * save['exposed_s_per_save']:.1f} ms per save)"
          + (f", written behind the steps in {1e3 * save['write_s']:.0f} ms" if save_async else "")
          + f"; in output_dir: {files}")

# %% [markdown]
# ### Why the snapshot comes before the next step
#
# The background writer must not read the live parameters: `optimizer.step()` changes them **in
# place** (the same storage, new values), so a writer still busy with step N's files when step N+1
# begins would write some tensors as they were after step N and the rest as they are after N+1 —
# a checkpoint of a model that never existed, and nothing in the file says so. The snapshot is
# the copy taken on the training thread before the next step can run; the writer reads only the
# copy. Below, a writer that is "slow" (it has written two tensors when the next step comes) reads
# the live tensors, and another reads a snapshot.

# %%
model = TinyMLP(dim=4, hidden=8, layers=2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
F.mse_loss(model(torch.randn(8, 4)), torch.zeros(8, 4)).backward()
opt.step()                                                          # step N
after_n = {k: v.clone() for k, v in model.state_dict().items()}
live = model.state_dict()                                           # views of the parameters, not copies
snapshot = {k: v.clone() for k, v in live.items()}                  # what save_async copies to host memory
names = list(live)
written_live = {k: live[k].clone() for k in names[:2]}              # the slow writer has done two tensors...
before_step = model.layers[0].weight.data_ptr()
opt.zero_grad()
F.mse_loss(model(torch.randn(8, 4)), torch.zeros(8, 4)).backward()
opt.step()                                                          # ... when step N+1 runs
print(f"optimizer.step() kept each parameter's storage: {model.layers[0].weight.data_ptr() == before_step}")
written_live.update({k: live[k].clone() for k in names[2:]})        # ... then it writes the rest
for label, written in (("live tensors", written_live), ("snapshot", snapshot)):
    from_n = [k for k in names if torch.equal(written[k], after_n[k])]
    print(f"writer reading the {label:<12}: after step N: {from_n}; after step N+1: "
          f"{[k for k in names if k not in from_n]}")

# %% [markdown]
# ## What you have now
#
# - the migration: two names, every stock setting kept, three knobs (`prefetch_depth`,
#   `grad_sync`, the bucket size through the field that already exists);
# - launches: `accelerate launch` for one machine, the same command per machine with
#   `--num_machines`/`--machine_rank` for several, and the environment contract behind both;
# - a report you can read in numbers: efficiency, headroom, the biggest cost above the ceiling, the
#   rank everyone waits for.
# - the report's advice taken as a claim and checked: applied, measured again, its prediction error
#   computed, and the same prediction made by you from the report's parts.
# - the save as a stream: `save_async=True` snapshots on the training thread and writes behind
#   the next steps, and the snapshot comes before the next step because the step works in place.
#
# Lesson 09 takes the ceiling from 2 processes to 1024 devices with the planner.
