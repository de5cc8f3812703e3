"""A whole training step's memory per rank through Megatron-Bridge's own loop, on this rank.

Bridge's ``pretrain()`` of a Bridge recipe (default: the project's tiny Llama,
``tiny_llama_pretrain_config``: Bridge's pretrain base, mock GPT data, RMSNorm, SwiGLU) for two
steps on the calling world's ranks (DP = world / CP), counted by
:func:`megatron_hcp.training.step_memory.counted_schedules` around the schedule Bridge's loop
takes (``training.train.get_forward_backward_func``, the hook's dynamic-CP wrapper included):
the bytes its ``forward_backward`` holds when its first backward starts (the activations) and
its peak, of the last step. ``benchmarks/bridge_memory.py`` prints them from CP 1 to 8 and
``tests/unit/bridge/test_bridge_step_memory.py`` keeps them constant x CP in CI.
"""

from __future__ import annotations

from typing import Any

__all__ = ["TINY_LLAMA", "bridge_step_memory"]

TINY_LLAMA = "tiny_llama_pretrain_config"


def bridge_step_memory(cp: int, comm: str, seq: int, hidden: int, layers: int, heads: int,
                       recipe: str = TINY_LLAMA) -> dict[str, Any]:
    """On every rank of the calling world: Bridge's ``pretrain`` of two steps at CP ``cp``
    (``comm``; ``a2a+p2p`` as [2, cp / 2]); this rank's ``activations`` and ``peak`` (bytes) of
    the last step and the ``layout`` the run's model config had (CP size, comm type, HCP
    sizes)."""
    import torch.distributed as dist

    from ..bridge.run import prepare_environment

    prepare_environment(cpu=True)
    import megatron.bridge.training.train as bridge_train
    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.pretrain import pretrain

    from ..training.step_memory import counted_schedules
    from .bridge_recipe import build_bridge_config

    world = dist.get_world_size()
    if cp < 1 or world % cp:
        raise ValueError(f"bridge_step_memory: cp={cp} must divide the world of {world} ranks")
    args = {"seq_length": seq, "hidden_size": hidden, "num_layers": layers,
            "num_attention_heads": heads, "num_query_groups": heads,
            "ffn_hidden_size": 4 * hidden, "global_batch_size": world // cp, "train_iters": 2}
    overrides = [f"model.context_parallel_size={cp}"]
    if cp > 1:
        overrides.append(f"model.cp_comm_type={comm}")
    if comm == "a2a+p2p" and cp > 1:  # a2a over pairs, the ring over the rest
        overrides.append(f"model.hierarchical_context_parallel_sizes=[2,{cp // 2}]")
    cfg = build_bridge_config(recipe, args, overrides, steps=2)
    with counted_schedules(bridge_train) as seen:
        pretrain(cfg, forward_step)
    model = cfg.model
    return {**seen, "layout": (model.context_parallel_size, model.cp_comm_type if cp > 1 else None,
                               model.hierarchical_context_parallel_sizes)}
