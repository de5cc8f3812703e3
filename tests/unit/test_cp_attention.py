"""CP attention against single-process attention on the gathered tensors (4 gloo ranks).

The case runner (:func:`run_cases`) takes the device as a parameter and keeps its process groups
per rank thread, so the same cases also run as threads of one process on CPU or CUDA tensors
(``megatron_hcp.threaded_world``: ``tests/unit/test_threaded_world.py``, ``tests/gpu``)."""

from __future__ import annotations

import itertools
import math
import threading

import pytest
import torch
import torch.distributed as dist

from megatron_hcp.attention.reference import (
    BlockCounter,
    CommCounter,
    CPAttentionError,
    assemble_from_chunks,
    context_parallel_attention,
    full_attention,
    get_local_chunk,
    pad_thd,
)
from megatron_hcp.local_world import RankError
from megatron_hcp.parallel_state.groups import new_groups
from megatron_hcp.parallel_state.layout import hierarchical_level_groups

WORLD = 4
COMMS = ["p2p", "all_gather", "a2a", "a2a+p2p"]
FORMATS = ["bshd", "sbhd", "thd"]
HEADS = {"mha": (4, 4), "gqa": (4, 2), "kv_rep": (4, 1)}  # (q heads, kv heads)
TOL = {torch.float64: 1e-10, torch.float32: 1e-5}
# per rank (a gloo process, or a thread of a ThreadedWorld): groups are created once, in the same
# order everywhere
_RANK_STATE = threading.local()


def cp_groups(cp: int, hcp: tuple[int, int] | None):
    """This rank's CP group (or [a2a, p2p] groups) and the index of its CP group."""
    key = (cp, hcp)
    if not hasattr(_RANK_STATE, "groups"):
        _RANK_STATE.groups = {}
    _GROUPS = _RANK_STATE.groups
    if key not in _GROUPS:
        rank = dist.get_rank()
        flat = [list(range(s, s + cp)) for s in range(0, dist.get_world_size(), cp)]
        index = next(i for i, g in enumerate(flat) if rank in g)
        if hcp is None:
            levels = [flat]
        else:
            per_group = [hierarchical_level_groups(g, hcp) for g in flat]
            levels = [[g for p in per_group for g in p[lvl]] for lvl in range(2)]
        mine = [new_groups(level) for level in levels]
        _GROUPS[key] = (mine if hcp else mine[0], index)
    return _GROUPS[key]


def make_inputs(fmt, heads, dtype, cp, seed, b=2, d=8, dv=None):
    """Global q, k, v (and thd metadata) identical on every rank of a CP group; ``dv`` is v's
    head dim (MLA), ``d`` by default."""
    dv = d if dv is None else dv
    gen = torch.Generator().manual_seed(seed)
    hq, hkv = heads
    meta = {}
    if fmt == "thd":
        lengths = torch.randint(0, 21, (3,), generator=gen).tolist()
        cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
        extra = torch.randint(0, 2, (3,), generator=gen) * 2 * cp  # padding between sequences
        _, cu_pad = pad_thd(torch.zeros(int(cu[-1]), 1), cu, cp)
        cu_pad = cu_pad + torch.cat([torch.zeros(1, dtype=cu_pad.dtype),
                                     extra.cumsum(0).to(cu_pad.dtype)])
        t = int(cu_pad[-1])
        shapes = [(t, hq, d), (t, hkv, d), (t, hkv, dv), (t, hq, dv)]
        meta = dict(cu_seqlens=cu, cu_seqlens_padded=cu_pad)
    else:
        s = 2 * cp * 4
        order = (lambda h, e: (b, s, h, e)) if fmt == "bshd" else (lambda h, e: (s, b, h, e))
        shapes = [order(hq, d), order(hkv, d), order(hkv, dv), order(hq, dv)]
    q, k, v, dout = (torch.randn(sh, generator=gen, dtype=torch.float64) for sh in shapes)
    if fmt == "thd":  # padding tokens hold garbage: it must not leak into real tokens
        valid = torch.zeros(shapes[0][0], dtype=torch.bool)
        for i in range(len(meta["cu_seqlens"]) - 1):
            start = int(meta["cu_seqlens_padded"][i])
            valid[start : start + int(meta["cu_seqlens"][i + 1] - meta["cu_seqlens"][i])] = True
        meta["valid"] = valid
    return [x.to(dtype) for x in (q, k, v, dout)], meta


