"""Projected step time of a plan: compute at a FLOP rate plus the exposed CP ring traffic.

The FLOPs model of :mod:`.workload` makes splitting a sequence over more ranks free, so under
it alone static CP (every sequence on one fixed CP size) is perfectly balanced. What static CP
really pays for is communication: a sequence on ``c`` ranks runs ``c - 1`` ring steps per layer
forward and backward, each sending one K/V chunk (backward: K/V plus dK/dV), overlapped with
that step's attention block. This module projects that cost so plans can be compared on it.

Per layer, per ring step of a sequence of length ``L`` on ``c`` ranks (chunk ``L / c``):

* forward: send ``2 * chunk * kv_hidden`` elements, overlapped with ``1 / c`` of the rank's
  forward attention FLOPs; exposed = ``max(0, latency + bytes / bandwidth - attention time)``;
* backward: twice the bytes, overlapped with the backward attention (2x forward).

The single-link :class:`Hardware` numbers are assumptions (defaults: an H100-class GPU, 400
TFLOP/s achieved, 100 GB/s and 10 us per ring step); the benchmark prints results for several of
them. The layout planner builds its :class:`Cluster` from GPU presets whose efficiencies are
fitted to published measurements (:mod:`megatron_hcp.planner.calibration`); no GPU ran here.

The layout planner (:mod:`megatron_hcp.planner`) uses the same accounting with two link classes
(:class:`Cluster`: inside a node / across nodes, each group priced by where its ranks sit):
:func:`cp_layer_seconds` (ring, a2a, a2a+p2p, all_gather), :func:`tp_layer_seconds`,
:func:`dp_gradient_seconds`, :func:`pipeline_bubble_seconds`, and overlapped traffic charged
:data:`OVERLAP_SLOWDOWN` of its hidden part. :func:`plan_seconds`, :func:`group_seconds` and
:func:`static_cp_seconds` take either a :class:`Hardware` (one link, :func:`projected_seconds`,
unchanged) or a :class:`Cluster`: then each CP group is priced by :func:`dynamic_group_seconds`
with that accounting - a flat ring, or under (dynamic) hierarchical CP an a2a level of
``min(c, a)`` contiguous ranks (not overlapped) plus a ring over ``c / min(c, a)`` of them
(overlapped), each on the link class its ranks need.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from ..config import dynamic_levels
from ..sharding import contiguous_window_reach
from .workload import GPTWorkload

__all__ = [
    "OVERLAP_SLOWDOWN",
    "Cluster",
    "Hardware",
    "LayerComm",
    "collective_seconds",
    "cp_layer_seconds",
    "dp_gradient_seconds",
    "dynamic_group_seconds",
    "dynamic_levels",
    "fsdp_seconds",
    "group_pricer",
    "group_seconds",
    "overlapped_seconds",
    "p2p_seconds",
    "pipeline_bubble_seconds",
    "plan_seconds",
    "projected_seconds",
    "static_cp_seconds",
    "tp_layer_seconds",
]


@dataclass(frozen=True)
class Hardware:
    """Assumed accelerator and CP-link numbers for a projection."""

    flops_per_second: float = 400e12
    bytes_per_second: float = 100e9
    latency_seconds: float = 10e-6
    bytes_per_element: int = 2


def projected_seconds(workload: GPTWorkload, length: int, group_size: int,
                      hw: Hardware) -> float:
    """Seconds the slowest rank spends on ``length`` split over ``group_size`` ranks (fwd +
    bwd). In the contiguous layout under a causal window the ring stops at the window's reach
    and dK/dV go home in one more hop (as :func:`cp_layer_seconds`)."""
    if workload.mode != "flops":
        raise ValueError("projection needs workload.mode='flops' (it converts FLOPs to seconds)")
    compute = workload.cost(length, group_size) / hw.flops_per_second
    c = group_size
    if c == 1:
        return compute
    kv_hidden = (workload.num_query_groups or workload.num_attention_heads) * workload.head_dim
    chunk_bytes = 2 * (length / c) * kv_hidden * hw.bytes_per_element
    # forward attention FLOPs of this rank in one layer, spread over the c ring steps
    fwd_step = workload.attention_flops(length) / (3 * workload.num_layers) / c / c
    fwd_exposed = max(0.0, hw.latency_seconds + chunk_bytes / hw.bytes_per_second
                      - fwd_step / hw.flops_per_second)
    bwd_exposed = max(0.0, hw.latency_seconds + 2 * chunk_bytes / hw.bytes_per_second
                      - 2 * fwd_step / hw.flops_per_second)
    steps, home = c - 1, 0.0
    if (workload.cp_partition_mode == "contiguous" and workload.window is not None
            and workload.causal and length > 0):
        reach = contiguous_window_reach(length / c, workload.window, c)
        if reach < steps:
            steps = reach
            home = hw.latency_seconds + chunk_bytes / hw.bytes_per_second if reach else 0.0
    return compute + workload.num_layers * (steps * (fwd_exposed + bwd_exposed) + home)


def group_seconds(workload: GPTWorkload, lengths: Sequence[int], samples: Iterable[int],
                  group_size: int, hw: Hardware | Cluster, *, start: int = 0,
                  hcp_a2a_size: int | None = None) -> float:
    """Seconds each rank of a CP group spends on ``samples`` (all split over the group).

    With a :class:`Cluster` the group is the ranks ``start .. start + group_size - 1`` (their
    nodes choose the links) and ``hcp_a2a_size`` makes it hierarchical
    (:func:`dynamic_group_seconds`); a :class:`Hardware` prices a flat single-link ring.
    """
    price = group_pricer(workload, hw, hcp_a2a_size)
    return sum(price(lengths[s], start, group_size) for s in samples)


def plan_seconds(plan, lengths: Sequence[int], workload: GPTWorkload, hw: Hardware | Cluster,
                 hcp_a2a_size: int | None = None) -> float:
    """Projected step of a dynamic-CP plan: sum over micro-batches of the slowest rank."""
    price = group_pricer(workload, hw, hcp_a2a_size)
    return sum(max((sum(price(lengths[s], g.ranks[0], len(g.ranks)) for s in g.samples)
                    for g in mb.groups if g.ranks), default=0.0)
               for mb in plan.micro_batches)


def static_cp_seconds(replicas: Sequence[Sequence[int]], lengths: Sequence[int], cp: int,
                      workload: GPTWorkload, hw: Hardware | Cluster,
                      hcp_a2a_size: int | None = None) -> float:
    """Projected step of static CP: DP replicas only meet at the step end (slowest replica).

    Replica ``r`` runs on the contiguous ranks ``r * cp ...`` (megatron's tp-cp-dp order with
    TP 1); ``hcp_a2a_size`` (with a :class:`Cluster`) prices static HCP ``[a, cp / a]``.
    """
    price = group_pricer(workload, hw, hcp_a2a_size)
    return max(sum(price(lengths[s], r * cp, cp) for s in samples)
               for r, samples in enumerate(replicas))


# --------------------------------------------------------------------------------------------
# Two link classes (inside a node / across nodes) for the layout planner (megatron_hcp.planner).
# The functions above keep their single-link model (the dynamic-CP scheduler ranks with them);
# the ones below price each group by where its ranks sit, with the same ring accounting.
# --------------------------------------------------------------------------------------------

#: Compute slowdown while communication overlaps it: 18.9 % on average over GPT/LLaMA
#: workloads on H100/A100/MI250/MI210 (Lee et al. 2025, "Characterizing Compute-Communication
#: Overlap in GPU-Accelerated Distributed Deep Learning", arXiv:2507.03114). Hidden traffic is
#: therefore charged this share of its (hidden) duration.
OVERLAP_SLOWDOWN = 0.189


@dataclass(frozen=True)
class Cluster:
    """Nodes of ``gpus_per_node`` GPUs; one link class inside a node, one across nodes.

    Defaults: an H100 SXM node (NVLink 4: 900 GB/s bidirectional = 450 GB/s per direction per
    GPU; 80 GB HBM3), one 400 Gb/s InfiniBand NIC per GPU (50 GB/s per direction, DGX H100
    rail-optimised), latencies 5 us (NVLink) and 10 us (IB) per message, 400 TFLOP/s achieved
    bf16 (about 40 % of the 989 TFLOP/s dense peak). The layout planner builds its clusters from
    GPU presets instead (:mod:`megatron_hcp.planner.gpus`, calibrated rates).

    ``flops_per_second`` is the rate of the GEMMs (linear and output layers);
    ``attention_flops_per_second`` that of the attention kernel (``L^2`` FLOPs), by default the
    same. The two differ in practice: FP8 recipes run only the GEMMs in FP8, and fused attention
    reaches a lower share of the peak than large GEMMs.
    """

    nodes: int = 1
    gpus_per_node: int = 8
    flops_per_second: float = 400e12
    intra_bytes_per_second: float = 450e9
    intra_latency_seconds: float = 5e-6
    inter_bytes_per_second: float = 50e9
    inter_latency_seconds: float = 10e-6
    memory_bytes: float = 80e9
    bytes_per_element: int = 2
    attention_flops_per_second: float | None = None
    memory_bytes_per_second: float | None = None  # HBM; None: no weight-streaming bound

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def attention_rate(self) -> float:
        """FLOP/s of the attention kernel (``attention_flops_per_second``, else the GEMM rate)."""
        return self.attention_flops_per_second or self.flops_per_second

    def compute_seconds(self, workload: GPTWorkload, length: int, group_size: int,
                        a2a_size: int = 1) -> float:
        """Seconds of the slowest rank's share of ``length`` on ``group_size`` ranks (fwd +
        bwd): the linear layers at the GEMM rate, the ``L^2`` attention at the attention rate,
        times the layout's imbalance (``GPTWorkload.cost``; ``a2a_size``: hierarchical CP's
        a2a level, whose ranks split heads)."""
        linear = length * workload.linear_flops_per_token() / group_size
        attention = workload.attention_flops(length) / group_size
        attention *= workload.attention_load(length, group_size, a2a_size)
        return linear / self.flops_per_second + attention / self.attention_rate

    def placement(self, ranks: Sequence[int]) -> tuple[int, int]:
        """(nodes the ranks span, fewest of them on one of those nodes)."""
        per_node: dict[int, int] = {}
        for r in ranks:
            per_node[r // self.gpus_per_node] = per_node.get(r // self.gpus_per_node, 0) + 1
        return len(per_node), min(per_node.values()) if per_node else 0

    def crosses_nodes(self, ranks: Sequence[int]) -> bool:
        return self.placement(ranks)[0] > 1

    def hardware(self, ranks: Sequence[int]) -> Hardware:
        """The single-link :class:`Hardware` of a group (its slowest link class)."""
        inter = self.crosses_nodes(ranks)
        return Hardware(
            flops_per_second=self.flops_per_second,
            bytes_per_second=self.inter_bytes_per_second if inter else
            self.intra_bytes_per_second,
            latency_seconds=self.inter_latency_seconds if inter else self.intra_latency_seconds,
            bytes_per_element=self.bytes_per_element,
        )


def overlapped_seconds(comm: float, compute: float) -> float:
    """Exposed seconds of ``comm`` run beside ``compute``: the excess, plus the slowdown."""
    return max(0.0, comm - compute) + OVERLAP_SLOWDOWN * min(comm, compute)


def p2p_seconds(cluster: Cluster, nbytes: float, ranks: Sequence[int]) -> float:
    """One ring step over ``ranks``: every rank sends ``nbytes`` to its neighbour; the step
    ends when the slowest hop (across nodes, if the ring leaves one) has delivered."""
    hw = cluster.hardware(ranks)
    return hw.latency_seconds + nbytes / hw.bytes_per_second


def collective_seconds(cluster: Cluster, kind: str, nbytes: float,
                       ranks: Sequence[int]) -> float:
    """Seconds of one collective over ``ranks``; ``nbytes`` is the full buffer of one rank
    (all_reduce: the buffer; all_gather: the gathered output; reduce_scatter: the input;
    all_to_all: what a rank holds before the exchange).

    Ring algorithms (NCCL): all_reduce sends ``2(n-1)/n`` of the buffer per rank in
    ``2(n-1)`` steps, all_gather / reduce_scatter ``(n-1)/n`` in ``n-1``. A group inside one
    node runs at the NVLink rate; a group across nodes with ``k`` members per node at
    ``min(intra, k * inter)`` (NCCL builds one ring per NIC through the node's GPUs, so the
    ``k`` NICs of a node carry it in parallel). all_to_all: ``(k-1)/n`` of the buffer goes to
    peers on the node, ``(n-k)/n`` through the rank's own NIC, concurrently.
    """
    n = len(ranks)
    if n <= 1 or nbytes <= 0:
        return 0.0
    nodes, k = cluster.placement(ranks)
    intra, inter = cluster.intra_bytes_per_second, cluster.inter_bytes_per_second
    latency = cluster.inter_latency_seconds if nodes > 1 else cluster.intra_latency_seconds
    if kind == "all_to_all":
        on_node = nbytes * (k - 1) / n / intra if k > 1 else 0.0
        off_node = nbytes * (n - k) / n / inter if nodes > 1 else 0.0
        return latency + max(on_node, off_node)
    bandwidth = intra if nodes == 1 else min(intra, k * inter)
    if kind == "all_reduce":
        return 2 * (n - 1) * latency + 2 * (n - 1) / n * nbytes / bandwidth
    if kind in ("all_gather", "reduce_scatter"):
        return (n - 1) * latency + (n - 1) / n * nbytes / bandwidth
    raise ValueError(f"unknown collective {kind!r}")


@dataclass(frozen=True)
class LayerComm:
    """Exposed communication seconds of one transformer layer, forward and backward."""

    forward: float = 0.0
    backward: float = 0.0

    def __add__(self, other: LayerComm) -> LayerComm:
        return LayerComm(self.forward + other.forward, self.backward + other.backward)


def cp_layer_seconds(workload: GPTWorkload, cluster: Cluster, length: int, tp: int,
                     comm_type: str, cp_ranks: Sequence[int],
                     a2a_ranks: Sequence[int] = (), p2p_ranks: Sequence[int] = (),
                     cp_partition_mode: str = "zigzag") -> LayerComm:
    """Exposed CP traffic of one layer for a sequence of ``length`` on one rank.

    ``c = len(cp_ranks)``; a rank holds ``L/c`` tokens and ``nq/tp`` query, ``nkv/tp`` KV heads
    of ``head_dim`` (B bytes per element).

    * ``p2p``: ``c-1`` ring steps of ``2 (L/c) (nkv/tp) head_dim B`` bytes (K and V), each
      overlapped with ``1/c`` of the rank's attention (:func:`overlapped_seconds`); backward
      sends K/V plus dK/dV (twice the bytes) beside twice the FLOPs (as :func:`projected_seconds`).
    * ``a2a`` (Ulysses): one all-to-all of Q, K, V before and one of O after attention,
      ``(L/c) head_dim (2 nq + 2 nkv)/tp B`` bytes per rank, not overlapped; backward the same.
    * ``a2a+p2p``: that all-to-all over the inner ``a2a_ranks`` (a rank then holds ``L/p``
      tokens, ``nkv/(tp a)`` KV heads: the same ``2 (L/c) (nkv/tp) head_dim B`` bytes per step),
      then ``p-1`` ring steps over ``p2p_ranks``, each beside ``1/p`` of the attention.
    * ``all_gather``: all-gather of K and V (``2 L (nkv/tp) head_dim B`` gathered), not
      overlapped; backward gathers again and reduce-scatters dK/dV.

    ``cp_partition_mode="contiguous"`` with a causal sliding window (``workload.window``): a
    ring of ``n`` ranks (slices of ``L/n`` tokens) runs only the ``ceil(window / (L/n))`` steps
    the window reaches back, and dK/dV then go home in one more hop (not overlapped); zigzag
    needs both neighbours, so its ring stays whole.
    """
    c = len(cp_ranks)
    if c <= 1:
        return LayerComm()
    b = cluster.bytes_per_element
    d = workload.head_dim
    nq = workload.num_attention_heads / tp
    nkv = (workload.num_query_groups or workload.num_attention_heads) / tp
    flops = cluster.attention_rate
    attn_fwd = workload.attention_flops(length) / (3 * workload.num_layers) / c / tp / flops
    kv_chunk = 2 * (length / c) * nkv * d * b

    def ring(ranks: Sequence[int], share: float) -> LayerComm:
        steps = len(ranks) - 1
        if steps <= 0:
            return LayerComm()
        home = 0.0
        if (cp_partition_mode == "contiguous" and workload.window is not None
                and workload.causal and length > 0):
            reach = contiguous_window_reach(length / len(ranks), workload.window, len(ranks))
            if reach < steps:
                steps = reach
                home = p2p_seconds(cluster, kv_chunk, ranks) if reach else 0.0
        if steps <= 0:
            return LayerComm()
        fwd = overlapped_seconds(p2p_seconds(cluster, kv_chunk, ranks), attn_fwd * share)
        bwd = overlapped_seconds(p2p_seconds(cluster, 2 * kv_chunk, ranks), 2 * attn_fwd * share)
        return LayerComm(steps * fwd, steps * bwd + home)

    def a2a(ranks: Sequence[int]) -> LayerComm:
        held = (length / c) * d * (2 * nq + 2 * nkv) * b
        t = collective_seconds(cluster, "all_to_all", held, ranks)
        return LayerComm(t, t)

    if comm_type == "p2p":
        return ring(cp_ranks, 1.0 / c)
    if comm_type == "a2a":
        return a2a(cp_ranks)
    if comm_type == "a2a+p2p":
        return a2a(a2a_ranks) + ring(p2p_ranks, 1.0 / max(1, len(p2p_ranks)))
    if comm_type == "all_gather":
        gathered = 2 * length * nkv * d * b
        ag = collective_seconds(cluster, "all_gather", gathered, cp_ranks)
        rs = collective_seconds(cluster, "reduce_scatter", gathered, cp_ranks)
        return LayerComm(ag, ag + rs)
    raise ValueError(f"unknown cp_comm_type {comm_type!r}")


def tp_layer_seconds(cluster: Cluster, tokens: float, hidden: int,
                     tp_ranks: Sequence[int], overlap_compute: float | None = None,
                     gather_bytes_per_element: float | None = None) -> LayerComm:
    """TP traffic of one layer with sequence parallelism (megatron's layout): forward
    all-gathers the ``tokens x hidden`` activation before the QKV and FC1 GEMMs and
    reduce-scatters after the projection and FC2 (2 + 2 collectives); backward the same.
    Not overlapped (megatron's default), or beside ``overlap_compute`` seconds per direction
    (``--tp-comm-overlap``: Transformer Engine's userbuffers). ``gather_bytes_per_element``
    (default ``bytes_per_element``) prices the all-gathers: 1 under FP8, where Transformer
    Engine quantizes the GEMM input before gathering it (``with_quantized_all_gather = fp8`` in
    its LayerNormLinear / LayerNormMLP); the reduce-scatters of GEMM outputs stay BF16."""
    if len(tp_ranks) <= 1:
        return LayerComm()
    buf = tokens * hidden * cluster.bytes_per_element
    gathered = tokens * hidden * (gather_bytes_per_element or cluster.bytes_per_element)
    t = 2 * collective_seconds(cluster, "all_gather", gathered, tp_ranks) + 2 * (
        collective_seconds(cluster, "reduce_scatter", buf, tp_ranks))
    if overlap_compute is not None:
        return LayerComm(overlapped_seconds(t, overlap_compute),
                         overlapped_seconds(t, 2 * overlap_compute))
    return LayerComm(t, t)


def dp_gradient_seconds(cluster: Cluster, params_per_rank: float, ranks: Sequence[int],
                        distributed_optimizer: bool, window: float, grad_bytes: int = 4,
                        param_bytes: int = 2) -> float:
    """Exposed gradient synchronisation over the DPxCP ``ranks`` (megatron reduces gradients
    over data and context parallel ranks together): with the distributed optimizer a
    reduce-scatter of fp32 gradients (``grad_bytes``; 2 with ``--grad-reduce-in-bf16``) and an
    all-gather of bf16 parameters (``param_bytes``; 1 with FP8 parameter gather), else an
    all-reduce of the gradients; overlapped with ``window`` seconds of backward compute
    (``--overlap-grad-reduce`` / ``--overlap-param-gather``)."""
    if len(ranks) <= 1:
        return 0.0
    if distributed_optimizer:
        t = (collective_seconds(cluster, "reduce_scatter", grad_bytes * params_per_rank, ranks)
             + collective_seconds(cluster, "all_gather", param_bytes * params_per_rank, ranks))
    else:
        t = collective_seconds(cluster, "all_reduce", grad_bytes * params_per_rank, ranks)
    return overlapped_seconds(t, window)


def fsdp_seconds(cluster: Cluster, params_per_rank: float, ranks: Sequence[int],
                 micro_batch_compute: Sequence[float], grad_bytes: int = 4,
                 param_bytes: int = 2) -> float:
    """Exposed FSDP traffic (Megatron-FSDP ``optim_grads_params``, ZeRO-3) over the DPxCP
    ``ranks``: every micro-batch all-gathers the weights for its forward and again for its
    backward and reduce-scatters its gradients (sharded gradients cannot be accumulated
    unsharded), layer by layer beside that micro-batch's compute (prefetching)."""
    if len(ranks) <= 1:
        return 0.0
    t = (2 * collective_seconds(cluster, "all_gather", param_bytes * params_per_rank, ranks)
         + collective_seconds(cluster, "reduce_scatter", grad_bytes * params_per_rank, ranks))
    return sum(overlapped_seconds(t, c) for c in micro_batch_compute)


def pipeline_bubble_seconds(micro_batch_seconds: Sequence[float], pp: int,
                            transfer_seconds: float, vp: int = 1,
                            stage_share: float | None = None) -> float:
    """1F1B with ``pp`` stages (each micro-batch takes ``t * stage_share`` on the fullest
    stage, ``stage_share`` = 1/pp for an even split): the step is ``sum(t) * stage_share`` of
    work plus ``pp - 1`` slots of the longest micro-batch while the pipeline fills and drains,
    each with an activation transfer forward and a gradient transfer back. The interleaved
    schedule with ``vp`` model chunks per stage shrinks each slot to ``1/vp`` of a stage
    (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
    Megatron-LM", Sec. 2.2.2: bubble ``(p-1)/(v m)``)."""
    if pp <= 1 or not micro_batch_seconds:
        return 0.0
    share = 1.0 / pp if stage_share is None else stage_share
    return (pp - 1) * (max(micro_batch_seconds) * share / vp + 2 * transfer_seconds)


# --------------------------------------------------------------------------------------------
# Dynamic (hierarchical) CP on two link classes: the planner's accounting per dynamic group.
# --------------------------------------------------------------------------------------------


def dynamic_group_seconds(workload: GPTWorkload, length: int, ranks: Sequence[int],
                          cluster: Cluster, hcp_a2a_size: int | None = None) -> float:
    """Seconds one rank of the CP group ``ranks`` spends on ``length`` (fwd + bwd, TP 1).

    Compute at the cluster's FLOP rate plus, per layer, :func:`cp_layer_seconds`: a flat ring
    over ``ranks`` (``p2p``), or with ``hcp_a2a_size = a`` an all-to-all over ``min(c, a)``
    contiguous ranks (pure ``a2a`` when ``c <= a``: no ring term) and a ring over every
    ``a``-th rank. Each level runs on the slowest link its ranks need: inside a node the
    intra-node link, across nodes the inter-node one. All a2a groups (rings) of a block are
    priced and the slowest counts (they differ only when a node is not a power of two). An a2a
    level larger than the KV head count replicates the KV heads up to it (the reference
    backend's rule): its traffic is priced with that many KV heads.
    """
    if workload.mode != "flops":
        raise ValueError("projection needs workload.mode='flops' (it converts FLOPs to seconds)")
    c = len(ranks)
    a, p = dynamic_levels(c, hcp_a2a_size)
    compute = cluster.compute_seconds(workload, length, c, a)
    if c <= 1:
        return compute
    if a > (workload.num_query_groups or workload.num_attention_heads):
        workload = dataclasses.replace(workload, num_query_groups=a)  # replicated KV heads
    mode = workload.cp_partition_mode
    if a == 1:
        comm = cp_layer_seconds(workload, cluster, length, 1, "p2p", ranks,
                                cp_partition_mode=mode)
    elif p == 1:
        comm = cp_layer_seconds(workload, cluster, length, 1, "a2a", ranks)
    else:
        comm = max((cp_layer_seconds(workload, cluster, length, 1, "a2a+p2p", ranks,
                                     a2a_ranks=ranks[i * a:(i + 1) * a],
                                     p2p_ranks=ranks[i % a::a], cp_partition_mode=mode)
                    for i in range(max(p, a))),
                   key=lambda x: x.forward + x.backward)
    return compute + workload.num_layers * (comm.forward + comm.backward)


def group_pricer(workload: GPTWorkload, hw: Hardware | Cluster,
                 hcp_a2a_size: int | None = None) -> Callable[[int, int, int], float]:
    """``price(length, start, size)``: seconds per rank of a group of ``size`` contiguous ranks
    from ``start`` (memoised; aligned blocks on power-of-two nodes share one price per size)."""
    if isinstance(hw, Hardware):
        if hcp_a2a_size is not None:
            raise ValueError(
                f"hcp_a2a_size={hcp_a2a_size} needs a two-link Cluster (the a2a level's link "
                "differs from the ring's): pass a Cluster instead of a Hardware")
        return lambda length, start, size: projected_seconds(workload, length, size, hw)
    cluster = hw
    g = cluster.gpus_per_node
    uniform = g >= 1 and g & (g - 1) == 0  # aligned power-of-two blocks: same shape per size

    @functools.cache
    def price(length: int, start: int, size: int) -> float:
        if uniform and start and size & (size - 1) == 0 and start % size == 0:
            return price(length, 0, size)
        return dynamic_group_seconds(workload, length, range(start, start + size), cluster,
                                     hcp_a2a_size)

    return price
