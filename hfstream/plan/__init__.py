"""The planner: step time, exposed gradient communication and the ceiling for 1 .. 1024 devices, without running.

It answers before anyone buys hardware or books a cluster what `hfstream.report.timeline` and ``hfstream
bench`` would measure: for a model (a preset, a ``config.json`` or a parameter count), a device
(FLOP/s, memory bandwidth) and a link (bandwidth, latency) it predicts forward, backward, the
optimizer step and the ring all-reduce of every gradient bucket at each world size, whether
overlap can still hide that communication, and from which N the link and not compute sets the
ceiling (docs/design.md section 4). With a device (``--device h100-80gb``, ``--device-memory``)
it says what each mode keeps per device, what fits and the smallest change that makes it fit;
its links are priced by level (a ring inside each node, one across nodes). Against a measured
``hfstream bench --json`` run it calibrates itself and reports its error.

    shapes    `ModelShape`: a model's parameters and tensors, from presets, config.json or a count
    predict   `PlanConfig`, the cost model (`predict_row`, `overlap_limit`, `plan`) and `predict_buckets`
    links     `Links`: a collective's time from the node's and the network's bandwidth
    memory    `memory_report`: bytes per device by mode, activations, what fits and the smallest change
    devices   `DEVICES`: device presets (memory, FLOP/s, node links) and `parse_bytes`
    compare   `predict_bench` and `compare_with_measurement`: the planner against a bench run
    tables    `format_plan_table`: the text table of a plan (its figure: `hfstream.cli.plot.plot_plan`)
    cli       ``hfstream plan`` and ``python -m hfstream.plan``
"""

from .cli import add_arguments, main, run_from_args
from .compare import compare_with_measurement, format_comparison, predict_bench
from .devices import DEVICES, DevicePreset, parse_bytes
from .links import Links
from .memory import OPTIMIZERS, activation_bytes, memory_by_mode, memory_report
from .predict import (DDP_FIRST_BUCKET_MB, DEFAULT_WORLD_SIZES, PlanConfig, allreduce_s, calibrated_mem_bandwidth_gbs,
                      calibrated_tflops, overlap_limit, plan, predict_buckets, predict_row, ring_factor, step_flops)
from .shapes import PRESETS, ModelShape, load_model, shape_from_config, shape_from_params
from .tables import format_plan_table

__all__ = ["DEVICES", "DevicePreset", "Links", "OPTIMIZERS", "activation_bytes", "memory_by_mode", "memory_report",
           "parse_bytes", "DDP_FIRST_BUCKET_MB", "DEFAULT_WORLD_SIZES", "PRESETS", "ModelShape", "PlanConfig", "add_arguments",
           "allreduce_s", "calibrated_mem_bandwidth_gbs", "calibrated_tflops", "compare_with_measurement",
           "format_comparison", "format_plan_table", "load_model", "main", "overlap_limit", "plan", "predict_bench",
           "predict_buckets", "predict_row", "ring_factor", "run_from_args", "shape_from_config", "shape_from_params",
           "step_flops"]
