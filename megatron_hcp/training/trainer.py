"""Train a tiny megatron-core GPT with megatron's own schedule, DDP and optimizer (any backend).

``train_tiny_gpt(spec)`` runs on every rank of an initialized world whose model-parallel
groups are set (MPU path) or passed as ``pg_collection`` (decentralized path). It returns, on
every rank, the per-step ``lm loss`` (per-token mean over the global batch) and gradient norm, so
runs with different parallel layouts can be compared step by step.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from ..config import CPConfig, CPConfigError, Topology, Violation, fields_read_by
from ..dynamic_cp.step import plan_step, schedule_arguments
from ..layers.norm import uses_torch_norms, with_sequence_parallel_norms
from ..parallel_state.groups import collective_device
from .checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from .data import (
    CORPORA,
    global_batch,
    markov_sample,
    static_cp_micro_batches,
    varlen_lengths,
    varlen_sample,
)

__all__ = ["TinyGPTSpec", "VarLen", "train_tiny_gpt"]


@dataclass
class VarLen:
    """Variable-length packed (THD) data: lognormal lengths (median ``mean``, shape ``sigma``)
    clipped to ``[min_len, max_len]``; static runs pack ``samples_per_micro_batch`` samples."""

    min_len: int = 16
    max_len: int = 256
    mean: float = 64.0
    sigma: float = 1.2
    samples_per_micro_batch: int = 1
    lengths: list[int] | None = None  # fixed lengths for every step (instead of drawing them)
    corpus: str = "motif"  # "motif" (per-sample repeated motifs) or "markov" (data.CORPORA)

    def __post_init__(self) -> None:
        if self.corpus not in CORPORA:
            raise ValueError(f"varlen corpus={self.corpus!r}: use one of {', '.join(CORPORA)}")


_CP_FIELDS = frozenset(CPConfig.field_names())
# the model shape the CP rules read (CPConfig holds them) and its defaults here
_MODEL_DEFAULTS = {"num_layers": 2, "num_attention_heads": 4, "seq_length": 64}


@dataclass
class TinyGPTSpec:
    """Model, data and parallel settings of a tiny GPT run (sizes are megatron's).

    Every CP and parallel setting, and the model shape the CP rules read (layers, heads, KV
    heads, sequence length), lives in ``config`` (:class:`~megatron_hcp.config.CPConfig`, the
    one validated input); every size derived from it is read from :attr:`topology`
    (``spec.topology.cp``, ``spec.topology.dynamic``), never from the config's fields again.
    :meth:`of` takes them flat.
    """

    config: CPConfig = field(default_factory=CPConfig)
    hidden_size: int = 64
    vocab_size: int = 128
    micro_batch_size: int = 2
    global_batch_size: int = 8
    steps: int = 3
    lr: float = 1e-3
    seed: int = 1234
    share_embeddings_and_output_weights: bool = False
    sequence_parallel: bool = False  # megatron's; norms become SequenceParallelTorchNorm
    device: str = "cpu"  # "cuda": model and batches on this rank's current CUDA device (NCCL)
    attention_backend: str = "reference"
    virtual_pipeline_model_parallel_size: int | None = None
    varlen: VarLen | None = None
    checkpoint_dir: str | None = None  # <dir>/iter_<step>/rank_<r>.pt + manifest.json
    save_at_steps: tuple[int, ...] = ()  # save after these many steps
    resume_from_step: int | None = None  # load <dir>/iter_<step> and continue from there
    extra_config: dict[str, Any] = field(default_factory=dict)
    # (step, row or sample id, length) -> that sequence's loss mask (1 = counted); None: the
    # data's own mask (its first two tokens masked). A module-level function, so that it
    # reaches the ranks.
    loss_mask: Callable[[int, int, int], torch.Tensor] | None = None
    max_position_embeddings: int | None = None  # GPTModel's max_sequence_length (seq_length)

    def __post_init__(self) -> None:
        missing = {k: v for k, v in _MODEL_DEFAULTS.items() if getattr(self.config, k) is None}
        if missing:
            self.config = dataclasses.replace(self.config, **missing)

    @property
    def topology(self) -> Topology:
        """The one topology of ``config`` (``CPConfig.resolve``: validated, every size and group
        derived once; resolved again only when ``config`` is replaced)."""
        cached = self.__dict__.get("_topology")
        if cached is None or cached.config is not self.config:
            cached = self.config.resolve()
            self.__dict__["_topology"] = cached
        return cached

    @classmethod
    def of(cls, **kwargs: Any) -> TinyGPTSpec:
        """Flat keywords: CPConfig's fields go to ``config``, the others to the spec."""
        cp = {k: kwargs.pop(k) for k in list(kwargs) if k in _CP_FIELDS}
        return cls(config=CPConfig(**cp), **kwargs)


# TransformerConfig fields the trainer sets from the spec (extra_config may not set them)
_SET_BY_SPEC = (*fields_read_by("transformer"), "hidden_size",
                "virtual_pipeline_model_parallel_size", "sequence_parallel")


def _transformer_config(spec: TinyGPTSpec):
    from megatron.core.transformer.transformer_config import (
        MLATransformerConfig,
        TransformerConfig,
    )

    taken = sorted(set(spec.extra_config) & set(_SET_BY_SPEC))
    if taken:
        raise CPConfigError([Violation(
            f"extra_config[{name!r}]", spec.extra_config[name],
            "is set by the trainer from the spec (its CPConfig or its own field)",
            f"set {name} on the spec or its config instead") for name in taken])
    # multi-latent attention (extra_config multi_latent_attention=True plus MLA's head dims)
    config_class = (MLATransformerConfig if spec.extra_config.get("multi_latent_attention")
                    else TransformerConfig)
    mla = spec.extra_config.get("multi_latent_attention")
    if spec.config.cp_partition_mode != "zigzag" and mla:
        raise CPConfigError([Violation(
            "cp_partition_mode", spec.config.cp_partition_mode,
            "multi-latent attention applies RoPE in its own code, which cuts zigzag only",
            "use cp_partition_mode=zigzag with MLA")])
    extra = dict(spec.extra_config)
    window = spec.config.window_size  # the CP rules read it; megatron's attention runs it
    if window is not None:
        given = extra.get("window_size")
        if given is not None and tuple(given) != tuple(window):
            raise CPConfigError([Violation(
                "extra_config['window_size']", given,
                f"differs from the config's window_size={list(window)}",
                "set window_size once, on the config")])
        extra["window_size"] = tuple(window)
    config = config_class(
        num_layers=spec.config.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.config.num_attention_heads,
        num_query_groups=spec.config.num_query_groups,
        tensor_model_parallel_size=spec.topology.tp,
        pipeline_model_parallel_size=spec.topology.pp,
        context_parallel_size=spec.topology.cp,
        cp_comm_type=spec.config.comm_type,
        hierarchical_context_parallel_sizes=spec.config.hierarchical_context_parallel_sizes,
        virtual_pipeline_model_parallel_size=spec.virtual_pipeline_model_parallel_size,
        variable_seq_lengths=spec.varlen is not None and spec.topology.pp > 1,
        # (no MoE here; megatron rejects variable_seq_lengths with the allgather default)
        moe_token_dispatcher_type="alltoall",
        max_seqlen_per_dp_cp_rank=spec.config.max_seqlen_per_dp_cp_rank,
        pipeline_dtype=torch.float32,
        params_dtype=torch.float32,
        # on the GPU megatron builds parameters (and RoPE's frequencies) on the device, as users
        # run it; deterministic_init re-draws every matrix either way
        use_cpu_initialization=spec.device == "cpu",
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_dropout_fusion=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        calculate_per_token_loss=spec.config.per_token_loss(),
        batch_p2p_sync=False,
        batch_p2p_comm=False,
        deallocate_pipeline_outputs=False,
        sequence_parallel=spec.sequence_parallel,
        **extra,
    )
    # upstream's TransformerConfig field (megatron's development branch); on the releases
    # without it an attribute, which the reference attention and the RoPE patch read
    config.cp_partition_mode = spec.config.cp_partition_mode
    return config


def _loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor, *,
               micro_batch_cp_group: Any = None):
    """(loss, tokens, report) for megatron's schedule, which divides ``loss`` by ``tokens``
    (and by the micro-batch count) unless the loss is per token.

    Per-token loss (``micro_batch_cp_group`` None): this rank's loss sum and token count; the
    schedule sums both over the step and ``finalize_model_grads`` divides by the count over
    DPxCP. Per micro-batch (megatron's ``calculate_per_token_loss=False``): the count is the
    micro-batch's over its whole CP group, all-reduced here - a count per CP rank would weight
    the ranks' tokens unequally under uneven masks and divide by zero on a fully masked rank
    (the class of bug of Megatron-LM #7452) - and the loss sum is scaled by the CP size, as
    megatron's own legacy path does, because DDP averages gradients over DPxCP while the CP
    ranks hold parts of one micro-batch."""
    losses = output_tensor.float().reshape(-1)
    mask = loss_mask.reshape(-1).float()
    loss = torch.sum(losses * mask)
    tokens = mask.sum()
    report = torch.stack([loss.detach(), tokens.detach()])  # this rank's, for the lm loss
    if micro_batch_cp_group is None:
        return loss, tokens.to(torch.int), {"lm loss": report}
    count = tokens.detach().to(collective_device(micro_batch_cp_group)).clone()
    dist.all_reduce(count, group=micro_batch_cp_group)
    cp_size = micro_batch_cp_group.size()
    return loss * cp_size, count.to(tokens.device).to(torch.int), {"lm loss": report}


