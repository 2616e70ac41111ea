"""The prefetch benchmark runs end to end and reports consistent numbers (speed itself is a
benchmark result in docs/benchmarks.md, never a test)."""

import json

import pytest

from hfstream.cli.bench import prefetch as bench_prefetch


def test_quick_run_writes_consistent_json(tmp_path):
    out = tmp_path / "r.json"
    assert bench_prefetch.main(["--steps", "8", "--warmup", "2", "--rounds", "3", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    for key in ("compute_ms", "collate_ms", "stock_step_ms", "prefetch_step_ms"):
        assert r[key] > 0
    assert r["prefetch_over_max"] == pytest.approx(r["prefetch_step_ms"] / max(r["collate_ms"], r["compute_ms"]))
    assert r["speedup"] == pytest.approx(r["stock_step_ms"] / r["prefetch_step_ms"])


def test_bad_steps(capsys):
    with pytest.raises(SystemExit):
        bench_prefetch.main(["--steps", "3", "--warmup", "2"])
    assert "--steps" in capsys.readouterr().err


def test_collate_is_deterministic_and_keeps_tokens():
    rows = [{"input_ids": [1, 2, 3, 4]}, {"input_ids": [5, 6, 7, 8]}]
    a, b = bench_prefetch.CostlyCollate(5)(rows), bench_prefetch.CostlyCollate(0)(rows)
    assert a["input_ids"].tolist() == b["input_ids"].tolist() == [[1, 2, 3, 4], [5, 6, 7, 8]]


def test_report_overhead_quick(tmp_path):
    out = tmp_path / "o.json"
    assert bench_prefetch.main(["--report-overhead", "--steps", "6", "--warmup", "2", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["report_on_step_ms"] > 0 and r["report_off_step_ms"] > 0
    assert r["overhead"] == pytest.approx(r["report_on_step_ms"] / r["report_off_step_ms"] - 1)
