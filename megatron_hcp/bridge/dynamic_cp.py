"""Dynamic CP in Megatron-Bridge's own training loop (``pretrain`` / ``finetune``).

Bridge 0.6.2 hands a dynamic-CP config to megatron-core and does nothing else: it never wraps its
data iterator nor changes the micro-batch count. Applied by :func:`megatron_hcp.bridge.install`,
these registry patches make such a config (megatron-core 0.19's ``hybrid_context_parallel`` or
the development branch's ``dynamic_context_parallel``) train through Bridge's loop on
megatron-hcp's scheduler and data path:

* ``bridge-cp-setup`` (``training.config.runtime_config_update``, the first thing ``pretrain()``
  and ``finetune()`` do, and ``training.setup.setup``): before Bridge's own config code and
  before any process group exists, every rank reads Bridge's config into a
  :class:`~megatron_hcp.config.CPConfig` strictly and validates it (named errors, the same on
  every rank). The validated config travels on the model config
  (``_megatron_hcp_cp_config``, private: Bridge does not serialize it). A dynamic-CP config is
  taken over: megatron-core's own ``hybrid_context_parallel`` / ``dynamic_context_parallel``
  flags are turned off (logged on rank 0), so megatron's schedule and groups for it never run
  beside megatron-hcp's.
* ``bridge-mpu-cp-groups`` (``training.initialize._initialize_distributed``): on the MPU path
  (``dist.use_decentralized_pg=False``), after Bridge initialized megatron's groups, they are
  checked against megatron-hcp's layout and logged (``HIERARCHICAL_CONTEXT_PARALLEL_GROUPS``
  for HCP); for dynamic CP its groups (and dynamic hierarchical levels) are created and Bridge's
  collection is returned as an ``HCPProcessGroupCollection`` whose typed ``dynamic_cp`` holds
  them (nothing is set on megatron's object). On the decentralized path the hooked
  ``_create_pg_collection`` (:mod:`.hook`) builds them.
* ``bridge-dynamic-cp-schedule`` (``get_forward_backward_func`` as bound in ``training.train``
  and ``training.eval``): when the step's process-group collection carries dynamic CP groups,
  the forward-backward function takes the ``num_microbatches`` micro-batches Bridge's data
  iterator holds for the step, cuts them into sequences (:func:`bridge_batch_samples`),
  schedules the global batch (:class:`~megatron_hcp.dynamic_cp.runtime.DynamicCPDataPath`) and
  runs the plan's micro-batches - as many as the plan has - through megatron's schedule (no
  pipelining, 1F1B or interleaved). Bridge's sample accounting is unchanged.
* ``bridge-dynamic-cp-batch`` (``training.gpt_step.get_batch`` and ``get_packed_seq_params``):
  Bridge's forward step takes such a micro-batch as it is - this rank's tokens already, its
  ``PackedSeqParams`` carrying the micro-batch's CP group - instead of cutting it again for the
  static CP group.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
import torch.distributed as dist

from ..attention.partition import partition_mode
from ..config import CPConfig, CPConfigError, Topology, Violation
from ..dynamic_cp.step import PlannedMicroBatches, plan_step, schedule_arguments
from ..parallel_state.dynamic import dynamic_cp_groups_of
from ..patching.moe_router import dynamic_cp_router_problems
from ..patching.registry import Target
from .config import cp_config_from_bridge, read_window

__all__ = ["DynamicCPForwardBackward", "DynamicMicroBatches", "bridge_batch_samples",
           "cp_config_of", "dynamic_cp_steps", "prepare_config"]

DynamicMicroBatches = PlannedMicroBatches  # its name before the step was shared with the trainer

logger = logging.getLogger("megatron_hcp")

_PKG = "megatron.bridge"
_ATTR = "_megatron_hcp_cp_config"
_STEPS = "_megatron_hcp_dynamic_cp_steps"  # the run's training-step plans, on its model config
# megatron-core's switches for its own dynamic CP (0.19 name, development-branch name)
_MEGATRON_DYNAMIC_FLAGS = ("hybrid_context_parallel", "dynamic_context_parallel")


# ---------------------------------------------------------------------------- config
def cp_config_of(model_config: Any) -> CPConfig | None:
    """The :class:`CPConfig` ``bridge-cp-setup`` validated for ``model_config`` (None: none)."""
    return getattr(model_config, _ATTR, None)


def dynamic_cp_steps(model_config: Any) -> list[dict[str, Any]]:
    """What each dynamic-CP training step of this run (its model config) ran: ``micro_batches``,
    ``group_sizes`` (every group of the plan, largest first) and ``hierarchical_groups`` (groups
    on a2a x p2p levels)."""
    return list(getattr(model_config, _STEPS, ()))


def _record_step(model_config: Any, plan: Any, a2a_size: int | None) -> None:
    sizes = sorted((len(g.ranks) for mb in plan.micro_batches for g in mb.groups), reverse=True)
    record = {"micro_batches": len(plan.micro_batches), "group_sizes": sizes,
              "hierarchical_groups": sum(a2a_size is not None and size > a2a_size
                                         for size in sizes)}
    setattr(model_config, _STEPS, [*getattr(model_config, _STEPS, ()), record])


def _attach(cfg_model: Any, config: CPConfig) -> None:
    for target in (cfg_model, getattr(cfg_model, "transformer", None)):
        if target is not None:
            setattr(target, _ATTR, config)


def prepare_config(cfg: Any, world_size: int | None = None) -> CPConfig:
    """Validate Bridge's ``cfg`` (a ConfigContainer) as a CP setup; take dynamic CP over.

    Pure (no collectives): every rank raises the same :class:`CPConfigError` for a bad config.
    Returns the validated config, also attached to ``cfg.model`` (:func:`cp_config_of`).
    """
    model = cfg.model
    taken = cp_config_of(model)
    if taken is not None and taken.dynamic and not any(
            getattr(model, f, False) for f in _MEGATRON_DYNAMIC_FLAGS):
        return taken  # this config was prepared before (megatron's flags already off)
    from .config import world_size_before_init

    dist_cfg = getattr(cfg, "dist", None)
    config = cp_config_from_bridge(
        model, world_size_before_init() if world_size is None else world_size,
        use_megatron_fsdp=getattr(dist_cfg, "use_megatron_fsdp", False))
    topology = config.resolve()  # every rule; the sizes below are derived once, here
    if (config.cp_partition_mode != "zigzag" and topology.cp > 1
            and not topology.dynamic):
        raise CPConfigError([Violation(
            "model.cp_partition_mode", config.cp_partition_mode,
            "Bridge's own batch step cuts every sequence zigzag with static CP (its dsv4_step "
            "slices the whole packed buffer, not each sequence); megatron-hcp cuts batches "
            "itself with dynamic CP only",
            "use model.cp_partition_mode=zigzag with static CP in Bridge, or dynamic CP")])
    if topology.dynamic:
        _check_dynamic_loop(model, topology)
        turned_off = [f for f in _MEGATRON_DYNAMIC_FLAGS if getattr(model, f, False)]
        for name in turned_off:
            setattr(model, name, False)
        if turned_off and _rank() == 0:
            logger.info(
                "megatron_hcp: dynamic CP (%s) runs on megatron-hcp's scheduler and data path "
                "(token cap %s per rank, groups of %d..%d ranks); megatron-core's own %s is "
                "turned off for this run", ", ".join(f"{f}=True" for f in turned_off),
                config.max_seqlen_per_dp_cp_rank, topology.dynamic_min_size,
                topology.dp_cp, " / ".join(turned_off))
    _attach(model, config)
    return config


def _check_dynamic_loop(model: Any, topology: Topology) -> None:
    """What dynamic CP needs of Bridge's loop beyond the CP rules: variable sequence lengths
    between pipeline stages, and a token cap that holds the longest sequence Bridge's data can
    bring (``model.seq_length``) on the whole DPxCP group."""
    from ..sharding import padded_length

    problems = []
    config = topology.config
    if topology.pp > 1 and not getattr(model, "variable_seq_lengths", False):
        problems.append(Violation(
            "model.variable_seq_lengths", getattr(model, "variable_seq_lengths", None),
            "dynamic CP with pipeline parallelism sends packed micro-batches of different "
            "lengths between the stages",
            "set model.variable_seq_lengths=True (megatron-core also wants "
            "model.moe_token_dispatcher_type=alltoall with it)"))
    if config.cp_partition_mode != "zigzag" and getattr(model, "mtp_num_layers", None):
        problems.append(Violation(
            "model.cp_partition_mode", config.cp_partition_mode,
            f"multi-token prediction (model.mtp_num_layers={model.mtp_num_layers}) rolls its "
            "inputs and labels across the micro-batch's CP group as megatron-core cuts "
            "sequences (roll_tensor of packed sequences: each rank's front and mirrored tail "
            "chunk); in the contiguous layout the tokens rolled over a slice boundary come from "
            "the wrong rank (measured: DeepSeek-V3 with one MTP layer off CP=1 by 2.4e-5 in "
            "loss by step 3)",
            "use model.cp_partition_mode=zigzag with MTP (or train without MTP)"))
    recompute = list(getattr(model, "recompute_modules", None) or [])
    if (getattr(model, "multi_latent_attention", False)
            and getattr(model, "recompute_granularity", None) == "selective"
            and "mla_up_proj" in recompute):
        problems.append(Violation(
            "model.recompute_modules", recompute,
            "MLA's up-projection recomputed in backward (selective recompute of mla_up_proj) "
            "redoes its RoPE after mla-dynamic-cp-group has given the micro-batch's CP group "
            "back to the static one: the recomputed RoPE would use the wrong group and table "
            "(wrong gradients, no error)",
            "drop mla_up_proj from model.recompute_modules under dynamic CP (or recompute "
            "whole layers: model.recompute_granularity=full)"))
    problems += dynamic_cp_router_problems(model)
    n, cap, longest = topology.dp_cp, config.max_seqlen_per_dp_cp_rank, config.seq_length
    tp = topology.tp if getattr(model, "sequence_parallel", False) else 1
    if longest and cap and padded_length(longest, n, tp) // n > cap:
        need = padded_length(longest, n, tp) // n
        problems.append(Violation(
            "model.max_seqlen_per_dp_cp_rank", cap,
            f"the longest sequence (model.seq_length={longest}) needs {need} tokens per rank "
            f"even on all DPxCP={n} ranks", f"set model.max_seqlen_per_dp_cp_rank >= {need}"))
    if problems:
        raise CPConfigError(problems)


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _make_runtime_config_update(original):
    @functools.wraps(original)
    def runtime_config_update(cfg, *args, **kwargs):
        """Bridge's, after :func:`prepare_config`: ``pretrain()`` / ``finetune()`` call it first,
        and Bridge's own config code divides by the CP sizes (a string size was Bridge's
        ``TypeError``); the CP fields are read strictly here, named errors on every rank."""
        prepare_config(cfg)
        return original(cfg, *args, **kwargs)

    return runtime_config_update


def _make_setup(original):
    @functools.wraps(original)
    def setup(state, train_valid_test_datasets_provider, *args, **kwargs):
        """Bridge's ``setup``, after :func:`prepare_config` (before any process group)."""
        prepare_config(state.cfg)
        return original(state, train_valid_test_datasets_provider, *args, **kwargs)

    return setup


