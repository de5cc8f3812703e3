"""A packed block's pieces as FlashAttention-2 varlen calls (attention.reference.gpu.varlen).

No CPU kernel takes segments, and this machine has no GPU: FA2's kernel itself runs only in
``tests/gpu`` and in the once-per-process check of ``auto``. Here: the calls' segments
compute exactly the pieces' pairs (random packings), the reference the kernel is checked
against equals plain SDPA per segment, the check accepts the reference and refuses a kernel
that differs, and CP attention run through the calls - with the reference in the kernel's
place - matches the single-process oracle on every comm type and layout.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from megatron_hcp.attention.reference import BlockCounter, local_attention
from megatron_hcp.attention.reference.blocks import plan_block
from megatron_hcp.attention.reference.gpu import varlen as varlen_module
from megatron_hcp.attention.reference.gpu.varlen import (
    VARLEN_ENV,
    VARLEN_KERNEL,
    VarlenCall,
    fa2_visible,
    forget_kernel_checks,
    kernel_matches_reference,
    max_seqlens,
    reference_backward,
    reference_forward,
    varlen_calls,
    varlen_mode,
    varlen_takes,
    varlening,
)
from megatron_hcp.attention.reference.pieces import splitting
from megatron_hcp.attention.reference.seq_layout import CPAttentionError, SeqLayout
from megatron_hcp.harness.threaded_world import ThreadedWorld
from tests.unit.attention.test_cp_attention import (
    COMMS,
    MODES,
    WORLD,
    failures_of,
    matrix_cases,
    mla_cases,
    offset_cases,
    run_cases,
    runnable_in,
    window_cases,
)
from tests.unit.attention.test_packed_pieces import _packings, _pairs, layout_pairs

pytestmark = pytest.mark.torch_only


def _call_pairs(call: VarlenCall, n: int) -> torch.Tensor:
    """The (row, col) pairs over ``n`` local tokens the segments of ``call`` compute."""
    seen = torch.zeros(n, n, dtype=torch.int)
    row, col = call.row, call.col
    for q, k in zip(call.q_lens, call.k_lens):
        if q and k:
            seen[row:row + q, col:col + k] += fa2_visible(
                q, k, call.causal, call.window, max_seqlens(call)[1]).int()
        row, col = row + q, col + k
    assert (row, col) == (call.row + call.rows, call.col + call.cols)  # segments tile spans
    return seen


def test_calls_compute_exactly_the_pairs_of_the_pieces():
    """Every block in pieces of about 270 random packings (both layouts, grouped halves or
    not, CP 1/2/4, padding, empty sequences): its varlen calls compute each pair of its pieces
    once and no other; causal segments are squares; at most two calls a causal block, three a
    full one."""
    checked = 0
    for layout, kv, causal, where in layout_pairs(_packings(300)):
        with splitting("on"):
            block = plan_block(layout, kv, causal)
        if block is None or not block.pieces:
            continue
        n = layout.local_tokens
        seen = sum(_call_pairs(call, n) for call in block.calls)
        assert torch.equal(seen, _pairs(block, n)), where
        # causal: a sequence's pairs of runs are one chain (diagonal squares) and one (keys
        # before queries); full: its four pairs of halves three chains
        assert len(block.calls) <= (2 if causal else 3), (where, block.calls)
        for call in block.calls:
            assert all(q == k for q, k in zip(call.q_lens, call.k_lens)
                       if q and k and call.causal)
        checked += 1
    assert checked > 500


def _windows(seed: int):
    """A window per call: bounded on either side or both (never unbounded on both)."""
    import random

    rng = random.Random(seed)
    while True:
        window = (rng.choice([-1, 0, 1, 2, 5, 9]), rng.choice([-1, 0, 1, 3, 7]))
        yield (3, -1) if window == (-1, -1) else window


def _long_sequences(seed: int):
    """Single sequences of up to 16 tokens a chunk (CP 2 and 4, both layouts), causal or
    not, as :func:`_packings` draws them, for windows longer than a chunk."""
    import random

    rng = random.Random(seed)
    for _ in range(40):
        mode, cp = rng.choice(["zigzag", "contiguous"]), rng.choice([2, 4])
        n = (2 * cp if mode == "zigzag" else cp) * rng.randint(3, 16)
        yield mode, cp, (n,), (n,), rng.random() < 0.7, False


def _long_windows(seed: int):
    import random

    rng = random.Random(seed)
    while True:
        yield rng.choice([(rng.randint(0, 40), 0), (rng.randint(0, 40), -1),
                          (-1, rng.randint(0, 40)), (rng.randint(0, 40), rng.randint(0, 40))])


def test_window_calls_compute_exactly_the_pairs_of_the_masked_block():
    """Every windowed block of random packings and single sequences (both layouts, grouped
    halves or not, CP 1/2/4, windows bounded on either side or both, shorter and longer than
    a chunk, causal or not): the varlen calls of its bands compute each visible pair of the
    masked block once and no other - as FA2 computes a segment (:func:`fa2_visible`: its
    rules for a window side past ``max_seqlen_k`` included); a single sequence's block takes
    at most four calls (one per pair of its halves' chunks)."""
    checked = 0
    cases = [*zip(layout_pairs(_packings(200, seed=5), dense=True), _windows(1)),
             *zip(layout_pairs(_long_sequences(4), dense=True), _long_windows(6))]
    for (layout, kv, causal, where), window in cases:
        with splitting("on"):
            block = plan_block(layout, kv, causal, window, varlen=True)
        if block is None:
            continue
        n = layout.local_tokens
        seen = sum((_call_pairs(c, n) for c in block.calls), torch.zeros(n, n, dtype=torch.int))
        assert torch.equal(seen, _pairs(block, n)), (where, window)
        assert len(block.calls) <= 4 or not layout.is_dense, block.calls
        checked += 1
    assert checked > 700


def test_fa2s_rules_for_an_unbounded_window_side():
    """FA2 takes a window side of max_seqlen_k or more as unbounded and then bounds an
    unbounded side at max_seqlen_k where the other side is bounded (its sources, as
    fa2_visible models them): a segment of 16 rows against 8 keys, left 0 and right
    unbounded, loses keys under max_seqlen_k 8; the calls get max_seqlen_k of at least their
    rows, where it sees them all."""
    wanted = torch.ones(16, 8, dtype=torch.bool).triu(-8)  # j - i >= 8 - 16 - 0
    assert not torch.equal(fa2_visible(16, 8, False, (0, -1), 8), wanted)
    assert torch.equal(fa2_visible(16, 8, False, (0, -1), 16), wanted)
    call = VarlenCall(0, 16, 0, 8, (16,), (8,), False, (0, -1))
    assert max_seqlens(call) == (16, 16)
    assert max_seqlens(VarlenCall(0, 1, 0, 1, (1,), (1,), True)) == (2, 2)





def test_window_trimming_from_bands_is_the_masks():
    """A windowed block's trimmed rows and columns, read from its bands (no [rows, cols] mask
    on the host), are the rows and columns its mask shows seeing anything (random packings
    and single sequences, both layouts, grouped or not, windows of every kind)."""
    from megatron_hcp.attention.reference import blocks, masks

    checked = 0
    for (layout, kv, causal, where), window in zip(
            layout_pairs(_packings(150, seed=9), dense=True), _windows(2)):
        halves = blocks._halves(layout, kv, causal)
        if halves is None:
            continue
        rows, cols = layout.half(halves[0]), kv.half(halves[1])
        mask = masks._mask(blocks._meta(layout, rows), blocks._meta(kv, cols), causal, window)
        got = blocks._window_trim(layout, kv, causal, window, halves[:2])
        if not bool(mask.any()):
            assert got is None
            continue
        n = layout.local_tokens
        idx_r = torch.arange(n)[rows] if isinstance(rows, slice) else rows
        idx_c = torch.arange(n)[cols] if isinstance(cols, slice) else cols
        # every local token is a slice (the block takes its tensors whole), else an index
        got_r, got_c = (torch.arange(n)[sel] if isinstance(sel, slice) else sel
                        for sel in got[:2])
        assert torch.equal(got_r, idx_r[mask.any(1)]), (where, window)
        assert torch.equal(got_c, idx_c[mask.any(0)]), (where, window)
        checked += 1
    assert checked > 300


def test_gaps_become_segments_without_keys_or_rows():
    """Padding between two pieces: a segment of its rows without keys and one of its keys
    without rows; the call reports rows that see no key."""
    from megatron_hcp.attention.reference.pieces import Piece

    (call,) = varlen_calls((Piece(0, 3, 0, 3, True), Piece(5, 2, 5, 2, True)))
    assert call == VarlenCall(0, 7, 0, 7, (3, 2, 0, 2), (3, 0, 2, 2), True)
    assert call.empty_rows
    (dense,) = varlen_calls((Piece(0, 3, 0, 3, True), Piece(3, 2, 3, 2, True)))
    assert dense.q_lens == (3, 2) and not dense.empty_rows


@pytest.fixture
def fresh_parts():
    """kernel_calls' cache empty before and after (a test changes FA2's limits)."""
    varlen_module.kernel_calls.cache_clear()
    yield
    varlen_module.kernel_calls.cache_clear()


def test_calls_run_in_parts_within_fa2s_limits(monkeypatch, fresh_parts):
    """A call whose dq buffer (rows + 128 a segment, times heads x rounded head dim) would
    pass 32-bit offsets, or whose segments pass the grid's limit, runs in parts cut at
    segment boundaries that compute the same pairs; a segment too large alone: no calls."""
    layout = SeqLayout((32,) * 12, (30,) * 12, 2, 0).with_grouped_halves()
    with splitting("on"):
        block = plan_block(layout, layout, True)
    n = layout.local_tokens
    assert varlen_module.kernel_calls(block.calls, 16, 128) == block.calls  # fits: as planned
    assert varlen_module._rounded_head_dim(72) == 96
    assert varlen_module._rounded_head_dim(136) == 192
    buffer = (8 + 128 * 3) * 2 * 32  # three segments of 8 rows pass it, two do not
    for elements, segments, most in ((buffer, 65535, 2), (2**31, 3, 3)):
        monkeypatch.setattr(varlen_module, "_DQ_ACCUM_ELEMENTS", elements)
        monkeypatch.setattr(varlen_module, "_MAX_SEGMENTS", segments)
        varlen_module.kernel_calls.cache_clear()
        parts = varlen_module.kernel_calls(block.calls, 2, 8)
        assert len(parts) > len(block.calls)
        assert torch.equal(sum(_call_pairs(p, n) for p in parts),
                           sum(_call_pairs(c, n) for c in block.calls))
        assert max(len(part.q_lens) for part in parts) == most
        for part in parts:
            assert (part.rows + 128 * len(part.q_lens)) * 2 * 32 < elements
    monkeypatch.setattr(varlen_module, "_DQ_ACCUM_ELEMENTS", (4 + 128) * 2 * 32)
    varlen_module.kernel_calls.cache_clear()
    assert varlen_module.kernel_calls(block.calls, 2, 8) is None  # an 8-row segment alone


def test_parts_without_a_segment_that_computes_are_dropped(monkeypatch, fresh_parts):
    """Cutting a call next to its gaps leaves parts of gaps only, which compute nothing: they
    are dropped, and the parts start and end with segments that compute (no launch, no
    empty tensors for FA2)."""
    from megatron_hcp.attention.reference.pieces import Piece

    (call,) = varlen_calls((Piece(0, 4, 0, 4, True), Piece(10, 40, 10, 40, True)))
    assert call.q_lens == (4, 6, 0, 40) and call.k_lens == (4, 0, 6, 40)
    monkeypatch.setattr(varlen_module, "_DQ_ACCUM_ELEMENTS", (40 + 128) * 32 + 1)
    parts = varlen_module.kernel_calls((call,), 1, 32)
    assert parts == (VarlenCall(0, 4, 0, 4, (4,), (4,), True),
                     VarlenCall(10, 40, 10, 40, (40,), (40,), True)), parts


def test_the_split_rule_counts_the_calls_fa2_runs(monkeypatch, fresh_parts):
    """``auto`` prices a split block at the calls FA2 runs for q's heads and head dim: its
    parts, or every piece where a segment is too large for a call."""
    from megatron_hcp.attention.reference import blocks

    short = SeqLayout((128,) * 256, (120,) * 256, 4, 1).with_grouped_halves()
    with splitting("auto"):
        assert plan_block(short, short, True, varlen=(16, 128)).pieces is not None
        monkeypatch.setattr(varlen_module, "_DQ_ACCUM_ELEMENTS", 100 * 16 * 128)
        varlen_module.kernel_calls.cache_clear()
        # every 16-row segment alone is past the limit: one call a piece, so masked
        assert varlen_module.kernel_calls(
            plan_block(short, short, True, varlen=True).calls, 16, 128) is None
        assert plan_block(short, short, True, varlen=(16, 128)).pieces is None
    assert blocks._launches((1, 2, 3), ("a",), True) == 1
    assert blocks._launches((1, 2, 3), ("a",), None) == 3


def test_attention_through_parts_of_calls(monkeypatch, fresh_parts):
    """Packed attention whose calls run in parts of two segments (the reference in the
    kernel's place) gives the pieces' output and gradients (fp64, GQA, padding)."""
    monkeypatch.setattr(varlen_module, "_fa2_takes", lambda q, k, v: True)
    monkeypatch.setattr(varlen_module, "_flash_forward", reference_forward)
    monkeypatch.setattr(varlen_module, "_flash_backward", reference_backward)
    monkeypatch.setattr(varlen_module, "_MAX_SEGMENTS", 2)
    gen = torch.Generator().manual_seed(3)
    cu = torch.tensor([0, 5, 11, 11, 20, 27], dtype=torch.int32)
    pad = torch.tensor([0, 6, 12, 14, 24, 32], dtype=torch.int32)
    q, dout = (torch.randn(32, 4, 8, generator=gen, dtype=torch.float64) for _ in "qo")
    k, v = (torch.randn(32, 2, 8, generator=gen, dtype=torch.float64) for _ in "kv")
    results = {}
    for mode in ("on", "off"):
        ins = [x.clone().requires_grad_() for x in (q, k, v)]
        with BlockCounter() as counter, splitting("on"), varlening(mode):
            out = local_attention(*ins, qkv_format="thd", cu_seqlens_q=cu,
                                  cu_seqlens_q_padded=pad)
            out.backward(dout)
        results[mode] = (out, *(x.grad for x in ins))
        assert (counter.kernels[(VARLEN_KERNEL, "")] >= 3) == (mode == "on"), counter
    for got, want in zip(results["on"], results["off"]):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def _segments_of(cu_q, cu_k):
    q, k = cu_q.tolist(), cu_k.tolist()
    return list(zip(zip(q, q[1:]), zip(k, k[1:])))


@pytest.mark.parametrize("causal", [True, False])
def test_the_reference_is_sdpa_per_segment(causal):
    """The reference FA2 is checked against: per segment, the output and LSE of plain SDPA
    (causal bottom-right, as FA2 aligns it), and the gradients of SDPA's autograd given the
    final output and LSE; a segment without keys: output 0, LSE +inf, no gradient (fp64,
    GQA)."""
    gen = torch.Generator().manual_seed(1)
    qk = ((5, 5), (0, 3), (4, 0), (6, 6), (2, 7)) if not causal else (
        (5, 5), (0, 3), (4, 0), (6, 6), (7, 7))
    cu_q = torch.tensor([0, *torch.tensor([a for a, _ in qk]).cumsum(0).tolist()])
    cu_k = torch.tensor([0, *torch.tensor([b for _, b in qk]).cumsum(0).tolist()])
    tq, tk = int(cu_q[-1]), int(cu_k[-1])
    q, dout = (torch.randn(tq, 4, 8, generator=gen, dtype=torch.float64) for _ in "qo")
    k, v = (torch.randn(tk, 2, 8, generator=gen, dtype=torch.float64) for _ in "kv")
    out, lse = reference_forward(q, k, v, cu_q, cu_k, 7, 7, causal, 0.3)
    dq, dk, dv = reference_backward(dout, q, k, v, out, lse, cu_q, cu_k, 7, 7, causal, 0.3)
    ins = [x.clone().requires_grad_() for x in (q, k, v)]
    for (q0, q1), (k0, k1) in _segments_of(cu_q, cu_k):
        if q1 == q0:
            continue
        if k1 == k0:
            assert torch.all(out[q0:q1] == 0) and torch.all(lse[:, q0:q1] == float("inf"))
            assert torch.all(dq[q0:q1] == 0)
            continue
        sq, sk, sv = (x[a:b].transpose(0, 1).unsqueeze(0) for x, (a, b) in
                      zip(ins, ((q0, q1), (k0, k1), (k0, k1))))
        mask = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool).tril(k1 - k0 - (q1 - q0))
        want = F.scaled_dot_product_attention(sq, sk, sv, attn_mask=mask if causal else None,
                                              scale=0.3, enable_gqa=True)
        want.backward(dout[q0:q1].transpose(0, 1).unsqueeze(0))
        torch.testing.assert_close(out[q0:q1], want[0].transpose(0, 1).detach(), rtol=0,
                                   atol=1e-12)
        scores = torch.einsum("qhd,khd->hqk", q[q0:q1], k[k0:k1].repeat_interleave(2, 1)) * 0.3
        scores = scores.masked_fill(~mask, float("-inf")) if causal else scores
        torch.testing.assert_close(lse[:, q0:q1], torch.logsumexp(scores, -1), rtol=0,
                                   atol=1e-12)
    for got, x in zip((dq, dk, dv), ins):
        torch.testing.assert_close(got, x.grad, rtol=0, atol=1e-12)
    # keys without rows (the (0, 3) segment) get no gradient
    assert torch.all(dk[5:8] == 0) and torch.all(dv[5:8] == 0)


