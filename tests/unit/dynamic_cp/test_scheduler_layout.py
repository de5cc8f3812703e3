"""The dynamic-CP scheduler plans in the CP partition layout (``cp_partition_mode``): the layout's
padding for the token cap, and its slowest rank's causal share for the balance. Oracles: the
real shards of :mod:`megatron_hcp.sharding` (positions per rank, counted by brute force)."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest
import torch

from megatron_hcp.dynamic_cp.projection import Cluster, Hardware, projected_seconds
from megatron_hcp.dynamic_cp.scheduler import schedule, summarize
from megatron_hcp.dynamic_cp.workload import (
    GPTWorkload,
    ScheduleError,
    min_group_size,
    partition_shares,
    tokens_per_rank,
)
from megatron_hcp.sharding import get_local_chunk, padded_length

MODES = ("zigzag", "contiguous")
ZIGZAG = GPTWorkload(num_layers=2, hidden_size=512, num_attention_heads=8)
CONTIGUOUS = dataclasses.replace(ZIGZAG, cp_partition_mode="contiguous")


def rank_entries(length: int, cp: int, mode: str, window: int | None) -> list[int]:
    """Causal score entries of every rank's real shard (query ``p`` sees ``min(p, W) + 1``)."""
    positions = torch.arange(padded_length(length, cp, cp_partition_mode=mode))
    out = []
    for r in range(cp):
        mine = get_local_chunk(positions, cp, r, "sbhd", cp_partition_mode=mode)
        mine = mine[mine < length]  # padding is no work
        seen = mine + 1 if window is None else torch.clamp(mine, max=window) + 1
        out.append(int(seen.sum()))
    return out


def brute_cost(workload: GPTWorkload, length: int, cp: int) -> list[float]:
    """Every rank's cost: its linear share plus the attention scaled by its entries."""
    entries = rank_entries(length, cp, workload.cp_partition_mode, workload.window)
    mean = sum(entries) / cp
    linear = length * workload.linear_flops_per_token() / cp
    return [linear + workload.attention_flops(length) / cp * e / mean for e in entries]


@pytest.mark.parametrize("mode", MODES)
def test_tokens_per_rank_is_the_layouts_padding(mode):
    for length in (1, 7, 9, 16, 33, 1000):
        for c in (1, 2, 4, 8):
            assert tokens_per_rank(length, c, mode) == padded_length(
                length, c, cp_partition_mode=mode) // c
    # contiguous pads to c, not 2c: a sequence of 9 holds 3 per rank on 4 ranks, not 4
    assert tokens_per_rank(9, 4, "contiguous") == 3 and tokens_per_rank(9, 4, "zigzag") == 4
    assert min_group_size(12, 3, 8, cp_partition_mode="contiguous") == 4
    assert min_group_size(12, 3, 8, cp_partition_mode="zigzag") == 8


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("window", [None, 5, 40])
def test_cost_is_the_slowest_real_shard(mode, window):
    model = dataclasses.replace(ZIGZAG, cp_partition_mode=mode, window=window)
    for length in (64, 96, 256):
        for c in (2, 4, 8):
            ranks = brute_cost(model, length, c)
            assert model.rank_costs(length, c) == pytest.approx(ranks, rel=1e-12)
            assert model.cost(length, c) == pytest.approx(max(ranks), rel=1e-12)
            assert model.cost(length, 1) / c == pytest.approx(sum(ranks) / c, rel=1e-12)
            if mode == "contiguous":  # the last rank is the slowest: summing is exact
                assert max(ranks) == ranks[-1]
    # zigzag without a window balances exactly; contiguous causal does not
    assert ZIGZAG.balanced and not CONTIGUOUS.balanced
    assert CONTIGUOUS.attention_load(256, 4) == pytest.approx(7 / 4, rel=0.01)


def test_uneven_lengths_follow_the_real_padding():
    """Lengths that do not divide: the pieces are ``ceil(L / unit)`` tokens and the padding does
    no work (a sequence of 17 on 8 contiguous ranks leaves ranks 6 and 7 empty)."""
    for mode in MODES:
        model = dataclasses.replace(CONTIGUOUS, cp_partition_mode=mode, window=3)
        for length in (17, 101, 1001):
            assert model.rank_costs(length, 8) == pytest.approx(brute_cost(model, length, 8),
                                                                rel=1e-12)
    shares = partition_shares(17, 8, "contiguous")
    # pieces of 3: rank 5 holds 2 tokens, so rank 4 (not the last) is the slowest
    assert shares[6] == shares[7] == 0 and max(shares) == shares[4] > shares[5]


def test_hierarchical_blocks_pool_their_slices():
    """Under dynamic HCP an a2a block of ranks gathers its slices and splits the heads: each of
    its ranks carries the block's mean; the imbalance is the ring's."""
    entries = rank_entries(256, 8, "contiguous", None)
    blocks = [sum(entries[i:i + 4]) / 4 for i in (0, 0, 0, 0, 4, 4, 4, 4)]
    mean = sum(entries) / 8
    assert partition_shares(256, 8, "contiguous", None, 4) == pytest.approx(
        [b / mean for b in blocks], rel=1e-12)
    assert CONTIGUOUS.cost(256, 8, 4) < CONTIGUOUS.cost(256, 8)


