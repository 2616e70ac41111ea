"""What a first GPU run would have hit, pinned down on CPU (issue 21): each rank's own device
without ``set_device``, no object collective on the current CUDA device, the used flags copied
without a host wait, a re-entrant stream context, the nan/inf filter off the hot path, and a
look-ahead that covers a step's micro-batches.

The accelerator is faked where needed (monkeypatched ``torch.accelerator`` / ``streams``); the
real device semantics run in ``make gpu-check``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import types

import pytest
import torch

from hfstream import StreamTrainingArguments, streams
from hfstream.gradsync import reduction
from hfstream.prefetch.prefetcher import StreamPrefetcher, depth_for_step


# -- each rank's own device -----------------------------------------------------------------------
@pytest.fixture
def four_gpus(monkeypatch):
    """A machine with four CUDA devices as torch.accelerator reports them; the current one settable."""
    current = {"index": 0}
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda check_available=False: torch.device("cuda"))
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: current["index"])
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    return current


def test_default_device_is_local_ranks_accelerator_when_the_script_never_set_one(four_gpus, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert streams.default_device() == torch.device("cuda", 3)
    assert streams.resolve_device(None) == torch.device("cuda", 3)
    assert streams.resolve_device("cuda") == torch.device("cuda", 3)      # no index: this rank's
    monkeypatch.setenv("LOCAL_RANK", "5")                                  # 8 ranks on 4 visible devices
    assert streams.default_device() == torch.device("cuda", 1)


def test_default_device_keeps_the_device_the_script_or_accelerate_set(four_gpus, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "3")
    four_gpus["index"] = 2                                                 # torch.cuda.set_device(2)
    assert streams.default_device() == torch.device("cuda", 2)
    monkeypatch.delenv("LOCAL_RANK")
    four_gpus["index"] = 0                                                 # one process, no launcher
    assert streams.default_device() == torch.device("cuda", 0)


def gather_objects_suite(rank, world_size):
    from hfstream.gradsync.sharded import state as shard_state

    def no_object_collective(*a, **k):
        raise AssertionError("all_gather_object stages on the current CUDA device")

    torch.distributed.all_gather_object = no_object_collective
    mine = {"rank": rank, "keys": ["exp_avg"] * (1 + 3 * rank), "dtype": torch.bfloat16}   # unequal sizes
    return shard_state._all_gather_objects(mine, None, world_size, torch.device("cpu"))


@pytest.mark.multiprocess
def test_sharded_state_keys_are_exchanged_on_the_buckets_device_not_by_object_collective(run_distributed):
    for got in run_distributed(gather_objects_suite, 2, timeout=90):
        assert [g["rank"] for g in got] == [0, 1]
        assert [len(g["keys"]) for g in got] == [1, 4] and got[1]["dtype"] is torch.bfloat16


# -- the used flags: no blocking copy --------------------------------------------------------------
@pytest.fixture
def copies(monkeypatch):
    """Records what the flags' host tensor and copy ask for (a CPU build cannot pin memory)."""
    seen = {}
    real_tensor, real_copy = torch.tensor, torch.Tensor.copy_

    def tensor(data, *a, pin_memory=False, **k):
        seen["pin_memory"] = pin_memory
        return real_tensor(data, *a, **k)

    def copy_(self, src, non_blocking=False):
        seen["non_blocking"] = non_blocking
        return real_copy(self, src, non_blocking=non_blocking)

    monkeypatch.setattr(torch, "tensor", tensor)
    monkeypatch.setattr(torch.Tensor, "copy_", copy_)
    return seen


def test_used_flags_are_copied_from_pinned_memory_without_blocking_on_an_accelerator(copies, monkeypatch):
    monkeypatch.setattr(streams, "is_accelerator", lambda device: True)
    flags = torch.full((3,), 7.0)
    reduction.write_used_flags(flags, [True, False, True])
    assert copies == {"pin_memory": True, "non_blocking": True}
    assert flags.tolist() == [1.0, 0.0, 1.0]


def test_used_flags_on_cpu_are_a_plain_copy_and_all_used_is_a_fill(copies):
    flags = torch.full((2,), 7.0, dtype=torch.bfloat16)
    reduction.write_used_flags(flags, [False, True])
    assert copies == {"pin_memory": False, "non_blocking": False} and flags.tolist() == [0.0, 1.0]
    copies.clear()
    reduction.write_used_flags(flags, [True, True])
    assert copies == {} and flags.tolist() == [1.0, 1.0]                   # no host tensor at all


