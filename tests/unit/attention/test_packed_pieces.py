"""Packed (thd) blocks computed per sequence (attention.reference.pieces): the pieces cover
exactly the pairs the masked block sees, CP attention computed in pieces matches the
single-process oracle on every comm type and layout, and ``auto`` splits where pieces cost
less than the masked block."""

from __future__ import annotations

import itertools
import random
import threading

import pytest
import torch

from megatron_hcp.attention.reference import BlockCounter, local_attention
from megatron_hcp.attention.reference.blocks import plan_block
from megatron_hcp.attention.reference.pieces import (
    MAX_MASKED_PAIRS,
    PIECE_COST_PAIRS,
    SPLIT_ENV,
    seq_runs,
    split_mode,
    splitting,
)
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
)

pytestmark = pytest.mark.torch_only


def _pairs(block, n: int) -> torch.Tensor:
    """The visible (row, col) pairs of ``block`` over ``n`` local tokens, counted per pair."""
    seen = torch.zeros(n, n, dtype=torch.int)
    for part in block.pieces if block.pieces is not None else (block,):
        rows, cols = (torch.arange(n)[s] if isinstance(s, slice) else s
                      for s in (part.rows, part.cols))
        if part.mask is not None:
            visible = part.mask.dense().int()
        else:
            visible = torch.ones(len(rows), len(cols), dtype=torch.int)
            visible = visible.tril() if part.causal else visible
        seen[rows[:, None], cols[None, :]] += visible
    return seen


def _packings(trials: int, seed: int = 0):
    """Random packings: layout, CP size, sequences padded to the layout's unit with up to two
    units of padding (some empty, some all padding), causal or not, grouped halves or not."""
    rng = random.Random(seed)
    for _ in range(trials):
        mode, cp = rng.choice(["zigzag", "contiguous"]), rng.choice([1, 2, 4])
        unit = 2 * cp if mode == "zigzag" else cp
        padded = tuple(unit * rng.randint(0, 4) for _ in range(rng.randint(1, 4)))
        real = tuple(rng.randint(max(0, p - 2 * unit + 1), p) for p in padded)
        if sum(padded):
            yield mode, cp, padded, real, rng.random() < 0.7, rng.random() < 0.7


def layout_pairs(packings, dense: bool = False):
    """(layout, the layout of a source position, causal, what to report) of every position
    and source of ``packings`` (:func:`_packings`), halves grouped where drawn; ``dense``:
    also the packing's tokens as one unpadded sequence."""
    for mode, cp, padded, real, causal, group in packings:
        whole = (sum(padded) or 8 * cp,)
        for lengths in ((padded, real), (whole, whole)) if dense else ((padded, real),):
            for position in range(cp):
                layout = SeqLayout(*lengths, cp, position, mode)
                if layout.is_dense and not dense:
                    continue
                if group and layout.groupable:
                    layout = layout.with_grouped_halves()
                for src in range(cp):
                    yield layout, layout.at(cp, src), causal, (mode, cp, *lengths, causal,
                                                                position, src)


def test_pieces_cover_exactly_the_pairs_of_the_masked_block():
    """Every block of every position of about 270 random packings (300 drawn): the dense
    pieces (each a full rectangle or one chunk's causal square of real tokens) see each
    visible pair of the masked block once and no other pair."""
    checked = 0
    for layout, kv, causal, where in layout_pairs(_packings(300)):
        with splitting("off"):
            masked = plan_block(layout, kv, causal)
        with splitting("on"):
            pieces = plan_block(layout, kv, causal)
        if masked is None:
            assert pieces is None
            continue
        assert masked.pieces is None and pieces.pieces is not None
        assert all(p.mask is None and p.pieces is None for p in pieces.pieces)
        n = layout.local_tokens
        assert torch.equal(_pairs(pieces, n), _pairs(masked, n)), (where, layout.grouped)
        checked += 1
    assert checked > 1000


def test_runs_of_a_layout():
    """A zigzag half is one chunk per sequence (grouped: all first halves, then all second
    halves); both halves of one position at CP 1 are one run; padding ends the runs it is in."""
    layout = SeqLayout((8, 16), (7, 10), 2, 0)  # chunks of 2 and 4 tokens
    assert seq_runs(layout, "all") == (((0, 0, 2, 2), (2, 6, 2, 1)),
                                       ((4, 0, 4, 4), (8, 12, 4, 0)))
    grouped = layout.with_grouped_halves()
    assert seq_runs(grouped, "all") == (((0, 0, 2, 2), (6, 6, 2, 1)),
                                        ((2, 0, 4, 4), (8, 12, 4, 0)))
    assert seq_runs(grouped, "second") == (((6, 6, 2, 1),), ((8, 12, 4, 0),))
    whole = SeqLayout((8, 4), (5, 4), 1, 0)
    assert seq_runs(whole, "all") == (((0, 0, 8, 5),), ((8, 0, 4, 4),))
    contiguous = SeqLayout((8,), (5,), 2, 1, "contiguous")
    assert seq_runs(contiguous, "all") == (((0, 4, 4, 1),),)