def _forward_step(data_iterator, model, *, cp_group: Any = None):
    """megatron's forward step; ``cp_group`` set: the loss is per micro-batch (see
    :func:`_loss_func`)."""
    batch = next(data_iterator)
    output = model(batch.tokens, batch.position_ids, None, labels=batch.labels,
                   packed_seq_params=batch.packed_seq_params)
    return output, partial(_loss_func, batch.loss_mask, micro_batch_cp_group=cp_group)


def _global_param_names(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """Parameters keyed by a name that does not depend on the pipeline layout."""
    names: dict[str, torch.nn.Parameter] = {}
    layers = getattr(getattr(model, "decoder", None), "layers", [])
    layer_params = set()
    for layer in layers:
        for name, param in layer.named_parameters():
            names[f"layer{layer.layer_number}.{name}"] = param
            layer_params.add(id(param))
    for name, param in model.named_parameters():
        if id(param) in layer_params:
            continue
        if getattr(param, "shared_embedding", False):
            # tied output weight on the last pipeline stage: same draw as the embedding
            name = "embedding.word_embeddings.weight"
        names[name] = param
    return names


def deterministic_init(model: torch.nn.Module, seed: int, tp_rank: int, tp_size: int,
                       std: float = 0.02) -> None:
    """Re-draw every matrix from a seed tied to its global name, then take this TP shard.

    The model is then the same whatever the TP/PP/CP layout (megatron's own init depends on
    the pipeline stage); vectors keep megatron's constant init (norm weights 1, biases 0),
    except the learnable softmax offset, which megatron draws at random: it is re-drawn too.
    """
    import zlib

    with torch.no_grad():
        for name, param in _global_param_names(model).items():
            if param.dim() < 2 and not name.endswith("softmax_offset"):
                continue
            shape = list(param.shape)
            split = getattr(param, "tensor_model_parallel", False) and tp_size > 1
            dim = getattr(param, "partition_dim", 0)
            if split:
                shape[dim] *= tp_size
            gen = torch.Generator().manual_seed(seed * 7919 + zlib.crc32(name.encode()))
            full = torch.randn(shape, generator=gen, dtype=torch.float64) * std
            if split:
                full = full.chunk(tp_size, dim=dim)[tp_rank]
            param.copy_(full.to(param.dtype))


def _device(spec: TinyGPTSpec) -> torch.device:
    """The rank's compute device: the CPU, or (``spec.device="cuda"``) its current GPU."""
    if spec.device == "cpu":
        return torch.device("cpu")
    if spec.device != "cuda" or not torch.cuda.is_available():
        raise ValueError(f"device={spec.device!r}: use 'cpu', or 'cuda' where CUDA is available")
    return torch.device("cuda", torch.cuda.current_device())


def _groups(pg_collection):
    if pg_collection is not None:
        return pg_collection
    from megatron.core.process_groups_config import ProcessGroupCollection

    return ProcessGroupCollection.use_mpu_process_groups()


def _layer_spec_kwargs(config: Any) -> dict[str, Any]:
    """megatron's layer-spec options the config asks for (multi-latent attention)."""
    return {"multi_latent_attention": True} if config.multi_latent_attention else {}


def _build_chunks(spec: TinyGPTSpec, config: Any, pg_collection: Any, pgs: Any) -> list[Any]:
    """The model chunks of this pipeline rank (one, or one per virtual stage)."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    from ..attention.module import gpt_layer_spec  # imports megatron: only when training

    pp_rank, pp_size = pgs.pp.rank(), pgs.pp.size()
    vpp = spec.virtual_pipeline_model_parallel_size or 1
    chunks = []
    for vp in range(vpp):
        mtp = None
        if config.mtp_num_layers:
            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

            mtp = get_gpt_mtp_block_spec(
                config, gpt_layer_spec(spec.attention_backend, **_layer_spec_kwargs(config)),
                use_transformer_engine=False,
                vp_stage=vp if spec.virtual_pipeline_model_parallel_size else None,
                pp_rank=pp_rank)
        layers = gpt_layer_spec(spec.attention_backend, **_layer_spec_kwargs(config))
        if config.sequence_parallel and uses_torch_norms(layers):
            if mtp is not None:
                raise ValueError("sequence_parallel=True with mtp_num_layers: the MTP block's "
                                 "norms on the local spec refuse sequence parallelism; turn one "
                                 "of them off")
            layers = with_sequence_parallel_norms(
                layers, config, vp if spec.virtual_pipeline_model_parallel_size else None,
                pp_rank)
        chunk = GPTModel(
            config=config,
            transformer_layer_spec=layers,
            vocab_size=spec.vocab_size,
            max_sequence_length=spec.max_position_embeddings or spec.config.seq_length,
            pre_process=pp_rank == 0 and vp == 0,
            post_process=pp_rank == pp_size - 1 and vp == vpp - 1,
            position_embedding_type="rope",
            share_embeddings_and_output_weights=spec.share_embeddings_and_output_weights,
            pg_collection=pg_collection,
            mtp_block_spec=mtp,
            **({"vp_stage": vp} if spec.virtual_pipeline_model_parallel_size else {}),
        )
        deterministic_init(chunk, spec.seed, pgs.tp.rank(), pgs.tp.size())
        chunks.append(chunk.to(_device(spec)))
    return chunks


def _dynamic_groups(pg_collection: Any):
    from ..parallel_state.dynamic import dynamic_cp_groups_of

    if pg_collection is not None:
        groups = dynamic_cp_groups_of(pg_collection)
        if groups is None:
            raise ValueError(
                "dynamic_context_parallel=True but pg_collection has no dynamic_cp groups: "
                "build it with megatron_hcp.parallel_state.collection.create_pg_collection(config) "
                "where "
                "config.dynamic_context_parallel is True"
            )
        return groups
    from ..parallel_state.mpu import dynamic_cp_groups

    return dynamic_cp_groups()


class _StepData:
    """Micro-batches of one step for the spec's data mode (fixed, packed static, dynamic)."""

    def __init__(self, spec: TinyGPTSpec, pgs: Any, pg_collection: Any, multiple: int):
        self.spec = spec
        self.dp_size, self.dp_rank = pgs.dp.size(), pgs.dp.rank()
        self.cp_size, self.cp_rank = pgs.cp.size(), pgs.cp.rank()
        self.path = None
        tp = spec.topology.tp
        if spec.sequence_parallel and spec.varlen is None and (
                spec.config.seq_length // max(1, self.cp_size)) % tp:
            raise ValueError(
                f"sequence_parallel=True: seq_length={spec.config.seq_length} / "
                f"context_parallel_size={self.cp_size} tokens per rank must divide by "
                f"tensor_model_parallel_size={tp} (sequence parallelism splits them over the "
                f"TP ranks); use a seq_length that is a multiple of {2 * self.cp_size * tp}")
        if spec.config.cp_partition_mode != "zigzag" and (self.cp_size > 1
                                                   or spec.topology.dynamic):
            from ..patching import require_applied

            require_applied(("rope-cp-partition-mode",),
                            f"cp_partition_mode={spec.config.cp_partition_mode!r} (RoPE of a "
                            "slice)")
        if spec.topology.dynamic:
            from ..dynamic_cp.runtime import DynamicCPDataPath
            from ..patching import DYNAMIC_CP_PATCHES, require_applied

            if spec.varlen is None:
                raise ValueError("dynamic_context_parallel needs variable-length packed data "
                                 "(spec.varlen)")
            require_applied(DYNAMIC_CP_PATCHES, "dynamic context parallelism")
            from ..dynamic_cp.workload import GPTWorkload

            self.path = DynamicCPDataPath(
                _dynamic_groups(pg_collection), dp_group=pgs.dp, cp_group=pgs.cp,
                tp_group=pgs.tp, max_seqlen_per_dp_cp_rank=spec.config.max_seqlen_per_dp_cp_rank,
                min_cp_size=spec.topology.dynamic_min_size,
                workload=GPTWorkload(
                    num_layers=spec.config.num_layers, hidden_size=spec.hidden_size,
                    num_attention_heads=spec.config.num_attention_heads,
                    num_query_groups=spec.config.num_query_groups,
                    window=GPTWorkload.causal_window(spec.config.window_size)),
                micro_batch_multiple=multiple, sequence_parallel=spec.sequence_parallel,
                cp_partition_mode=spec.config.cp_partition_mode)
        rows = spec.global_batch_size
        unit = spec.micro_batch_size * self.dp_size if spec.varlen is None else self.dp_size
        if rows % unit:
            raise ValueError(f"global_batch_size={rows} must be a multiple of {unit} "
                             "(micro_batch_size * data-parallel size)")

    def micro_batches(self, step: int) -> list[Any]:
        spec = self.spec
        rows = spec.global_batch_size
        if spec.varlen is None:
            data = global_batch(spec.seed, step, rows, spec.config.seq_length, spec.vocab_size)
            if spec.loss_mask is not None:
                data["loss_mask"] = torch.stack([
                    spec.loss_mask(step, r, spec.config.seq_length).float() for r in range(rows)])
            return static_cp_micro_batches(
                data, dp_size=self.dp_size, dp_rank=self.dp_rank,
                micro_batch_size=spec.micro_batch_size, cp_size=self.cp_size,
                cp_rank=self.cp_rank, cp_partition_mode=spec.config.cp_partition_mode)
        from ..dynamic_cp.packing import pack_thd

        v = spec.varlen
        lengths = list(v.lengths) if v.lengths else varlen_lengths(
            spec.seed, step, rows, min_len=v.min_len, max_len=v.max_len, mean=v.mean,
            sigma=v.sigma)
        per = rows // self.dp_size
        ids = range(self.dp_rank * per, (self.dp_rank + 1) * per)

        def load(i: int) -> torch.Tensor:
            sample = markov_sample if v.corpus == "markov" else varlen_sample
            out = sample(spec.seed, step, i, lengths[i], spec.vocab_size)
            if spec.loss_mask is not None:
                out[2] = spec.loss_mask(step, i, lengths[i]).to(out.dtype)
            return out

        if self.path is not None:
            return plan_step(self.path, ids, load, _device(spec)).micro_batches
        samples = [load(i) for i in ids]
        k = v.samples_per_micro_batch
        tp = spec.topology.tp if spec.sequence_parallel else 1
        return [pack_thd(samples[j:j + k], self.cp_size, self.cp_rank, pad_multiple=tp,
                         cp_partition_mode=spec.config.cp_partition_mode)
                for j in range(0, len(samples), k)]


def _save_checkpoint(spec: TinyGPTSpec, step: int, model: list[Any], optimizer: Any) -> None:
    """Per-rank files plus a manifest written last (:mod:`.checkpoint`)."""
    if not spec.checkpoint_dir:
        raise ValueError("checkpointing needs spec.checkpoint_dir")
    save_checkpoint(spec.checkpoint_dir, step, {
        "step": step, "model": [m.state_dict() for m in model],
        "optimizer": optimizer.state_dict()})


def _load_checkpoint(spec: TinyGPTSpec, model: list[Any], optimizer: Any) -> None:
    if not spec.checkpoint_dir:
        raise ValueError("resuming needs spec.checkpoint_dir")

    def restore(state: dict[str, Any]) -> None:  # inside the ranks' agreement on the verdict
        if state["step"] != spec.resume_from_step or len(state["model"]) != len(model):
            raise CheckpointError(f"step {state['step']} with {len(state['model'])} model "
                                  f"chunks does not fit this run ({len(model)} chunks)")
        for m, sd in zip(model, state["model"]):
            m.load_state_dict(sd)
        optimizer.load_state_dict(state["optimizer"])

    load_checkpoint(spec.checkpoint_dir, spec.resume_from_step, restore=restore)


def train_tiny_gpt(spec: TinyGPTSpec, pg_collection: Any = None,
                   on_step: Any = None) -> dict[str, list[float]]:
    """Build, train ``spec.steps`` steps and return ``{"loss": [...], "grad_norm": [...],
    "num_zeros": [...], "micro_batches": [...], "local_cp_sizes": [...], "cp_levels": [...]}``;
    all but the last two (this rank's CP group size and levels per micro-batch) are identical
    on every rank."""
    from ..parallel_state.mpu import megatron_memory_buffer

    with megatron_memory_buffer():  # SP's gather buffer, also on a decentralized collection
        return _train(spec, pg_collection, on_step)


def _train(spec: TinyGPTSpec, pg_collection: Any, on_step: Any) -> dict[str, list[float]]:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    config = _transformer_config(spec)  # refuses bad settings before any collective
    pgs = _groups(pg_collection)
    torch.manual_seed(spec.seed)
    model_parallel_cuda_manual_seed(spec.seed, tp_rank=pgs.tp.rank(), ep_rank=0, etp_rank=0)
    pp_size = pgs.pp.size()
    chunks = _build_chunks(spec, config, pg_collection, pgs)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                               overlap_grad_reduce=False,
                                               use_distributed_optimizer=False)
    model = [DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk,
                                     pg_collection=pg_collection) for chunk in chunks]
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=spec.lr, weight_decay=0.0, clip_grad=0.0,
                        use_distributed_optimizer=False, log_num_zeros_in_grad=True),
        model,
        use_gloo_process_groups=False,
        pg_collection=pg_collection,
    )
    config.no_sync_func = [m.no_sync for m in model] if len(model) > 1 else model[0].no_sync
    config.finalize_model_grads_func = partial(finalize_model_grads, pg_collection=pg_collection)

    forward_backward = get_forward_backward_func(
        pp_size=pp_size, vp_size=spec.virtual_pipeline_model_parallel_size)
    schedule_groups: dict[str, Any] = {}
    if pg_collection is not None:  # decentralized path: no MPU globals are read
        from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

        schedule_groups = {"pg_collection": pg_collection,
                           "p2p_communicator": P2PCommunicator(pp_group=pgs.pp, config=config)}
    multiple = pp_size if spec.virtual_pipeline_model_parallel_size else 1
    data = _StepData(spec, pgs, pg_collection, multiple)
    # per-token loss, or per micro-batch over its tokens on the (static) CP group
    forward_step = (_forward_step if config.calculate_per_token_loss
                    else partial(_forward_step, cp_group=pgs.cp))
    history: dict[str, list] = {"loss": [], "grad_norm": [], "num_zeros": [],
                                "micro_batches": [], "local_cp_sizes": [], "cp_levels": [],
                                "iteration_time": []}
    first = 0
    if spec.resume_from_step is not None:
        _load_checkpoint(spec, model, optimizer)
        first = spec.resume_from_step
    for step in range(first, spec.steps):
        started = time.perf_counter()
        micro = [mb.to(_device(spec)) for mb in data.micro_batches(step)]
        for m in model:
            m.zero_grad_buffer()
        optimizer.zero_grad()
        common = dict(forward_step_func=forward_step, model=model, forward_only=False,
                      **schedule_groups)
        if spec.varlen is None:  # fixed-length rows
            reports = forward_backward(
                data_iterator=[iter(micro) for _ in model] if len(model) > 1 else iter(micro),
                num_microbatches=len(micro), seq_length=spec.config.seq_length,
                micro_batch_size=spec.micro_batch_size, **common)
        else:  # packed rows, static or dynamic CP: the arguments Bridge's loop gets too
            reports = forward_backward(**common, **schedule_arguments(micro, len(model)))
        _, grad_norm, num_zeros = optimizer.step()
        history["loss"].append(_global_loss(reports, pgs))
        history["grad_norm"].append(float(grad_norm))
        history["num_zeros"].append(float(num_zeros or 0))
        history["micro_batches"].append(len(micro))
        history["local_cp_sizes"].append([
            getattr(mb.packed_seq_params, "local_cp_size", None) for mb in micro])
        history["cp_levels"].append([  # dynamic hierarchical CP: [a2a, p2p] level sizes
            [g.size() for g in levels] if (levels := getattr(
                mb.packed_seq_params, "hierarchical_cp_groups", None)) else None
            for mb in micro])
        history["iteration_time"].append(time.perf_counter() - started)
        if step + 1 in spec.save_at_steps:
            _save_checkpoint(spec, step + 1, model, optimizer)
        if on_step is not None:
            on_step(step, history)
    return history


def _global_loss(reports: list[dict], pgs: Any) -> float:
    """Per-token loss over the global batch, on every rank (last PP stage broadcasts)."""
    total = torch.zeros(2, dtype=torch.float64, device=collective_device(pgs.dp_cp))
    for report in reports:
        total += report["lm loss"].double().to(total.device)
    dist.all_reduce(total, group=pgs.dp_cp)
    if pgs.pp.size() > 1:
        last = dist.get_process_group_ranks(pgs.pp)[-1]
        dist.broadcast(total, src=last, group=pgs.pp)
    return float(total[0] / total[1])