# -- streams.use_stream: re-entrant, per thread ----------------------------------------------------
class _StreamWithABrokenContext:
    """A torch.Stream whose own context manager keeps one saved stream (torch <= ~2.11): never used."""

    def __init__(self, name):
        self.name, self.device = name, torch.device("cuda", 0)

    def __enter__(self):
        raise AssertionError("torch.Stream's own context manager is not re-entrant")

    __exit__ = __enter__


def test_use_stream_nests_and_runs_on_two_threads_through_the_device_modules_stream(monkeypatch):
    local = threading.local()

    @contextlib.contextmanager
    def stream(s):                   # what torch.cuda.stream does: a new context, current stream per thread
        previous = getattr(local, "current", "default")
        local.current = s.name
        try:
            yield
        finally:
            local.current = previous

    monkeypatch.setattr(torch, "get_device_module", lambda kind: types.SimpleNamespace(stream=stream))
    side = _StreamWithABrokenContext("side")
    seen, barrier = {}, threading.Barrier(2)

    def stage(name):
        with streams.use_stream(side):
            barrier.wait(timeout=10)                 # both threads inside the same stream's block
            with streams.use_stream(side):           # nested on the same stream
                seen[name, "inner"] = local.current
            seen[name, "outer"] = local.current
        seen[name, "after"] = getattr(local, "current", "default")

    threads = [threading.Thread(target=stage, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert seen == {(n, k): v for n in ("a", "b") for k, v in (("inner", "side"), ("outer", "side"),
                                                               ("after", "default"))}


def test_use_stream_on_a_real_cpu_stream_nests():
    s = torch.Stream(device="cpu")
    with streams.use_stream(s), streams.use_stream(s):
        assert torch.ones(2).sum().item() == 2.0


# -- logging_nan_inf_filter: off the hot path by default ---------------------------------------------
def test_nan_inf_filter_defaults_off_unless_the_run_is_the_stock_one(tmp_path):
    make = lambda **kw: StreamTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], **kw)  # noqa: E731
    assert make().logging_nan_inf_filter is False                                  # prefetching: no host sync
    assert make(prefetch_depth=0, grad_sync="overlap").logging_nan_inf_filter is False
    assert make(prefetch_depth=0, grad_sync="native").logging_nan_inf_filter is True   # exactly the stock Trainer
    assert make(logging_nan_inf_filter=True).logging_nan_inf_filter is True          # asked for: kept
    help_text = StreamTrainingArguments.__dataclass_fields__["logging_nan_inf_filter"].metadata["help"]
    assert "device sync" in help_text and "Only the logged loss differs" in help_text


def test_nan_inf_filter_default_survives_combining_with_another_arguments_class(tmp_path):
    from transformers import HfArgumentParser

    from hfstream import stream_arguments
    from tests.test_trl import TeamArguments

    cls = stream_arguments(TeamArguments)
    assert cls(output_dir=str(tmp_path), report_to=[], use_cpu=True).logging_nan_inf_filter is False
    (parsed,) = HfArgumentParser(cls).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--use_cpu", "--report_to", "none", "--logging_nan_inf_filter", "true"])
    assert parsed.logging_nan_inf_filter is True


# -- the look-ahead under gradient accumulation --------------------------------------------------------
def test_depth_covers_the_micro_batches_a_step_pulls_at_once():
    assert depth_for_step(2, 8) == 8 and depth_for_step(4, 2) == 4 and depth_for_step(0, 8) == 0
    assert StreamPrefetcher([], device="cpu", depth=2, batches_per_step=8).depth == 8
    with pytest.raises(ValueError, match="batches_per_step=0"):
        StreamPrefetcher([], device="cpu", depth=2, batches_per_step=0)