def _broken_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
    """A kernel with the wrong causal alignment: what the check must catch."""
    return reference_forward(q, k, v, cu_q, cu_k, max_q, max_k, not causal, scale)


def test_the_check_accepts_the_reference_and_refuses_another_kernel(monkeypatch):
    """``auto``'s once-per-process check, run with the reference in the kernel's place on
    the CPU: it passes; a kernel with a wrong mask fails it with one warning naming the
    switch, and ``auto`` then keeps the pieces one call each; ``on`` skips the check."""
    monkeypatch.delenv(VARLEN_ENV, raising=False)
    monkeypatch.setattr(varlen_module, "_fa2_takes", lambda q, k, v: True)
    monkeypatch.setattr(varlen_module, "_flash_forward", reference_forward)
    monkeypatch.setattr(varlen_module, "_flash_backward", reference_backward)
    q = torch.zeros(1, 4, 8, 64, dtype=torch.bfloat16)
    forget_kernel_checks()
    try:
        assert kernel_matches_reference(torch.device("cpu"), torch.bfloat16)
        assert varlen_takes(q, q, q)
        forget_kernel_checks()
        monkeypatch.setattr(varlen_module, "_flash_forward", _broken_forward)
        with pytest.warns(RuntimeWarning, match=r"varlen kernel did not match .*"
                                                r"MEGATRON_HCP_VARLEN=off"):
            assert not varlen_takes(q, q, q)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # cached: no second warning
            assert not varlen_takes(q, q, q)
        with varlening("on"):
            assert varlen_takes(q, q, q)
        with varlening("off"):
            assert not varlen_takes(q, q, q)
    finally:
        forget_kernel_checks()


