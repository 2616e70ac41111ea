"""Every setting the README's argument table lists, and every existing field it says hfstream honours,
reaches the building block it sets, through `StreamTrainer` in a run on 2 gloo processes.

One spawn runs five short trainings (3 steps of a tiny GPT-2 each) whose settings differ, and a
callback reads, after each optimizer step, what the building blocks are doing in that run:

    setting                  held by (run: value)
    prefetch_depth           the `StreamPrefetcher` feeding the steps: its depth (3, 2) or none at all (0)
    grad_sync                the GradSync's mode; "serial" launches nothing from backward's hooks,
                             "overlap" does; "sharded" shards the optimizer; "native" is DDP, no GradSync;
                             "auto" is "overlap" here (plain data parallel)
    grad_bucket_mb           the plan: 0 = one bucket per parameter, inf = one bucket, "auto" = the tuner
    grad_comm_dtype          the dtype of the buffers the gradients travel in (bf16 vs float32)
    comm_stream_priority     the priority GradSync creates its side streams with. On CPU (gloo) there are
                             no side streams and no NCCL group, so what is held is the value GradSync and
                             its `CommStreams` were given; the stream itself only on a GPU (tests marked gpu)
    step_watchdog_s          the step watchdog's report time (5 s; None = half of ddp_timeout; 0 = none)
    stream_report            the ``stream/<key>`` scalars the reporters get, or none
    ddp_bucket_cap_mb        hfstream's cap when grad_bucket_mb is left at its default; DDP's under "native"
    ddp_timeout              GradSync's bound on every wait and the watchdog's exit time (+ 15 s)
    ddp_broadcast_buffers    a buffer each rank changes before a step is the same on both ranks after it
                             (unset, True), or stays each rank's own (False)
    dataloader_pin_memory    the train loader's ``pin_memory`` (the DataLoader still pins, the README says).
                             On CPU, TrainingArguments turns it off under ``use_cpu``; one run sets it back
                             after construction, as it stays on an accelerator machine
    use_cpu                  switched on for 2 processes without an accelerator: the ranks form one job

Each setting is read in at least two runs with different values, so a Trainer that passed a
constant instead of the setting fails here. Mutants checked by hand on a copy of the tree, each
failing a test below: in `StreamTrainerMixin._wrap_model` each of ``bucket_mb``, ``mode``,
``comm_dtype``, ``comm_stream_priority``, ``timeout``, ``broadcast_buffers`` given a constant; the
prefetcher built with ``depth=2``; the watchdog's ``limit`` taken as None; the timeline made
whatever ``stream_report`` says; ``effective_bucket_mb`` ignoring ``ddp_bucket_cap_mb``; the
``use_cpu`` switch removed; the train loader's ``pin_memory`` turned off.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import TrainerCallback

from hfstream.testing import run_on_ranks

pytestmark = pytest.mark.multiprocess

STEPS = 3

RUNS = {
    # Every hfstream setting away from its default, and the existing fields it honours.
    "overlap": dict(grad_sync="overlap", grad_bucket_mb=0, grad_comm_dtype="bf16", comm_stream_priority="normal",
                    prefetch_depth=3, step_watchdog_s=5.0, ddp_timeout=77, ddp_broadcast_buffers=False,
                    stream_report=False, dataloader_pin_memory=False, use_cpu=False),
    # grad_bucket_mb left at its default: ddp_bucket_cap_mb sets hfstream's cap.
    "sharded": dict(grad_sync="sharded", ddp_bucket_cap_mb=1, prefetch_depth=0, ddp_timeout=60),
    "serial": dict(grad_sync="serial", grad_bucket_mb=float("inf"), step_watchdog_s=0, ddp_broadcast_buffers=True),
    "native": dict(grad_sync="native", ddp_bucket_cap_mb=2, prefetch_depth=0),
    "defaults": dict(),
}


class ReadBlocks(TrainerCallback):
    """Rank 1 changes a buffer before each step; after each step, what every building block holds."""

    def __init__(self, trainer, rank):
        self.trainer, self.rank, self.seen = trainer, rank, []
        self.written = None   # what this rank wrote into the buffer before the current step

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        # Rank r writes 100 r + step. Where buffers are broadcast, rank 1 holds what rank 0 holds after
        # the step (rank 0's value at the forward, or under sharded at the last step, landed at the forward).
        self.written = 100.0 * self.rank + state.global_step
        self.trainer.model.probe.fill_(self.written)

    def on_step_end(self, args, state, control, train_dataloader=None, **kwargs):
        from torch.nn.parallel import DistributedDataParallel

        t, sync = self.trainer, self.trainer.grad_sync
        wrapped = t.model_wrapped
        seen = {
            "step": state.global_step,
            "probe": float(t.model.probe[0]), "written": self.written,
            "prefetch_depth": t._prefetcher.depth if t._prefetcher is not None else None,
            "watchdog": (t._watchdog.report_after_s, t._watchdog.exit_after_s) if t._watchdog is not None else None,
            "timeline": t._timeline is not None,
            "pin_memory": getattr(train_dataloader, "pin_memory", None),
            "use_cpu": t.args.use_cpu,
            "processes": t.accelerator.num_processes,
            "ddp_cap": wrapped.bucket_bytes_cap if isinstance(wrapped, DistributedDataParallel) else None,
            "grad_sync": None,
        }
        if sync is not None:
            seen["grad_sync"] = {
                "mode": sync.mode, "world_size": sync.world_size,
                "buckets": len(sync.buckets), "bucket_mb": sync.bucket_mb, "hooked": len(sync.hooked_parameters),
                "wire": sorted({str(st.buffer.dtype) for st in sync.bucket_states if st.buffer is not None}),
                "priority": (sync.comm_stream_priority, sync._comm_streams.priority),
                "timeout_s": sync.timeout_s,
                "launched_in_backward": sync.stats.launched_in_backward,
                "sharded_optimizer": t._zero1_optimizer,
            }
        self.seen.append(seen)


def all_runs(rank, world_size, tmp):
    from tiny import lm_dataset, reported, tiny_causal_lm, train_args

    from hfstream import StreamTrainer, StreamTrainingArguments

    out = {}
    for name, settings in RUNS.items():
        model = tiny_causal_lm("gpt2", seed=0)
        model.register_buffer("probe", torch.zeros(1))   # tiny GPT-2 has no buffer of its own
        args = train_args(StreamTrainingArguments, f"{tmp}/{name}", max_steps=STEPS, **settings)
        if name == "sharded":
            args.dataloader_pin_memory = True   # TrainingArguments turned it off (use_cpu), as no accelerator is here
        trainer = StreamTrainer(model=model, args=args, train_dataset=lm_dataset())
        logs = reported(trainer)
        blocks = ReadBlocks(trainer, rank)
        trainer.add_callback(blocks)
        trainer.train()
        out[name] = {"seen": blocks.seen, "logged": sorted({k for h in logs for k in h if k.startswith("stream/")}),
                     "params": sum(1 for p in model.parameters() if p.requires_grad)}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("settings_reach")
    ranks = run_on_ranks(all_runs, 2, str(tmp), init_process_group=False, timeout=300)
    for res in ranks:
        for name, run in res.items():
            assert [s["step"] for s in run["seen"]] == list(range(1, STEPS + 1)), name
    return ranks


def _each(runs, name):
    """Every step's reading of run ``name``, on every rank."""
    return [seen for res in runs for seen in res[name]["seen"]]


