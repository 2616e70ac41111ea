"""The report's comm_cpu_ms: what gloo's own threads took from the host's cores in a step.

The advice leans on it (`hfstream.report.advice._slowdown`): where nothing was in flight in backward
it is the only sign of what a collective run inside backward would take from backward.
"""

from __future__ import annotations

import math

import pytest
import torch

from hfstream.report.timeline import StepTimeline

pytestmark = pytest.mark.multiprocess


def _steps(rank, world_size, mib_per_step):
    import torch.distributed as dist

    timeline = StepTimeline()
    x = torch.ones(4 * 2**18)   # 4 MiB
    for step, mib in enumerate(mib_per_step):
        timeline.begin_step(step)
        timeline.data_ready()
        timeline.forward_start()
        timeline.forward_end()
        for _ in range(mib // 4):
            dist.all_reduce(x, async_op=True).wait()
        timeline.backward_end()
        timeline.optimizer_start()
        timeline.end_step()
    timeline.resolve(wait=True)
    return [r.comm_cpu_ms for r in timeline.records]


def test_the_collectives_threads_cpu_is_counted_in_the_step_that_ran_them(run_distributed):
    cpu = run_distributed(_steps, 2, [0, 256, 0])[0]
    assert cpu[1] > 0            # 256 MiB all-reduced: gloo's threads used CPU in that step
    assert cpu[1] > 5 * cpu[2]   # and not in the one after it, which sent nothing (clock ticks: 10 ms)


def test_one_process_has_no_collectives_threads_to_read():
    timeline = StepTimeline()
    timeline.begin_step(0)
    timeline.data_ready()
    timeline.forward_start()
    timeline.forward_end()
    timeline.backward_end()
    timeline.end_step()
    assert math.isnan(timeline.summary(warmup=0)["comm_cpu_ms"])
