"""What hfstream decides for the user is said without --log_level info, once, by the main process."""

import logging
import os
import subprocess
import sys
import textwrap
import types

import pytest
from accelerate.utils import DistributedType

from hfstream import log
from hfstream.trainer.data_parallel import resolve_grad_sync

TESTS = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture
def said(monkeypatch, caplog):
    """The hfstream lines a user sees at the Trainer's default level (warning), as messages."""
    monkeypatch.setattr(log, "_said", set())
    monkeypatch.delenv("RANK", raising=False)
    root = logging.getLogger("hfstream")
    monkeypatch.setattr(root, "level", root.level)
    log.show_hfstream_logs(logging.WARNING)
    root.addHandler(caplog.handler)
    yield lambda: [r.getMessage() for r in caplog.records]
    root.removeHandler(caplog.handler)


def _args(grad_sync, engine_owns_comm=False):
    return types.SimpleNamespace(grad_sync=grad_sync, n_gpu=0, uses_engine_owning_comm=lambda: engine_owns_comm)


def _accelerator(processes):
    engine = DistributedType.MULTI_CPU if processes > 1 else DistributedType.NO
    return types.SimpleNamespace(distributed_type=engine, num_processes=processes)


def test_auto_resolution_is_said_at_the_default_level_once(said):
    for _ in range(3):   # a second Trainer in the same process (a search) says nothing new
        assert resolve_grad_sync(_args("auto"), _accelerator(2), False) == "overlap"
    lines = [m for m in said() if "grad_sync='auto' resolved to 'overlap'" in m]
    assert len(lines) == 1, said()


@pytest.mark.parametrize("mode", ["overlap", "sharded"])
def test_an_explicit_hfstream_mode_on_one_process_says_there_is_nothing_to_sync(said, mode):
    for _ in range(2):
        assert resolve_grad_sync(_args(mode), _accelerator(1), False) == mode
    lines = [m for m in said() if "nothing to synchronise" in m]
    assert len(lines) == 1 and f"grad_sync={mode!r} on one process" in lines[0], said()


def test_several_processes_with_an_explicit_mode_say_nothing(said):
    assert resolve_grad_sync(_args("overlap"), _accelerator(2), False) == "overlap"
    assert resolve_grad_sync(_args("native"), _accelerator(1), False) == "native"
    assert not said()


def test_other_ranks_leave_the_decision_to_rank_0(said, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    resolve_grad_sync(_args("auto"), _accelerator(2), False)
    assert not said()


def test_log_level_error_hides_the_decisions(said):
    log.show_hfstream_logs(logging.ERROR)
    resolve_grad_sync(_args("auto"), _accelerator(2), False)
    assert not said()


def test_a_user_sees_the_decision_on_stderr_once_with_one_prefix(tmp_path):
    """The real path: a fresh process, a Trainer at its default log level, built twice."""
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {TESTS!r})
        from hfstream import StreamTrainer, StreamTrainingArguments
        from tiny import lm_dataset, tiny_causal_lm, train_args
        for _ in range(2):
            StreamTrainer(model=tiny_causal_lm(), train_dataset=lm_dataset(),
                          args=train_args(StreamTrainingArguments, {str(tmp_path)!r}, grad_sync="overlap"))
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in out.stderr.splitlines() if "nothing to synchronise" in line]
    assert len(lines) == 1, out.stderr[-3000:]
    assert lines[0].startswith("[hfstream] grad_sync='overlap' on one process"), lines