def _make_initialize_distributed(original):
    @functools.wraps(original)
    def _initialize_distributed(model_config, dist_config, *args, **kwargs):
        """Bridge's; then, on the MPU path, megatron-hcp adopts megatron's groups (check, log,
        dynamic CP groups typed on the returned collection)."""
        pg_collection = original(model_config, dist_config, *args, **kwargs)
        config = cp_config_of(model_config)
        if config is not None and not getattr(dist_config, "use_decentralized_pg", False):
            from ..parallel_state.mpu import adopt_initialized_mpu, dynamic_cp_groups

            order = ("tp-cp-ep-pp-dp" if getattr(dist_config, "use_tp_pp_dp_mapping", False)
                     else "tp-cp-ep-dp-pp")
            adopt_initialized_mpu(
                config, order=order,
                distributed_timeout_minutes=getattr(dist_config, "distributed_timeout_minutes",
                                                    None))
            if config.dynamic:  # megatron's collection, with the dynamic groups typed
                from ..parallel_state.pg_collection import HCPProcessGroupCollection

                pg_collection = HCPProcessGroupCollection.of(
                    pg_collection, dynamic_cp=dynamic_cp_groups())
        return pg_collection

    return _initialize_distributed


# ---------------------------------------------------------------------------- samples
def _row_segments(batch: dict[str, Any], row: int, length: int) -> list[tuple[int, int]]:
    """``(start, end)`` of every sequence of ``row`` (logical tokens, padding excluded)."""
    if batch.get("cu_seqlens_q") is not None:  # megatron / TE naming
        logical = batch["cu_seqlens_q"].reshape(-1, batch["cu_seqlens_q"].shape[-1])[row]
        padded = batch.get("cu_seqlens_q_padded")
        physical = logical if padded is None else padded.reshape(-1, padded.shape[-1])[row]
        return [(int(physical[i]), int(physical[i]) + int(logical[i + 1] - logical[i]))
                for i in range(len(logical) - 1)]
    if batch.get("cu_seqlens") is not None:  # Bridge's legacy naming (-1 / repeated padding)
        cu = batch["cu_seqlens"].reshape(-1, batch["cu_seqlens"].shape[-1])[row].tolist()
        if batch.get("cu_seqlens_argmin") is not None:
            cu = cu[:int(batch["cu_seqlens_argmin"].reshape(-1)[row])]
        cut = next((i for i, v in enumerate(cu) if v < 0), len(cu))
        cu = [min(int(v), length) for v in cu[:cut]]
        return list(zip(cu[:-1], cu[1:]))
    return [(0, length)]


