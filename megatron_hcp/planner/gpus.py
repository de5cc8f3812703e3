"""GPU presets (``--gpu``) and training precision (``--precision``) for the layout planner.

Peak figures are the vendors' published dense Tensor Core rates (the datasheets print the
2:4-sparsity rate, twice the dense one), memory, NVLink and network bandwidth per GPU:

* ``h100``: NVIDIA H100 Tensor Core GPU datasheet, SXM5 column: BF16 1,979 / FP8 3,958 TFLOP/s
  with sparsity, 80 GB HBM3, 3.35 TB/s, NVLink 900 GB/s (bidirectional); DGX H100: one 400 Gb/s
  ConnectX-7 NIC per GPU, 8 GPUs per node.
* ``h200``: NVIDIA H200 datasheet (SXM): the H100's Tensor Core rates, 141 GB HBM3e, 4.8 TB/s,
  NVLink 900 GB/s; DGX H200: one 400 Gb/s NIC per GPU, 8 GPUs per node.
* ``b200``: NVIDIA DGX B200 datasheet / HGX B200 specifications: 72 PFLOP/s FP8 training
  (8 GPUs, sparse: 4.5 dense per GPU), BF16 half of it, 1,440 GB HBM3e (180 GB per GPU),
  64 TB/s (8 per GPU), NVLink 5 1.8 TB/s per GPU (bidirectional), 8x 400 Gb/s ConnectX-7.
* ``gb200``: NVIDIA GB200 NVL72 specifications: 720 PFLOP/s FP8 / 360 BF16 (72 GPUs, sparse:
  5 / 2.5 dense per GPU), 13.4 TB HBM3e (186 GB per GPU), 576 TB/s, NVLink 130 TB/s (1.8 TB/s
  per GPU), one NVLink domain of 72 GPUs (the planner's "node"); one 400 Gb/s NIC per GPU.

NVLink and NIC figures are bidirectional / line rates; the planner uses bytes per second per
direction (NVLink 900 GB/s -> 450; 400 Gb/s -> 50 GB/s).

What a run achieves is not on a datasheet: ``GEMM_EFFICIENCY`` (share of the precision's peak the
linear layers reach) and ``ATTENTION_EFFICIENCY`` (share of the BF16 peak the fused attention
reaches; FP8 recipes keep attention in BF16), one value per GPU architecture (Hopper: h100,
h200; Blackwell: b200, gb200 - the kernels differ, the GPUs of one architecture share them), are
fitted to published measurements by ``benchmarks/plan_calibration.py --fit`` (the rows it used
are marked ``fit: true`` in ``calibration/published.yaml``); every other row checks them. No
published BF16 run on Blackwell was found: its BF16 GEMM efficiency is assumed equal to
Hopper's.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..dynamic_cp.projection import Cluster

__all__ = ["ATTENTION_EFFICIENCY", "GEMM_EFFICIENCY", "GPUS", "PRECISIONS", "GPUSpec",
           "cluster_for"]

PRECISIONS = ("bf16", "fp8")

#: share of the dense peak of the run's precision that the linear layers (and the output layer)
#: reach, end to end (kernel efficiency, launch gaps, element-wise work between the GEMMs), per
#: (architecture, precision); fitted, see the module docstring
GEMM_EFFICIENCY = {("hopper", "bf16"): 0.585, ("hopper", "fp8"): 0.408,
                   ("blackwell", "bf16"): 0.585, ("blackwell", "fp8"): 0.373}
#: share of the dense BF16 peak that fused (flash) attention reaches, forward + backward, per
#: architecture; fitted
ATTENTION_EFFICIENCY = {"hopper": 0.286, "blackwell": 0.367}


@dataclass(frozen=True)
class GPUSpec:
    """Published figures of one GPU (per GPU, dense Tensor Core rates)."""

    name: str
    arch: str  # hopper | blackwell: which fitted efficiencies apply
    bf16_flops: float
    fp8_flops: float
    memory_bytes: float
    hbm_bytes_per_second: float
    nvlink_bytes_per_second: float  # per direction
    network_bytes_per_second: float  # per direction, per GPU
    gpus_per_node: int  # GPUs of one NVLink domain
    source: str

    def peak(self, precision: str) -> float:
        return self.fp8_flops if precision == "fp8" else self.bf16_flops


GPUS: dict[str, GPUSpec] = {
    "h100": GPUSpec("h100", "hopper", 989.4e12, 1978.9e12, 80e9, 3.35e12, 450e9, 50e9, 8,
                    "NVIDIA H100 datasheet (SXM5), DGX H100"),
    "h200": GPUSpec("h200", "hopper", 989.4e12, 1978.9e12, 141e9, 4.8e12, 450e9, 50e9, 8,
                    "NVIDIA H200 datasheet (SXM), DGX H200"),
    "b200": GPUSpec("b200", "blackwell", 2250e12, 4500e12, 180e9, 8e12, 900e9, 50e9, 8,
                    "NVIDIA DGX B200 datasheet"),
    "gb200": GPUSpec("gb200", "blackwell", 2500e12, 5000e12, 186e9, 8e12, 900e9, 50e9, 72,
                     "NVIDIA GB200 NVL72 specifications"),
}


def cluster_for(gpu: str, precision: str, nodes: int = 1, gpus_per_node: int | None = None, *,
                gemm_efficiency: dict[tuple[str, str], float] | None = None,
                attention_efficiency: dict[str, float] | None = None,
                **overrides: float) -> Cluster:
    """The :class:`Cluster` of ``nodes`` x ``gpus_per_node`` (default: one NVLink domain) GPUs
    of the preset ``gpu`` training in ``precision``; ``overrides`` (any Cluster field, e.g.
    ``flops_per_second`` from ``--tflops``) replace the preset's values. The efficiencies
    default to the fitted :data:`GEMM_EFFICIENCY` / :data:`ATTENTION_EFFICIENCY` (the fit passes
    its trial values)."""
    if gpu not in GPUS:
        raise ValueError(f"--gpu {gpu!r}: use one of {', '.join(GPUS)}")
    if precision not in PRECISIONS:
        raise ValueError(f"--precision {precision!r}: use one of {', '.join(PRECISIONS)}")
    g = GPUS[gpu]
    values = {
        "nodes": nodes, "gpus_per_node": gpus_per_node or g.gpus_per_node,
        "flops_per_second": g.peak(precision) * (gemm_efficiency or GEMM_EFFICIENCY)[
            (g.arch, precision)],
        "attention_flops_per_second": g.bf16_flops * (attention_efficiency
                                                      or ATTENTION_EFFICIENCY)[g.arch],
        "intra_bytes_per_second": g.nvlink_bytes_per_second,
        "inter_bytes_per_second": g.network_bytes_per_second,
        "memory_bytes": g.memory_bytes,
        "memory_bytes_per_second": g.hbm_bytes_per_second,
    }
    values.update(overrides)
    return Cluster(**values)