def test_no_check_while_a_cuda_graph_is_captured(monkeypatch):
    """While a CUDA graph is captured neither the check (allocations, a copy from the host)
    is made nor the calls run (their offsets are copied from the host once per packing): the
    pieces one call each, and the question asked again after the capture."""
    monkeypatch.setattr(varlen_module, "_fa2_takes", lambda q, k, v: True)
    monkeypatch.setattr(varlen_module, "_capturing", lambda: True)
    q = torch.zeros(1, 4, 8, 64, dtype=torch.float16)
    with varlening("on"):
        assert not varlen_takes(q, q, q)
    monkeypatch.setattr(varlen_module, "_flash_forward", reference_forward)
    monkeypatch.setattr(varlen_module, "_flash_backward", reference_backward)
    forget_kernel_checks()
    try:
        monkeypatch.setattr(varlen_module, "_capturing", lambda: True)
        assert not kernel_matches_reference(torch.device("cpu"), torch.float16)
        monkeypatch.setattr(varlen_module, "_capturing", lambda: False)
        assert kernel_matches_reference(torch.device("cpu"), torch.float16)
    finally:
        forget_kernel_checks()


def test_no_varlen_on_the_cpu_and_the_switch_is_checked(monkeypatch):
    """On the CPU the pieces run one call each whatever the switch says; a bad value is
    refused naming the variable - by the attention before it runs."""
    q = torch.randn(1, 4, 8, 64, dtype=torch.bfloat16)
    with varlening("on"):
        assert not varlen_takes(q, q, q)
    monkeypatch.setenv(VARLEN_ENV, " OFF ")
    assert varlen_mode() == "off"
    monkeypatch.setenv(VARLEN_ENV, "always")
    with pytest.raises(CPAttentionError, match=r"MEGATRON_HCP_VARLEN='always': use auto .*"
                                               r"unset it for auto"):
        varlen_mode()
    x = torch.randn(1, 8, 2, 4)
    with pytest.raises(CPAttentionError, match="MEGATRON_HCP_VARLEN='always'"):
        local_attention(x, x, x)


