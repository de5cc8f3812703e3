"""Enumerate the layouts CPConfig accepts and estimate step time and memory per GPU for each.

The cost terms are :mod:`megatron_hcp.dynamic_cp.projection`'s (the dynamic-CP scheduler's
model, with its two link classes); the memory model is documented in :mod:`megatron_hcp.planner`.
"""

from __future__ import annotations

import dataclasses
import heapq
from dataclasses import dataclass, field

from ..config import CPConfig, CPConfigError, Topology
from ..dynamic_cp.projection import (
    Cluster,
    LayerComm,
    cp_layer_seconds,
    dp_gradient_seconds,
    fsdp_seconds,
    p2p_seconds,
    pipeline_bubble_seconds,
    tp_layer_seconds,
)
from ..dynamic_cp.scheduler import schedule
from ..dynamic_cp.workload import (
    ScheduleError,
    min_group_size,
    partition_load,
    tokens_per_rank,
)
from ..sharding import layout_unit
from .inputs import Batch, ModelSpec, Options

__all__ = [
    "Estimate",
    "Layout",
    "label",
    "propose",
    "enumerate_layouts",
    "estimate",
    "memory_per_gpu",
    "usable_bytes",
]

#: bytes per parameter: bf16 weight 2 + fp32 main grad 4 + fp32 master 4 + Adam m 4 + v 4
#: (Megatron-LM distributed optimizer docs: 18 without, 6 + 12/d with it over d DPxCP ranks);
#: ``--grad-reduce-in-bf16`` keeps the main grad in bf16 (2 bytes less). FP8 (the Bridge
#: FP8-CS recipe: ``fp8_param_gather``) keeps the layer weights as FP8 plus their FP8
#: transpose, again 2 bytes per parameter
WEIGHT_GRAD_BYTES = 6
OPTIMIZER_BYTES = 12
#: output logits on the last stage: bf16 logits + the fp32 copy the vocab-parallel cross entropy
#: keeps for its backward
LOGIT_BYTES = 6
#: bytes per parameter and micro-batch the weight-gradient GEMM moves to update the fp32 main
#: gradient (read + write; megatron's gradient-accumulation fusion accumulates into it); half
#: with bf16 main grads
MAIN_GRAD_BYTES = 8
#: Megatron-FSDP: unsharded bf16 weights of the layer being computed and of the prefetched one
FSDP_GATHERED_LAYERS = 2
#: working buffers of the layer being computed, per token and hidden unit, that TP does not
#: shrink: the all-gathered GEMM input (sequence parallelism gathers the whole sequence of the
#: CP rank) and the gradient of the layer input, 2 bytes each
WORKING_BYTES = 4
#: share of GPU memory kept free for the CUDA context, NCCL buffers and allocator fragmentation
MEMORY_RESERVE = 0.10
CAP_ALIGN = 256  # dynamic-CP token cap rounded down to a multiple of this


def propose(model: ModelSpec, options: Options, *, tp: int, cp: int, pp: int, dp: int,
            cp_comm_type: str | None = None, hcp: tuple[int, int] | None = None,
            seq_length: int | None = None, dynamic: bool = False, min_cp: int = 1,
            cap: int | None = None, mode: str = "zigzag") -> CPConfig:
    """The CPConfig of one candidate setup of ``model``: what the planner validates and
    resolves (``cp_comm_type`` None: CP = 1; a dynamic candidate's DPxCP group is ``cp * dp``
    with ``cap`` tokens per rank)."""
    return CPConfig(
        context_parallel_size=cp, cp_comm_type=cp_comm_type,
        hierarchical_context_parallel_sizes=list(hcp) if hcp else None,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        data_parallel_size=dp, num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups, num_layers=model.num_layers,
        seq_length=None if dynamic else seq_length,
        dynamic_context_parallel=dynamic, min_dynamic_context_parallel_size=min_cp,
        max_seqlen_per_dp_cp_rank=cap, calculate_per_token_loss=True if dynamic else None,
        cp_attention_backend=options.attention_backend, te_version=options.te_version,
        cp_partition_mode=mode, window_size=None if model.window is None else [model.window, 0])