def _sync(runs, name):
    return [seen["grad_sync"] for seen in _each(runs, name)]


def test_prefetch_depth_is_the_depth_of_the_prefetcher_feeding_the_steps(runs):
    want = {"overlap": 3, "defaults": 2, "serial": 2, "sharded": None, "native": None}   # None: 0, no prefetcher
    for name, depth in want.items():
        assert {s["prefetch_depth"] for s in _each(runs, name)} == {depth}, name


def test_grad_sync_chooses_what_reduces_the_gradients(runs):
    assert {(s["mode"], s["world_size"]) for s in _sync(runs, "overlap")} == {("overlap", 2)}
    assert {(s["mode"], s["world_size"]) for s in _sync(runs, "defaults")} == {("overlap", 2)}   # "auto"
    assert {s["mode"] for s in _sync(runs, "serial")} == {"serial"}
    assert {(s["mode"], s["sharded_optimizer"]) for s in _sync(runs, "sharded")} == {("sharded", True)}
    assert all(s["grad_sync"] is None and s["ddp_cap"] is not None for s in _each(runs, "native"))   # DDP
    # What the modes do differently in the run: serial launches every bucket from finish(), overlap from the hooks.
    assert {s["launched_in_backward"] for s in _sync(runs, "serial")} == {0}
    assert all(s["launched_in_backward"] == s["buckets"] > 1 for s in _sync(runs, "overlap"))


