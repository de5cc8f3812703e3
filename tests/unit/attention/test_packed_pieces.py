"""Packed (thd) blocks computed per sequence (attention.reference.pieces): the pieces cover
exactly the pairs the masked block sees, CP attention computed in pieces matches the
single-process oracle on every comm type and layout, and ``auto`` splits where pieces cost
less than the masked block."""

from __future__ import annotations

import random

import pytest
import torch

from megatron_hcp.attention.reference import BlockCounter, local_attention
from megatron_hcp.attention.reference.blocks import plan_block
from megatron_hcp.attention.reference.pieces import (
    PIECE_COST_PAIRS,
    SPLIT_ENV,
    seq_runs,
    split_mode,
    splitting,
)
from megatron_hcp.attention.reference.seq_layout import CPAttentionError, SeqLayout
from megatron_hcp.threaded_world import ThreadedWorld
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


def test_pieces_cover_exactly_the_pairs_of_the_masked_block():
    """Every block of every position of 300 random packings: the dense pieces (each a full
    rectangle or one chunk's causal square of real tokens) see each visible pair of the
    masked block once and no other pair."""
    checked = 0
    for mode, cp, padded, real, causal, group in _packings(300):
        for position in range(cp):
            layout = SeqLayout(padded, real, cp, position, mode)
            if layout.is_dense:
                continue
            layout = layout.with_grouped_halves() if group and layout.groupable else layout
            for src in range(cp):
                with splitting("off"):
                    masked = plan_block(layout, layout.at(cp, src), causal)
                with splitting("on"):
                    pieces = plan_block(layout, layout.at(cp, src), causal)
                if masked is None:
                    assert pieces is None
                    continue
                assert masked.pieces is None and pieces.pieces is not None
                assert all(p.mask is None and p.pieces is None for p in pieces.pieces)
                n = layout.local_tokens
                assert torch.equal(_pairs(pieces, n), _pairs(masked, n)), (
                    mode, cp, padded, real, causal, position, src, layout.grouped)
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
    masked block of 32K x 32K pairs; 512 sequences of 128 tokens cost more (a piece's
    launches are worth PIECE_COST_PAIRS pairs); ``off`` never splits."""
    monkeypatch.delenv(SPLIT_ENV, raising=False)
    long = SeqLayout((65536, 65536), (65536, 52000), 4, 1).with_grouped_halves()
    short = SeqLayout((128,) * 512, (120,) * 512, 4, 1).with_grouped_halves()
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


def test_the_switch_reads_auto_on_and_off(monkeypatch):
    """Unset: auto; on / off in any case and spacing; anything else is refused naming the
    variable, the value and the choices - by the attention before it runs."""
    monkeypatch.delenv(SPLIT_ENV, raising=False)
    assert split_mode() == "auto"
    for value, mode in ((" On ", "on"), ("OFF", "off"), ("auto", "auto")):
        monkeypatch.setenv(SPLIT_ENV, value)
        assert split_mode() == mode
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
    with BlockCounter() as counter, splitting("on"):
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