def bridge_batch_samples(batch: dict[str, Any]) -> list[torch.Tensor]:
    """The sequences of one Bridge micro-batch as int64 ``[3, L]`` samples (tokens, labels,
    loss mask): one per packed sequence (``cu_seqlens_q`` / legacy ``cu_seqlens``), else one
    per row.

    A sequence without a token in the loss is left out: it adds nothing to the loss or to any
    gradient (attention stays inside a packed sequence), and scheduling it would only cost
    compute (packed rows end with such padding). Position ids must count 0..L-1 within each
    sequence (they become the packed micro-batch's positions); anything else is refused.
    """
    tokens, labels, mask = batch["tokens"], batch["labels"], batch["loss_mask"]
    if tokens.dim() == 1:
        tokens, labels, mask = tokens[None], labels[None], mask[None]
    positions = batch.get("position_ids")
    samples = []
    for row in range(tokens.shape[0]):
        for start, end in _row_segments(batch, row, int(tokens.shape[1])):
            if end <= start:
                continue
            loss = mask[row, start:end]
            if not bool((loss == 0).logical_or(loss == 1).all()):
                raise ValueError(
                    "dynamic CP: loss_mask must be 0 or 1 per token (got other values); "
                    "weighted losses are not supported by the dynamic-CP data path")
            if not bool(loss.any()):
                continue
            if positions is not None:
                pos = positions.reshape(tokens.shape)[row, start:end]
                if not torch.equal(pos.cpu(), torch.arange(end - start)):
                    raise ValueError(
                        "dynamic CP: position_ids must count 0..L-1 within each sequence "
                        f"(row {row}, tokens {start}..{end}); with reset_position_ids inside "
                        "one attention span, set dataset.reset_position_ids=False or mark the "
                        "documents as packed sequences (inter_document_masking=True)")
            samples.append(torch.stack([tokens[row, start:end], labels[row, start:end],
                                        loss.long()]).to(torch.int64).cpu())
    return samples


