"""Vocab-parallel cross-entropy over an explicit tensor-parallel group.

megatron-core 0.16.1's unfused ``vocab_parallel_cross_entropy`` reads the global MPU TP group, so
a model built on the decentralized path (``pg_collection``, no MPU globals) cannot compute its
loss unless the fused variant (torch.compile) is used. This is the same computation with the
group passed in.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["vocab_parallel_cross_entropy"]


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, group) -> torch.Tensor:
        logits = logits.float()
        row_max = logits.max(dim=-1)[0]
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - row_max.unsqueeze(-1)
        part = logits.shape[-1]
        start = dist.get_rank(group) * part
        outside = (target < start) | (target >= start + part)
        local_target = (target - start).masked_fill(outside, 0)
        predicted = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        predicted = predicted.masked_fill(outside, 0.0)
        dist.all_reduce(predicted, group=group)
        exp = shifted.exp()
        total = exp.sum(dim=-1)
        dist.all_reduce(total, group=group)
        ctx.save_for_backward(exp / total.unsqueeze(-1), outside, local_target)
        return total.log() - predicted

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        softmax, outside, local_target = ctx.saved_tensors
        grad_logits = softmax.clone()
        hit = (~outside).unsqueeze(-1).to(grad_logits.dtype)
        grad_logits.scatter_add_(-1, local_target.unsqueeze(-1), -hit)
        return grad_logits * grad.unsqueeze(-1), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group
                                 ) -> torch.Tensor:
    """Per-token loss of ``logits`` [..., vocab/tp] against ``target`` over TP ``group``."""
    return _VocabParallelCrossEntropy.apply(logits, target, group)