def label(config: CPConfig, vp: int = 1) -> str:
    """A candidate's name in the report: ``TP2 PP2 VP2 CP4 a2a+p2p [2,2] DP2``,
    ``TP1 dynamic-CP8 min1 cap16384``."""
    tp, pp, cp = (config.tensor_model_parallel_size, config.pipeline_model_parallel_size,
                  config.context_parallel_size)
    mode = config.cp_partition_mode
    parts = [f"TP{tp}", f"PP{pp}"] if pp > 1 else [f"TP{tp}"]
    if vp > 1:
        parts.append(f"VP{vp}")
    if config.dynamic:  # CP x DP ranks share the dynamic groups: no separate DP size
        cap = config.max_seqlen_per_dp_cp_rank
        return " ".join(parts + [f"dynamic-CP{config.dp_cp_size} "
                                 f"min{config.min_dynamic_context_parallel_size}"
                                 + (f" cap{cap}" if cap else "")
                                 + (f" {mode}" if mode != "zigzag" else "")])
    if cp > 1:
        hcp = config.hierarchical_context_parallel_sizes
        parts.append(f"CP{cp} {config.cp_comm_type}"
                     + (f" [{hcp[0]},{hcp[1]}]" if hcp else "")
                     + (f" {mode}" if mode != "zigzag" else ""))
    parts.append(f"DP{config.data_parallel_size}")
    return " ".join(parts)


@dataclass(frozen=True, eq=False)
class Layout:
    """One candidate the planner ranks: its :class:`~megatron_hcp.config.Topology` (the
    candidate's CPConfig resolved on the cluster's ranks) and the pipeline schedule's virtual
    stages per rank. Every size and rank list is the topology's; the names below read it."""

    topology: Topology
    vp: int = 1  # virtual pipeline (interleaved 1F1B) model chunks per stage

    @classmethod
    def of(cls, model: ModelSpec, options: Options, *, world: int | None = None, vp: int = 1,
           **setup: object) -> Layout:
        """The candidate :func:`propose` describes, resolved on ``world`` ranks (default: its
        own size); raises :class:`~megatron_hcp.config.CPConfigError` when CPConfig refuses
        it."""
        return cls(propose(model, options, **setup).resolve(world), vp)  # type: ignore[arg-type]

    @property
    def config(self) -> CPConfig:
        return self.topology.config

    @property
    def tp(self) -> int:
        return self.topology.tp

    @property
    def cp(self) -> int:
        return self.topology.cp

    @property
    def pp(self) -> int:
        return self.topology.pp

    @property
    def dp(self) -> int:
        return self.topology.dp

    @property
    def hcp(self) -> tuple[int, ...] | None:
        return self.topology.hierarchical_sizes

    @property
    def dynamic(self) -> bool:
        return self.topology.dynamic

    @property
    def min_cp(self) -> int:
        return self.config.min_dynamic_context_parallel_size

    @property
    def cp_comm_type(self) -> str | None:
        return self.config.cp_comm_type

    @property
    def cap(self) -> int | None:
        return self.config.max_seqlen_per_dp_cp_rank

    @property
    def mode(self) -> str:
        return self.config.cp_partition_mode

    @property
    def seq_length(self) -> int | None:
        return self.config.seq_length

    @property
    def label(self) -> str:
        return label(self.config, self.vp)


@dataclass
class Estimate:
    layout: Layout
    recompute: str
    step_seconds: float
    breakdown: dict[str, float]  # compute, cp, tp, pp_bubble, dp (seconds, sum = step)
    memory: dict[str, float]  # bytes per GPU: weights_optimizer, activations, logits, total
    fits: bool
    tokens_per_second_per_gpu: float
    micro_batches: int
    advice: list[str] = field(default_factory=list)
    detail: dict = field(default_factory=dict)  # link classes etc. for the "why" sentence