def test_windows_stay_masked():
    """A window inside a pair of runs is a band, not a dense piece: windowed blocks keep their
    mask whatever the switch says."""
    layout = SeqLayout((16, 32), (16, 30), 2, 0).with_grouped_halves()
    with splitting("on"):
        block = plan_block(layout, layout, True, (3, 0))
    assert block.pieces is None and block.mask is not None


def test_auto_splits_long_sequences_and_keeps_many_short_ones_masked(monkeypatch):
    """``auto``: two sequences of 64K tokens at CP 4 cost far less in pieces than as one
    masked block of 32K x 32K pairs; 256 sequences of 128 tokens cost more (a piece's
    launches are worth PIECE_COST_PAIRS pairs); ``off`` never splits; a block whose mask
    would take 512 MiB or more is split whatever its pieces cost."""
    monkeypatch.delenv(SPLIT_ENV, raising=False)
    long = SeqLayout((65536, 65536), (65536, 52000), 4, 1).with_grouped_halves()
    short = SeqLayout((128,) * 256, (120,) * 256, 4, 1).with_grouped_halves()
    for src in range(4):
        assert plan_block(long, long.at(4, src), True).pieces is not None
        assert plan_block(short, short.at(4, src), True).pieces is None
    block = plan_block(long, long, True)  # the diagonal: 4 runs of 8192 tokens (one 2848 real)
    rows = block.rows.stop - block.rows.start
    pairs = sum((p.rows.stop - p.rows.start) * (p.cols.stop - p.cols.start)
                for p in block.pieces)
    # sequence 0: (A, A), (B, A), (B, B) of 8192 each; sequence 1: its B run 2848 real
    assert (rows, len(block.pieces), pairs) == (32768, 6, 4 * 8192**2 + 2848 * 8192 + 2848**2)
    assert pairs + PIECE_COST_PAIRS * len(block.pieces) < rows * rows / 3
    with splitting("off"):
        assert plan_block(long, long, True).pieces is None
    # 512 sequences of 64 tokens at CP 2: 1536 pieces a block would cost more than the
    # masked block's 2^28 pairs, but its mask would be 512 MiB in bf16: split all the same
    many = SeqLayout((64,) * 512, (64,) * 512, 2, 0).with_grouped_halves()
    block = plan_block(many, many, True)
    rows = block.rows.stop - block.rows.start
    assert rows * rows == MAX_MASKED_PAIRS and len(block.pieces) == 1536
    assert PIECE_COST_PAIRS * len(block.pieces) > rows * rows


def test_the_switch_reads_auto_on_and_off(monkeypatch):
    """Unset: auto; on / off in any case and spacing; anything else is refused naming the
    variable, the value and the choices - by the attention before it runs."""
    monkeypatch.delenv(SPLIT_ENV, raising=False)
    assert split_mode() == "auto"
    for value, mode in ((" On ", "on"), ("OFF", "off"), ("auto", "auto")):
        monkeypatch.setenv(SPLIT_ENV, value)
        assert split_mode() == mode
    with splitting("off"):  # a thread's choice wins over the environment
        assert split_mode() == "off"
    monkeypatch.setenv(SPLIT_ENV, "always")
    with pytest.raises(CPAttentionError, match=r"MEGATRON_HCP_SPLIT_PACKED='always': use auto "
                                               r".* on .* or off .*unset it for auto"):
        split_mode()
    q = torch.randn(1, 8, 2, 4)
    with pytest.raises(CPAttentionError, match="MEGATRON_HCP_SPLIT_PACKED='always'"):
        local_attention(q, q, q)


@pytest.fixture(scope="module")
def threads():
    with ThreadedWorld(WORLD, device="cpu") as world:
        yield world


def _split_cases(cases):
    with BlockCounter() as counter, splitting("on"):  # in this rank thread
        errors = run_cases(cases)
    return errors, counter.masks, len(counter.computed)


@pytest.mark.multirank
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("comm", COMMS)
def test_oracle_thd_cases_computed_in_pieces(threads, comm, mode):
    """CP attention on packed sequences with every block computed in pieces (rank threads of
    this process) against the single-process oracle at the usual tolerances (fp64 1e-10, fp32
    1e-5): causal / full, MHA / GQA / KV replication, CP 2 / 4, MLA head dims, a learnable
    softmax offset; no masked block runs (no mask is built)."""
    cases = [case for case in (*matrix_cases(comm, "thd", mode), *mla_cases(comm, mode),
                               *offset_cases(comm, mode)) if case[1] == "thd"]
    cases = runnable_in(cases, WORLD)
    per_rank = threads.run(_split_cases, cases)
    assert not (bad := failures_of(cases, [errors for errors, *_ in per_rank])), bad[:8]
    assert not any(masks for _, masks, _ in per_rank), [masks for _, masks, _ in per_rank]
    assert all(blocks > 0 for *_, blocks in per_rank)


