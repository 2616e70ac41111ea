"""Multi-node on one machine, and faults: two "nodes" started as two launcher invocations.

Each node is a real `torchrun` or `accelerate launch` process with ``--nnodes 2`` and a
rendezvous on 127.0.0.1, running tests/scripts/train_tiny.py (a tiny GPT-2 through
StreamTrainer or the stock Trainer).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from hfstream.testing import free_port, launch_nodes, processes_mentioning, stop_nodes, wait_nodes

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "tests" / "scripts" / "train_tiny.py")
pytestmark = pytest.mark.multiprocess

COMMON = ["--max_steps", "12", "--per_device_train_batch_size", "4", "--report_to", "none", "--save_strategy", "no",
          "--disable_tqdm", "true", "--logging_steps", "1000", "--seed", "0", "--learning_rate", "1e-3",
          "--lr_scheduler_type", "constant", "--dataloader_num_workers", "0", "--use_cpu", "true"]


def torchrun_nodes(port: int, script_args: list[str], nnodes: int = 2) -> list[list[str]]:
    return [[sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--node-rank", str(i),
             "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port), SCRIPT, *script_args]
            for i in range(nnodes)]


def accelerate_nodes(port: int, script_args: list[str]) -> list[list[str]]:
    config = str(ROOT / "recipes" / "accelerate" / "cpu_2node.yaml")
    return [[sys.executable, "-m", "accelerate.commands.launch", "--config_file", config, "--machine_rank", str(i),
             "--main_process_port", str(port), "--num_cpu_threads_per_process", "1", SCRIPT, *script_args]
            for i in range(2)]


def one_node_two_procs(port: int, script_args: list[str]) -> list[list[str]]:
    return [[sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
             "--master-addr", "127.0.0.1", "--master-port", str(port), SCRIPT, *script_args]]


def run(commands, out: Path, timeout: float = 240.0):
    nodes = launch_nodes(commands, str(out / "logs"), cwd=str(ROOT))
    try:
        wait_nodes(nodes, timeout=timeout)
    finally:
        stop_nodes(nodes)
    for node in nodes:
        assert node.returncode == 0, f"node {node.index} exited {node.returncode}:\n{node.output[-3000:]}"
    return nodes


@pytest.mark.slow
def test_two_accelerate_nodes_train_like_one_node_with_the_same_global_batch(tmp_path):
    """overlap + prefetch over two `accelerate launch` nodes == one torchrun node with 2 processes."""
    args = COMMON + ["--grad_sync", "overlap", "--prefetch_depth", "2"]
    run(accelerate_nodes(free_port(), args + ["--output_dir", str(tmp_path / "two")]), tmp_path / "two")
    run(one_node_two_procs(free_port(), args + ["--output_dir", str(tmp_path / "one")]), tmp_path / "one")
    two = torch.load(tmp_path / "two" / "params_rank0.pt")
    two_r1 = torch.load(tmp_path / "two" / "params_rank1.pt")
    one = torch.load(tmp_path / "one" / "params_rank0.pt")
    for name in one:
        assert torch.equal(two[name], two_r1[name]), f"ranks disagree on {name}"
        assert torch.equal(two[name], one[name]), f"{name}: two nodes differ from one node"
    assert (tmp_path / "two" / "done_rank1").read_text() == "12"


# --------------------------------------------------------------------------- faults
DDP_TIMEOUT = 10


def _fault_run(tmp_path, fault: str, extra: list[str] = ()):
    out = tmp_path / fault
    args = COMMON + ["--max_steps", "400", "--ddp_timeout", str(DDP_TIMEOUT), "--fault", fault, "--fault_step", "4",
                     "--fault_rank", "1", "--output_dir", str(out), *extra]
    nodes = launch_nodes(torchrun_nodes(free_port(), args), str(out / "logs"), cwd=str(ROOT))
    return out, nodes


def _assert_survivor_failed_cleanly(nodes, out, budget_s: float, *expected: str):
    try:
        wait_nodes(nodes, which=[0], timeout=budget_s + 60)
    finally:
        stop_nodes(nodes)       # the faulty node (stopped or dead) and anything left
    survivor = nodes[0]
    log = survivor.output
    assert survivor.returncode not in (0, None), log[-3000:]
    # Startup (imports, rendezvous, 4 steps) comes on top of the budget; on 2 loaded cores it
    # stays well under 40 s.
    assert survivor.seconds < budget_s + 40, f"took {survivor.seconds:.0f} s:\n{log[-2000:]}"
    for text in expected:
        assert text in log, f"{text!r} not in the survivor's log:\n{log[-3000:]}"
    assert not processes_mentioning(str(out)), "processes of the run are still alive"


def test_a_killed_peer_ends_the_run_on_the_other_node(tmp_path):
    out, nodes = _fault_run(tmp_path, "kill", ["--grad_sync", "overlap"])
    _assert_survivor_failed_cleanly(nodes, out, DDP_TIMEOUT, "GradSync.finish() on rank 0")


@pytest.mark.slow   # 25 s; the killed peer above keeps the fault path in the default run
def test_a_frozen_peer_ends_the_run_within_ddp_timeout_and_says_what_was_pending(tmp_path):
    """The stock Trainer, same setup (ddp_timeout=20, peer frozen at step 4), still waited 150 s later."""
    out, nodes = _fault_run(tmp_path, "stop", ["--grad_sync", "overlap"])
    _assert_survivor_failed_cleanly(nodes, out, DDP_TIMEOUT, "GradSync.finish() on rank 0",
                                    "reduction not complete", "watchdog: rank 0 has been inside step 5")


# Where a peer may freeze, beyond "inside a step": the survivor must end within ddp_timeout plus a
# margin wherever it then waits, and say where that was.
FAULT_POINTS = {
    "between": ([], "watchdog: rank 0 has been"),
    "eval": (["--eval_strategy", "steps", "--eval_steps", "4", "--per_device_eval_batch_size", "4"],
             "watchdog: rank 0 has been"),
    "save": (["--save_strategy", "steps", "--save_steps", "4"], "watchdog: rank 0 has been"),
}


@pytest.mark.parametrize("where", [
    pytest.param("between", marks=pytest.mark.slow),   # a frozen peer in make test: the ddp_timeout test
    pytest.param("eval", marks=pytest.mark.slow),
    pytest.param("save", marks=pytest.mark.slow),
])
def test_a_peer_frozen_anywhere_in_train_ends_the_survivor_with_where_it_waited(tmp_path, where):
    extra, expected = FAULT_POINTS[where]
    out, nodes = _fault_run(tmp_path, "stop", ["--grad_sync", "overlap", "--fault_at", where, *extra])
    # The watchdog ends a rank that made no progress for ddp_timeout + 15 s, whichever phase it is in.
    _assert_survivor_failed_cleanly(nodes, out, DDP_TIMEOUT + 15, expected)


@pytest.mark.slow
def test_a_frozen_peer_under_native_ddp_is_ended_by_the_watchdog(tmp_path):
    out, nodes = _fault_run(tmp_path, "stop", ["--grad_sync", "native"])
    _assert_survivor_failed_cleanly(nodes, out, DDP_TIMEOUT + 15, "hfstream watchdog", "Exiting with code 124")


# --------------------------------------------------------------------------- resume
def _final(out: Path) -> dict[str, torch.Tensor]:
    return torch.load(out / "params_rank0.pt")


# The overlap variant is slow-marked to keep `make test` within 20 minutes on 2 cores: its resume
# path is the stock Trainer's (tests/test_trainer_overlap.py resumes overlap in the default run);
# the sharded variant, whose optimizer checkpoint is hfstream's own, stays in the default run.
@pytest.mark.parametrize("grad_sync", [pytest.param("overlap", marks=pytest.mark.slow), "sharded"])
def test_resume_after_every_rank_is_killed_matches_an_uninterrupted_run_bitwise(tmp_path, grad_sync):
    """40 steps, a checkpoint every 10, every rank SIGKILLed at step 25, resumed from step 20.

    Sharded: the checkpoint holds the whole optimizer, cut again into each rank's slices."""
    args = COMMON + ["--max_steps", "40", "--save_strategy", "steps", "--save_steps", "10", "--grad_sync", grad_sync,
                     "--prefetch_depth", "2", "--per_device_train_batch_size", "2"]
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    run(one_node_two_procs(free_port(), args + ["--output_dir", str(whole)]), whole)
    nodes = launch_nodes(one_node_two_procs(free_port(), args + ["--output_dir", str(cut), "--fault", "kill",
                                                                "--fault_step", "25", "--fault_rank", "-1"]),
                         str(cut / "logs"), cwd=str(ROOT))
    try:
        wait_nodes(nodes, timeout=240)
    finally:
        stop_nodes(nodes)
    assert nodes[0].returncode != 0 and not (cut / "done_rank0").exists()
    assert sorted(p.name for p in cut.glob("checkpoint-*")) == ["checkpoint-10", "checkpoint-20"]
    run(one_node_two_procs(free_port(), args + ["--output_dir", str(cut), "--resume", "last"]), cut)
    assert (cut / "done_rank0").read_text() == "40"
    a, b = _final(whole), _final(cut)
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs after resume"


