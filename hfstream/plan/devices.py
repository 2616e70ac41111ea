"""Device presets: memory, FLOP/s, memory bandwidth and the links of a typical node, for ``--device``.

Figures are the vendors' data-sheet numbers (dense bf16 tensor FLOP/s, no sparsity), memory as
``nvidia-smi`` reports the total (MiB), and the links of the usual node (NVIDIA DGX/HGX:
8 GPUs on NVLink, one 400 Gb/s (H100, H200) or 200 Gb/s (A100) InfiniBand NIC per GPU).
The intra-node figure is the bus bandwidth of a ring all-reduce over the node's 8 GPUs for
large messages (nccl-tests' ``busbw``). H100/H200: NVLink 4's 450 GB/s each way (900 GB/s both
ways, data sheet); measured ``all_reduce_perf -g 8`` busbw on 8x H100 SXM5 is published as
460-480 GB/s (Alaya NeW, "NCCL-tests in practice", 2026-05-06,
docs.alayanew.com/en/docs/tech-blog/2026-05-06-nccl-tests), within 7 % of 450. A100: NVLink 3
is 300 GB/s each way, but the same source measures 230-250 GB/s busbw on 8x A100 SXM4, so the
preset takes the measured 240 (300 would price the all-reduce 25 % short). Your own
``all_reduce_perf`` is the figure to trust: ``--intra-node-gbs`` replaces the preset's.
"""

from __future__ import annotations

from dataclasses import dataclass

MiB = 2**20


@dataclass(frozen=True)
class DevicePreset:
    """One accelerator and the node it usually sits in."""

    memory_bytes: int
    """Total device memory (``nvidia-smi``'s total)."""
    peak_tflops: float
    """Dense bf16 tensor-core TFLOP/s (data sheet, without sparsity)."""
    mem_bandwidth_gbs: float
    """Device memory bandwidth, GB/s (data sheet)."""
    devices_per_node: int
    """Devices on the node's fast links."""
    intra_node_gbs: float
    """Bus bandwidth of a ring inside the node, GB/s (NVLink per direction; PCIe for L4)."""
    inter_node_gbs: float
    """Network bandwidth per device across nodes, GB/s (its NIC)."""


DEVICES: dict[str, DevicePreset] = {
    # H100 SXM5: 989 TFLOP/s bf16, 3.35 TB/s HBM3, NVLink 4 450 GB/s each way, 400 Gb/s NDR per GPU.
    "h100-80gb": DevicePreset(81559 * MiB, 989.0, 3350.0, 8, 450.0, 50.0),
    # H200 SXM: as H100, 141 GB HBM3e at 4.8 TB/s.
    "h200-141gb": DevicePreset(143771 * MiB, 989.0, 4800.0, 8, 450.0, 50.0),
    # A100 SXM4: 312 TFLOP/s bf16, NVLink 3 (240 GB/s measured busbw, above), 200 Gb/s HDR per GPU.
    "a100-40gb": DevicePreset(40960 * MiB, 312.0, 1555.0, 8, 240.0, 25.0),
    "a100-80gb": DevicePreset(81920 * MiB, 312.0, 2039.0, 8, 240.0, 25.0),
    # L4: 121 TFLOP/s bf16, 300 GB/s GDDR6, no NVLink: PCIe Gen4 x16 (~25 GB/s achieved), 100 Gb/s NIC shared.
    "l4-24gb": DevicePreset(23034 * MiB, 121.0, 300.0, 8, 25.0, 12.5),
}


def parse_bytes(text: str) -> int:
    """``80GB`` (10**9), ``80GiB`` (2**30), ``24G`` (= GiB), ``512MiB``, ``85899345920`` -> bytes.

    Raises:
        ValueError: not a positive size.
    """
    t = text.strip().replace("_", "").replace(",", "")
    units = {"tib": 2**40, "gib": 2**30, "mib": 2**20, "kib": 2**10, "tb": 10**12, "gb": 10**9, "mb": 10**6,
             "kb": 10**3, "t": 2**40, "g": 2**30, "m": 2**20, "k": 2**10, "b": 1}
    scale = 1
    for unit, s in units.items():
        if t.lower().endswith(unit):
            t, scale = t[:-len(unit)], s
            break
    try:
        value = float(t) * scale
    except ValueError:
        raise ValueError(f"expected a size such as 80GB, 80GiB or 85899345920 (bytes), got {text!r}") from None
    if not value >= 1 or value != value or value == float("inf"):
        raise ValueError(f"must be a size > 0, got {text!r}")
    return int(value)
