"""Checks of a recipe run made in the launcher, before any rank starts: what the ranks would
otherwise find only after seconds of start-up, or a machine's memory would find by exhausting.

* :func:`rank_environment_problems` - the values the ranks read from their environment: the
  attention's switches (``MEGATRON_HCP_FUSED_OPS`` / ``_SPLIT_PACKED`` / ``_VARLEN``, each by
  its own rule) and ``OMP_NUM_THREADS``, from the launcher's environment or a recipe's
  ``ENV_VARS``;
* :func:`recipe_memory` / :func:`check_memory` - the bytes per rank of a ``MODEL_ARGS``
  recipe's whole model by the planner's memory model (:func:`~megatron_hcp.planner.estimate.
  memory_per_gpu`: weights, gradients and optimizer state, activations of the micro-batches in
  flight, logits), times the ranks this node starts, against the memory the machine has
  available. A Bridge recipe's model is built by Bridge's recipe function inside the ranks and
  is not estimated here.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ..config import CPConfigError, Violation, parse_value

__all__ = ["FP32_SCALE", "check_memory", "recipe_memory", "available_memory",
           "rank_environment_problems"]

# the planner counts activations and logits in 2-byte (bf16) elements; the CPU recipes train fp32
FP32_SCALE = 2.0
_MAX_THREADS = 1 << 12


def _switches() -> tuple[Any, ...]:
    from ..attention.reference.gpu import FUSED, VARLEN
    from ..attention.reference.pieces import SPLIT

    return FUSED, SPLIT, VARLEN


def rank_environment_problems(env: Mapping[str, str], where: str) -> list[Violation]:
    """The values in ``env`` (``where``: "ENV_VARS" or "the environment") that every rank would
    refuse or misread: a switch outside its modes, ``OMP_NUM_THREADS`` not an integer in
    1..4096."""
    problems = []
    for switch in _switches():
        value = env.get(switch.variable)
        if value is not None and value.strip().lower() not in switch.modes:
            problems.append(Violation(f"{where}.{switch.variable}", value,
                                      f"must be one of {', '.join(switch.modes)}",
                                      f"use {switch.choices}; unset it for {switch.modes[0]}"))
    threads = env.get("OMP_NUM_THREADS")
    if threads is not None:
        try:
            parse_value(threads, "int", f"{where}.OMP_NUM_THREADS")
            ok = 1 <= int(threads) <= _MAX_THREADS
        except (CPConfigError, ValueError):
            ok = False
        if not ok:
            problems.append(Violation(f"{where}.OMP_NUM_THREADS", threads,
                                      f"must be an integer in 1..{_MAX_THREADS}",
                                      "set the threads per rank, e.g. 1"))
    return problems


def recipe_memory(recipe: Any) -> dict[str, float]:
    """Bytes per rank of a ``MODEL_ARGS`` recipe's run (the fullest rank) by the planner's
    memory model, activations and logits at fp32: ``weights_optimizer``, ``activations``,
    ``logits``, ``total``."""
    from ..dynamic_cp.projection import Cluster
    from ..planner.estimate import Layout, memory_per_gpu
    from ..planner.inputs import ModelSpec, Options

    spec = recipe.spec
    config, topology = spec.config, spec.topology
    model = ModelSpec(num_layers=config.num_layers, hidden_size=spec.hidden_size,
                      num_attention_heads=config.num_attention_heads,
                      num_query_groups=config.num_query_groups, vocab_size=spec.vocab_size,
                      untie_embeddings=not spec.share_embeddings_and_output_weights)
    if spec.varlen is not None:  # a packed micro-batch: its samples at their longest
        tokens = spec.varlen.samples_per_micro_batch * spec.varlen.max_len
    else:
        tokens = spec.micro_batch_size * config.seq_length
    per_rank = -(-tokens // topology.cp)
    micro_batches = max(1, spec.global_batch_size // (spec.micro_batch_size * topology.dp))
    layout = Layout(topology, spec.virtual_pipeline_model_parallel_size or 1)
    options = Options(recompute="selective", distributed_optimizer=False)
    memory = memory_per_gpu(model, layout, per_rank, min(topology.pp, micro_batches),
                            "selective", options, Cluster(bytes_per_element=2))
    # the planner counts 2-byte elements throughout (its K/V buffers too): fp32 is twice that
    memory["activations"] *= FP32_SCALE
    memory["logits"] *= FP32_SCALE
    memory["total"] = memory["weights_optimizer"] + memory["activations"] + memory["logits"]
    return memory


def available_memory() -> int:
    """Bytes this machine has available for new processes (``MemAvailable``), else its
    physical memory."""
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_memory(recipe: Any, ranks_here: int, available: int | None = None) -> None:
    """Refuse a ``MODEL_ARGS`` recipe whose ``ranks_here`` ranks would need more memory than
    ``available`` (default: :func:`available_memory`), naming the bytes."""
    memory = recipe_memory(recipe)
    need = memory["total"] * ranks_here
    have = available_memory() if available is None else available
    if need > have:
        gib = 1 << 30
        raise CPConfigError([Violation(
            f"recipe {recipe.name} (MODEL_ARGS)", f"{memory['total'] / gib:.1f} GiB per rank",
            f"its model needs about {memory['total'] / gib:.1f} GiB per rank by the planner's "
            f"memory model (weights, gradients and optimizer "
            f"{memory['weights_optimizer'] / gib:.1f} GiB, activations "
            f"{memory['activations'] / gib:.1f} GiB, logits {memory['logits'] / gib:.1f} GiB), "
            f"{need / gib:.1f} GiB for the {ranks_here} ranks of this node, over the "
            f"{have / gib:.1f} GiB this machine has available",
            "make the model smaller (hidden size, layers, vocabulary, sequence length) or "
            "spread it over more nodes")])
