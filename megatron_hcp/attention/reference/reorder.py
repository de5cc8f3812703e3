"""How tokens and heads move between the model's layout and the attention's, forward and back.

Tensors are ``[B, H, S, D]``. K and V travel as one tensor, their head dims side by side
(:func:`pack_kv`: ``[B, Hkv, S, D + Dv]``, contiguous): the ring's message, the all-gather's
input and the all-to-all's, saved once for the backward.

* :class:`UlyssesAllToAll` - scatter heads, gather the a2a group's sequence (its backward: the
  inverse); :func:`seq_to_heads` / :func:`heads_to_seq`. One all-to-all each way; a send buffer
  and a receive buffer of the tensor's size live only inside it (:func:`~.comm.release`).
* :class:`TokenOrder` - the tokens in another order on this rank (packed zigzag halves grouped).
* :class:`OutputOrder` - how the attention's output leaves it (none, token order, or the a2a
  back) and how its backward gets the output and its gradient back: the attention functions
  keep only the output they return (which the model holds anyway) and convert it back in
  backward, as Transformer Engine's a2a attention does, instead of keeping it twice; in token
  order as :class:`RowsInOrder`, which gathers only the rows a block reads.
* :class:`HeldOutput` - the returned output as such a function holds it: released in the
  backward once moved back, so the output is not alive in both layouts at the backward's peak.

``heads_inner``: a result laid out [B, S, H, D] in memory (heads inside the rows, as megatron's
bshd / thd tensors and the efficient kernel's backward read an output), else contiguous
[B, H, S, D] (what a K/V message must be).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from . import comm
from .blocks import take

__all__ = ["HeldOutput", "OutputOrder", "RowsInOrder", "TokenOrder", "UlyssesAllToAll",
           "heads_to_seq", "pack_kv", "run_starts", "seq_to_heads", "split_kv"]


def pack_kv(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """K [B, Hkv, S, D] and V [B, Hkv, S, Dv] as one contiguous [B, Hkv, S, D + Dv] tensor (one
    copy; differentiable: its gradient splits back into views)."""
    return torch.cat([k, v], dim=-1)


def split_kv(kv: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of a packed tensor (views: head dim contiguous, rows ``D + Dv`` apart)."""
    return kv[..., :dim], kv[..., dim:]