@pytest.mark.slow
@pytest.mark.parametrize("grad_sync", ["overlap", "sharded"])
def test_resume_with_a_different_process_count_continues_from_the_checkpoint(tmp_path, grad_sync):
    """2 processes write checkpoint-10; 1 process resumes it and finishes (global batch halves: documented)."""
    out = tmp_path / "run"
    args = COMMON + ["--save_strategy", "steps", "--save_steps", "10", "--grad_sync", grad_sync]
    run(one_node_two_procs(free_port(), args + ["--max_steps", "10", "--output_dir", str(out)]), out)
    single = [[sys.executable, SCRIPT, *args, "--max_steps", "16", "--output_dir", str(out), "--resume", "last"]]
    run(single, out)
    assert (out / "done_rank0").read_text() == "16"


# --------------------------------------------------------------------------- other engines
def test_fsdp_config_on_cpu_falls_back_to_native_with_one_log_line_and_keeps_prefetching(tmp_path):
    """On CPU, Accelerate runs an fsdp config as DDP (measured: the reducer warns; no FSDP module);
    hfstream's part: 'auto' becomes 'native' with one warning per rank, and the prefetcher runs."""
    import json

    out = tmp_path / "fsdp"
    args = COMMON + ["--max_steps", "6", "--fsdp", "full_shard", "--fsdp_config",
                     '{"version": 2, "transformer_layer_cls_to_wrap": ["GPT2Block"]}', "--grad_sync", "auto",
                     "--prefetch_depth", "2", "--output_dir", str(out)]
    nodes = run(one_node_two_procs(free_port(), args), out)
    log = nodes[0].output
    assert log.count("grad_sync='auto' falls back to 'native'") == 2, log[-3000:]
    for rank in (0, 1):
        info = json.loads((out / f"info_rank{rank}.json").read_text())
        assert info["grad_sync"] == "native" and info["prefetch_thread"] is True, info