def _divisors(n: int) -> list[int]:
    """The divisors of ``n`` in increasing order (O(sqrt n))."""
    small = [d for d in range(1, int(n ** 0.5) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def _round_up(x: int, unit: int) -> int:
    return -(-x // unit) * unit


def enumerate_layouts(model: ModelSpec, batch: Batch, cluster: Cluster, options: Options
                      ) -> tuple[list[Layout], list[tuple[CPConfig, str]]]:
    """Every static layout (and, for a length distribution, dynamic-CP layout without its cap)
    with CPConfig's verdict: (accepted, [(rejected, reason)]). The token cap of dynamic layouts
    is set by :func:`estimate` from memory and validated again there."""
    world = cluster.world_size
    accepted: list[Layout] = []
    rejected: list[tuple[CPConfig, str]] = []
    max_tp = options.max_tp or cluster.gpus_per_node
    gpn = cluster.gpus_per_node
    for tp in _divisors(world):
        # TP groups are contiguous ranks: inside one node (tp | gpn), or whole nodes (--max-tp)
        if tp > max_tp or (gpn % tp if tp <= gpn else tp % gpn):
            continue
        for pp in _divisors(world // tp):
            if model.num_layers % pp:
                continue  # megatron: layers split evenly over the stages
            rest = world // (tp * pp)
            for cp in _divisors(rest):
                dp = rest // cp
                seq = batch.max_length if batch.fixed else _round_up(batch.max_length, 2 * cp)
                kinds: list[tuple[str | None, tuple[int, int] | None, str]] = [
                    (None, None, "zigzag")]
                if cp > 1:
                    kinds = [("p2p", None), ("all_gather", None), ("a2a", None)]
                    kinds += [("a2a+p2p", (a, cp // a)) for a in _divisors(cp) if 1 < a < cp]
                    # a windowed model: the ring layouts also in the contiguous layout, whose
                    # ring stops at the window's reach (TE refuses it: rejected, named)
                    modes = ("zigzag", "contiguous") if model.window is not None else (
                        "zigzag",)
                    kinds = [(k, h, m) for k, h in kinds for m in modes
                             if m == "zigzag" or k in ("p2p", "a2a+p2p")]
                for kind, hcp, mode in kinds:
                    config = propose(model, options, tp=tp, cp=cp, pp=pp, dp=dp,
                                     cp_comm_type=kind, hcp=hcp, seq_length=seq, mode=mode)
                    if batch.fixed and len(batch.lengths) % dp:
                        rejected.append((config, f"global batch {len(batch.lengths)} is not "
                                                 f"divisible by DP={dp}"))
                        continue
                    try:  # a candidate is a setup that resolves to a Topology
                        accepted.append(Layout(config.resolve(world)))
                    except CPConfigError as err:
                        rejected.append((config, "; ".join(str(v) for v in err.violations)))
            n = rest
            if not batch.fixed and n >= 2 and n & (n - 1) == 0:
                # dynamic groups are rings: a windowed model also in the contiguous layout
                modes = ("zigzag", "contiguous") if model.window is not None else ("zigzag",)
                for m, mode in ((m, mode) for m in options.min_dynamic_sizes for mode in modes):
                    if m > n:
                        continue
                    # the token cap is set by estimate() from memory; the longest sequence
                    # probes it here, so that what the backend refuses is named
                    config = propose(model, options, tp=tp, cp=1, pp=pp, dp=n,
                                     cp_comm_type="p2p", dynamic=True, min_cp=m,
                                     cap=batch.max_length, mode=mode)
                    try:
                        accepted.append(Layout(config.resolve(world)))
                    except CPConfigError as err:
                        rejected.append((dataclasses.replace(config,
                                                             max_seqlen_per_dp_cp_rank=None),
                                         "; ".join(str(v) for v in err.violations)))
    return accepted, rejected


# ------------------------------------------------------------------------------- memory
def _activation_bytes_per_token(model: ModelSpec, tp: int, precision: str = "bf16") -> float:
    """Per layer and token, sequence parallel + selective recompute (Korthikanti et al. 2022,
    Sec. 4, generalised to GQA / gated MLP): norms 4h, QKV input 2h, Q/K/V 2q+4kv, attention
    output 2q, FC1 input 2h, MLP 4f (gated: 6f), dropout masks 2h, softmax stats 4 nq; / tp.
    FP8 (Transformer Engine) saves the inputs of the four linear layers quantized, 1 byte per
    element: QKV input h, attention output q, FC1 input h, FC2 input f (Q/K/V, the norms and
    the MLP activation's input stay BF16: attention and the element-wise ops run in BF16)."""
    w = model.workload()
    h, q, kv, f = model.hidden_size, w.query_width, model.kv_heads * w.head_dim, model.ffn
    mlp = (6 if model.gated_mlp else 4) * f
    total = (4 * h + 2 * h + 2 * q + 4 * kv + 2 * q + 2 * h + mlp + 2 * h
             + 4 * model.num_attention_heads)
    if precision == "fp8":
        total -= h + q + h + f
    return total / tp


def stage_layers(model: ModelSpec, pp: int) -> int:
    """Transformer layers on the fullest pipeline stage (an uneven split puts the remainder
    on some stages; the fullest one sets the pace)."""
    return -(-model.num_layers // pp)


def memory_per_gpu(model: ModelSpec, layout: Layout, tokens: int, in_flight: int,
                   recompute: str, options: Options, cluster: Cluster) -> dict[str, float]:
    """Bytes on the fuller of the first and last pipeline stage (``tokens`` per rank and
    micro-batch, ``in_flight`` micro-batches held by the first stage; the interleaved schedule
    holds ``1 + (p-1)/(p vp)`` times that, Korthikanti et al. 2022, Sec. 4.2.3)."""
    tp, pp = layout.tp, layout.pp
    layers = stage_layers(model, pp)
    embed = model.vocab_size * model.hidden_size
    layer_params = layers * model.params_per_layer()
    first = layer_params + embed
    last = layer_params + (embed if (model.untie_embeddings or pp > 1) else 0)
    if pp == 1:
        first = last = model.params()
    d = layout.dp * layout.cp
    weight_grad = WEIGHT_GRAD_BYTES - (2 if options.grad_reduce_in_bf16 else 0)
    per_param = weight_grad + (OPTIMIZER_BYTES / d if options.distributed_optimizer
                               else OPTIMIZER_BYTES)
    gathered = 0.0
    if options.fsdp:  # everything sharded, plus the gathered weights of two layers
        per_param = (weight_grad + OPTIMIZER_BYTES) / d
        gathered = FSDP_GATHERED_LAYERS * 2 * model.params_per_layer() / tp
    selective = _activation_bytes_per_token(model, tp, options.precision)
    working = WORKING_BYTES * model.hidden_size * tokens
    if recompute == "full":  # layer inputs only, plus one layer being recomputed
        per_mb = (layers * 2 * model.hidden_size / tp) * tokens
        working += selective * tokens
    else:
        per_mb = layers * selective * tokens
    if pp > 1 and layout.vp > 1:
        in_flight = in_flight * (1 + (pp - 1) / (pp * layout.vp))
    w = model.workload()
    kv_local = model.kv_heads / tp * w.head_dim * cluster.bytes_per_element
    if layout.cp == 1:  # no CP, whatever cp_comm_type a recipe's config carries: no buffers
        pass
    elif layout.cp_comm_type == "all_gather":
        working += 2 * tokens * layout.cp * kv_local  # gathered K and V of one layer
    elif layout.cp_comm_type in ("p2p", "a2a+p2p"):
        working += 2 * 2 * tokens * kv_local  # K/V chunk in flight and the one being used
    logits = LOGIT_BYTES * tokens * model.vocab_size / tp
    stages = [  # (weights + optimizer, activations, logits) of the first and the last stage
        (first / tp * per_param + gathered, per_mb * in_flight + working, 0.0),
        (last / tp * per_param + gathered, per_mb + working, logits),
    ]
    if pp == 1:
        stages = [(first / tp * per_param + gathered, per_mb * in_flight + working, logits)]
    weights, acts, out = max(stages, key=sum)
    return {"weights_optimizer": weights, "activations": acts, "logits": out,
            "total": weights + acts + out}


def _usable(cluster: Cluster) -> float:
    return cluster.memory_bytes * (1 - MEMORY_RESERVE)


# ------------------------------------------------------------------------------- time
class _Costs:
    """Per-micro-batch seconds of one rank for the whole model (the stage share is / PP)."""

    def __init__(self, model: ModelSpec, layout: Layout, cluster: Cluster, options: Options,
                 recompute: str, grid: Topology):
        self.model, self.layout, self.cluster = model, layout, cluster
        self.options, self.recompute = options, recompute
        self.workload = model.workload()
        self.tp_ranks = grid.groups["tp"][0]
        self.cp_ranks = grid.groups["cp"][0]
        self.a2a_ranks = grid.hcp[0][0] if grid.hcp else ()
        self.p2p_ranks = grid.hcp[1][0] if grid.hcp else ()
        self._cache: dict = {}

    def sequence(self, length: int, group: tuple[int, ...] | None = None
                 ) -> tuple[float, float, float]:
        """(GEMM, attention, exposed CP) seconds of one sequence on ``group`` (default: the CP
        group); full recompute adds one forward (x 4/3) to the layers' GEMMs and attention."""
        key = (length, group)
        if key not in self._cache:
            w, t = self.workload, self.layout.tp
            ranks = group if group is not None else self.cp_ranks
            c = len(ranks)
            full = self.recompute == "full"
            again = 4 / 3 if full else 1.0
            linear = length * w.linear_flops_per_token() / (c * t) * again
            logits = length / c * w.logits_flops_per_token(self.model.vocab_size) / t
            gemm = (linear + logits) / self.cluster.flops_per_second
            attention = w.attention_flops(length) / (c * t) * again / self.cluster.attention_rate
            kind = self.layout.cp_comm_type or "p2p"
            if c > 1 and kind != "a2a":  # the busiest rank's share of the causal work
                ring = len(self.p2p_ranks) if kind == "a2a+p2p" else c
                attention *= partition_load(length, ring, self.layout.mode, w.window)
            comm = cp_layer_seconds(w, self.cluster, length, t, kind, ranks, self.a2a_ranks,
                                    self.p2p_ranks, self.layout.mode) if c > 1 else LayerComm()
            cp = w.num_layers * ((2 if full else 1) * comm.forward + comm.backward)
            self._cache[key] = (gemm, attention, cp)
        return self._cache[key]

    def compute(self, gemm: float, attention: float) -> float:
        """Compute seconds of one micro-batch: its GEMMs no faster than streaming the weights
        once per GEMM pass from HBM (roofline: forward and data-gradient reads at the GEMM
        precision, the fp32 main-gradient update of the weight gradient, one more forward read
        with full recompute), plus its attention."""
        hbm = self.cluster.memory_bytes_per_second
        if not hbm:
            return gemm + attention
        b = 1 if self.options.precision == "fp8" else 2
        main_grad = MAIN_GRAD_BYTES // (2 if self.options.grad_reduce_in_bf16 else 1)
        per_param = (3 if self.recompute == "full" else 2) * b + main_grad
        params = (self.model.num_layers * self.model.params_per_layer()
                  + self.model.vocab_size * self.model.hidden_size) / self.layout.tp
        return max(gemm, params * per_param / hbm) + attention

    def tp_seconds(self, tokens_per_rank: float, compute: float) -> float:
        w, t = self.workload, self.layout.tp
        overlap = None
        if self.options.tp_comm_overlap:
            overlap = compute / 3 / w.num_layers  # forward compute of one layer
        comm = tp_layer_seconds(self.cluster, tokens_per_rank, self.model.hidden_size,
                                self.tp_ranks if t > 1 else (), overlap,
                                1 if self.options.precision == "fp8" else None)
        return w.num_layers * ((2 if self.recompute == "full" else 1) * comm.forward
                               + comm.backward)


def _pack(lengths: list[int], capacity: int, unit: int) -> list[list[int]]:
    """First-fit decreasing of sequences (padded to ``unit``) into ``capacity``-token bins."""
    bins: list[list[int]] = []
    room: list[int] = []
    for length in sorted(lengths, reverse=True):
        size = _round_up(length, unit)
        for i, r in enumerate(room):
            if size <= r:
                bins[i].append(length)
                room[i] -= size
                break
        else:
            bins.append([length])
            room.append(capacity - size)
    return bins


def _step(micro: list[list[tuple[float, float, float]]], pp: int, xfer: float, share: float,
          vp: int = 1) -> tuple[float, dict[str, float], int]:
    """micro[r] = (compute, cp, tp) per micro-batch of replica r (whole model) -> slowest
    replica's step; ``share`` of each on the fullest of the ``pp`` stages."""
    best = None
    for mbs in micro:
        if not mbs:
            continue
        compute, cp, tp = (sum(m[i] for m in mbs) * share for i in range(3))
        bubble = pipeline_bubble_seconds([sum(m) for m in mbs], pp, xfer, vp, share)
        step = compute + cp + tp + bubble
        if best is None or step > best[0]:
            best = (step, {"compute": compute, "cp": cp, "tp": tp, "pp_bubble": bubble},
                    len(mbs))
    assert best is not None
    return best


def estimate(model: ModelSpec, batch: Batch, cluster: Cluster, options: Options,
             layout: Layout) -> Estimate | None:
    """Step time and memory of ``layout``; the recompute mode per ``options.recompute``.
    Returns None for a layout that does not resolve (``CPConfig.resolve``), e.g. a dynamic one
    whose token cap CPConfig rejects."""
    modes = ["selective", "full"] if options.recompute == "auto" else [options.recompute]
    result = None
    for mode in modes:
        result = _estimate(model, batch, cluster, options, layout, mode)
        if result is None or result.fits:
            return result
    return result


def _dynamic_cap(model: ModelSpec, batch: Batch, cluster: Cluster, options: Options,
                 layout: Layout, recompute: str) -> tuple[int, bool]:
    """The largest token cap per rank that fits memory (aligned), or the smallest legal one
    (then it does not fit)."""
    n = layout.dp
    need = tokens_per_rank(batch.max_length, n, layout.mode)
    probe = memory_per_gpu(model, layout, 0, layout.pp, recompute, options, cluster)
    per_token = (memory_per_gpu(model, layout, 1024, layout.pp, recompute, options, cluster)
                 ["total"] - probe["total"]) / 1024
    cap = int((_usable(cluster) - probe["total"]) / per_token) // CAP_ALIGN * CAP_ALIGN
    cap = min(cap, _round_up(batch.tokens, CAP_ALIGN))
    if cap >= need:
        return cap, True
    return _round_up(need, CAP_ALIGN), False


def _estimate(model: ModelSpec, batch: Batch, cluster: Cluster, options: Options,
              layout: Layout, recompute: str) -> Estimate | None:
    lengths = list(batch.lengths)
    if layout.dynamic:
        cap, _ = _dynamic_cap(model, batch, cluster, options, layout, recompute)
        n = layout.dp
        try:
            cp = min_group_size(batch.max_length, cap, n, layout.min_cp, layout.mode)
        except ScheduleError:
            cp = n
        try:  # the candidate at its token cap and smallest group: a topology of its own
            layout = Layout(dataclasses.replace(
                layout.config, context_parallel_size=cp, data_parallel_size=n // cp,
                max_seqlen_per_dp_cp_rank=cap).resolve(cluster.world_size), layout.vp)
        except CPConfigError:
            return None
    grid = layout.topology
    costs = _Costs(model, layout, cluster, options, recompute, grid)
    detail: dict = {}
    if layout.dynamic:
        dp_cp = tuple(grid.groups["dp_cp"][0])
        n = len(dp_cp)
        try:  # the scheduler ranks its plans with the DPxCP group's slowest link
            workload = dataclasses.replace(model.workload(), cp_partition_mode=layout.mode)
            plan = schedule(lengths, n, layout.cap, workload=workload,
                            min_cp_size=layout.min_cp, hardware=cluster.hardware(dp_cp))
        except ScheduleError:
            return None
        per_mb = []
        sizes: dict[int, int] = {}
        for mb in plan.micro_batches:
            worst = (0.0, 0.0, 0.0)
            for g in mb.groups:
                ranks = tuple(dp_cp[i] for i in g.ranks)
                gemm = attn = cpt = 0.0
                tokens = 0
                for s in g.samples:
                    x, y, z = costs.sequence(lengths[s], ranks)
                    gemm, attn, cpt = gemm + x, attn + y, cpt + z
                    tokens += tokens_per_rank(lengths[s], len(ranks), layout.mode)
                    sizes[len(ranks)] = sizes.get(len(ranks), 0) + 1
                comp = costs.compute(gemm, attn) if g.samples else 0.0
                tpt = costs.tp_seconds(tokens, comp)
                if comp + cpt + tpt > sum(worst):
                    worst = (comp, cpt, tpt)
            per_mb.append(worst)
        replicas = [per_mb]
        tokens_mb = layout.cap
        detail["group_sizes"] = dict(sorted(sizes.items()))
    else:
        c = layout.cp
        # a fixed-length batch has one kind of micro-batch, one sequence each
        bins = ([lengths[:1]] if batch.fixed
                else _pack(lengths, layout.seq_length, layout_unit(c, layout.mode)))
        seconds: dict[tuple[int, ...], tuple[float, float, float]] = {}
        mbs = []
        for b in bins:  # each kind of micro-batch is costed once
            key = tuple(b)
            if key not in seconds:
                gemm, attn, cpt = (sum(costs.sequence(x)[i] for x in b) for i in range(3))
                comp = costs.compute(gemm, attn)
                tokens = sum(tokens_per_rank(x, c, layout.mode) for x in b)
                seconds[key] = (comp, cpt, costs.tp_seconds(tokens, comp))
            mbs.append(seconds[key])
        if batch.fixed:
            mbs *= len(lengths)
        if len(seconds) == 1:  # every micro-batch alike: each replica holds q or q + 1
            q, extra = divmod(len(mbs), layout.dp)
            replicas = [[mbs[0]] * (q + 1)] * (extra > 0) + [[mbs[0]] * q] * (extra < layout.dp)
        else:  # longest first to the least-loaded replica (a heap: O(log DP) each)
            replicas = [[] for _ in range(layout.dp)]
            loads = [(0.0, r) for r in range(layout.dp)]
            for m in sorted(mbs, key=sum, reverse=True):
                load, r = heapq.heappop(loads)
                replicas[r].append(m)
                heapq.heappush(loads, (load + sum(m), r))
            # identical replicas take identical steps: each kind once
            replicas = list({tuple(r): r for r in replicas}.values())
        tokens_mb = layout.seq_length // c
    pp_bytes = tokens_mb * model.hidden_size / layout.tp * cluster.bytes_per_element
    xfer = p2p_seconds(cluster, pp_bytes, grid.groups["pp"][0]) if layout.pp > 1 else 0.0
    share = stage_layers(model, layout.pp) / model.num_layers
    step, parts, m = _step(replicas, layout.pp, xfer, share, layout.vp)
    # --overlap-grad-reduce: the gradient reduction runs beside the last micro-batch's backward
    window = min(x[0] for r in replicas for x in r) * 2 / 3 * share
    params_per_rank = model.params() / layout.pp / layout.tp
    dp_cp = grid.groups["dp_cp"][0]
    sizes = {"grad_bytes": 2 if options.grad_reduce_in_bf16 else 4,  # fp8: FP8 param gather
             "param_bytes": 1 if options.precision == "fp8" else 2}
    if options.fsdp:  # every micro-batch of the slowest replica, beside its own compute
        slowest = max((r for r in replicas if r), key=lambda r: sum(map(sum, r)))
        parts["dp"] = fsdp_seconds(cluster, params_per_rank, dp_cp,
                                   [x[0] * share for x in slowest], **sizes)
    else:
        parts["dp"] = dp_gradient_seconds(cluster, params_per_rank, dp_cp,
                                          options.distributed_optimizer, window, **sizes)
    step += parts["dp"]
    mem = memory_per_gpu(model, layout, tokens_mb, min(layout.pp, m), recompute, options,
                         cluster)
    advice = layout.config.validate()  # resolved: valid; its advice
    detail.update({
        "cp_crosses_nodes": cluster.crosses_nodes(grid.groups["cp"][0]),
        "a2a_crosses_nodes": bool(grid.hcp) and cluster.crosses_nodes(grid.hcp[0][0]),
        "p2p_crosses_nodes": bool(grid.hcp) and cluster.crosses_nodes(grid.hcp[1][0]),
        "tp_crosses_nodes": cluster.crosses_nodes(grid.groups["tp"][0]),
        "dp_cp_size": len(grid.groups["dp_cp"][0]),
    })
    return Estimate(layout=layout, recompute=recompute, step_seconds=step, breakdown=parts,
                    memory=mem, fits=mem["total"] <= _usable(cluster),
                    tokens_per_second_per_gpu=batch.tokens / step / cluster.world_size,
                    micro_batches=m, advice=advice, detail=detail)


def usable_bytes(cluster: Cluster) -> float:
    """GPU memory a layout may use (the rest is :data:`MEMORY_RESERVE`)."""
    return _usable(cluster)
