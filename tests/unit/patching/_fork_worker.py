"""Rank function of the fork-patch equality test.

Kept apart from the test module: importing it must not import megatron, so that a rank can
put the patched copy first on ``sys.path`` before megatron is imported.
"""

from __future__ import annotations

from pathlib import Path

WORLD = 4


def import_megatron(source: str) -> str:
    """Import megatron from the patched copy ``source``; return where it came from.

    Run once per rank before any training, so that a spawned rank's cold import of torch and
    megatron is not charged to the time limit of a training call."""
    import sys

    sys.path.insert(0, source)
    import megatron.core

    return str(Path(megatron.core.__file__).resolve())


def train_with(source: str | None, cp: int, comm: str, hcp: list[int] | None, pp: int,
               dynamic: bool = False):
    """Train a tiny GPT with megatron from ``source`` (a patched copy, no runtime patching)
    or from the installed package with the runtime patches."""
    import sys

    if source is not None and source not in sys.path:
        sys.path.insert(0, source)
    import megatron.core

    from megatron_hcp.config import CPConfig
    from megatron_hcp.parallel_state.mpu import destroy_model_parallel, initialize_model_parallel
    from megatron_hcp.patching import ALL_PATCHES, apply_cpu_runtime, apply_dynamic_cp, is_applied
    from megatron_hcp.training.trainer import TinyGPTSpec, VarLen, train_tiny_gpt

    where = str(Path(megatron.core.__file__).resolve())
    if source is None:
        apply_cpu_runtime()
        if dynamic:
            apply_dynamic_cp()
    applied = [p.name for p in ALL_PATCHES if is_applied(p)]
    initialize_model_parallel(
        CPConfig(context_parallel_size=cp, pipeline_model_parallel_size=pp,
                 data_parallel_size=WORLD // (cp * pp), cp_comm_type=comm,
                 hierarchical_context_parallel_sizes=hcp, num_attention_heads=4,
                 num_query_groups=2, seq_length=64, dynamic_context_parallel=dynamic,
                 max_seqlen_per_dp_cp_rank=96 if dynamic else None),
        create_gloo_process_groups=False)
    try:
        run = train_tiny_gpt(TinyGPTSpec.of(
            num_layers=4, num_attention_heads=4, num_query_groups=2, steps=2,
            context_parallel_size=cp, pipeline_model_parallel_size=pp, cp_comm_type=comm,
            hierarchical_context_parallel_sizes=hcp,
            varlen=VarLen(min_len=8, max_len=160, mean=40, sigma=1.0) if dynamic else None,
            dynamic_context_parallel=dynamic, max_seqlen_per_dp_cp_rank=96 if dynamic else None,
            global_batch_size=8))
    finally:
        destroy_model_parallel()
    return {"where": where, "applied": applied, "loss": run["loss"],
            "grad_norm": run["grad_norm"]}