# --------------------------------------------------------------------------- the SLURM template
FAKE_SRUN = """#!/bin/bash
# Stands in for srun: runs the command once per node, in parallel, with SLURM_NODEID set.
pids=()
for ((n = 0; n < SLURM_NNODES; n++)); do
  [[ "$1" == --* ]] && shift
  SLURM_NODEID=$n "$@" &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
exit $rc
"""


@pytest.mark.slow
def test_the_sbatch_template_runs_two_nodes_through_accelerate_launch(tmp_path):
    """The real template, with srun/scontrol replaced by shims that start both "nodes" here."""
    import os
    import subprocess

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "scontrol").write_text("#!/bin/bash\necho 127.0.0.1\n")
    accelerate = bin_dir / "accelerate"
    accelerate.write_text(f"#!/bin/bash\nexec {sys.executable} -m accelerate.commands.accelerate_cli \"$@\"\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    out = tmp_path / "run"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "fake[0-1]",
           "SLURM_NNODES": "2", "SLURM_JOB_ID": "1", "CONFIG": "recipes/accelerate/cpu_2node.yaml",
           "PROCS_PER_NODE": "1", "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1",
           "TRAIN_ARGS": f"--output_dir {out} --max_steps 4 --n_layer 1 --n_embd 32 --n_head 2 --corpus_bytes 60000 "
                         f"--block_size 32 --per_device_train_batch_size 2 --report_to none --save_strategy no "
                         f"--eval_strategy no --grad_sync overlap"}
    done = subprocess.run(["bash", "recipes/slurm/train_2node.sbatch"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=400)
    log = done.stdout + done.stderr
    (tmp_path / "sbatch.log").write_text(log)
    errors = [line for line in log.splitlines() if line.startswith("[rank") and "^^^" not in line]
    assert done.returncode == 0, "\n".join(errors[-40:]) + "\n" + log[-3000:]
    assert "2 nodes x 1 processes" in done.stdout