def test_auto_splits_what_varlen_calls_make_cheap():
    """256 sequences of 128 tokens at CP 4 stay masked as pieces (hundreds of calls) but
    split as varlen calls (two a block)."""
    short = SeqLayout((128,) * 256, (120,) * 256, 4, 1).with_grouped_halves()
    with splitting("auto"):
        for src in range(4):
            assert plan_block(short, short.at(4, src), True).pieces is None
            block = plan_block(short, short.at(4, src), True, varlen=True)
            assert block.pieces is not None and len(block.calls) == 2


@pytest.fixture(scope="module")
def threads():
    with ThreadedWorld(WORLD, device="cpu") as world:
        yield world


def _through_calls(cases):
    with BlockCounter() as counter, splitting("on"), varlening("on"):  # in this rank thread
        errors = run_cases(cases)
    return errors, counter.masks, counter.kernels


def _exact_through_calls(threads, cases) -> None:
    """``cases`` on the rank threads with blocks as varlen calls match the oracle (fp64
    1e-10, fp32 1e-5), build no mask, and take the varlen kernel on every rank."""
    cases = runnable_in(cases, WORLD)
    per_rank = threads.run(_through_calls, cases)
    assert not (bad := failures_of(cases, [errors for errors, *_ in per_rank])), bad[:8]
    assert not any(masks for _, masks, _ in per_rank), [masks for _, masks, _ in per_rank]
    assert all(kernels[(VARLEN_KERNEL, "")] > 0 for *_, kernels in per_rank), per_rank