# ---------------------------------------------------------------------------- schedule
class _DynamicPackedMetadata(dict):
    """The packed-sequence metadata Bridge's forward step passes on, for a dynamic micro-batch:
    the ready ``PackedSeqParams`` (its CP group included). Empty as a dict, so Bridge's FLOPs
    bookkeeping counts this rank's tokens."""

    def __init__(self, params: Any):
        super().__init__()
        self.params = params


def _make_get_batch(original):
    @functools.wraps(original)
    def get_batch(data_iterator, cfg, use_mtp=False, *, pg_collection, vp_stage=None):
        """Bridge's; a dynamic-CP micro-batch is taken as it is (already this rank's share)."""
        if isinstance(data_iterator, PlannedMicroBatches):
            mb = next(data_iterator)
            return (mb.tokens, mb.labels, mb.loss_mask, None, mb.position_ids,
                    _DynamicPackedMetadata(mb.packed_seq_params))
        return original(data_iterator, cfg, use_mtp, pg_collection=pg_collection,
                        vp_stage=vp_stage)

    return get_batch


def _make_get_packed_seq_params(original):
    @functools.wraps(original)
    def get_packed_seq_params(batch):
        if isinstance(batch, _DynamicPackedMetadata):
            return batch.params
        return original(batch)

    return get_packed_seq_params