def test_grad_bucket_mb_sets_the_plan(runs):
    params = runs[0]["overlap"]["params"]
    assert {(s["bucket_mb"], s["buckets"]) for s in _sync(runs, "overlap")} == {(0.0, params)}   # one per parameter
    assert {(s["bucket_mb"], s["buckets"]) for s in _sync(runs, "serial")} == {(math.inf, 1)}
    assert {run["seen"][0]["grad_sync"]["bucket_mb"] for res in runs for run in [res["defaults"]]} == {"auto"}
    assert all(s["bucket_mb"] == "auto" or s["bucket_mb"] > 0 for s in _sync(runs, "defaults"))   # tuning, then chosen


def test_ddp_bucket_cap_mb_sets_hfstreams_cap_when_grad_bucket_mb_is_left_and_ddps_under_native(runs):
    assert {s["bucket_mb"] for s in _sync(runs, "sharded")} == {1.0}
    assert {s["ddp_cap"] for s in _each(runs, "native")} == {2 * 1024 * 1024}


def _wire(runs, name):
    """The dtypes of the buffers gradients travelled in, over the run (a re-plan releases them until the next step)."""
    return {dtype for s in _sync(runs, name) for dtype in s["wire"]}


def test_grad_comm_dtype_is_the_dtype_gradients_travel_in(runs):
    assert _wire(runs, "overlap") == {"torch.bfloat16"}
    for name in ("serial", "sharded", "defaults"):
        assert _wire(runs, name) == {"torch.float32"}, name


def test_comm_stream_priority_is_what_gradsync_makes_its_streams_with(runs):
    # On gloo there is no side stream to inspect: the priority GradSync and its CommStreams hold.
    assert {s["priority"] for s in _sync(runs, "overlap")} == {("normal", "normal")}
    for name in ("serial", "sharded", "defaults"):
        assert {s["priority"] for s in _sync(runs, name)} == {("high", "high")}, name


def test_ddp_timeout_bounds_gradsyncs_waits_and_the_watchdogs_exit(runs):
    assert {s["timeout_s"] for s in _sync(runs, "overlap")} == {77.0}
    assert {s["timeout_s"] for s in _sync(runs, "sharded")} == {60.0}
    assert {s["timeout_s"] for s in _sync(runs, "defaults")} == {1800.0}   # TrainingArguments' default
    assert {s["watchdog"][1] for s in _each(runs, "overlap")} == {77.0 + 15.0}
    assert {s["watchdog"][1] for s in _each(runs, "sharded")} == {60.0 + 15.0}


def test_step_watchdog_s_is_when_the_watchdog_reports(runs):
    assert {s["watchdog"][0] for s in _each(runs, "overlap")} == {5.0}
    assert {s["watchdog"][0] for s in _each(runs, "sharded")} == {30.0}     # None: half of ddp_timeout
    assert {s["watchdog"][0] for s in _each(runs, "native")} == {900.0}     # native steps are watched too
    assert {s["watchdog"] for s in _each(runs, "serial")} == {None}         # 0: off


def test_stream_report_is_whether_the_reporters_get_the_step_breakdown(runs):
    for res in runs:
        assert res["overlap"]["logged"] == [] and {s["timeline"] for s in res["overlap"]["seen"]} == {False}
        for name in ("sharded", "serial", "defaults"):
            assert "stream/step_ms" in res[name]["logged"] and "stream/comm_busy_ms" in res[name]["logged"], name


def test_ddp_broadcast_buffers_is_whether_rank_0s_buffers_reach_the_others_each_step(runs):
    r0, r1 = runs
    # False: each rank keeps what it wrote before the step.
    for res in runs:
        assert [s["probe"] for s in res["overlap"]["seen"]] == [s["written"] for s in res["overlap"]["seen"]]
    # Unset (DDP's default, True) or True: after each step rank 1 holds rank 0's value, not its own.
    for name in ("sharded", "serial", "defaults", "native"):
        mine = [s["probe"] for s in r1[name]["seen"]]
        assert mine == [s["probe"] for s in r0[name]["seen"]], name
        assert all(v < 100.0 for v in mine), (name, mine)   # a value rank 0 wrote


def test_dataloader_pin_memory_still_reaches_the_train_loader(runs):
    assert {s["pin_memory"] for s in _each(runs, "overlap")} == {False}
    assert {s["pin_memory"] for s in _each(runs, "sharded")} == {True}


def test_use_cpu_is_switched_on_so_two_cpu_processes_train_as_one_job(runs):
    # The "overlap" run asked for use_cpu=False on a machine without an accelerator.
    assert {(s["use_cpu"], s["processes"]) for s in _each(runs, "overlap")} == {(True, 2)}
