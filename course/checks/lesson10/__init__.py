"""Lesson 10 checks: a reduce-scatter built by hand, a sharded clipped step, the all-gather waited
for by forward pre-hooks; and the measurements behind the lesson's figures. One module per concern:

    threads.py         the thread ranks every exercise is graded on (a logging fake torch.distributed)
    reduce_scatter.py  10.reduce_scatter
    sharded_step.py    10.sharded_step
    gather_hook.py     10.gather_hook
    pipelined.py       10.pipelined_step, and the step and its gathers measured on rank 0
    measure.py         the reduce-scatter and the three modes measured on real gloo ranks, their figures
    trainer.py         StreamTrainer(grad_sync="sharded") on 2 processes; a profiler trace on a GPU

The measurements use real gloo processes (`hfstream.testing.run_on_ranks`): on the bare loopback,
and on `hfstream.testing.link.SimulatedLink`, which delays the completion of every all-reduce,
all-to-all, all-gather and point-to-point transfer to what its bytes would take at a given bandwidth.
"""

from . import gather_hook, pipelined, reduce_scatter, sharded_step  # noqa: F401  (registers the exercises)
from .measure import (measure_modes, measure_reduce_scatter, modes_figure, modes_sentences, rs_figure,
                      timeline_figure, timeline_sentences)
from .pipelined import measure_pipelining, pipelining_figure, pipelining_sentences, step_then_gather
from .threads import ThreadWorld, in_threads
from .trainer import profile_sharded_step, train_sharded

__all__ = ["ThreadWorld", "in_threads", "measure_modes", "measure_pipelining", "measure_reduce_scatter", "modes_figure",
           "modes_sentences", "pipelining_figure", "pipelining_sentences", "profile_sharded_step", "rs_figure",
           "step_then_gather", "timeline_figure", "timeline_sentences", "train_sharded"]