def seq_to_heads(x: torch.Tensor, group, perm: torch.Tensor, heads_inner: bool = True,
                 reps: int = 1) -> torch.Tensor:
    """[B, H, S, D] -> [B, H*reps/a, a*S, D]: scatter heads, gather the a2a group's sequence,
    tokens in the order ``perm`` of the gathered ones (source-major). ``reps``: each head
    taken ``reps`` times in a row (KV heads replicated for an a2a wider than them) as the
    send buffer is written - no replicated copy of ``x`` beside it. On the wire a rank's part
    is [S, B, H*reps/a, D]: one copy in, one gather out."""
    a = dist.get_world_size(group)
    b, h, s, d = x.shape
    if reps > 1:  # one replica a rank (h * reps == a): [h, reps, s, b, d] is [a, s, b, 1, d]
        send = x.unsqueeze(2).expand(b, h, reps, s, d).permute(1, 2, 3, 0, 4).contiguous()
        h *= reps
        send = send.view(a, s, b, h // a, d)
    else:
        send = x.unflatten(1, (a, h // a)).permute(1, 3, 0, 2, 4).contiguous()  # [a,s,b,h/a,d]
    recv = torch.empty_like(send)
    comm.all_to_all_single(recv, send, group)
    comm.release(send, x)
    tokens = recv.view(a * s, b, h // a, d)
    if heads_inner:
        out = tokens.transpose(0, 1).index_select(1, perm).transpose(1, 2)
    else:
        out = tokens.permute(1, 2, 0, 3).index_select(2, perm)
    comm.release(recv, out)
    return out


def heads_to_seq(x: torch.Tensor, group, inv_perm: torch.Tensor, consume: bool = False
                 ) -> torch.Tensor:
    """Inverse of :func:`seq_to_heads`: [B, H/a, a*S, D] -> [B, H, S, D], heads inside the
    rows. One gather in (into the wire layout), one copy out. ``consume``: ``x`` is this
    call's to free (:func:`~.comm.release`) once gathered - the caller never reads it again."""
    a = dist.get_world_size(group)
    b, hl, sa, d = x.shape
    s = sa // a
    send = x.permute(2, 0, 1, 3).index_select(0, inv_perm)  # [a*s, b, hl, d]: [a, s, ...]
    if consume:
        comm.release(x)
    recv = torch.empty_like(send)
    comm.all_to_all_single(recv, send, group)
    comm.release(send)
    # heads inside the rows whatever the sizes (a reshape could return a view of another
    # order, e.g. with one head a rank, which megatron would copy into this one again)
    out = recv.view(a, s, b, hl, d).permute(2, 1, 0, 3, 4).contiguous().view(b, s, a * hl, d)
    comm.release(recv, out)
    return out.transpose(1, 2)


def tokens_in_order(x: torch.Tensor, perm: torch.Tensor, heads_inner: bool = True
                    ) -> torch.Tensor:
    """``x`` [B, H, S, D] with its tokens in the order ``perm`` (one gather)."""
    if heads_inner:
        return x.transpose(1, 2).index_select(1, perm).transpose(1, 2)
    return x.index_select(2, perm)


class UlyssesAllToAll(torch.autograd.Function):
    """:func:`seq_to_heads` (``perm``; heads inside the rows or contiguous; ``reps``: heads
    replicated); the backward takes the gradient back with :func:`heads_to_seq`
    (``inv_perm``), the replicas' summed. Saves nothing."""

    @staticmethod
    def forward(ctx, x, group, perm, inv_perm, heads_inner: bool = True, reps: int = 1):
        ctx.meta = (group, inv_perm, reps)
        return seq_to_heads(x, group, perm, heads_inner, reps)

    @staticmethod
    def backward(ctx, grad):
        group, inv_perm, reps = ctx.meta
        grad = heads_to_seq(grad, group, inv_perm)
        if reps > 1:  # the replicas' gradients summed
            grad = grad.unflatten(1, (-1, reps)).sum(2)
        return grad, None, None, None, None, None


class TokenOrder(torch.autograd.Function):
    """Tokens (dim 2 of [B, H, S, D]) taken in the order ``perm``; the backward takes the
    gradient back with ``inv`` (its inverse): one gather each way. Saves nothing."""

    @staticmethod
    def forward(ctx, x, perm, inv, heads_inner: bool = True):
        ctx.inv = inv
        return tokens_in_order(x, perm, heads_inner)

    @staticmethod
    def backward(ctx, grad):
        return tokens_in_order(grad, ctx.inv), None, None, None


def run_starts(index: torch.Tensor) -> tuple[int, ...]:
    """For each entry of a host ``index``, where the run of consecutive ascending values it
    belongs to starts (entries ``i`` and ``j`` are in one run iff their starts are equal)."""
    n = int(index.numel())
    if n == 0:
        return ()
    breaks = torch.ones(n, dtype=torch.bool)
    breaks[1:] = index[1:] != index[:-1] + 1
    starts = torch.arange(n)
    starts[~breaks] = 0
    return tuple(torch.cummax(starts, 0).values.tolist())


@dataclass(frozen=True, eq=False)
class RowsInOrder:
    """``x`` [B, H, S, D] seen with its tokens in the order ``perm`` (row ``i`` is ``x``'s row
    ``perm[i]``) without moving it whole: :meth:`take` returns the rows a block reads - a view
    where they are one run of ``x``'s rows (``host``: ``perm`` on the host, ``runs``: its
    :func:`run_starts`), else gathered: a run of the reordered rows (a block's rows, a row
    chunk, a half) gathered once and kept until a block reads rows it does not hold, or half
    of them or fewer (or :meth:`let_go`); more than half of the rows as the whole reordered
    once (a block of most rows reads them whole anyway); an index of up to half of them (a
    piece) a gather of just those.
    So a block in pieces, row chunks or halves holds its own rows, not a copy of the whole,
    and the blocks after it that read the same rows (the later halves of a ring) gather them
    once."""

    x: torch.Tensor
    perm: torch.Tensor
    host: tuple[int, ...] = ()
    runs: tuple[int, ...] = ()
    _kept: list = field(default_factory=list)  # [(first, stop, rows)]: at most one

    def take(self, sel: slice | torch.Tensor) -> torch.Tensor:
        """The rows ``sel`` of the reordered tensor."""
        n = int(self.perm.numel())
        if isinstance(sel, slice):
            span = range(n)[sel]
            if span.step != 1 or len(span) == 0:
                return self._gather(self.perm[sel])
            a, b = span.start, span.stop
            if self._kept:  # (no local name for the kept rows: let_go must free them)
                first, stop = self._kept[0][:2]
                if first <= a and b <= stop and 2 * (b - a) > stop - first:
                    return self._kept[0][2][:, :, a - first:b - first]
            if self.in_place(sel):
                return self.x[:, :, self.host[a]:self.host[a] + b - a]
            if 2 * (b - a) > n:
                a, b = 0, n
            return take(self._keep(a, b), slice(span.start - a, span.stop - a))
        if self._kept and self._kept[0][:2] == (0, n):
            return take(self._kept[0][2], sel)
        if 2 * int(sel.numel()) > n:
            return take(self._keep(0, n), sel)
        return self._gather(self.perm.index_select(0, sel))

    def _keep(self, a: int, b: int) -> torch.Tensor:
        """The reordered rows ``a`` to ``b`` gathered and kept, what was kept let go first
        (one kept at a time)."""
        self.let_go()
        self._kept.append((a, b, self._gather(self.perm[a:b])))
        return self._kept[0][2]

    def in_place(self, sel: slice | torch.Tensor) -> bool:
        """The rows ``sel`` are one run of ``x``'s rows: :meth:`take` returns a view."""
        if not isinstance(sel, slice) or not self.runs:
            return False
        span = range(int(self.perm.numel()))[sel]
        return (span.step == 1 and span.stop > span.start
                and self.runs[span.start] == self.runs[span.stop - 1])

    def let_go(self) -> None:
        """Drop the rows kept gathered (the next :meth:`take` gathers what it reads)."""
        self._kept.clear()

    @property
    def row_elements(self) -> int:
        """Elements of one row (all batches and heads)."""
        b, h, _, d = self.x.shape
        return b * h * d

    def _gather(self, index: torch.Tensor) -> torch.Tensor:
        return tokens_in_order(self.x, index)

    def row_sums(self, other: RowsInOrder) -> torch.Tensor:
        """``rowsum(self * other)`` [B, H, S] in the reordered token order (fp32 or wider)."""
        acc = torch.promote_types(self.x.dtype, torch.float32)
        sums = (self.x.to(acc) * other.x.to(acc)).sum(-1)
        return sums.index_select(2, self.perm)


@dataclass(frozen=True, eq=False)
class OutputOrder:
    """How an attention function's output [B, H, S, Dv] leaves it (:meth:`leave`) and how its
    backward takes the returned output and its gradient back (:meth:`back`): ``"none"``,
    ``"tokens"`` (:func:`tokens_in_order`: ``perm`` out, ``inv`` back) or ``"a2a"``
    (:func:`heads_to_seq` with ``inv`` out, :func:`seq_to_heads` with ``perm`` back, over
    ``group``)."""

    kind: str = "none"
    perm: torch.Tensor | None = None
    inv: torch.Tensor | None = None
    group: object = None
    inv_host: tuple[int, ...] = ()  # "tokens": ``inv`` on the host and its runs
    inv_runs: tuple[int, ...] = ()  # (:func:`run_starts`), for RowsInOrder's views

    @property
    def moves(self) -> bool:
        return self.kind != "none"

    def leave(self, out: torch.Tensor) -> torch.Tensor:
        """The output as the caller gets it; ``out`` (the attention's own, read by nothing
        else) is freed on the way where that lowers the peak (the a2a back)."""
        if self.kind == "a2a":
            return heads_to_seq(out, self.group, self.inv, consume=True)
        if self.kind == "tokens":
            return tokens_in_order(out, self.perm)
        return out

    def back(self, x: torch.Tensor, whole: bool = True) -> torch.Tensor | RowsInOrder:
        """The returned output (or its gradient) in the attention's layout, heads inside the
        rows; in token order, where not ``whole``, as a :class:`RowsInOrder` (no copy)."""
        if self.kind == "tokens" and not whole:
            return RowsInOrder(x, self.inv, self.inv_host, self.inv_runs)
        if self.kind == "a2a":
            return seq_to_heads(x, self.group, self.perm)
        if self.kind == "tokens":
            return tokens_in_order(x, self.inv)
        return x


def _graph_kept() -> bool:
    """Whether the running backward keeps the graph (``retain_graph``): its saved state must
    then outlive it. Where torch cannot tell, assume it does."""
    keep = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return True if keep is None else bool(keep())


class HeldOutput:
    """An attention function's returned output, held for its backward where the backward reads
    it moved back into the attention's layout (an :class:`OutputOrder` that moves).

    ``save_for_backward`` would hold the returned output until the whole backward ends, beside
    its moved-back copy. This holds a detached alias of it instead (it shares the storage and
    the version counter, and has no ``grad_fn``: no reference cycle through the graph) and
    :meth:`take` lets go of it, so once the backward has moved it back and the model's next
    layer has released its own reference (its backward ran first), the returned output's
    memory is free. An in-place change of the output between forward and backward is refused,
    as autograd refuses it for a saved tensor; a graph kept for another backward
    (``retain_graph``) keeps the output too. Only where :meth:`applies`."""

    @staticmethod
    def applies(out: torch.Tensor) -> bool:
        """Whether ``out`` may be held so: not an inference tensor (it has no version
        counter), and not while saved-tensor hooks are active (activation offloading,
        checkpointing), which must see every saved tensor to move or drop it - there the
        output is saved as usual."""
        top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
        return not out.is_inference() and top is not None and top(False) is None

    def __init__(self, out: torch.Tensor):
        self._out: torch.Tensor | None = out.detach()
        self._version = out._version

    def take(self) -> torch.Tensor:
        """The output; this holder's reference is dropped unless the graph is kept."""
        out = self._out
        if out is None:
            raise RuntimeError(
                "the CP attention's backward ran a second time after its graph was freed; "
                "pass retain_graph=True to the first backward to run it again")
        if out._version != self._version:
            raise RuntimeError(
                "the CP attention's output was modified in place after the forward (version "
                f"{out._version}, saved at {self._version}); its backward reads the output as "
                "returned: use an out-of-place op on it (e.g. x = x + y, not x += y)")
        if not _graph_kept():
            self._out = None
        return out