def test_the_cap_is_met_in_the_layouts_padding():
    """Sequences of 12 at cap 3: contiguous fits each on 4 ranks (3 tokens), one micro-batch;
    zigzag needs 8 ranks per sequence (12 -> 16 -> 2 tokens), so two micro-batches."""
    contiguous = schedule([12, 12], 8, 3, workload=CONTIGUOUS)
    zigzag = schedule([12, 12], 8, 3, workload=ZIGZAG)
    assert [len(g.ranks) for g in contiguous.micro_batches[0].groups] == [4, 4]
    assert len(contiguous.micro_batches) == 1 and len(zigzag.micro_batches) == 2
    assert contiguous.summary["peak_tokens_per_rank"] == 3
    with pytest.raises(ScheduleError, match="needs more than 8 ranks"):
        schedule([40], 8, 2, workload=CONTIGUOUS)  # 40 / 8 = 5 tokens > 2


def batch(seed: int, count: int = 32) -> list[int]:
    rng = random.Random(seed)
    return [int(rng.lognormvariate(8, 1.0)) + 16 for _ in range(count)]


@pytest.mark.parametrize("window", [None, 300])
def test_makespan_prices_every_ranks_real_shards(window):
    """The summary's makespan is the sum over micro-batches of the slowest rank, each rank
    charged its own shard of every sequence it holds (brute force)."""
    model = dataclasses.replace(CONTIGUOUS, window=window)
    lengths, n, cap = batch(3), 8, 16384
    plan = schedule(lengths, n, cap, workload=model)
    makespan = 0.0
    for mb in plan.micro_batches:
        load = [0.0] * n
        for g in mb.groups:
            for s in g.samples:
                for r, cost in zip(g.ranks, brute_cost(model, lengths[s], len(g.ranks))):
                    load[r] += cost
        makespan += max(load)
    assert plan.summary["makespan"] == pytest.approx(makespan, rel=1e-9)
    assert plan.summary["ideal"] == pytest.approx(
        sum(model.cost(x, 1) for x in lengths) / n, rel=1e-12)


def test_the_scheduler_weighs_the_contiguous_imbalance():
    """Planned for contiguous slices, a step is faster in that layout than the zigzag plan run
    in it (the zigzag plan assumes every rank of a group does the mean work)."""
    n, cap = 8, 32768
    gains = []
    for seed in range(3):
        lengths = batch(seed)
        aware = schedule(lengths, n, cap, workload=CONTIGUOUS)
        blind = schedule(lengths, n, cap, workload=ZIGZAG)
        run_blind = summarize(blind, lengths, n, cap, CONTIGUOUS)["makespan"]
        assert aware.summary["makespan"] <= run_blind * (1 + 1e-9)
        gains.append(run_blind / aware.summary["makespan"])
    assert max(gains) > 1.05, gains


def test_projection_charges_the_slowest_rank_and_the_windowed_ring():
    hw = Hardware()
    windowed = dataclasses.replace(CONTIGUOUS, window=256)
    length, c = 65536, 8
    # contiguous without a window: compute of the last rank's share
    assert projected_seconds(CONTIGUOUS, length, c, hw) > projected_seconds(ZIGZAG, length, c, hw)
    # a window shorter than a slice: one ring step plus dK/dV home, not c - 1 steps
    zig_windowed = dataclasses.replace(ZIGZAG, window=256)
    compute = windowed.cost(length, c) / hw.flops_per_second
    comm = projected_seconds(windowed, length, c, hw) - compute
    zig_comm = (projected_seconds(zig_windowed, length, c, hw)
                - zig_windowed.cost(length, c) / hw.flops_per_second)
    assert 0 < comm < zig_comm / 3
    cluster = Cluster(gpus_per_node=8)
    assert cluster.compute_seconds(CONTIGUOUS, length, c) > cluster.compute_seconds(
        ZIGZAG, length, c)
    # hierarchical: the a2a level splits heads evenly, the imbalance is over the ring only
    assert cluster.compute_seconds(CONTIGUOUS, length, c, 2) < cluster.compute_seconds(
        CONTIGUOUS, length, c)


def test_a_bad_layout_is_named():
    with pytest.raises(ValueError, match="cp_partition_mode='striped'"):
        GPTWorkload(cp_partition_mode="striped")


def test_cli_schedule_plans_in_the_layout(tmp_path, capsys):
    """``schedule --cp-partition-mode contiguous``: the contiguous padding meets a cap the
    zigzag one cannot; an unknown layout is refused by name."""
    from megatron_hcp.cli import main as cli_main

    lengths = tmp_path / "lengths.json"
    lengths.write_text(json.dumps([12, 12]))
    common = ["schedule", "--dp-cp", "8", "--max-seqlen-per-rank", "3", "--hidden", "256",
              "--heads", "4", "--lengths", str(lengths), "--json"]
    runs = {}
    for mode in MODES:
        assert cli_main(common + ["--cp-partition-mode", mode, "--window", "4"]) == 0
        runs[mode] = json.loads(capsys.readouterr().out)
    assert len(runs["contiguous"]["micro_batches"]) == 1
    assert len(runs["zigzag"]["micro_batches"]) == 2
    assert runs["contiguous"]["summary"]["peak_tokens_per_rank"] == 3
    assert cli_main(common + ["--cp-partition-mode", "striped"]) == 2
    err = capsys.readouterr().err
    assert "--cp-partition-mode" in err and "striped" in err and "contiguous" in err
