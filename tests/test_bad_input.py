"""Bad input: each is a clear error or a documented behaviour, never a hang.

Launcher-level cases run tests/scripts/train_tiny.py on 2 processes under torchrun.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from hfstream.trainer.checkpoint import CheckpointError, check_checkpoint
from hfstream.testing import free_port, launch_nodes, stop_nodes, wait_nodes

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "tests" / "scripts" / "train_tiny.py")
COMMON = ["--per_device_train_batch_size", "4", "--report_to", "none", "--disable_tqdm", "true", "--logging_steps",
          "1000", "--seed", "0", "--learning_rate", "1e-3", "--dataloader_num_workers", "0", "--use_cpu", "true",
          "--grad_sync", "overlap", "--prefetch_depth", "2", "--ddp_timeout", "20"]


def two_procs(out: Path, *args: str, timeout: float = 180):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), SCRIPT, *COMMON, "--output_dir", str(out), *args]
    nodes = launch_nodes([cmd], str(out / "logs"), cwd=str(ROOT))
    try:
        wait_nodes(nodes, timeout=timeout)
    finally:
        stop_nodes(nodes)
    return nodes[0]


# --------------------------------------------------------------------------- checkpoints
def _checkpoint(tmp_path) -> Path:
    from safetensors.torch import save_file

    ckpt = tmp_path / "checkpoint-10"
    ckpt.mkdir()
    save_file({"w": torch.randn(64, 64)}, str(ckpt / "model.safetensors"))
    torch.save({"state": {0: torch.randn(64, 64)}}, ckpt / "optimizer.pt")
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": 10}))
    return ckpt


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def test_an_intact_checkpoint_passes(tmp_path):
    ckpt = _checkpoint(tmp_path)
    assert check_checkpoint(ckpt) is None
    _truncate(ckpt / "model.safetensors")   # the same folder, damaged: the check did look at it
    with pytest.raises(CheckpointError):
        check_checkpoint(ckpt)


def test_hfstreams_own_report_never_stops_a_resume(tmp_path):
    # Resuming reads nothing of stream_report.json: half of one (the main process still writing it, when
    # a script resumes in the same process: seeds 307 and 341) must not refuse the checkpoint.
    from hfstream.trainer.report_file import REPORT_FILE

    ckpt = _checkpoint(tmp_path)
    (ckpt / REPORT_FILE).write_text('{"mean": ')
    assert check_checkpoint(ckpt) is None
    (ckpt / "trainer_state.json").write_text('{"global_step": ')   # the Trainer's own files still count
    with pytest.raises(CheckpointError, match="trainer_state.json"):
        check_checkpoint(ckpt)


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.pt", "trainer_state.json"])
def test_a_truncated_file_is_named_with_the_way_out(tmp_path, name):
    ckpt = _checkpoint(tmp_path)
    _truncate(ckpt / name)
    with pytest.raises(CheckpointError, match=rf"damaged: {name}.*Resume from an earlier checkpoint"):
        check_checkpoint(ckpt)


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.pt"])
def test_a_file_cut_by_one_byte_or_left_empty_is_refused_saying_which(tmp_path, name):
    ckpt = _checkpoint(tmp_path)
    path = ckpt / name
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(CheckpointError, match=rf"damaged: {name}"):
        check_checkpoint(ckpt)
    path.write_bytes(b"")   # a job killed right after it created the file
    with pytest.raises(CheckpointError, match=rf"damaged: {name}: " + ("the file is empty" if name.endswith(".pt") else "")):
        check_checkpoint(ckpt)


def test_a_missing_checkpoint_directory_names_the_argument(tmp_path):
    with pytest.raises(CheckpointError, match="resume_from_checkpoint="):
        check_checkpoint(tmp_path / "nope")


@pytest.mark.parametrize("resume", ["path", True])
def test_train_checks_the_checkpoint_it_resumes_from_before_loading_it(tmp_path, resume):
    from hfstream import StreamTrainer, StreamTrainingArguments
    from tiny import lm_dataset, tiny_causal_lm, train_args

    args = train_args(StreamTrainingArguments, tmp_path, max_steps=2, save_strategy="steps", save_steps=2)
    StreamTrainer(model=tiny_causal_lm(), args=args, train_dataset=lm_dataset(16)).train()
    _truncate(tmp_path / "checkpoint-2" / "model.safetensors")
    args = train_args(StreamTrainingArguments, tmp_path, max_steps=4, save_strategy="no")
    trainer = StreamTrainer(model=tiny_causal_lm(), args=args, train_dataset=lm_dataset(16))
    with pytest.raises(CheckpointError, match="damaged: model.safetensors"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2") if resume == "path" else True)


@pytest.mark.slow   # one rank's truncated checkpoint is refused in make test (check_checkpoint's tests)
@pytest.mark.multiprocess
def test_resuming_two_ranks_from_a_truncated_checkpoint_fails_fast_on_both(tmp_path):
    out = tmp_path / "run"
    first = two_procs(out, "--max_steps", "10", "--save_strategy", "steps", "--save_steps", "10")
    assert first.returncode == 0, first.output[-3000:]
    _truncate(out / "checkpoint-10" / "model.safetensors")
    node = two_procs(out, "--max_steps", "14", "--resume", "last", timeout=120)
    assert node.returncode != 0
    assert node.output.count("CheckpointError: checkpoint") == 2, node.output[-3000:]   # both ranks say why


# --------------------------------------------------------------------------- data
@pytest.mark.multiprocess
def test_fewer_samples_than_ranks_trains_on_padded_batches(tmp_path):
    """One sample, two ranks: rank 1's shard is empty. Accelerate's even_batches repeats samples so
    that both ranks step together (documented behaviour), and nothing hangs."""
    out = tmp_path / "run"
    node = two_procs(out, "--max_steps", "3", "--samples", "1", "--save_strategy", "no")
    assert node.returncode == 0, node.output[-3000:]
    assert (out / "done_rank1").read_text() == "3"


@pytest.mark.multiprocess
def test_batches_of_different_lengths_on_each_rank_stay_in_sync(tmp_path):
    """Per-batch padding gives each rank its own sequence length; gradients have the parameters'
    shapes, so the reductions match and the ranks end with the same weights."""
    out = tmp_path / "run"
    node = two_procs(out, "--max_steps", "8", "--variable_length", "true", "--save_strategy", "no")
    assert node.returncode == 0, node.output[-3000:]
    a, b = torch.load(out / "params_rank0.pt"), torch.load(out / "params_rank1.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.multiprocess
def test_a_nan_loss_on_one_rank_reaches_every_rank_and_nothing_hangs(tmp_path):
    """Documented: the mean of a NaN gradient is NaN on every rank, so every rank's weights go NaN
    together (no rank silently diverges from the others); no hang. Guard with a finite-loss check
    of your own, or max_grad_norm to see the non-finite norm in the logs."""
    out = tmp_path / "run"
    node = two_procs(out, "--max_steps", "6", "--fault", "nan", "--fault_step", "3", "--fault_rank", "1",
                     "--save_strategy", "no")
    assert node.returncode == 0, node.output[-3000:]
    a, b = torch.load(out / "params_rank0.pt"), torch.load(out / "params_rank1.pt")
    assert any(torch.isnan(v).any() for v in a.values())
    for k in a:
        assert torch.equal(torch.isnan(a[k]), torch.isnan(b[k])) and torch.equal(a[k].nan_to_num(), b[k].nan_to_num())


def test_a_model_with_no_trainable_parameters_is_refused_before_training(tmp_path):
    from hfstream import StreamTrainer, StreamTrainingArguments

    model = torch.nn.Linear(4, 4)
    model.requires_grad_(False)
    args = StreamTrainingArguments(output_dir=str(tmp_path), max_steps=1, report_to=[], use_cpu=True)
    trainer = StreamTrainer(model=model, args=args, train_dataset=[{"x": torch.zeros(4)}])
    with pytest.raises(ValueError, match="no trainable parameters.*requires_grad_"):
        trainer.train()


@pytest.mark.parametrize("resume", ["missing", True])
def test_a_checkpoint_that_is_not_there_gets_the_stock_trainers_own_error(tmp_path, resume):
    # Drop-in: what a script catches under the stock Trainer it catches here (a missing path is
    # left to the Trainer; only a present, damaged checkpoint is hfstream's to refuse).
    from hfstream import StreamTrainer, StreamTrainingArguments
    from tiny import lm_dataset, tiny_causal_lm, train_args

    args = train_args(StreamTrainingArguments, tmp_path, max_steps=2, save_strategy="no")
    trainer = StreamTrainer(model=tiny_causal_lm(), args=args, train_dataset=lm_dataset(16))
    want = "Can't find a valid checkpoint at" if resume == "missing" else "No valid checkpoint found in output directory"
    with pytest.raises(ValueError, match=want) as refused:
        trainer.train(resume_from_checkpoint=str(tmp_path / "nope") if resume == "missing" else True)
    assert type(refused.value) is ValueError   # not hfstream's CheckpointError
