"""save_async=True: the stock Trainer's checkpoint, written behind training, never seen half-written.

One process here (the files, the timing of the write, a failing write, resuming with the stock
Trainer); two gloo ranks in every mode are in test_save_async_ranks.py.
"""

from __future__ import annotations

import filecmp
import os
import threading

import pytest
import torch
from transformers import HfArgumentParser, Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

from hfstream import StreamTrainer, StreamTrainingArguments
from tiny import lm_dataset, params, tiny_causal_lm, train_args

SAVE = dict(save_strategy="steps", save_steps=2, prefetch_depth=0, grad_sync="native")


def _trainer(out, cls=StreamTrainer, eval_dataset=None, **kw):
    return cls(model=tiny_causal_lm("gpt2", seed=0), train_dataset=lm_dataset(), eval_dataset=eval_dataset,
               args=train_args(StreamTrainingArguments, out, **{**SAVE, **kw}))


def _same_files(a, b, ignore=("training_args.bin", "stream_report.json")) -> None:
    """The same file names, and every file byte for byte (training_args.bin holds save_async itself)."""
    assert sorted(os.listdir(a)) == sorted(os.listdir(b))
    names = [n for n in os.listdir(a) if n not in ignore]
    match, mismatch, errors = filecmp.cmpfiles(a, b, names, shallow=False)
    assert (mismatch, errors) == ([], []), (a, b)
    args_a, args_b = (torch.load(os.path.join(d, "training_args.bin"), weights_only=False) for d in (a, b))
    assert {k: v for k, v in args_a.to_dict().items() if k not in ("save_async", "output_dir")} == \
        {k: v for k, v in args_b.to_dict().items() if k not in ("save_async", "output_dir")}