def run_case(comm, fmt, causal, heads, cp, dtype, seed, dv=None, window=None, sink=None,
             bias=None, *, device="cpu"):
    """``sink``: None, "off-by-one" (zero offsets) or "learnable" (random, with gradient;
    ``cp`` must then be the world: the offset's gradient is summed over it). ``bias``: a
    post-scale bias shape ("bhss", "1hss", "11ss", "111s"), with gradient, summed likewise.
    ``device``: where every tensor lives (inputs, packing metadata, oracle and CP attention)."""
    hcp = (2, cp // 2) if comm == "a2a+p2p" else None
    group, group_id = cp_groups(cp, hcp)
    flat_rank = dist.get_rank() % cp  # groups are contiguous blocks of the world
    (q, k, v, dout), meta = make_inputs(fmt, heads, dtype, cp, seed + 1000 * group_id, dv=dv)
    q, k, v, dout = (x.to(device) for x in (q, k, v, dout))
    meta = {key: x.to(device) for key, x in meta.items()}
    pad = meta.get("cu_seqlens_padded")
    offset = ref_offset = None
    if sink is not None:
        gen = torch.Generator().manual_seed(seed)
        offset = (torch.zeros(heads[0], dtype=dtype) if sink == "off-by-one" else
                  torch.randn(heads[0], generator=gen, dtype=torch.float64).to(dtype) + 1.0)
        offset = offset.to(device).requires_grad_(sink == "learnable")
        ref_offset = offset.detach().clone().requires_grad_(sink == "learnable")
    attn_bias = ref_bias = None
    if bias is not None:
        bsz, seq = (q.shape[0], q.shape[1]) if fmt == "bshd" else (q.shape[1], q.shape[0])
        dims = [bsz, heads[0], seq, seq]
        shape = [dims[i] if c != "1" else 1 for i, c in enumerate(bias)]
        gen = torch.Generator().manual_seed(seed + 7)
        attn_bias = torch.randn(shape, generator=gen, dtype=torch.float64).to(device, dtype)
        attn_bias.requires_grad_()
        ref_bias = attn_bias.detach().clone().requires_grad_()
    ref_in = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    ref = full_attention(*ref_in, causal=causal, qkv_format=fmt, window_size=window,
                         cu_seqlens=meta.get("cu_seqlens"), cu_seqlens_padded=pad,
                         softmax_offset=ref_offset, attention_bias=ref_bias)
    ref.backward(dout)

    def shard(x):
        return get_local_chunk(x, cp, flat_rank, fmt, pad)

    local = [shard(x).detach().requires_grad_() for x in (q, k, v)]
    out = context_parallel_attention(
        *local, cp_comm_type=comm, cp_group=group, causal=causal, qkv_format=fmt,
        cu_seqlens_q=meta.get("cu_seqlens"), cu_seqlens_kv=meta.get("cu_seqlens"),
        cu_seqlens_q_padded=pad, cu_seqlens_kv_padded=pad, window_size=window,
        softmax_offset=offset, attention_bias=attn_bias,
    )
    out.backward(shard(dout))
    assert out.shape == shard(ref).shape and local[2].grad.shape == local[2].shape
    errors = {
        "out": (out - shard(ref)).abs().max().item(),
        "dq": (local[0].grad - shard(ref_in[0].grad)).abs().max().item(),
        "dk": (local[1].grad - shard(ref_in[1].grad)).abs().max().item(),
        "dv": (local[2].grad - shard(ref_in[2].grad)).abs().max().item(),
    }
    if sink == "learnable":  # each rank's part covers its rows (and heads): sum over CP
        assert cp == dist.get_world_size()
        grad = offset.grad.clone()
        dist.all_reduce(grad)
        errors["dsink"] = (grad - ref_offset.grad).abs().max().item()
    if bias is not None:  # each rank's part covers its rows: sum over CP
        assert cp == dist.get_world_size()
        grad = attn_bias.grad.clone()
        dist.all_reduce(grad)
        errors["dbias"] = (grad - ref_bias.grad).abs().max().item()
    if fmt == "thd":  # padding rows: exactly zero output and no gradient
        valid = shard(meta["valid"])
        errors["pad_out"] = out[~valid].abs().max().item() if (~valid).any() else 0.0
        errors["pad_dq"] = local[0].grad[~valid].abs().max().item() if (~valid).any() else 0.0
    return errors


def run_cases(cases, device="cpu"):
    return [run_case(*case, device=device) for case in cases]


def failures_of(cases, per_rank):
    """(rank, case, errors above the dtype's tolerance) of every failing case."""
    failures = []
    for rank, results in enumerate(per_rank):
        for case, errors in zip(cases, results):
            bad = {k: e for k, e in errors.items() if not e <= TOL[case[5]]}
            if bad:
                failures.append((rank, case, bad))
    return failures


# ------------------------------------------------------------------ the oracle cases
# One definition of every case list, used by the tests below (gloo processes), by the threaded
# ranks on CPU (tests/unit/test_threaded_world.py) and on one GPU (tests/gpu).
def matrix_cases(comm, fmt):
    """causal/full x MHA/GQA/KV replication x CP 2/4 x fp64/fp32."""
    return [
        (comm, fmt, causal, HEADS[h], cp, dtype, seed)
        for seed, (causal, h, cp, dtype) in enumerate(itertools.product(
            [True, False], HEADS, [2, 4], [torch.float64, torch.float32]))
    ]


def mla_cases(comm):
    """MLA shapes (v's head dim 4, q/k's 8), every format, causal/full, fp64/fp32."""
    return [
        (comm, fmt, causal, HEADS["gqa"], 4, dtype, seed, 4)
        for seed, (fmt, causal, dtype) in enumerate(itertools.product(
            FORMATS, [True, False], [torch.float64, torch.float32]))
    ]


WINDOWS = [(3, 0), (2, 5), (6, -1), (-1, 3)]  # (left, right); 3 < one chunk of 4 tokens


def window_cases(comm):
    return [
        (comm, fmt, causal, HEADS["gqa"], 4, dtype, seed, None, WINDOWS[seed % len(WINDOWS)])
        for seed, (fmt, causal, dtype) in enumerate(itertools.product(
            FORMATS, [True, False], [torch.float64, torch.float32]))
    ]


def offset_cases(comm):
    return [
        (comm, fmt, causal, HEADS["gqa"], 4, dtype, seed, None,
         (2, 1) if seed == 5 else None, "off-by-one" if seed % 4 == 3 else "learnable")
        for seed, (fmt, causal, dtype) in enumerate(itertools.product(
            FORMATS, [True, False], [torch.float64, torch.float32]))
    ]


def bias_cases():
    shapes = ["bhss", "1hss", "11ss", "111s"]
    return [
        ("p2p", fmt, causal, HEADS["gqa"], 4, dtype, seed, None, None,
         "learnable" if seed % 5 == 0 else None, shapes[seed % 4])
        for seed, (fmt, causal, dtype) in enumerate(itertools.product(
            ["bshd", "sbhd"], [True, False], [torch.float64, torch.float32]))
    ]


def all_oracle_cases():
    """Every case of the tests below, by name (the cases need a world of ``WORLD`` ranks; a
    case runs in a smaller world when its CP size divides it and, with a learnable offset or
    a bias, equals it: see :func:`runnable_in`)."""
    named = {}
    for comm in COMMS:
        for fmt in FORMATS:
            named[f"matrix/{comm}/{fmt}"] = matrix_cases(comm, fmt)
        named[f"mla/{comm}"] = mla_cases(comm)
        named[f"window/{comm}"] = window_cases(comm)
        named[f"offset/{comm}"] = offset_cases(comm)
    named["bias/p2p"] = bias_cases()
    return named


def runnable_in(cases, world_size):
    """The cases a world of ``world_size`` ranks can run: CP sizes dividing the world, and
    equal to it where a gradient is summed over the world (learnable offset, bias)."""
    def fits(case):
        learnable = len(case) > 9 and case[9] == "learnable"
        cp, summed = case[4], learnable or (len(case) > 10 and case[10] is not None)
        return world_size % cp == 0 and cp <= world_size and (not summed or cp == world_size)
    return [case for case in cases if fits(case)]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("comm", COMMS)
def test_matches_single_process_attention(world, comm, fmt):
    cases = matrix_cases(comm, fmt)
    assert not (bad := failures_of(cases, world.run(run_cases, cases))), bad[:8]


@pytest.mark.parametrize("comm", COMMS)
def test_mla_head_dims(world, comm):
    """MLA shapes (v's head dim 4, q/k's 8): output and dv in v's head dim, every format."""
    cases = mla_cases(comm)
    assert not (bad := failures_of(cases, world.run(run_cases, cases))), bad[:8]


@pytest.mark.parametrize("comm", COMMS)
def test_sliding_window(world, comm):
    """window_size=(left, right) on load-balanced chunks, every format, causal and full."""
    cases = window_cases(comm)
    assert not (bad := failures_of(cases, world.run(run_cases, cases))), bad[:8]


@pytest.mark.parametrize("comm", COMMS)
def test_softmax_offset(world, comm):
    """Softmax with an offset (a sink logit per head): learnable, with its gradient summed over
    CP, and off-by-one; every format, causal and full, GQA and a window on one case."""
    cases = offset_cases(comm)
    assert not (bad := failures_of(cases, world.run(run_cases, cases))), bad[:8]


def test_post_scale_bias_on_the_ring(world):
    """A post-scale bias over the whole sequence (TE's bhss, 1hss, 11ss, 111s) on the ring:
    each block takes the bias of its rows and columns; output, dq/dk/dv and the bias gradient
    summed over CP equal the oracle, causal and full, bshd and sbhd, with and without an
    offset."""
    cases = bias_cases()
    assert not (bad := failures_of(cases, world.run(run_cases, cases))), bad[:8]


def bias_refusals():
    group, _ = cp_groups(4, None)
    hgroup, _ = cp_groups(4, (2, 2))
    (q, k, v, _), meta = make_inputs("bshd", (4, 2), torch.float64, 4, 3)
    local = [get_local_chunk(x, 4, dist.get_rank() % 4, "bshd") for x in (q, k, v)]
    bias = torch.zeros(1, 1, q.shape[1], q.shape[1], dtype=torch.float64)
    messages = []
    for comm, g, b in (("a2a", group, bias), ("all_gather", group, bias),
                       ("a2a+p2p", hgroup, bias), ("p2p", group, bias[..., :-2])):
        try:
            context_parallel_attention(*local, cp_comm_type=comm, cp_group=g, attention_bias=b)
            messages.append(None)
        except CPAttentionError as err:
            messages.append(str(err))
    (tq, tk, tv, _), tmeta = make_inputs("thd", (4, 2), torch.float64, 4, 3)
    pad = tmeta["cu_seqlens_padded"]
    tl = [get_local_chunk(x, 4, dist.get_rank() % 4, "thd", pad) for x in (tq, tk, tv)]
    try:
        context_parallel_attention(*tl, cp_comm_type="p2p", cp_group=group, qkv_format="thd",
                                   cu_seqlens_q=tmeta["cu_seqlens"], cu_seqlens_q_padded=pad,
                                   attention_bias=bias)
        messages.append(None)
    except CPAttentionError as err:
        messages.append(str(err))
    return messages


def test_post_scale_bias_refused_where_te_has_none(world):
    messages = world.run(bias_refusals)[0]
    for text, words in zip(messages, [
            ["cp_comm_type='a2a'", "ring only"], ["cp_comm_type='all_gather'", "ring only"],
            ["cp_comm_type='a2a+p2p'", "ring only"], ["shape", "whole sequence"],
            ["qkv_format='thd'", "bshd/sbhd"]]):
        assert text is not None and all(w in text for w in words), messages


def count_blocks(comm, window):
    group, _ = cp_groups(4, (2, 2) if comm == "a2a+p2p" else None)
    (q, k, v, _), _ = make_inputs("bshd", (4, 2), torch.float64, 4, 5)
    local = [get_local_chunk(x, 4, dist.get_rank() % 4, "bshd") for x in (q, k, v)]
    with BlockCounter() as counter:
        context_parallel_attention(*local, cp_comm_type=comm, cp_group=group,
                                   window_size=window)
    return len(counter.computed), counter.skipped, counter.pairs


@pytest.mark.parametrize("comm", ["p2p", "all_gather"])
def test_window_skips_blocks_outside_it(world, comm):
    # CP=4, chunks of 4 tokens, causal window of 3: rank r (chunks r, 7-r) sees only chunks next
    # to its own, i.e. sources r-1, r, r+1; the other blocks are skipped
    per_rank = world.run(count_blocks, comm, (3, 0))
    assert [(c, s) for c, s, _ in per_rank] == [(2, 2), (3, 1), (3, 1), (2, 2)]
    full = world.run(count_blocks, comm, None)
    assert [(c, s) for c, s, _ in full] == [(4, 0)] * 4
    assert all(w[2] < f[2] for w, f in zip(per_rank, full))


def assemble_roundtrip():
    cp = 4
    for fmt in FORMATS:
        (q, *_), meta = make_inputs(fmt, (4, 4), torch.float64, cp, 7)
        pad = meta.get("cu_seqlens_padded")
        chunks = [get_local_chunk(q, cp, r, fmt, pad) for r in range(cp)]
        assert torch.equal(assemble_from_chunks(chunks, fmt, pad), q), fmt
    return True


def test_chunking_roundtrip_and_megatron_layout():
    assert assemble_roundtrip()
    x = torch.arange(16).view(1, 16)
    # rank 1 of CP=4 holds chunks 1 and 6 of 8 (megatron's get_batch_on_this_cp_rank)
    assert get_local_chunk(x, 4, 1, "bshd").tolist() == [[2, 3, 12, 13]]


# ------------------------------------------------------------------ exact communication
def count_comm(comm, fmt):
    cp = 4
    hcp = (2, 2) if comm == "a2a+p2p" else None
    group, _ = cp_groups(cp, hcp)
    flat_rank = dist.get_rank() % cp
    (q, k, v, dout), meta = make_inputs(fmt, (4, 2), torch.float32, cp, 3)
    pad = meta.get("cu_seqlens_padded")
    local = [get_local_chunk(x, cp, flat_rank, fmt, pad).requires_grad_() for x in (q, k, v)]
    with CommCounter() as fwd:
        out = context_parallel_attention(
            *local, cp_comm_type=comm, cp_group=group, qkv_format=fmt,
            cu_seqlens_q=meta.get("cu_seqlens"), cu_seqlens_q_padded=pad)
    with CommCounter() as bwd:
        out.backward(get_local_chunk(dout, cp, flat_rank, fmt, pad))
    kv_local = local[1].numel()
    return ([(r.op, r.numel, r.group_size) for r in fwd.records],
            [(r.op, r.numel, r.group_size) for r in bwd.records], kv_local, local[0].numel())


@pytest.mark.parametrize("fmt", ["bshd", "thd"])
def test_exact_communication(world, fmt):
    # p2p: CP-1 ring steps of exactly 2*s*Hkv*d (times batch) elements; backward adds the
    # travelling dK/dV (CP sends, fp32).
    fwd, bwd, kv, _ = world.run(count_comm, "p2p", fmt)[0]
    assert fwd == [("send", 2 * kv, 4)] * 3
    assert bwd == [("send", 2 * kv, 4)] * 7  # 3 KV steps interleaved with 4 dK/dV hand-overs
    # all_gather: one all-gather forward; backward gathers again and reduce-scatters dK/dV
    fwd, bwd, kv, _ = world.run(count_comm, "all_gather", fmt)[0]
    assert fwd == [("all_gather", 2 * kv, 4)]
    assert bwd == [("all_gather", 2 * kv, 4), ("reduce_scatter", 4 * 2 * kv, 4)]
    # a2a: q, k, v in and the output back, each sending (a-1)/a of its tensor
    fwd, bwd, kv, qn = world.run(count_comm, "a2a", fmt)[0]
    kv_rep = kv * 2  # 2 KV heads replicated to the a2a size 4
    assert fwd == [("all_to_all", qn * 3 // 4, 4), ("all_to_all", kv_rep * 3 // 4, 4),
                   ("all_to_all", kv_rep * 3 // 4, 4), ("all_to_all", qn * 3 // 4, 4)]
    assert [op for op, *_ in bwd] == ["all_to_all"] * 4
    # a2a+p2p [2,2]: a2a in the inner pair, then p-1 = 1 ring step over the outer pair
    fwd, bwd, kv, qn = world.run(count_comm, "a2a+p2p", fmt)[0]
    assert [(op, size) for op, _, size in fwd] == [("all_to_all", 2)] * 3 + [("send", 2)] + [
        ("all_to_all", 2)]
    ring_send = fwd[3][1]
    assert ring_send == 2 * kv  # after a2a: half the heads, twice the tokens
    assert [(op, size) for op, _, size in bwd] == [("all_to_all", 2)] + [("send", 2)] * 3 + [
        ("all_to_all", 2)] * 3


# ------------------------------------------------------------------ bad input
def bad_inputs():
    group, _ = cp_groups(4, None)
    q = torch.randn(1, 8, 4, 8)
    errors = []
    cases = [
        dict(q=torch.randn(1, 8, 3, 8), cp_comm_type="a2a", cp_group=group),  # 3 heads / 4
        dict(q=q, k=torch.randn(1, 8, 3, 8), cp_comm_type="p2p", cp_group=group),  # GQA 4/3
        dict(q=torch.randn(1, 7, 4, 8), cp_comm_type="p2p", cp_group=group),  # odd length
        dict(q=q, cp_comm_type="a2a+p2p", cp_group=group),  # needs two groups
        dict(q=q, cp_comm_type="p2p", cp_group=None),  # silent CP-off
        dict(q=q, cp_comm_type="ring", cp_group=group),
        dict(q=torch.randn(24, 4, 8), qkv_format="thd", cp_comm_type="p2p", cp_group=group,
             cu_seqlens_q=torch.tensor([0, 10, 24])),  # 10 and 14 are not multiples of 8
        dict(q=torch.randn(5, 4, 8), qkv_format="thd", cp_comm_type="p2p", cp_group=group,
             cu_seqlens_q=torch.tensor([0, 8, 24])),  # local tokens should be 24/4 = 6
        dict(q=q, k=torch.randn(1, 8, 4, 6), cp_comm_type="p2p", cp_group=group),  # dq 8, dk 6
        dict(q=q, cp_comm_type="p2p", cp_group=group, window_size=(3,)),
    ]
    for kwargs in cases:
        qq = kwargs.pop("q")
        kk = kwargs.pop("k", None)
        kk = torch.randn(qq.shape[:-2] + (qq.shape[-2],) + qq.shape[-1:]) if kk is None else kk
        try:
            context_parallel_attention(qq, kk, kk.clone(), **kwargs)
            errors.append(None)
        except CPAttentionError as err:
            errors.append(str(err))
    return errors


def test_bad_input_clear_error_on_every_rank_before_any_collective(world):
    per_rank = world.run(bad_inputs)
    assert all(r == per_rank[0] for r in per_rank)
    messages = per_rank[0]
    assert None not in messages, messages
    for fragment, message in zip(
        ["does not divide the 3 local query heads", "not a multiple of 3 KV heads",
         "is odd", "needs cp_group=[a2a_group, p2p_group]", "would run with CP off",
         "use one of", "not a multiple of 2*cp_size=8", "q holds 5 tokens",
         "q head dim 8 != k head dim 6", "window_size=(3,): use (left, right)"], messages):
        assert fragment in message, (fragment, message)
    # no collective was left half-way: the world still answers
    assert world.run(dist.get_rank) == list(range(WORLD))


def test_pad_thd_pads_each_sequence():
    x = torch.arange(7.0).view(7, 1)
    out, cu_pad = pad_thd(x, torch.tensor([0, 3, 7]), cp_size=2)
    assert cu_pad.tolist() == [0, 4, 8]
    assert out.view(-1).tolist() == [0, 1, 2, 0, 3, 4, 5, 6]


def test_world_errors_are_reported(world):
    with pytest.raises(RankError):
        world.run(math.sqrt, -1.0)