@pytest.mark.multirank
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("comm", COMMS)
def test_oracle_thd_cases_through_varlen_calls(threads, reference_kernel, comm, mode):
    """CP attention on packed sequences with every block in pieces run as varlen calls (the
    reference in the kernel's place) against the single-process oracle: causal / full, MHA /
    GQA / KV replication, CP 2 / 4, a softmax offset; MLA head dims run their pieces one call
    each."""
    _exact_through_calls(threads, [
        case for case in (*matrix_cases(comm, "thd", mode), *mla_cases(comm, mode),
                          *offset_cases(comm, mode)) if case[1] == "thd"])


def test_the_planned_call_table():
    """benchmarks/attention.py --launches' packed table, small: a row per packing, S and CP
    that cuts every sequence; masked blocks make one call a block (CP a rank), pieces one a
    piece, varlen calls at most two a block whatever the number of sequences."""
    from benchmarks.attention import packed_call_table

    lines = packed_call_table([256], {"long": (8, 4, 2, 2), "short": (1,) * 16}, [2, 4, 8])
    rows = [line.split() for line in lines[3:]]
    assert [r[:3] for r in rows] == [["long", "256", "2"], ["long", "256", "4"],
                                     ["long", "256", "8"], ["short", "256", "2"],
                                     ["short", "256", "4"], ["short", "256", "8"]], rows
    for row in rows:
        cp, (masked, pieces, varlen, auto, auto_varlen) = int(row[2]), map(int, row[3:])
        assert masked == cp and varlen <= 2 * cp < pieces, row
        assert masked <= auto <= pieces, row
        assert masked <= auto_varlen <= varlen, row


