"""Layout planner (``megatron-hcp plan``): TP / CP / PP / DP, cp_comm_type, HCP sizes and the
dynamic-CP knobs for a model on a cluster, ranked by projected step time, with the reasons.

Enumeration. TP divides the GPUs per node (TP groups are contiguous ranks inside a node; larger
TP only with ``--max-tp``, in whole nodes), PP divides the layer count,
CP x DP fills the rest; CP > 1 tries ``p2p``, ``all_gather``, ``a2a`` and ``a2a+p2p`` with every
``[a2a, p2p]`` factorisation with both levels >= 2. A fixed-length batch needs the global batch
divisible by DP (megatron's rule, micro-batch size 1). Every layout is validated by
:meth:`megatron_hcp.config.CPConfig.validate` with the Transformer Engine backend
(``te_version``, default 2.8): what it rejects is counted and never proposed. A length
distribution adds dynamic-CP layouts (DPxCP a power of two, ``p2p``, minimum group size 1, 2, 4,
8, token cap per rank = the most that fits in memory, aligned to 256; CP = the smallest group
that holds the longest sequence), scheduled by :func:`megatron_hcp.dynamic_cp.scheduler.schedule`.

Cluster: a GPU preset (``--gpu h100|h200|b200|gb200``, :mod:`.gpus`: vendor peak, memory, HBM,
NVLink and NIC bandwidth, efficiencies fitted to published runs); every explicit flag
(``--tflops``, ``--attention-tflops``, ``--intra-gbps``, ...) overrides the preset.

Time per step (:mod:`megatron_hcp.dynamic_cp.projection`, the scheduler's cost model):

* compute: training FLOPs of :class:`~megatron_hcp.dynamic_cp.workload.GPTWorkload` / (TP x CP):
  the GEMMs (linear layers, output layer ``6 h V`` per token) at the GEMM rate of the precision
  (``--precision``; FP8 recipes run only the linear layers in FP8), causal attention ``L^2`` at
  the attention rate (BF16); full recompute adds one forward of the layers (x 4/3). A
  micro-batch's GEMMs take at least the time to stream the weights from HBM (forward and
  data-gradient reads, the main-gradient update): few tokens per rank make GEMMs memory-bound;
* CP (:func:`~megatron_hcp.dynamic_cp.projection.cp_layer_seconds`): the ring (``p2p`` and the
  outer level of ``a2a+p2p``) overlapped with each step's attention block; ``a2a`` and
  ``all_gather`` not overlapped; a recomputed forward repeats the forward traffic;
* TP with sequence parallelism: 2 all-gathers + 2 reduce-scatters of the ``tokens x hidden``
  activation per layer and direction (all-gathers in FP8 under ``--precision fp8``), not
  overlapped (megatron's default) unless ``--tp-comm-overlap``;
* DP: reduce-scatter of fp32 gradients (bf16 with ``--grad-reduce-in-bf16``) + all-gather of
  bf16 parameters (FP8 under fp8) over DPxCP (distributed optimizer; all-reduce without it),
  overlapped with the last micro-batch's backward; ``--fsdp`` (ZeRO-3): every micro-batch
  gathers the weights twice and reduce-scatters its gradients beside its own compute;
* PP (1F1B): ``(m + p - 1)`` stage slots for ``m`` micro-batches (a bubble of ``p - 1`` slots
  of the fullest stage, ``ceil(L/p)`` layers; ``1/vp`` of a slot with ``vp`` interleaved
  chunks) plus two activation transfers per extra stage;
* overlapped traffic still costs ``OVERLAP_SLOWDOWN = 0.189`` of its hidden duration (average
  compute slowdown under concurrent communication, Lee et al. 2025, arXiv:2507.03114);
* links (:class:`~megatron_hcp.dynamic_cp.projection.Cluster`): a ring step is as slow as its
  slowest hop; a collective over ``k`` ranks per node on several nodes runs at
  ``min(intra, k x inter)`` (NCCL: one ring per NIC); an all-to-all sends ``(k-1)/n`` over
  NVLink and ``(n-k)/n`` over the NIC concurrently. The optimizer step is not modelled.

Memory per GPU (the fuller of the first and last pipeline stage):

* weights + gradients + optimizer: bf16 weight 2 + fp32 main gradient 4 + Adam (fp32 master,
  two moments) 12 bytes per parameter; with the distributed optimizer the 12 are sharded over the
  DPxCP ranks (Megatron-LM distributed-optimizer docs: 18 vs 6 + 12/d bytes per parameter);
  bf16 main gradients 2 bytes less; FP8 (FP8 weights + their transpose) the same 2 bytes as
  bf16; FSDP shards all 18 and holds two layers' bf16 weights gathered; parameters split over TP
  (vocabulary too) and PP (embedding on the first stage, the output layer on the last);
* activations per layer and token (Korthikanti et al. 2022, "Reducing Activation Recomputation
  in Large Transformer Models", Sec. 4, with sequence parallelism and selective recompute, i.e.
  the attention scores are recomputed / flash attention: 34 h bytes for GPT with a 4h MLP),
  generalised to GQA and gated MLPs: norms 4h + QKV input 2h + Q, K, V 2q + 4kv + attention output
  2q + FC1 input 2h + MLP 4f (gated 6f) + dropout masks 2h (megatron's default dropout 0.1) +
  softmax statistics 4 nq, all / TP (FP8: the four linear inputs at 1 byte); times the layers of
  a stage and the micro-batches in flight on the first stage (1F1B: ``min(p, m)``; interleaved
  ``x (1 + (p-1)/(p vp))``). Full recompute keeps 2h/TP per layer and token plus one layer's
  working set;
* the working buffers of the layer being computed that TP does not shrink: the all-gathered
  GEMM input and the layer-input gradient, 4 bytes per token and hidden unit;
* CP buffers of one layer: ring K/V chunks in flight (2 x 2 chunks) or the all-gathered K/V;
* logits on the last stage: 6 bytes per token and vocabulary entry / TP (bf16 logits + the fp32
  copy of the vocabulary-parallel cross entropy);
* ``MEMORY_RESERVE = 0.10`` of the GPU kept free (CUDA context, NCCL buffers, fragmentation:
  an assumption). Layouts that do not fit are ranked after those that do and marked, never
  dropped; ``--recompute auto`` (default) uses selective recompute when it fits, else full.

Ranking: fitting layouts first; step times within ``--tie-tolerance`` (default 2 %: below the
model's resolution, see :mod:`.calibration`) are a tie, won by the layout with the least memory
per GPU (the Bridge page prefers TP2 CP4 a2a over TP1 CP16 a2a+p2p for "identical throughput
with more memory headroom"), at equal memory (within 1 GB) by the faster. How far to trust the
projection: :mod:`.calibration` compares it with published measurements (``megatron-hcp plan``
prints the summary); no GPU ran here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..config import CPConfig
from ..dynamic_cp.projection import OVERLAP_SLOWDOWN, Cluster
from . import estimate as _est
from .estimate import Estimate, Layout, enumerate_layouts, estimate, label, propose, usable_bytes
from .inputs import Batch, ModelSpec, Options, PlanInputError
from .report import (
    bridge_overrides,
    describe,
    dominant,
    flag_notes,
    megatron_flags,
    rank,
    why,
)

__all__ = ["Batch", "Cluster", "Estimate", "Layout", "ModelSpec", "Options", "PlanInputError",
           "PlanResult", "label", "plan", "propose"]


@dataclass
class PlanResult:
    model: ModelSpec
    batch: Batch
    cluster: Cluster
    options: Options
    ranked: list[Estimate]
    rejected: list[tuple[CPConfig, str]]  # a candidate's CPConfig, and why it was refused

    @property
    def winner(self) -> Estimate:
        return self.ranked[0]

    def find(self, label: str) -> int:
        """Position (0-based) of the layout with this label in the ranking."""
        for i, e in enumerate(self.ranked):
            if e.layout.label == label:
                return i
        raise KeyError(label)

    def why(self, e: Estimate) -> str:
        contrast = None
        if e is self.winner:
            kind = (e.layout.dynamic, e.layout.cp_comm_type if e.layout.cp > 1 else None)
            contrast = next(((i + 1, x) for i, x in enumerate(self.ranked)
                             if (x.layout.dynamic, x.layout.cp_comm_type if x.layout.cp > 1
                                 else None) != kind), None)
        return why(e, self.winner, usable_bytes(self.cluster), contrast)

    def notes(self) -> list[str]:
        return flag_notes(self.winner)

    def flags(self) -> list[str]:
        o = self.options
        return megatron_flags(self.winner, len(self.batch.lengths), o.distributed_optimizer,
                              o.tp_comm_overlap, o.precision, o.fsdp, o.grad_reduce_in_bf16)

    def overrides(self) -> list[str]:
        o = self.options
        return bridge_overrides(self.winner, len(self.batch.lengths), o.distributed_optimizer,
                                o.tp_comm_overlap, o.precision, o.fsdp, o.grad_reduce_in_bf16)

    def to_json(self, top: int | None = None, explain: int = 3) -> dict:
        layouts = []
        for i, e in enumerate(self.ranked[:top] if top else self.ranked):
            lay = e.layout
            layouts.append({
                "rank": i + 1, "label": lay.label, "tp": lay.tp, "cp": lay.cp, "pp": lay.pp,
                "dp": lay.dp, "cp_comm_type": lay.cp_comm_type,
                "hierarchical_context_parallel_sizes": list(lay.hcp) if lay.hcp else None,
                "dynamic_context_parallel": lay.dynamic,
                "min_dynamic_context_parallel_size": lay.min_cp if lay.dynamic else None,
                "max_seqlen_per_dp_cp_rank": lay.cap, "seq_length": lay.seq_length,
                "recompute": e.recompute, "step_seconds": e.step_seconds,
                "tokens_per_second_per_gpu": e.tokens_per_second_per_gpu,
                "micro_batches_per_replica": e.micro_batches,
                "breakdown_seconds": dict(e.breakdown),
                "memory_gb": {k: v / 1e9 for k, v in e.memory.items()},
                "fits": e.fits, "dominant_cost": dominant(e),
                "dominant_cost_what": describe(dominant(e), e),
                "why": self.why(e) if i < explain else None,
                "advice": list(e.advice),
            })
        c = self.cluster
        return {
            "inputs": {
                "model": vars(self.model).copy(),
                "cluster": {"nodes": c.nodes, "gpus_per_node": c.gpus_per_node,
                            "tflops": c.flops_per_second / 1e12,
                            "attention_tflops": c.attention_rate / 1e12,
                            "hbm_gbps": (c.memory_bytes_per_second or 0) / 1e9,
                            "intra_gbps": c.intra_bytes_per_second / 1e9,
                            "inter_gbps": c.inter_bytes_per_second / 1e9,
                            "intra_latency_us": c.intra_latency_seconds * 1e6,
                            "inter_latency_us": c.inter_latency_seconds * 1e6,
                            "gpu_memory_gb": c.memory_bytes / 1e9},
                "batch": {"sequences": len(self.batch.lengths), "tokens": self.batch.tokens,
                          "max_length": self.batch.max_length, "fixed": self.batch.fixed},
                "options": vars(self.options).copy(),
            },
            "constants": {"overlap_slowdown": OVERLAP_SLOWDOWN,
                          "working_bytes_per_token_hidden": _est.WORKING_BYTES,
                          "main_grad_bytes_per_param": _est.MAIN_GRAD_BYTES,
                          "memory_reserve": _est.MEMORY_RESERVE,
                          "weight_grad_bytes_per_param": _est.WEIGHT_GRAD_BYTES,
                          "optimizer_bytes_per_param": _est.OPTIMIZER_BYTES,
                          "logit_bytes": _est.LOGIT_BYTES},
            "layouts": layouts,
            "winner": {"label": self.winner.layout.label, "why": self.why(self.winner),
                       "megatron_flags": self.flags(), "bridge_overrides": self.overrides(),
                       "notes": self.notes()},
            "rejected_by_cpconfig": len(self.rejected),
            "rejected_examples": [{"label": label(config), "reason": reason}
                                  for config, reason in self.rejected[:5]],
        }


def plan(model: ModelSpec, batch: Batch, cluster: Cluster, options: Options | None = None
         ) -> PlanResult:
    """Every layout CPConfig accepts for ``model`` on ``cluster``, estimated and ranked."""
    options = options or Options()
    if cluster.nodes < 1 or cluster.gpus_per_node < 1:
        raise PlanInputError("--nodes and --gpus-per-node must be >= 1")
    layouts, rejected = enumerate_layouts(model, batch, cluster, options)
    estimates = []
    for lay in layouts:
        e = estimate(model, batch, cluster, options, lay)
        if e is None:  # a dynamic layout whose cap CPConfig (or the scheduler) refuses
            rejected.append((dataclasses.replace(lay.config, max_seqlen_per_dp_cp_rank=None),
                             "no dynamic-CP schedule or CPConfig refused its token cap"))
        else:
            estimates.append(e)
    if not estimates:
        reason = rejected[0][1] if rejected else "no layout"
        raise PlanInputError(f"no valid layout for this model on {cluster.world_size} GPUs "
                             f"(e.g. {reason})")
    return PlanResult(model, batch, cluster, options, rank(estimates, options.tie_tolerance),
                      rejected)
