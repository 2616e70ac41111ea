"""The planner agrees with a measured shaped-link run within 25% (docs/design.md section 4).

Slow (a real benchmark run, ~1 min): `make test-slow`. Needs a quiet machine: the planner
models neither other jobs on the cores nor gloo's threads competing with compute.
"""

import json

import pytest

from hfstream.cli.bench import run as bench
from hfstream.plan import compare_with_measurement, predict_bench

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]


def test_planner_within_25_percent_of_a_shaped_run(tmp_path):
    out = tmp_path / "bench.json"
    assert bench.main(["--modes", "serial,ddp-default,overlap", "--steps", "6", "--rounds", "2",
                       "--json", str(out)]) == 0
    measured = json.loads(out.read_text())
    comparison = compare_with_measurement(predict_bench(measured), measured)
    assert set(comparison["modes"]) >= {"serial", "ddp-default", "overlap"}, comparison["modes"]
    for mode, row in comparison["modes"].items():
        for key in ("comm_busy_ms", "step_ms"):
            assert abs(row["rel_error"][key]) <= 0.25, (mode, key, row)