@pytest.mark.multirank
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("comm", COMMS)
def test_oracle_window_cases_through_varlen_calls(threads, reference_kernel, comm, mode):
    """Sliding windows (bshd, sbhd, thd; causal and full; GQA; CP 4) with every windowed
    block run as the varlen calls of its bands - FA2's own window, the reference in the
    kernel's place - against the single-process oracle."""
    _exact_through_calls(threads, window_cases(comm, mode))


@pytest.mark.parametrize("lengths, window, causal", [
    (None, (5, 0), True), (None, (3, 4), False), (None, (-1, 6), False),
    ((16, 8, 24, 16), None, True), ((16, 8, 24, 16), None, False), (None, None, True)])
def test_the_one_flash_call_baseline_computes_the_sdpa_baselines_problem(
        reference_kernel, lengths, window, causal):
    """The benchmark's one FA2 varlen call (its own window; every packed sequence a segment)
    computes what its SDPA baseline computes (an S x S mask; one call per sequence): output
    and gradients, GQA, fp64 - the figure's two baselines are one problem."""
    from megatron_hcp.attention.reference.block_cost import baseline_call

    gen = torch.Generator().manual_seed(5)
    q, dout = (torch.randn(1, 4, 64, 8, generator=gen, dtype=torch.float64) for _ in "qo")
    k, v = (torch.randn(1, 2, 64, 8, generator=gen, dtype=torch.float64) for _ in "kv")
    problem = dict(causal=causal, window=window, lengths=lengths)
    flash = baseline_call(q, k, v, dout, **problem, flash=True)(keep=True)
    sdpa = baseline_call(q, k, v, dout, **problem, flash=False)(keep=True)
    assert baseline_call(q, k, v, dout, **problem, flash=True)() is None  # timed: no copies
    for name, got, want in zip(("out", "dq", "dk", "dv"), flash, sdpa):
        assert got.shape == want.shape, name
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10, msg=name)