# -- arguments ----------------------------------------------------------------------------------------
def test_save_async_is_off_by_default_and_parses_from_the_command_line(tmp_path):
    assert StreamTrainingArguments(output_dir=str(tmp_path), report_to=[]).save_async is False
    (a,) = HfArgumentParser(StreamTrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--save_async", "--report_to", "none"])
    assert a.save_async is True
    assert "background" in StreamTrainingArguments.__dataclass_fields__["save_async"].metadata["help"]


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_a_bad_save_async_names_the_field(tmp_path, bad):
    with pytest.raises(ValueError, match=r"save_async=.*True, False"):
        StreamTrainingArguments(output_dir=str(tmp_path), report_to=[], save_async=bad)


@pytest.mark.parametrize("engine,kw", [("FSDP", dict(fsdp="full_shard")),
                                       ("DeepSpeed", dict(deepspeed={"train_micro_batch_size_per_gpu": "auto"}))])
def test_save_async_with_an_engine_that_saves_itself_is_refused_naming_the_alternative(tmp_path, engine, kw):
    with pytest.raises(ValueError, match=f"save_async=True cannot be combined with {engine}.*save_async=False"):
        StreamTrainingArguments(output_dir=str(tmp_path), report_to=[], save_async=True, grad_sync="native", **kw)


def test_save_async_with_fsdp_through_accelerate_launch_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(ValueError, match="save_async=True cannot be combined with FSDP"):
        StreamTrainingArguments(output_dir=str(tmp_path), report_to=[], save_async=True, grad_sync="native")


def test_save_async_with_push_to_hub_is_refused(tmp_path):
    with pytest.raises(ValueError, match="push_to_hub=True.*save_async=False"):
        StreamTrainingArguments(output_dir=str(tmp_path), report_to=[], save_async=True, push_to_hub=True)


# -- the files ---------------------------------------------------------------------------------------
def test_async_checkpoints_are_the_blocking_saves_files_byte_for_byte_with_rotation(tmp_path):
    runs = {}
    for save_async in (False, True):
        out = tmp_path / f"async{int(save_async)}"
        trainer = _trainer(out, max_steps=6, save_total_limit=2, save_async=save_async)
        trainer.train()
        runs[save_async] = out
    assert sorted(os.listdir(runs[True])) == sorted(os.listdir(runs[False])) == ["checkpoint-4", "checkpoint-6"]
    for name in ("checkpoint-4", "checkpoint-6"):
        _same_files(runs[False] / name, runs[True] / name)
    assert get_last_checkpoint(str(runs[True])) == str(runs[True] / "checkpoint-6")
    assert trainer.save_times["saves"] == 3


def test_the_stock_trainer_resumed_from_an_async_checkpoint_ends_as_its_uninterrupted_run(tmp_path):
    _trainer(tmp_path / "async", max_steps=4, save_async=True).train()

    def stock(out):
        return Trainer(model=tiny_causal_lm("gpt2", seed=0), train_dataset=lm_dataset(),
                       args=train_args(TrainingArguments, out, max_steps=8, save_strategy="no"))

    whole = stock(tmp_path / "whole")
    whole.train()
    resumed = stock(tmp_path / "resumed")
    resumed.train(resume_from_checkpoint=str(tmp_path / "async" / "checkpoint-4"))
    for k, v in params(whole.model).items():
        torch.testing.assert_close(params(resumed.model)[k], v, rtol=0, atol=0, msg=lambda m, k=k: f"{k}: {m}")
    assert resumed.state.global_step == 8


def test_load_best_model_at_end_finds_the_async_best_checkpoint(tmp_path):
    got = {}
    for save_async in (False, True):
        out = tmp_path / f"async{int(save_async)}"
        trainer = _trainer(out, max_steps=6, save_async=save_async, eval_strategy="steps", eval_steps=2,
                           load_best_model_at_end=True, save_total_limit=1, eval_dataset=lm_dataset(n=8, seed=5))
        trainer.train()
        got[save_async] = (os.path.basename(trainer.state.best_model_checkpoint), sorted(os.listdir(out)),
                           params(trainer.model))
    assert got[True][:2] == got[False][:2]
    for k, v in got[False][2].items():
        assert torch.equal(got[True][2][k], v), k


# -- behind training -----------------------------------------------------------------------------------
class HoldWriter:
    """Blocks the writer's first file until the training step after the save has begun."""

    def __init__(self):
        self.step_began = threading.Event()
        self.order: list[str] = []

    def __enter__(self):
        import safetensors.torch
        import transformers.modeling_utils

        self._undo = []
        for module in (transformers.modeling_utils,):
            original = module.safe_save_file

            def held(*args, _original=original, **kwargs):
                if threading.current_thread() is not threading.main_thread():   # the writer, not the snapshot
                    assert self.step_began.wait(20), "the save blocked training: the next step never began"
                    self.order.append("written")
                return _original(*args, **kwargs)

            self._undo.append((module, original))
            module.safe_save_file = held
        return self

    def __exit__(self, *exc):
        for module, original in self._undo:
            module.safe_save_file = original


class StepsBegin(TrainerCallback):
    def __init__(self, hold: HoldWriter, after: int):
        self.hold, self.after = hold, after

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.after:
            self.hold.order.append(f"step {state.global_step + 1} began")
            self.hold.step_began.set()


def test_the_files_are_written_while_the_next_step_trains(tmp_path):
    # With a blocking save the writer's wait would never end: step 3 cannot begin before step 2's save returns.
    with HoldWriter() as hold:
        trainer = _trainer(tmp_path, max_steps=4, save_async=True)
        trainer.add_callback(StepsBegin(hold, after=2))
        trainer.train()
    assert hold.order[:2] == ["step 3 began", "written"]
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-2", "checkpoint-4"]


class SeesCheckpoints(TrainerCallback):
    """What output_dir holds at each step's beginning, and which checkpoints on_save was told of."""

    def __init__(self, out):
        self.out, self.at_step, self.saved = out, {}, []

    def on_step_begin(self, args, state, control, **kwargs):
        self.at_step[state.global_step] = sorted(n for n in os.listdir(self.out) if n.startswith("checkpoint-"))

    def on_save(self, args, state, control, **kwargs):
        self.saved.append((state.global_step, os.path.isdir(os.path.join(self.out, f"checkpoint-{state.global_step}"))))


def test_checkpoint_n_appears_only_once_written_and_on_save_runs_then(tmp_path):
    with HoldWriter() as hold:   # step 2's save is written only once step 4 begins
        trainer = _trainer(tmp_path, max_steps=6, save_async=True)
        seen = SeesCheckpoints(tmp_path)
        trainer.add_callback(StepsBegin(hold, after=3))
        trainer.add_callback(seen)
        trainer.train()
    assert seen.at_step[2] == seen.at_step[3] == []   # still writing: no checkpoint-2, even at step 3's boundary
    assert seen.at_step[4] == ["checkpoint-2"]        # renamed at the first boundary after it was written
    assert seen.saved == [(2, True), (4, True), (6, True)]  # on_save with the save's own step, its folder complete


def test_train_returns_only_after_the_last_write(tmp_path):
    trainer = _trainer(tmp_path, max_steps=2, save_async=True)
    trainer.train()
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-2"]
    assert trainer._save_in_flight is None


# -- nothing lost ---------------------------------------------------------------------------------------
def test_a_failed_write_fails_the_run_at_the_next_step_naming_the_path_and_leaves_no_checkpoint(tmp_path, monkeypatch):
    import transformers.modeling_utils

    def disk_full(tensors, filename, *args, **kwargs):
        if threading.current_thread() is not threading.main_thread():
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", disk_full)
    steps = []

    class Steps(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            steps.append(state.global_step)

    trainer = _trainer(tmp_path, max_steps=6, save_async=True, save_steps=4)
    trainer.add_callback(Steps())
    with pytest.raises(RuntimeError, match=r"save_async: writing '.*checkpoint-4/model\.safetensors' failed "
                                           r"\(OSError.*No space left.*save_async=False"):
        trainer.train()
    assert steps == [1, 2, 3, 4, 5] or steps == [1, 2, 3, 4]   # at the step after the save, not later
    assert get_last_checkpoint(str(tmp_path)) is None
    assert not (tmp_path / "checkpoint-4").exists()


def test_a_save_cut_short_leaves_the_previous_checkpoint_the_last(tmp_path, monkeypatch):
    # The writer dies inside the second save (a crash mid-write): checkpoint-2 stays the last one, whole.
    import transformers.modeling_utils

    real = transformers.modeling_utils.safe_save_file
    calls = []

    def dies_on_second(tensors, filename, *args, **kwargs):
        if threading.current_thread() is not threading.main_thread():
            calls.append(filename)
            if len(calls) == 2:
                with open(filename, "wb") as f:
                    f.write(b"\0" * 10)   # half a file
                raise SystemExit("killed mid-write")
        return real(tensors, filename, *args, **kwargs)

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", dies_on_second)
    trainer = _trainer(tmp_path, max_steps=6, save_async=True)
    with pytest.raises(RuntimeError, match="checkpoint-4"):
        trainer.train()
    assert get_last_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-2")
    from hfstream.trainer.checkpoint import check_checkpoint

    check_checkpoint(tmp_path / "checkpoint-2")   # whole


def test_the_reporters_get_the_exposed_save_time_and_the_state_stays_stock(tmp_path):
    from tiny import reported

    for save_async in (False, True):
        trainer = _trainer(tmp_path / str(save_async), max_steps=4, save_async=save_async)
        logs = reported(trainer)
        trainer.train()
        shown = [log["stream/save_exposed_ms"] for log in logs if "stream/save_exposed_ms" in log]
        assert shown and all(ms > 0 for ms in shown), save_async
        assert trainer.save_times["saves"] == 2 and trainer.save_times["exposed_s"] > 0
        assert not any("stream/save_exposed_ms" in h for h in trainer.state.log_history)


def test_a_model_beyond_the_host_memory_is_refused_before_the_first_step_with_the_bytes(tmp_path, monkeypatch):
    import hfstream.trainer.save_async as checkpoint_async

    monkeypatch.setattr(checkpoint_async, "available_host_bytes", lambda: 1000)
    trainer = _trainer(tmp_path, max_steps=4, save_async=True)
    with pytest.raises(ValueError, match=r"save_async=True: a snapshot of the model's state alone needs \d+ bytes "
                                         r".*1000 available.*save_async=False"):
        trainer.train()
    assert trainer.state.global_step == 0


def test_a_snapshot_beyond_the_host_memory_is_saved_blocking_said_once_and_the_run_finishes(tmp_path, monkeypatch):
    import hfstream.trainer.save_async as checkpoint_async
    from hfstream.trainer.save_async import snapshot_bytes

    model_bytes = snapshot_bytes(tiny_causal_lm("gpt2", seed=0), None)
    # The model fits (train() starts), the model and AdamW's moments do not: every save is blocking.
    monkeypatch.setattr(checkpoint_async, "available_host_bytes", lambda: model_bytes + 10)
    trainer = _trainer(tmp_path / "short", max_steps=4, save_async=True)
    trainer.train()
    blocking = _trainer(tmp_path / "blocking", max_steps=4)
    blocking.train()
    for step in (2, 4):
        _same_files(tmp_path / "short" / f"checkpoint-{step}", tmp_path / "blocking" / f"checkpoint-{step}")
    said = [n for n in trainer.stream_report()["notes"] if "saved in the training loop instead" in n]
    assert len(said) == 1 and "a checkpoint's snapshot needs" in said[0], trainer.stream_report()["notes"]
    assert trainer._save_in_flight is None and trainer.save_times["snapshot_s"] == 0.0


def test_a_crashed_runs_leftover_staging_folder_is_not_mixed_into_the_new_checkpoint(tmp_path):
    stale = tmp_path / ".hfstream-saving" / "checkpoint-2"
    stale.mkdir(parents=True)
    (stale / "rng_state_3.pth").write_bytes(b"from a 4-rank run that died")
    _trainer(tmp_path, max_steps=2, save_async=True).train()
    assert "rng_state_3.pth" not in os.listdir(tmp_path / "checkpoint-2")
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-2"]


_KILLED_MID_SAVE = """
import sys, threading, time
sys.path.insert(0, {tests!r})
import transformers.modeling_utils
from hfstream import StreamTrainer, StreamTrainingArguments
from tiny import lm_dataset, tiny_causal_lm, train_args

real = transformers.modeling_utils.safe_save_file
def slow(tensors, filename, *args, **kwargs):
    if threading.current_thread() is not threading.main_thread() and "checkpoint-4" in filename:
        with open(filename, "wb") as f:
            f.write(b"half")
        print("WRITING", flush=True)
        time.sleep(600)                     # killed here
    return real(tensors, filename, *args, **kwargs)
transformers.modeling_utils.safe_save_file = slow
StreamTrainer(model=tiny_causal_lm("gpt2", seed=0), train_dataset=lm_dataset(),
              args=train_args(StreamTrainingArguments, {out!r}, max_steps=6, save_strategy="steps", save_steps=2,
                              prefetch_depth=0, grad_sync="native", save_async=True)).train()
"""


def test_a_run_killed_mid_save_leaves_the_previous_checkpoint_last_and_the_stock_trainer_resumes_it(tmp_path):
    import signal
    import subprocess
    import sys

    out = tmp_path / "run"
    script = _KILLED_MID_SAVE.format(tests=os.path.dirname(__file__), out=str(out))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        for line in proc.stdout:
            if line.startswith("WRITING"):
                break
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(60)
    assert get_last_checkpoint(str(out)) == str(out / "checkpoint-2")
    from hfstream.trainer.checkpoint import check_checkpoint

    check_checkpoint(out / "checkpoint-2")
    resumed = Trainer(model=tiny_causal_lm("gpt2", seed=0), train_dataset=lm_dataset(),
                      args=train_args(TrainingArguments, tmp_path / "resumed", max_steps=4, save_strategy="no"))
    resumed.train(resume_from_checkpoint=get_last_checkpoint(str(out)))
    assert resumed.state.global_step == 4


def test_save_only_model_writes_the_stock_files_only(tmp_path):
    for save_async in (False, True):
        _trainer(tmp_path / str(save_async), max_steps=2, save_async=save_async, save_only_model=True).train()
    _same_files(tmp_path / "False" / "checkpoint-2", tmp_path / "True" / "checkpoint-2")
    assert "optimizer.pt" not in os.listdir(tmp_path / "True" / "checkpoint-2")


def test_a_failed_rename_fails_the_run_naming_both_folders(tmp_path, monkeypatch):
    import hfstream.trainer.save_async as checkpoint_async

    def refused(src, dst):
        raise PermissionError(13, "Permission denied", dst)

    monkeypatch.setattr(checkpoint_async.os, "replace", refused)
    with pytest.raises(RuntimeError, match=r"renaming '.*\.hfstream-saving/checkpoint-2' to '.*checkpoint-2' failed "
                                           r"\(PermissionError.*save_async=False"):
        _trainer(tmp_path, max_steps=4, save_async=True).train()
    assert get_last_checkpoint(str(tmp_path)) is None


def test_waiting_for_a_frozen_writer_is_a_phase_the_watchdog_names(tmp_path, monkeypatch):
    # The watchdog runs on several processes only; its phases are recorded where the trainer tells it
    # (as in test_watchdog.py). A writer that never ends would be reported, then the process ended.
    import time as _time

    import transformers.modeling_utils

    real = transformers.modeling_utils.safe_save_file

    def slow(*args, **kwargs):
        if threading.current_thread() is not threading.main_thread():
            _time.sleep(1.0)
        return real(*args, **kwargs)

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", slow)
    trainer = _trainer(tmp_path, max_steps=3, save_async=True, save_steps=1)
    phases = []
    trainer._watch = phases.append
    trainer._watchdog = type("Watchdog", (), {"close": lambda self: None})()
    trainer.train()
    waits = [p for p in phases if p.startswith("waiting for the save of")]
    assert waits and "checkpoint-1 to finish writing (save_async)" in waits[0], phases


def test_the_step_report_holds_the_exposed_save_time_per_save_and_in_all(tmp_path):
    trainer = _trainer(tmp_path, max_steps=4, save_async=True)
    trainer.train()
    save = trainer.stream_report()["save"]
    assert save["save_async"] is True and save["saves"] == 2 and save["exposed_s"] > 0
    assert save["exposed_s_per_save"] == pytest.approx(save["exposed_s"] / 2, abs=1e-3)
    import json

    assert json.loads(trainer.stream_report().to_json())["save"]["saves"] == 2
    text = str(trainer.stream_report())
    assert "saves: 2," in text and f"({save['exposed_s_per_save']:.3f} s a save" in text and "async: snapshot" in text


def test_the_wait_for_the_last_write_at_the_end_of_train_is_reported_apart(tmp_path, monkeypatch):
    import transformers.modeling_utils

    original = transformers.modeling_utils.safe_save_file

    def slow(*args, **kwargs):   # the writer of step 4's save, which nothing trains behind
        if threading.current_thread() is not threading.main_thread() and "checkpoint-4" in str(args[1]):
            threading.Event().wait(0.5)
        return original(*args, **kwargs)

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", slow)
    trainer = _trainer(tmp_path, max_steps=4, save_async=True)
    trainer.train()
    save = trainer.stream_report()["save"]
    assert 0.5 <= save["drain_s"] <= save["wait_s"] <= save["exposed_s"]
    assert "the end of train()" in str(trainer.stream_report())
    blocking = _trainer(tmp_path / "blocking", max_steps=4)
    blocking.train()
    assert "blocking (save_async=True" in str(blocking.stream_report())


# -- the snapshot's host buffers ----------------------------------------------------------------------
def test_snapshot_buffers_hand_a_written_saves_buffers_to_the_next_snapshot_and_free_the_rest():
    from hfstream.trainer.save_async import SnapshotBuffers

    buffers = SnapshotBuffers()
    first = [buffers.take(16), buffers.take(8)]
    assert buffers.drop_rest() == first and buffers.held_bytes == 0   # in flight: not free
    buffers.give_back(first)
    assert buffers.held_bytes == 24
    again = buffers.take(16)
    assert again.data_ptr() == first[0].data_ptr()                    # the same size: the same buffer
    assert buffers.take(4).data_ptr() not in {b.data_ptr() for b in first}
    buffers.drop_rest()
    assert buffers.held_bytes == 0                                    # the 8-byte one nobody took is freed


def test_every_save_copies_into_buffers_allocated_before_the_first_save(tmp_path, monkeypatch):
    from hfstream.trainer import save_async

    taken = []
    init = save_async.AsyncSave.__init__

    def recording(self, *args, **kwargs):
        init(self, *args, **kwargs)
        taken.append(sorted(b.data_ptr() for b in self.buffers))

    monkeypatch.setattr(save_async.AsyncSave, "__init__", recording)
    trainer = _trainer(tmp_path / "async", max_steps=6, save_async=True)
    trainer.train()
    blocking = _trainer(tmp_path / "blocking", max_steps=6)
    blocking.train()
    assert len(taken) == 3 and taken[0]
    assert taken[1] == taken[0] and taken[2] == taken[0]   # no new host memory after the first save
    for step in (2, 4, 6):                                  # and every checkpoint still stock's, byte for byte
        _same_files(tmp_path / "async" / f"checkpoint-{step}", tmp_path / "blocking" / f"checkpoint-{step}")
    report = trainer.stream_report()["save"]   # what the user reads: gathered before the buffers were freed
    assert report == trainer._save_report() | {"run_s": report["run_s"]}
    # One snapshot held between saves: the model's and optimizer's tensors, and the RNG states (a few KiB).
    assert report["bytes"] <= report["held_bytes"] <= report["bytes"] + 2**16
    # The first save's too were allocated (and every page written) behind step 2, not by the save:
    # it allocated the RNG states' few KiB only.
    assert report["new_bytes"] <= 2**16 < report["bytes"]
    assert trainer._snapshot_buffers is None   # train() is over: the host memory is freed


# -- the writer process -------------------------------------------------------------------------------
def _same_as_blocking(tmp_path, steps) -> None:
    """The checkpoints under tmp_path/async are those of a blocking run, written under tmp_path/blocking."""
    _trainer(tmp_path / "blocking", max_steps=max(steps)).train()
    for step in steps:
        _same_files(tmp_path / "async" / f"checkpoint-{step}", tmp_path / "blocking" / f"checkpoint-{step}")


def _pids(tmp_path) -> set[int]:
    with open(tmp_path / "writer-pids") as f:
        return {int(line) for line in f}


def test_the_files_are_written_by_a_process_of_their_own_byte_for_byte(tmp_path, monkeypatch):
    import transformers.modeling_utils
    import writer_faults

    from hfstream.trainer import save_writer

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", writer_faults.records_pid)
    trainer = _trainer(tmp_path / "async", max_steps=4, save_async=True)
    trainer.train()
    # Not this process (a thread of it would write this pid): the writer process, one for every save.
    assert _pids(tmp_path) == {save_writer.writer().proc.pid} and os.getpid() not in _pids(tmp_path)
    assert not any("from a thread" in n for n in trainer._notes), trainer._notes
    monkeypatch.undo()
    _same_as_blocking(tmp_path, steps=(2, 4))
    assert not [n for n in os.listdir(save_writer.SHM_DIR) if n.startswith(f"hfstream-snapshot-{os.getpid()}-")]


def test_a_write_failing_in_the_writer_process_fails_the_run_naming_the_path(tmp_path, monkeypatch):
    import transformers.modeling_utils
    import writer_faults

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", writer_faults.disk_full_at_checkpoint_4)
    trainer = _trainer(tmp_path, max_steps=6, save_async=True)
    with pytest.raises(RuntimeError, match=r"save_async: writing '.*checkpoint-4/model\.safetensors' failed "
                                           r"\(OSError.*No space left.*save_async=False"):
        trainer.train()
    assert get_last_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-2")
    assert not any("from a thread" in n for n in trainer._notes), trainer._notes


def test_a_writer_process_killed_mid_write_leaves_the_save_to_a_thread_and_the_next_run_gets_a_new_one(
        tmp_path, monkeypatch):
    import transformers.modeling_utils
    import writer_faults

    from hfstream.trainer import save_writer

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", writer_faults.writer_dies_at_checkpoint_4)
    trainer = _trainer(tmp_path / "async", max_steps=6, save_async=True)
    first = save_writer.writer()
    trainer.train()   # the snapshot was still in memory: a thread wrote it, and the saves after it
    assert not first.alive and first.proc.returncode == 9
    said = [n for n in trainer._notes if "from a thread of the training process" in n]
    assert len(said) == 1 and f"(pid {first.proc.pid}) ended, exit code 9" in said[0], trainer._notes
    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", writer_faults.records_pid)
    _trainer(tmp_path / "again", max_steps=2, save_async=True).train()
    assert _pids(tmp_path) == {save_writer.writer().proc.pid} != {first.proc.pid}
    monkeypatch.undo()
    _same_as_blocking(tmp_path, steps=(2, 4, 6))


def test_a_write_function_the_writer_cannot_import_is_written_by_a_thread_said_once(tmp_path, monkeypatch):
    import transformers.modeling_utils

    real = transformers.modeling_utils.safe_save_file
    threads = []

    def wrapped(*args, **kwargs):   # a closure: pickle cannot name it for the writer process
        threads.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", wrapped)
    trainer = _trainer(tmp_path / "async", max_steps=4, save_async=True)
    trainer.train()
    assert threads and all(t.startswith("hfstream-save-checkpoint-") for t in threads)
    said = [n for n in trainer._notes if "from a thread of the training process" in n]
    assert len(said) == 1 and "wrapped" in said[0], trainer._notes
    monkeypatch.undo()
    _same_as_blocking(tmp_path, steps=(2, 4))


def _no_room_in_dev_shm(monkeypatch, save_writer):
    monkeypatch.setattr(save_writer, "shm_free_bytes", lambda: 1000)


def _writer_ends_at_start(monkeypatch, save_writer):   # as an import error in it would end it
    monkeypatch.setattr(save_writer, "START", "import sys; sys.exit(3)")
    monkeypatch.setattr(save_writer, "_WRITER", None)


@pytest.mark.parametrize("cannot_serve, why", [(_no_room_in_dev_shm, "/dev/shm has 1000 bytes free"),
                                               (_writer_ends_at_start, "ended, exit code 3")])
def test_where_the_writer_process_cannot_serve_a_thread_writes_said_once_with_why(tmp_path, monkeypatch,
                                                                                  cannot_serve, why):
    from hfstream.trainer import save_writer

    cannot_serve(monkeypatch, save_writer)
    trainer = _trainer(tmp_path / "async", max_steps=4, save_async=True)
    trainer.train()
    said = [n for n in trainer._notes if "from a thread of the training process" in n]
    assert len(said) == 1 and why in said[0], trainer._notes
    monkeypatch.undo()
    _same_as_blocking(tmp_path, steps=(2, 4))


def test_ctrl_c_is_the_training_processs_the_writer_process_goes_on(tmp_path):
    # A terminal's Ctrl-C reaches every process of its group: the writer must not die of it mid-write.
    import signal
    import time

    from hfstream.trainer import save_writer

    writer = save_writer.writer()
    time.sleep(0.5)   # past its start, where the handler is set first
    os.kill(writer.proc.pid, signal.SIGINT)
    time.sleep(0.5)
    assert writer.alive


# -- the snapshot's copies on CPU, beside the next step -----------------------------------------------
@pytest.fixture
def slow_copies(monkeypatch):
    """The snapshot's copy thread starts 0.3 s late: what the next step changes before it waits would be
    written. Yields the list of (save returned, copies landed) times."""
    import time

    from hfstream.trainer import save_async

    start, seen = save_async.HostCopies.start, []

    def late_start(self):
        jobs, self.jobs = self.jobs, []

        def copy_all():
            time.sleep(0.3)
            for host, source in jobs:
                host.copy_(source)
            seen[-1].append(time.perf_counter())

        seen.append([time.perf_counter()])
        self._thread = threading.Thread(target=copy_all, daemon=True)
        self._thread.start()
        return self

    monkeypatch.setattr(save_async.HostCopies, "start", late_start)
    yield seen
    monkeypatch.setattr(save_async.HostCopies, "start", start)


def test_on_cpu_the_snapshot_is_copied_beside_the_next_step_and_waited_for_before_its_optimizer_step(
        tmp_path, slow_copies):
    trainer = _trainer(tmp_path / "async", max_steps=4, save_async=True)
    trainer.train()
    assert len(slow_copies) == 2 and all(landed - returned >= 0.3 for returned, landed in slow_copies)
    save = trainer.stream_report()["save"]
    assert save["copy_wait_s"] >= 0.2 and save["exposed_s"] >= save["copy_wait_s"]   # the wait is the save's
    _same_as_blocking(tmp_path, steps=(2, 4))   # without the wait, step 3's update would be in checkpoint-2


class PerturbsWeights(StreamTrainer):
    """A training_step that moves the weights and back inside the step (as FGM and SAM do)."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        loss = super().training_step(model, inputs, num_items_in_batch)
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(1.0)
        return loss


def test_a_training_step_that_moves_the_weights_waits_for_the_copies_before_it_begins(tmp_path, slow_copies):
    _trainer(tmp_path / "async", cls=PerturbsWeights, max_steps=4, save_async=True).train()
    _trainer(tmp_path / "blocking", cls=PerturbsWeights, max_steps=4).train()
    for step in (2, 4):
        _same_files(tmp_path / "async" / f"checkpoint-{step}", tmp_path / "blocking" / f"checkpoint-{step}")


class ScriptArgs(StreamTrainingArguments):
    """A TrainingArguments subclass as a user's script defines it: in __main__, which the writer does not import."""


def test_an_arguments_class_from_the_script_leaves_only_training_args_bin_to_a_thread(tmp_path, monkeypatch):
    import sys

    import transformers.modeling_utils
    import writer_faults

    from hfstream.trainer import save_writer

    monkeypatch.setattr(ScriptArgs, "__module__", "__main__")
    monkeypatch.setattr(sys.modules["__main__"], "ScriptArgs", ScriptArgs, raising=False)
    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", writer_faults.records_pid)
    trainer = StreamTrainer(model=tiny_causal_lm("gpt2", seed=0), train_dataset=lm_dataset(),
                            args=train_args(ScriptArgs, tmp_path / "async", max_steps=4, **SAVE, save_async=True))
    trainer.train()
    assert _pids(tmp_path) == {save_writer.writer().proc.pid}   # the weights: the writer process, every save
    said = [n for n in trainer._notes if "from a thread of the training process" in n]
    assert len(said) == 1 and "(training_args.bin: NotShared: ScriptArgs is defined in the script" in said[0], said
    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", writer_faults.save_file)
    StreamTrainer(model=tiny_causal_lm("gpt2", seed=0), train_dataset=lm_dataset(),
                  args=train_args(ScriptArgs, tmp_path / "blocking", max_steps=4, **SAVE)).train()
    for step in (2, 4):   # training_args.bin too: the same class, written by the thread
        a, b = tmp_path / "async" / f"checkpoint-{step}", tmp_path / "blocking" / f"checkpoint-{step}"
        _same_files(a, b)
        assert type(torch.load(a / "training_args.bin", weights_only=False)) is ScriptArgs