class DynamicCPForwardBackward:
    """Bridge's forward-backward function, running dynamic-CP steps (module docstring); any
    other step goes to ``schedule`` unchanged."""

    def __init__(self, schedule: Any):
        self.schedule = schedule
        self._path: tuple[Any, Any] | None = None  # (groups, DynamicCPDataPath) of this run

    def __call__(self, **kwargs: Any) -> Any:
        groups = dynamic_cp_groups_of(kwargs.get("pg_collection"))
        if groups is None:
            return self.schedule(**kwargs)
        return self._dynamic_step(groups, kwargs)

    def _data_path(self, groups: Any, model_config: Any, pg_collection: Any, chunks: int):
        if self._path is not None and self._path[0] is groups:
            return self._path[1]
        from ..dynamic_cp.runtime import DynamicCPDataPath
        from ..dynamic_cp.workload import GPTWorkload

        config = cp_config_of(model_config)
        cap = (config.max_seqlen_per_dp_cp_rank if config is not None
               else model_config.max_seqlen_per_dp_cp_rank)
        path = DynamicCPDataPath(
            groups, dp_group=pg_collection.dp, cp_group=pg_collection.cp,
            tp_group=pg_collection.tp, max_seqlen_per_dp_cp_rank=cap,
            min_cp_size=groups.min_size,
            workload=GPTWorkload(
                num_layers=model_config.num_layers, hidden_size=model_config.hidden_size,
                ffn_hidden_size=model_config.ffn_hidden_size,
                num_attention_heads=model_config.num_attention_heads,
                num_query_groups=model_config.num_query_groups,
                gated_mlp=bool(model_config.gated_linear_unit),
                kv_channels=model_config.kv_channels,
                window=GPTWorkload.causal_window(
                    read_window(getattr(model_config, "window_size", None)))),
            micro_batch_multiple=pg_collection.pp.size() if chunks > 1 else 1,
            sequence_parallel=bool(model_config.sequence_parallel),
            cp_partition_mode=(config.cp_partition_mode if config is not None
                               else partition_mode(model_config)))
        self._path = (groups, path)
        return path

    def _dynamic_step(self, groups: Any, kwargs: dict[str, Any]) -> Any:
        from megatron.core.utils import get_model_config

        model = kwargs["model"]
        chunks = model if isinstance(model, list) else [model]
        model_config = get_model_config(chunks[0])
        pg_collection = kwargs["pg_collection"]
        path = self._data_path(groups, model_config, pg_collection, len(chunks))
        source = kwargs["data_iterator"]
        if isinstance(source, list):  # one view per virtual stage over the same micro-batches
            source = source[0]
        samples: list[torch.Tensor] = []
        for _ in range(kwargs["num_microbatches"]):
            samples.extend(bridge_batch_samples(next(source)))
        base = pg_collection.dp.rank() << 32  # ids unique over the DP group
        step = plan_step(path, [base + k for k in range(len(samples))],
                         lambda i: samples[i - base], next(chunks[0].parameters()).device)
        if not kwargs.get("forward_only", False):
            _record_step(model_config, step.plan, groups.a2a_size)
        kwargs.update(schedule_arguments(step.micro_batches, len(chunks)))
        kwargs["decoder_seq_length"] = kwargs["seq_length"]
        return self.schedule(**kwargs)


def _make_get_forward_backward_func(original):
    @functools.wraps(original)
    def get_forward_backward_func(*args, **kwargs):
        """megatron's, wrapped in :class:`DynamicCPForwardBackward`."""
        return DynamicCPForwardBackward(original(*args, **kwargs))

    return get_forward_backward_func


def dynamic_cp_targets() -> dict[str, tuple[Target, ...]]:
    """The registry targets of the patches in the module docstring, by patch name."""
    return {
        "bridge-cp-setup": (Target(f"{_PKG}.training.config", "runtime_config_update",
                                   _make_runtime_config_update, params=("cfg",),
                                   also_bound_under=_PKG),
                            Target(f"{_PKG}.training.setup", "setup", _make_setup,
                                   params=("state", "train_valid_test_datasets_provider"),
                                   also_bound_under=_PKG),),
        "bridge-mpu-cp-groups": (Target(f"{_PKG}.training.initialize",
                                        "_initialize_distributed", _make_initialize_distributed,
                                        params=("model_config", "dist_config")),),
        "bridge-dynamic-cp-schedule": tuple(
            Target(f"{_PKG}.training.{module}", "get_forward_backward_func",
                   _make_get_forward_backward_func)
            for module in ("train", "eval")),
        "bridge-dynamic-cp-batch": (
            Target(f"{_PKG}.training.gpt_step", "get_batch", _make_get_batch,
                   params=("data_iterator", "cfg", "use_mtp"), also_bound_under=_PKG),
            Target(f"{_PKG}.training.gpt_step", "get_packed_seq_params",
                   _make_get_packed_seq_params, also_bound_under=_PKG),
        ),
    }