@pytest.fixture
def fake_side_stream(monkeypatch):
    """The accelerator path on CPU tensors: side stream, events and stream waits are no-ops."""
    fake = types.SimpleNamespace(wait_event=lambda e: None, record=lambda s=None: None, query=lambda: True)
    monkeypatch.setattr(streams, "is_accelerator", lambda device: True)
    monkeypatch.setattr(streams, "has_side_streams", lambda device: True)
    monkeypatch.setattr(streams, "new_stream", lambda device, priority="normal": fake)
    monkeypatch.setattr(streams, "current_stream", lambda device: fake)
    monkeypatch.setattr(streams, "use_stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(streams, "new_event", lambda device, enable_timing=False: fake)
    monkeypatch.setattr(streams, "record_stream", lambda t, s: None)
    from hfstream.prefetch import prefetcher as prefetch

    monkeypatch.setattr(prefetch, "_SIDE_STREAMS", {})
    monkeypatch.setattr(prefetch, "_SAID", set())


def test_every_micro_batch_a_step_pulls_was_staged_during_the_step_before(fake_side_stream):
    pulled = []

    def source():
        for i in range(32):
            pulled.append(i)
            yield {"x": torch.tensor([i])}

    accumulation = 8
    it = iter(StreamPrefetcher(source(), device="cpu", depth=2, batches_per_step=accumulation))
    for step in range(3):
        staged_before = len(pulled)                       # what was in flight when the step began
        got = [next(it)["x"].item() for _ in range(accumulation)]
        assert got == list(range(step * accumulation, (step + 1) * accumulation))
        assert max(got) < staged_before, f"step {step}: batch {max(got)} was first pulled by this step"


def test_batches_already_on_the_device_are_said_once_to_leave_nothing_to_copy(fake_side_stream, caplog):
    batches = [{"x": torch.tensor([i])} for i in range(4)]   # "on the device" already: device is cpu
    with caplog.at_level(logging.WARNING, logger="hfstream"):
        assert len(list(StreamPrefetcher(batches, device="cpu", depth=2))) == 4
        assert len(list(StreamPrefetcher(batches, device="cpu", depth=2))) == 4
    said = [r.getMessage() for r in caplog.records if "nothing left to copy" in r.getMessage()]
    assert len(said) == 1, said


# -- one gradient group per trainer ---------------------------------------------------------------------
def _gradient_group_reuse(rank, world_size, tmp):
    import torch.distributed as dist
    from transformers import TrainerCallback

    from hfstream import StreamTrainer
    from hfstream.trainer import trainer as trainer_module
    from tiny import lm_dataset, tiny_causal_lm, train_args

    made, used = [], []

    def counting_group(args):        # stands in for the NCCL high-priority group, which gloo lacks
        made.append(dist.new_group(backend="gloo"))
        return made[-1]

    class GroupInUse(TrainerCallback):   # the group the reductions run on, while they run
        def on_step_end(self, args, state, control, **kwargs):
            in_use.append(trainer.grad_sync.process_group is made[0])

    trainer_module.gradient_group = counting_group
    in_use = []
    trainer = StreamTrainer(model=tiny_causal_lm("gpt2", seed=rank),
                            args=train_args(StreamTrainingArguments, f"{tmp}/out", grad_sync="overlap",
                                            prefetch_depth=0, max_steps=2),
                            train_dataset=lm_dataset(), callbacks=[GroupInUse()])
    for _ in range(2):
        trainer.train()
        used.append(trainer._grad_group is made[0])
    return {"made": len(made), "used": used, "in_use": in_use}


@pytest.mark.multiprocess
def test_one_gradient_group_per_trainer_is_reused_by_every_train_call(tmp_path, run_distributed):
    for out in run_distributed(_gradient_group_reuse, 2, str(tmp_path), init_process_group=False, timeout=300):
        assert out == {"made": 1, "used": [True, True], "in_use": [True] * 4}


# -- make gpu-check part 6 on CPU -------------------------------------------------------------------------
@pytest.mark.multiprocess
def test_gpu_check_one_rank_part_keeps_grad_sync_active_at_world_size_1_on_cpu(tmp_path):
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    out = tmp_path / "part.json"
    env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "dev.gpu_check", "--on-cpu", "--quick", "--parts", "onerank",
                           "--json", str(out)], cwd=repo, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (part,) = json.loads(out.read_text())["parts"]
    assert part["status"] == "pass", part
    passed = {name for name, ok, _ in part["checks"] if ok}
    assert {"overlap: GradSync active on one rank (the test-only switch)",
            "sharded: parameters equal plain SGD's (reduce-scatter, slice step, all-gather)"} <= passed
    assert part["numbers"]["soak_steps"] == part["numbers"]["size"]["soak"]