def test_windowed_and_packed_rows_are_timed_against_one_flash_call(reference_kernel):
    """Where FA2 runs and matched the reference (here: the reference, checked), a windowed or
    packed row's one call is one FA2 varlen call, and a window is not limited to the SDPA
    mask's size; dense rows keep one SDPA call (the issue's baseline)."""
    from megatron_hcp.attention.reference.block_cost import (
        FLASH_VARLEN,
        SDPA,
        measure_block_cost,
    )

    problem = dict(seq=64, heads=4, kv_heads=2, dim=8, cp=4, dtype=torch.float32,
                   device="cpu", repeats=1)
    assert measure_block_cost(**problem, window=(5, 0)).baseline == FLASH_VARLEN
    assert measure_block_cost(**problem, lengths=(32, 16, 8, 8)).baseline == FLASH_VARLEN
    assert measure_block_cost(**problem).baseline == SDPA


def test_without_fa2_the_window_baseline_is_sdpa_and_bounded():
    """Without FA2 (the CPU) windowed rows are timed against SDPA with the window as a mask,
    packed ones against SDPA per sequence, and a window too long for that mask is refused
    before anything is drawn."""
    from benchmarks.attention import gpu_block_table
    from megatron_hcp.attention.reference.block_cost import (
        MAX_WINDOW_BASELINE,
        SDPA,
        SDPA_PER_SEQUENCE,
        BaselineTooLarge,
        measure_block_cost,
    )

    problem = dict(heads=4, kv_heads=2, dim=8, cp=4, dtype=torch.float32, device="cpu",
                   repeats=1)
    assert measure_block_cost(seq=64, **problem, window=(5, 0)).baseline == SDPA
    packed = measure_block_cost(seq=64, **problem, lengths=(32, 16, 8, 8))
    assert packed.baseline == SDPA_PER_SEQUENCE
    with pytest.raises(BaselineTooLarge, match=f"use seq <= {MAX_WINDOW_BASELINE}"):
        measure_block_cost(seq=2 * MAX_WINDOW_BASELINE, **problem, window=(5, 0))
    lines = list(gpu_block_table([2 * MAX_WINDOW_BASELINE], {"window": (4, 4, 8, 8, 5)},
                                 "fp32", [2, 4], 1, device="cpu"))
    assert len(lines) == 4 and lines[-1].startswith("not measured: window at S=131072 ("), lines
