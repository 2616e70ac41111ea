"""The `hfstream` command and the demo recipe: help, clear errors, the launch command it builds,
and a short real demo run under `accelerate launch` on 2 CPU processes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hfstream.cli.main import REPO, build_parser, demo_command, main

sys.path.insert(0, str(REPO / "recipes"))


def test_help_lists_subcommands(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for cmd in ("demo", "bench", "bench-prefetch", "plan", "corpus", "env"):
        assert cmd in out


@pytest.mark.parametrize("argv,needle", [([], "required"), (["train"], "invalid choice"),
                                         (["corpus"], "out_dir"), (["env", "--fast"], "unrecognized")])
def test_bad_command_lines_fail_clearly(capsys, argv, needle):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and needle in capsys.readouterr().err


def test_corpus_and_env(tmp_path, capsys):
    assert main(["corpus", str(tmp_path), "--max-bytes", "10000"]) == 0
    assert (tmp_path / "stdlib_corpus.txt").stat().st_size <= 10000
    assert main(["env"]) == 0
    assert "torch" in capsys.readouterr().out


@pytest.mark.parametrize("devices,config,procs", [(0, "cpu_2proc.yaml", "2"), (1, "1gpu.yaml", "1"), (8, "8gpu.yaml", "8")])
def test_demo_picks_the_config_for_the_machine(devices, config, procs):
    cmd = demo_command(["--max_steps", "5"], num_devices=devices)
    assert cmd[cmd.index("--config_file") + 1].endswith(config)
    assert cmd[cmd.index("--num_processes") + 1] == procs
    assert cmd[-2:] == ["--max_steps", "5"] and Path(cmd[-3]).name == "train_clm.py"


def test_recipe_missing_data_file_is_a_clear_error(tmp_path):
    import train_clm

    with pytest.raises(SystemExit, match="data_files.*missing.txt"):
        train_clm.main(["--output_dir", str(tmp_path), "--data_files", str(tmp_path / "missing.txt"), "--use_cpu"])
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(SystemExit, match="empty"):
        train_clm.main(["--output_dir", str(tmp_path), "--data_files", str(empty), "--use_cpu"])


@pytest.mark.multiprocess
def test_demo_runs_under_accelerate_launch(tmp_path):
    out = tmp_path / "run"
    cmd = demo_command(["--output_dir", str(out), "--max_steps", "6", "--logging_steps", "3", "--corpus_bytes",
                        "200000", "--n_layer", "1", "--n_embd", "32", "--n_head", "2", "--block_size", "32"],
                       num_devices=0)
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "HF_DATASETS_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "hfstream step report" in proc.stdout and "2 ranks" in proc.stdout
    report = json.loads((out / "stream_report.json").read_text())
    assert report["grad_sync"] == "overlap" and len(report["per_rank"]) == 2
    for name in ("breakdown.png", "loss.png", "log_history.json"):
        assert (out / name).stat().st_size > 0
    assert (out / "model" / "config.json").exists()


def test_bench_subcommands_are_wired(capsys):
    for cmd in (["bench", "--help"], ["bench-prefetch", "--help"]):
        with pytest.raises(SystemExit) as e:
            main(cmd)
        assert e.value.code == 0
    assert "--quick" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(["bench", "--world-size", "0"])
    assert e.value.code == 2 and "--world-size" in capsys.readouterr().err


def test_a_missing_optional_package_is_one_line_naming_the_extra(tmp_path, monkeypatch, capsys):
    import sys

    from hfstream.cli.main import main

    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)   # import matplotlib fails as if not installed
    assert main(["plan", "--plot", str(tmp_path / "plan.png")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("hfstream: matplotlib is not installed; it comes with hfstream's 'plots' extra: "
                       "pip install 'hfstream[plots]'"), err
    assert not any("Traceback" in line for line in err)