@pytest.mark.parametrize("split", ["off", "on"])
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_the_packed_replay_does_the_work_of_packed_attention(cp, split):
    """The speed benchmark's packed replay (every rank's blocks of packed sequences, masked or
    in pieces, no communication) computes per-sequence causal attention: output and
    gradients, assembled from the ranks, equal one SDPA call per sequence (fp64)."""
    from megatron_hcp.attention.reference.block_cost import local_tokens, rank_block_pass

    lengths = tuple(2 * cp * n for n in (3, 1, 5))
    seq = sum(lengths)
    gen = torch.Generator().manual_seed(cp)
    q, dout = (torch.randn(1, 4, seq, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(1, 2, seq, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    ref_in = [x.clone().requires_grad_() for x in (q, k, v)]
    start = 0
    for n in lengths:
        part = [x[:, :, start:start + n] for x in ref_in]
        torch.nn.functional.scaled_dot_product_attention(
            *part, is_causal=True, enable_gqa=True).backward(dout[:, :, start:start + n])
        start += n
    ref_out = torch.cat([torch.nn.functional.scaled_dot_product_attention(
        *(x[:, :, a:a + n] for x in (q, k, v)), is_causal=True, enable_gqa=True)
        for a, n in zip((0, *itertools.accumulate(lengths)), lengths)], dim=2)
    out, dq = torch.zeros_like(ref_out), torch.zeros_like(q)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    with BlockCounter() as counter, splitting(split):
        for rank in range(cp):
            got, gq, *rest = rank_block_pass(q, k, v, dout, cp, rank, lengths=lengths)
            mine = local_tokens(seq, cp, rank, lengths)
            out[:, :, mine], dq[:, :, mine] = got, gq
            for src in range(cp):
                theirs = local_tokens(seq, cp, src, lengths)
                dk[:, :, theirs] += rest[src]
                dv[:, :, theirs] += rest[cp + src]
    assert bool(counter.masks) == (split == "off")  # pieces: no mask built
    for got, want in ((out, ref_out), (dq, ref_in[0].grad), (dk, ref_in[1].grad),
                      (dv, ref_in[2].grad)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_the_backward_plans_as_its_forward_did(monkeypatch):
    """A backward run on another thread (the autograd engine's own, on CUDA), which does not
    see the forward's ``splitting``, computes the pieces the forward computed: no mask built,
    gradients those of the masked blocks."""
    monkeypatch.delenv(SPLIT_ENV, raising=False)  # auto: this small packing stays masked
    gen = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, 5, 11], dtype=torch.int32)  # lengths 5 and 6, padded to 6 and 6
    pad = torch.tensor([0, 6, 12], dtype=torch.int32)
    q, k, v, dout = (torch.randn(12, 2, 8, generator=gen, dtype=torch.float64)
                     for _ in range(4))
    grads = {}
    for split in ("on", "off"):
        ins = [x.clone().requires_grad_() for x in (q, k, v)]
        with splitting(split):
            out = local_attention(*ins, qkv_format="thd", cu_seqlens_q=cu,
                                  cu_seqlens_q_padded=pad)
        seen = {}

        def backward(out=out, seen=seen):
            with BlockCounter() as counter:
                out.backward(dout)
            seen["masks"] = sum(counter.masks.values())

        thread = threading.Thread(target=backward)
        thread.start()
        thread.join()
        assert seen["masks"] == (0 if split == "on" else 1), (split, seen)
        grads[split] = [x.grad for x in ins]
    for got, want in zip(grads["on"], grads["off"]):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_the_packed_table_times_masked_blocks_and_pieces():
    """benchmarks/attention.py --device cuda's packed table, run small on the CPU: a row per
    packing, S and CP size that cuts every sequence, masked blocks (split off) and pieces
    (split on) timed against one SDPA call per sequence; pieces build no mask."""
    from benchmarks.attention import packed_block_table, packed_lengths

    assert packed_lengths(64, (8, 4, 2, 2)) == (32, 16, 8, 8)
    with pytest.raises(ValueError, match="S=60 is not a multiple of 16"):
        packed_lengths(60, (8, 4, 2, 2))
    lines = list(packed_block_table([64], {"long": (8, 4, 2, 2), "short": (1,) * 4}, 2, 8,
                                    "fp32", [2, 4, 8], 1, device="cpu", splits=("off", "on")))
    rows = lines[3:]
    assert lines[0].startswith("CPU, torch") and "else one SDPA call per sequence" in lines[0]
    # long: 32/16/8/8 tokens cut by CP 2 and 4 (CP 8: 8 tokens are not 16 chunks); short: 16
    assert [r.split()[:3] for r in rows] == [["long", "64", "2"], ["long", "64", "4"],
                                             ["short", "64", "2"], ["short", "64", "4"],
                                             ["short", "64", "8"]], rows
    assert all(r.endswith("masks none; baseline sdpa per sequence") and "cpu_flash" in r
               for r in rows), rows


def test_splitting_reads_its_mode_as_the_variable_is_read():
    with splitting(" On "):
        assert split_mode() == "on"
    with pytest.raises(CPAttentionError, match="split mode 'sometimes'"):
        with splitting("sometimes"):
            pass
