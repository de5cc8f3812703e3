"""MoE token dispatch when expert-parallel ranks hold different numbers of tokens.

Expert-parallel peers are data-parallel (DPxCP) ranks, and those hold micro-batches of different
lengths whenever the data's lengths vary: Bridge's packed SFT rows (each micro-batch padded to
its own length, a multiple of 16), and every dynamic-CP micro-batch (a rank's share of its
dynamic group's sequences, or an idle rank's 2-token filler). megatron-core's all-gather
dispatcher (``moe_token_dispatcher_type='allgather'``) gathers hidden states, probabilities and
the routing map over TP x EP as equal shares (``all_gather_into_tensor``) and reduce-scatters the
experts' output the same way: with unequal shares the ranks' collective sizes disagree (gloo
aborts the process: "Received data size doesn't match expected size"; NCCL would misread the
buffers). The all-to-all dispatcher exchanges its split sizes and needs nothing.

``moe-allgather-variable-tokens``: with expert parallelism the dispatcher first gathers every
rank's token count over TP x EP; when they differ, each rank's share is padded to the largest,
gathered as equal shares and the padding rows dropped (the experts see exactly the concatenation
of every rank's tokens, as upstream's gather of equal shares gives), and the combine puts the
experts' output back into the padded layout, reduce-scatters equal shares and keeps this rank's
rows (autograd through both as upstream's). Equal counts take upstream's own code unchanged;
without expert parallelism (TP x SP shares are equal by construction) nothing is exchanged.
"""

from __future__ import annotations

import functools
from typing import Any

from .registry import Patch, Target

__all__ = ["MOE_DISPATCH_PATCHES"]

VERSIONS = ("0.16.1", "0.19.2")
_DISPATCHER = "megatron.core.transformer.moe.token_dispatcher"
# of a dispatch of padded shares: (its real rows in the padded layout, the local count, a share)
_ROWS = "_megatron_hcp_padded_rows"


def _token_counts(count: int, group: Any, device: Any) -> list[int]:
    """Every rank's ``count`` over ``group``, in group order."""
    import torch
    import torch.distributed as dist

    mine = torch.tensor([count], dtype=torch.int64, device=device)
    every = torch.empty(group.size(), dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(every, mine, group=group)
    return every.tolist()


def _padded(tensor: Any, rows: int) -> Any:
    """``tensor`` ([n, ...]) with zero rows appended up to ``rows``."""
    import torch

    extra = rows - tensor.shape[0]
    if extra == 0:
        return tensor
    return torch.cat([tensor, tensor.new_zeros((extra, *tensor.shape[1:]))])


def _make_token_dispatch(original):
    @functools.wraps(original)
    def token_dispatch(self, hidden_states, probs):
        """Upstream's gather of equal shares over TP x EP; when the expert-parallel ranks'
        token counts differ, of padded shares with the padding dropped (module docstring)."""
        import torch
        from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

        setattr(self, _ROWS, None)
        if self.ep_size == 1:
            return original(self, hidden_states, probs)
        group = self.tp_ep_group
        counts = _token_counts(hidden_states.shape[0], group, hidden_states.device)
        if len(set(counts)) == 1:
            return original(self, hidden_states, probs)
        most = max(counts)
        rows = torch.cat([torch.arange(n, device=hidden_states.device) + i * most
                          for i, n in enumerate(counts)])
        setattr(self, _ROWS, (rows, hidden_states.shape[0], most))

        def gather(tensor):
            return gather_from_sequence_parallel_region(_padded(tensor, most), group=group)[rows]

        with torch.no_grad():
            self.routing_map = gather(self.routing_map)
        return gather(hidden_states), gather(probs)

    return token_dispatch


def _make_token_combine(original):
    @functools.wraps(original)
    def token_combine(self, hidden_states):
        """Upstream's reduce-scatter of equal shares; after a dispatch of padded shares, the
        experts' output put back into the padded layout, reduce-scattered, this rank's rows
        kept."""
        from megatron.core.tensor_parallel import reduce_scatter_to_sequence_parallel_region

        padded = getattr(self, _ROWS, None)
        if padded is None:
            return original(self, hidden_states)
        setattr(self, _ROWS, None)
        rows, local, most = padded
        group = self.tp_ep_group
        values = hidden_states.to(self.local_probs.dtype)
        full = values.new_zeros((most * group.size(), *values.shape[1:]))
        full = full.index_copy(0, rows, values)
        out = reduce_scatter_to_sequence_parallel_region(full, group=group)
        return out[:local].to(hidden_states.dtype)

    return token_combine


MOE_DISPATCH_PATCHES: tuple[Patch, ...] = (
    Patch(
        name="moe-allgather-variable-tokens",
        summary="the all-gather MoE dispatcher gathers and scatters the tokens of "
        "expert-parallel ranks holding different token counts (packed variable-length data, "
        "dynamic CP) as padded equal shares, the padding dropped; equal counts run upstream's "
        "code",
        upstream="megatron/core/transformer/moe/token_dispatcher.py:278-300 (0.16.1: same "
        "code) MoEAllGatherTokenDispatcher.token_dispatch gathers routing map, probs and hidden "
        "states over tp_ep_group as equal shares (gather_from_sequence_parallel_region without "
        "output_split_sizes), and token_combine (352-365) reduce-scatters equal shares: with "
        "micro-batches of different lengths on EP peers the sizes disagree (measured on gloo, "
        "Bridge's packed SFT rows with EP2, CP=1 and dynamic CP4: the rank processes abort, "
        "'Received data size doesn't match expected size')",
        versions=VERSIONS,
        targets=(
            Target(_DISPATCHER, "MoEAllGatherTokenDispatcher.token_dispatch",
                   _make_token_dispatch, params=("self", "hidden_states", "probs")),
            Target(_DISPATCHER, "MoEAllGatherTokenDispatcher.token_combine",
                   _make_token_combine, params=("self", "hidden_states")),
        ),
    ),
)
