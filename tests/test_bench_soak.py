"""The soak benchmark's machinery on a short run: threads and open files stay exactly flat across
many epochs (each epoch starts a new prefetcher thread, so a leaked one would show)."""

from __future__ import annotations

import os

import pytest

from hfstream.cli.bench.soak import _slope, soak

pytestmark = [pytest.mark.multiprocess,
              pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc (Linux)")]


@pytest.mark.slow   # 17 s; the slope's arithmetic and the refusals stay in the default run
def test_threads_and_open_files_stay_flat_across_twelve_epochs():
    doc = soak(steps=48, every=4, warmup_steps=8, samples_n=32)       # 4 steps per epoch
    assert sorted(doc["per_rank"]) == sorted(doc["samples"]) and len(doc["per_rank"]) == 2, doc["per_rank"]
    for rank, row in doc["per_rank"].items():
        for key in ("threads", "open_files"):
            assert row[key]["after_warmup"] == row[key]["last"], (rank, key, doc["samples"][rank])
        assert len(doc["samples"][rank]) >= 12


def test_slope_is_per_thousand_steps_after_warmup():
    rows = [{"step": s, "x": 10 + 0.002 * s} for s in range(0, 1001, 100)]
    start, last, slope = _slope(rows, "x", warmup_steps=200)
    assert start == pytest.approx(10.4) and last == pytest.approx(12.0) and slope == pytest.approx(2.0)


def test_bad_step_counts_are_refused_with_the_flag_named(capsys):
    from hfstream.cli.main import main

    with pytest.raises(SystemExit) as exit_info:
        main(["soak", "--steps", "0"])
    assert exit_info.value.code == 2 and "--steps" in capsys.readouterr().err
