"""Layout planner (``megatron-hcp plan``): the Bridge page's example, validity, output, costs."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_hcp.cli import main as cli_main
from megatron_hcp.config import CPConfig, CPConfigError
from megatron_hcp.dynamic_cp.projection import (
    OVERLAP_SLOWDOWN,
    Cluster,
    collective_seconds,
    cp_layer_seconds,
    dp_gradient_seconds,
    overlapped_seconds,
    pipeline_bubble_seconds,
)
from megatron_hcp.dynamic_cp.workload import (
    GPTWorkload,
    causal_pairs,
    partition_load,
    tokens_per_rank,
)
from megatron_hcp.planner import Batch, ModelSpec, Options, plan
from megatron_hcp.planner.estimate import (
    Layout,
    _activation_bytes_per_token,
    memory_per_gpu,
    usable_bytes,
)
from megatron_hcp.planner.inputs import lognormal
from megatron_hcp.planner.report import bridge_overrides, megatron_flags

# The Bridge page's decision example: 8 KV heads, 4 nodes x 8 GPUs, 128K sequences. The page
# names no model; this is the Llama-3-8B shape (32 layers, hidden 4096, 32 heads, 8 KV heads,
# SwiGLU FFN 14336, vocabulary 128256), 8 sequences per step.
LLAMA8B = ModelSpec(num_layers=32, hidden_size=4096, num_attention_heads=32,
                    num_query_groups=8, ffn_hidden_size=14336, gated_mlp=True,
                    vocab_size=128256)
BRIDGE_CLUSTER = Cluster(nodes=4, gpus_per_node=8)
B = "TP2 CP4 a2a DP4"
A = "TP1 CP16 a2a+p2p [8,2] DP2"
C = "TP1 CP16 p2p DP2"
LLAMA_ARGS = ["--layers", "32", "--hidden", "4096", "--heads", "32", "--kv-heads", "8",
              "--ffn", "14336", "--gated-mlp", "--vocab", "128256"]


@pytest.fixture(scope="module")
def bridge_plan():
    return plan(LLAMA8B, Batch.fixed_length(131072, 8), BRIDGE_CLUSTER)


def test_bridge_example_ordering(bridge_plan):
    """B (TP2 CP4 a2a) before A (TP1 CP16 a2a+p2p [8,2]) before C (TP1 CP16 p2p)."""
    pos = {name: bridge_plan.find(name) for name in (A, B, C)}
    assert pos[B] < pos[A] < pos[C], pos
    b, a, c = (bridge_plan.ranked[pos[x]] for x in (B, A, C))
    # A and B are a tie in time (the page: "identical throughput") - B wins on memory ...
    assert abs(b.step_seconds / a.step_seconds - 1) < Options().tie_tolerance
    assert b.memory["total"] < a.memory["total"] - 5e9
    # ... and C loses on its ring: 16 ranks over two nodes, the slowest hop on InfiniBand
    assert c.step_seconds > a.step_seconds * (1 + Options().tie_tolerance)
    assert c.breakdown["cp"] > 3 * a.breakdown["cp"]
    assert c.detail["cp_crosses_nodes"] and not b.detail["cp_crosses_nodes"]
    assert not a.detail["a2a_crosses_nodes"] and a.detail["p2p_crosses_nodes"]
    text = bridge_plan.why(b)
    assert "a2a over 4 ranks inside a node" in text
    assert "ring over 16 ranks across nodes" in bridge_plan.why(c)


def test_winner_flags_and_overrides_are_valid(bridge_plan):
    w = bridge_plan.winner
    flags = bridge_plan.flags()
    assert flags[flags.index("--context-parallel-size") + 1] == str(w.layout.cp)
    assert flags[flags.index("--tensor-model-parallel-size") + 1] == str(w.layout.tp)
    pairs = [o.split(".", 1)[1] for o in bridge_plan.overrides() if o.startswith("model.")]
    fields = set(CPConfig.field_names())
    cfg = CPConfig.from_pairs([p for p in pairs if p.split("=")[0] in fields])
    cfg.num_attention_heads, cfg.num_query_groups = 32, 8
    cfg.cp_attention_backend, cfg.te_version = "te", "2.8"
    cfg.data_parallel_size = w.layout.dp
    cfg.validate()
    assert cfg.world_size == BRIDGE_CLUSTER.world_size


def _config_from_json(row: dict, model: ModelSpec, options: Options) -> CPConfig:
    """Independent of Layout.config: the JSON fields straight into CPConfig."""
    return CPConfig(
        context_parallel_size=row["cp"], cp_comm_type=row["cp_comm_type"],
        hierarchical_context_parallel_sizes=row["hierarchical_context_parallel_sizes"],
        tensor_model_parallel_size=row["tp"], pipeline_model_parallel_size=row["pp"],
        data_parallel_size=row["dp"], num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups, num_layers=model.num_layers,
        seq_length=row["seq_length"],
        dynamic_context_parallel=row["dynamic_context_parallel"],
        min_dynamic_context_parallel_size=row["min_dynamic_context_parallel_size"] or 1,
        max_seqlen_per_dp_cp_rank=row["max_seqlen_per_dp_cp_rank"],
        calculate_per_token_loss=True if row["dynamic_context_parallel"] else None,
        cp_attention_backend="te", te_version=options.te_version)


@st.composite
def _cases(draw):
    head_dim = draw(st.sampled_from([16, 64, 128]))
    heads = draw(st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16, 32]))
    kv = draw(st.sampled_from([d for d in range(1, heads + 1) if heads % d == 0]))
    model = ModelSpec(num_layers=draw(st.integers(1, 12)), hidden_size=heads * head_dim,
                      num_attention_heads=heads, num_query_groups=kv,
                      gated_mlp=draw(st.booleans()), vocab_size=draw(st.sampled_from([
                          1000, 32000])), untie_embeddings=draw(st.booleans()))
    cluster = Cluster(nodes=draw(st.integers(1, 4)), gpus_per_node=draw(st.sampled_from(
        [1, 2, 4, 6, 8])), memory_bytes=draw(st.sampled_from([1e9, 80e9])))
    if draw(st.booleans()):
        length = draw(st.integers(1, 1000)) * draw(st.sampled_from([2, 3, 32, 64]))
        batch = Batch.fixed_length(length, draw(st.sampled_from([1, 2, 3, 4, 8, 16])))
    else:
        batch = lognormal(draw(st.integers(1, 24)), draw(st.sampled_from([256, 2048])),
                          1.0, 16, draw(st.sampled_from([4096, 40000])), seed=draw(
                              st.integers(0, 3)))
    te = draw(st.sampled_from(["2.8", "2.8", "1.11"]))  # 1.11: a2a+p2p refused by CPConfig
    return model, batch, cluster, Options(te_version=te, min_dynamic_sizes=(1, 2))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_cases())
def test_never_proposes_a_layout_cpconfig_rejects(case):
    model, batch, cluster, options = case
    try:
        result = plan(model, batch, cluster, options)
    except ValueError as err:  # PlanInputError: nothing valid at all (e.g. odd batch sizes)
        assert "no valid layout" in str(err)
        return
    rows = result.to_json()["layouts"]
    assert len(rows) == len(result.ranked)
    for row in rows:
        _config_from_json(row, model, options).validate()  # raises if CPConfig rejects it
        assert row["tp"] * row["cp"] * row["pp"] * row["dp"] == cluster.world_size
        if options.te_version == "1.11":
            assert row["cp_comm_type"] != "a2a+p2p"
    for config, reason in result.rejected:  # and what was left out was rejected for a reason
        if config.dynamic:
            continue  # its cap is chosen by estimate(), which validated it there
        if reason.startswith("global batch"):
            assert len(batch.lengths) % config.data_parallel_size
            continue
        with pytest.raises(CPConfigError):
            config.validate()


def test_json_schema(capsys):
    rc = cli_main(["plan", *LLAMA_ARGS, "--seq-length", "32768", "--global-batch", "16",
                   "--nodes", "2", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"inputs", "constants", "layouts", "winner", "rejected_by_cpconfig",
                        "rejected_examples"}
    assert set(out["inputs"]) == {"model", "cluster", "batch", "options"}
    assert out["constants"]["overlap_slowdown"] == OVERLAP_SLOWDOWN
    keys = {"rank", "label", "tp", "cp", "pp", "dp", "cp_comm_type",
            "hierarchical_context_parallel_sizes", "dynamic_context_parallel",
            "min_dynamic_context_parallel_size", "max_seqlen_per_dp_cp_rank", "seq_length",
            "recompute", "step_seconds", "tokens_per_second_per_gpu",
            "micro_batches_per_replica", "breakdown_seconds", "memory_gb", "fits",
            "dominant_cost", "dominant_cost_what", "why", "advice"}
    rows = out["layouts"]
    assert rows and all(set(r) == keys for r in rows)
    assert [r["rank"] for r in rows] == list(range(1, len(rows) + 1))
    for r in rows:
        assert set(r["breakdown_seconds"]) == {"compute", "cp", "tp", "pp_bubble", "dp"}
        assert sum(r["breakdown_seconds"].values()) == pytest.approx(r["step_seconds"])
        assert set(r["memory_gb"]) == {"weights_optimizer", "activations", "logits", "total"}
        mem = r["memory_gb"]
        assert mem["weights_optimizer"] + mem["activations"] + mem["logits"] == pytest.approx(
            mem["total"])
        assert r["recompute"] in ("selective", "full")
        assert r["dominant_cost"] in ("compute", "cp", "tp", "pp_bubble", "dp")
    assert all(isinstance(r["why"], str) for r in rows[:3])
    assert all(r["why"] is None for r in rows[3:])
    fits = [r["fits"] for r in rows]
    assert fits == sorted(fits, reverse=True)  # fitting layouts first, the others kept
    w = out["winner"]
    assert w["label"] == rows[0]["label"] and isinstance(w["notes"], list)
    assert "the best " in w["why"]  # contrast with the best layout of another CP kind
    assert all(isinstance(x, str) for x in w["megatron_flags"] + w["bridge_overrides"])


def test_layouts_that_do_not_fit_are_marked_not_dropped():
    small = Cluster(nodes=1, gpus_per_node=8, memory_bytes=8e9)
    result = plan(LLAMA8B, Batch.fixed_length(8192, 8), small)
    assert result.ranked and not any(e.fits for e in result.ranked)
    assert "DOES NOT FIT" in result.why(result.winner)


def test_length_distribution_gives_dynamic_cp_candidates():
    model = ModelSpec(num_layers=8, hidden_size=1024, num_attention_heads=16,
                      num_query_groups=4, vocab_size=32000)
    batch = lognormal(48, 2048, 1.2, 128, 65536, seed=1)
    cluster = Cluster(nodes=2, gpus_per_node=4, memory_bytes=24e9)
    result = plan(model, batch, cluster, Options(min_dynamic_sizes=(1, 2, 4)))
    dyn = [e for e in result.ranked if e.layout.dynamic]
    assert {e.layout.min_cp for e in dyn} == {1, 2, 4}
    for e in dyn:
        lay = e.layout
        n = lay.dp * lay.cp
        assert n & (n - 1) == 0 and lay.cp_comm_type == "p2p"
        assert lay.cap % 256 == 0 and lay.cap >= tokens_per_rank(batch.max_length, n)
        assert lay.config.validate() is not None and lay.topology.config is lay.config
        assert e.fits == (e.memory["total"] <= usable_bytes(cluster))
        assert sum(e.detail["group_sizes"].values()) == len(batch.lengths)
        assert min(e.detail["group_sizes"]) >= lay.min_cp
    static = [e for e in result.ranked if not e.layout.dynamic and e.layout.cp > 1]
    assert static and all(e.layout.seq_length % (2 * e.layout.cp) == 0 for e in static)
    best = next(e for e in result.ranked if e.layout.dynamic)
    f = megatron_flags(best, len(batch.lengths), True, False)
    assert f[f.index("--max-seqlen-per-dp-cp-rank") + 1] == str(best.layout.cap)
    assert f[f.index("--min-dynamic-context-parallel-size") + 1] == str(best.layout.min_cp)
    # the Bridge overrides give back the same validated dynamic-CP config
    pairs = [o.split(".", 1)[1] for o in bridge_overrides(best, len(batch.lengths), True, False)
             if o.startswith("model.")]
    cfg = CPConfig.from_pairs([p for p in pairs if p.split("=")[0] in CPConfig.field_names()])
    cfg.data_parallel_size = best.layout.dp
    cfg.validate()
    assert cfg.dynamic and cfg.max_seqlen_per_dp_cp_rank == best.layout.cap
    assert cfg.min_dynamic_context_parallel_size == best.layout.min_cp


# ------------------------------------------------------------------ cost terms by hand
W = GPTWorkload(num_layers=2, hidden_size=1024, num_attention_heads=8, num_query_groups=4)
INSTANT = Cluster(nodes=2, gpus_per_node=4, flops_per_second=float("inf"),
                  intra_bytes_per_second=100e9, intra_latency_seconds=2e-6,
                  inter_bytes_per_second=10e9, inter_latency_seconds=20e-6)


def test_a2a_layer_seconds_by_hand():
    # a2a over 4 ranks of one node, TP 1: Q, K, V and O of L/c tokens per rank, 3/4 of it moves
    length, d = 8192, 128
    held = (length / 4) * d * (2 * 8 + 2 * 4) * 2
    want = 2e-6 + held * 3 / 4 / 100e9
    got = cp_layer_seconds(W, INSTANT, length, 1, "a2a", [0, 1, 2, 3])
    assert got.forward == pytest.approx(want) and got.backward == pytest.approx(want)
    # across the two nodes with 2 ranks each: half of it leaves through the NIC at 10 GB/s
    got = cp_layer_seconds(W, INSTANT, length, 1, "a2a", [0, 1, 4, 5])
    assert got.forward == pytest.approx(20e-6 + max(held / 4 / 100e9, held / 2 / 10e9))


def test_ring_layer_seconds_by_hand():
    # attention free: every step exposed in full; the ring over both nodes runs at the IB rate
    length, c = 8192, 8
    chunk = 2 * (length / c) * 4 * 128 * 2  # K and V of the 4 KV heads, bf16
    got = cp_layer_seconds(W, INSTANT, length, 1, "p2p", list(range(8)))
    assert got.forward == pytest.approx(7 * (20e-6 + chunk / 10e9))
    assert got.backward == pytest.approx(7 * (20e-6 + 2 * chunk / 10e9))
    # a2a+p2p [4, 2]: a2a inside each node, one ring step of the same chunk across nodes
    got = cp_layer_seconds(W, INSTANT, length, 1, "a2a+p2p", list(range(8)),
                           a2a_ranks=[0, 1, 2, 3], p2p_ranks=[0, 4])
    a2a = 2e-6 + (length / 8) * 128 * 24 * 2 * 3 / 4 / 100e9
    assert got.forward == pytest.approx(a2a + 20e-6 + chunk / 10e9)


def test_contiguous_window_ring_by_hand():
    """The contiguous layout under a causal window of 1024 tokens: slices of 1024 (8 ranks, L
    8192) reach one back, so the ring runs 1 step, and dK/dV one more hop home in backward;
    zigzag (needs both neighbours) and the contiguous layout without a window run 7."""
    length, c = 8192, 8
    chunk = 2 * (length / c) * 4 * 128 * 2
    step = 20e-6 + chunk / 10e9
    windowed = GPTWorkload(num_layers=2, hidden_size=1024, num_attention_heads=8,
                           num_query_groups=4, window=1024)
    got = cp_layer_seconds(windowed, INSTANT, length, 1, "p2p", list(range(8)),
                           cp_partition_mode="contiguous")
    assert got.forward == pytest.approx(step)
    assert got.backward == pytest.approx((20e-6 + 2 * chunk / 10e9) + step)
    for workload, mode in ((windowed, "zigzag"), (W, "contiguous")):
        got = cp_layer_seconds(workload, INSTANT, length, 1, "p2p", list(range(8)),
                               cp_partition_mode=mode)
        assert got.forward == pytest.approx(7 * step)


def test_partition_load_and_windowed_attention_flops():
    """zigzag balances causal work; contiguous gives the last of c ranks (2c-1)/c of the mean
    without a window and about the mean under a window shorter than a slice; a window's
    attention is a band (L * (W+1) entries less its first triangle)."""
    assert partition_load(65536, 8) == 1.0
    assert partition_load(65536, 8, "contiguous") == pytest.approx(15 / 8, rel=1e-3)
    assert partition_load(65536, 8, "contiguous", 1024) == pytest.approx(1.0, abs=0.02)
    assert partition_load(65536, 8, "zigzag", 1024) == pytest.approx(1.0, abs=0.02)
    assert causal_pairs(0, 10, 2) == 1 + 2 + 3 * 8 and causal_pairs(0, 10) == 55
    windowed = GPTWorkload(num_layers=2, hidden_size=1024, num_attention_heads=8, window=1023)
    band = 3 * 2 * 4 * (1024 * 1025 // 2 + (65536 - 1024) * 1024) * 1024
    assert windowed.attention_flops(65536) == pytest.approx(band)
    assert GPTWorkload(num_layers=2, hidden_size=1024, num_attention_heads=8,
                       window=10**6).attention_flops(4096) == W.attention_flops(4096)


def test_a_windowed_model_is_planned_in_both_layouts():
    """With a sliding window the ring layouts are also estimated in the contiguous layout: on
    the reference backend its CP traffic is smaller (the ring stops at the window's reach);
    Transformer Engine refuses it, and the planner names why."""
    model = ModelSpec(num_layers=8, hidden_size=1024, num_attention_heads=16,
                      num_query_groups=4, vocab_size=32000, window=4096)
    batch = Batch.fixed_length(131072, 8)
    cluster = Cluster(nodes=1, gpus_per_node=8)
    ref = plan(model, batch, cluster, Options(attention_backend="reference"))
    by_label = {e.layout.label: e for e in ref.ranked}
    zig, con = by_label["TP1 CP8 p2p DP1"], by_label["TP1 CP8 p2p contiguous DP1"]
    assert con.breakdown["cp"] < zig.breakdown["cp"]
    assert con.layout.config.validate() is not None
    te = plan(model, batch, cluster, Options())
    assert not any(e.layout.mode == "contiguous" for e in te.ranked)
    assert any(config.cp_partition_mode == "contiguous" and "Transformer Engine" in why
               for config, why in te.rejected)
    # without a window the contiguous layout is not proposed (its causal imbalance only costs)
    plain = plan(ModelSpec(num_layers=8, hidden_size=1024, num_attention_heads=16,
                           num_query_groups=4), batch, cluster,
                 Options(attention_backend="reference"))
    assert not any(e.layout.mode == "contiguous" for e in plain.ranked)


def test_a_windowed_model_is_planned_with_dynamic_cp_in_both_layouts():
    """Dynamic CP of a windowed model is also estimated in the contiguous layout: the
    scheduler plans in it (its padding, its slowest rank) and the estimate names it; TE
    refuses it, named."""
    model = ModelSpec(num_layers=8, hidden_size=1024, num_attention_heads=16,
                      num_query_groups=4, vocab_size=32000, window=2048)
    batch = lognormal(64, 8192, 1.0, 256, 65536, seed=0)
    cluster = Cluster(nodes=1, gpus_per_node=8)
    ref = plan(model, batch, cluster, Options(attention_backend="reference"))
    dynamic = [e for e in ref.ranked if e.layout.dynamic]
    assert {e.layout.mode for e in dynamic} == {"zigzag", "contiguous"}
    assert all(("contiguous" in e.layout.label) == (e.layout.mode == "contiguous")
               for e in dynamic)
    te = plan(model, batch, cluster, Options())
    assert not any(e.layout.mode == "contiguous" for e in te.ranked)
    assert any(config.dynamic and config.cp_partition_mode == "contiguous"
               and "Transformer Engine" in why for config, why in te.rejected)


def test_overlap_and_collectives_by_hand():
    assert overlapped_seconds(1.0, 3.0) == pytest.approx(OVERLAP_SLOWDOWN)
    assert overlapped_seconds(3.0, 1.0) == pytest.approx(2.0 + OVERLAP_SLOWDOWN)
    # all-reduce over 8 ranks, 4 per node on 2 nodes: min(100, 4 x 10) = 40 GB/s
    got = collective_seconds(INSTANT, "all_reduce", 1e9, list(range(8)))
    assert got == pytest.approx(14 * 20e-6 + 2 * 7 / 8 * 1e9 / 40e9)
    assert collective_seconds(INSTANT, "all_gather", 1e9, [0, 1]) == pytest.approx(
        2e-6 + 0.5 * 1e9 / 100e9)


def test_dp_and_pipeline_terms_by_hand():
    # distributed optimizer over DPxCP = 8 ranks on 2 nodes (4 each, 40 GB/s): reduce-scatter
    # of 4-byte grads + all-gather of 2-byte params of 1e9 parameters, beside 1 s of backward
    p = 1e9
    comm = (7 * 20e-6 + 7 / 8 * 4 * p / 40e9) + (7 * 20e-6 + 7 / 8 * 2 * p / 40e9)
    got = dp_gradient_seconds(INSTANT, p, list(range(8)), True, 1.0)
    assert got == pytest.approx(OVERLAP_SLOWDOWN * comm)  # hidden: only the slowdown shows
    got = dp_gradient_seconds(INSTANT, p, list(range(8)), False, 0.01)
    ar = 14 * 20e-6 + 2 * 7 / 8 * 4 * p / 40e9
    assert got == pytest.approx(ar - 0.01 + OVERLAP_SLOWDOWN * 0.01)
    # 1F1B: 4 stages, micro-batches of 8 s (2 s per stage): 3 fill/drain slots + transfers
    assert pipeline_bubble_seconds([8.0, 6.0, 8.0], 4, 0.1) == pytest.approx(3 * (2.0 + 0.2))
    assert pipeline_bubble_seconds([8.0], 1, 0.1) == 0.0


def test_memory_terms_by_hand():
    # Korthikanti et al. 2022: 34 s b h / t bytes per layer (MHA, 4h MLP, dropout masks) with
    # sequence parallelism and selective recompute; plus the flash-attention softmax stats
    mha = ModelSpec(num_layers=4, hidden_size=2048, num_attention_heads=16, vocab_size=1000)
    for tp in (1, 2, 4):
        assert _activation_bytes_per_token(mha, tp) == pytest.approx((34 * 2048 + 4 * 16) / tp)
    lay = Layout.of(mha, Options(), tp=2, cp=2, pp=1, dp=2, cp_comm_type="a2a",
                    seq_length=4096)
    cluster = Cluster(nodes=1, gpus_per_node=8)
    mem = memory_per_gpu(mha, lay, 0, 1, "selective", Options(), cluster)
    assert mem["total"] == pytest.approx(mha.params() / 2 * (6 + 12 / 4))
    mem = memory_per_gpu(mha, lay, 0, 1, "selective", Options(distributed_optimizer=False),
                         cluster)
    assert mem["total"] == pytest.approx(mha.params() / 2 * 18)
    # PP2, 1000 tokens per rank, 1F1B: the first stage holds 2 micro-batches, the last one plus
    # the logits (6 bytes per token and vocabulary entry / TP); untied: V*h on both stages;
    # both hold the layer's working buffers (gathered input + input gradient, 4 bytes per token
    # and hidden unit, not divided by TP)
    lay = Layout.of(mha, Options(), tp=2, cp=1, pp=2, dp=4, seq_length=1000)
    per_param = 6 + 12 / 4
    stage = (2 * mha.params_per_layer() + 1000 * 2048) / 2 * per_param
    act = 2 * _activation_bytes_per_token(mha, 2) * 1000
    working = 4 * 2048 * 1000
    first, last = stage + 2 * act + working, stage + act + working + 6 * 1000 * 1000 / 2
    mem = memory_per_gpu(mha, lay, 1000, 2, "selective", Options(), cluster)
    assert mem["total"] == pytest.approx(max(first, last))
    full = memory_per_gpu(mha, lay, 1000, 2, "full", Options(), cluster)
    assert full["total"] == pytest.approx(max(
        stage + 2 * 2 * (2 * 2048 / 2) * 1000 + act / 2 + working,
        stage + 2 * (2 * 2048 / 2) * 1000 + act / 2 + working + 6 * 1000 * 1000 / 2))


def test_no_cp_buffers_without_cp():
    """A CP = 1 layout holds no K/V chunks in flight, whatever cp_comm_type its config carries
    (a recipe's default "p2p"; the functional harness checks recipes this way): measured on a
    training step (benchmarks/train_memory.py; 2026-11-29, at 879cdc3, a 2-core x86_64 CPU VM),
    CP 1 held none."""
    mha = ModelSpec(num_layers=2, hidden_size=256, num_attention_heads=4, vocab_size=128)
    cluster = Cluster(nodes=1, gpus_per_node=8)
    plain = Layout.of(mha, Options(), tp=1, cp=1, pp=1, dp=4, seq_length=2048)
    ring = Layout.of(mha, Options(), tp=1, cp=1, pp=1, dp=4, cp_comm_type="p2p",
                     seq_length=2048)
    assert ring.cp_comm_type == "p2p"
    got = [memory_per_gpu(mha, lay, 2048, 1, "selective", Options(), cluster)["activations"]
           for lay in (plain, ring)]
    assert got[0] == got[1]


def test_cli_plot_writes_png(tmp_path, capsys):
    path = tmp_path / "breakdown.png"
    rc = cli_main(["plan", *LLAMA_ARGS, "--seq-length", "131072", "--global-batch", "8",
                   "--nodes", "4", "--plot", str(path), "--top", "6"])
    assert rc == 0
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
    out = capsys.readouterr().out
    assert "winner:" in out and "megatron flags:" in out and "Bridge overrides:" in out


def test_model_from_recipe_file(capsys):
    recipe = "tests/functional/test_cases/gpt3_mcore_tp2_pp1_cp4_dcp/model_config.yaml"
    assert cli_main(["plan", "--model", recipe, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    model = out["inputs"]["model"]
    assert (model["num_layers"], model["hidden_size"], model["num_query_groups"]) == (4, 64, 2)
    assert out["inputs"]["batch"] == {"sequences": 8, "tokens": 512, "max_length": 64,
                                      "fixed": True}


@pytest.mark.parametrize("argv, fragment", [
    (["--layers", "x"], "--layers='x' must be an integer"),
    (["--bogus", "1"], "unrecognized arguments: --bogus 1"),
    (["--layers", "2"], "needs --hidden, --heads"),
    (["--layers", "2", "--hidden", "64", "--heads", "4"], "--seq-length"),
    (["--layers", "2", "--hidden", "64", "--heads", "4", "--seq-length", "64"],
     "--global-batch"),
    (["--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "3", "--seq-length",
      "64", "--global-batch", "2"], "must divide"),
    (["--layers", "2", "--hidden", "64", "--heads", "4", "--seq-length", "64",
      "--global-batch", "2", "--nodes", "0"], "--nodes"),
    (["--layers", "2", "--hidden", "64", "--heads", "4", "--seq-length", "64",
      "--global-batch", "2", "--tflops", "-1"], "--tflops"),
    (["--layers", "2", "--hidden", "64", "--heads", "4", "--lengths", "/nonexistent.json"],
     "--lengths"),
    (["--layers", "2", "--hidden", "64", "--heads", "4", "--lognormal", "1,2",
      "--global-batch", "2"], "MEDIAN,SIGMA,MIN,MAX"),
    (["--layers", "2", "--hidden", "64", "--heads", "4", "--seq-length", "64",
      "--global-batch", "2", "--recompute", "none"], "invalid choice"),
    (["--model", "/nonexistent.yaml", "--seq-length", "64", "--global-batch", "2"],
     "--model"),
    (["--layers", "2", "--hidden", "64", "--heads", "4", "--seq-length", "64",
      "--global-batch", "0"], "--global-batch=0 must be >= 1"),
    (["--layers", "2", "--hidden", "64", "--heads", "4", "--seq-length", "64",
      "--global-batch", "2", "--max-tp", "0"], "--max-tp"),
    (["--layers", "2", "--hidden", "64", "--heads", "4", "--seq-length", "64",
      "--global-batch", "2", "--plot", "/nonexistent/dir/x.png"], "--plot"),
])
def test_input_errors_are_one_line_exit_2(argv, fragment, capsys):
    try:
        rc = cli_main(["plan", *argv])
    except SystemExit as exc:
        rc = exc.code
    assert rc == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and fragment in err and "Traceback" not in err


def test_cli_lengths_file_gives_dynamic_rows(tmp_path, capsys):
    lengths = tmp_path / "lengths.json"
    lengths.write_text(json.dumps([512, 1024, 4096, 16384, 700, 300, 9000, 2048]))
    rc = cli_main(["plan", "--layers", "4", "--hidden", "512", "--heads", "8", "--kv-heads", "4",
                   "--lengths", str(lengths), "--gpus-per-node", "4", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["inputs"]["batch"] == {"sequences": 8, "tokens": 34064, "max_length": 16384,
                                      "fixed": False}
    dyn = [r for r in out["layouts"] if r["dynamic_context_parallel"]]
    assert dyn and all(r["min_dynamic_context_parallel_size"] in (1, 2, 4) for r in dyn)
    assert all(r["max_seqlen_per_dp_cp_rank"] > 0 and r["cp_comm_type"] == "p2p" for r in dyn)


def test_model_from_flags_text_file(tmp_path, capsys):
    flags = tmp_path / "model.sh"
    flags.write_text("# llama-ish\n--num-layers 8 --hidden-size 1024 --num-attention-heads 16 \\\n"
                     "  --num-query-groups 4 --ffn-hidden-size 2816 --swiglu "
                     "--untie-embeddings-and-output-weights --vocab-size 32000 --seq-length 8192 "
                     "--global-batch-size 16\n")
    assert cli_main(["plan", "--model", str(flags), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    model = out["inputs"]["model"]
    assert model["num_query_groups"] == 4 and model["gated_mlp"] and model["untie_embeddings"]
    assert model["ffn_hidden_size"] == 2816
    assert out["inputs"]["batch"]["sequences"] == 16


def test_the_planner_ranks_topologies():
    """Every ranked candidate is a CPConfig resolved on the cluster (#33): its sizes and rank
    lists are its Topology's; what was refused is the CPConfig, named by the same label."""
    from megatron_hcp.planner import label

    model = ModelSpec(num_layers=8, hidden_size=1024, num_attention_heads=16,
                      num_query_groups=4, vocab_size=32000, window=2048)
    cluster = Cluster(nodes=1, gpus_per_node=8)
    batch = lognormal(64, 8192, 1.0, 256, 65536, seed=0)
    result = plan(model, batch, cluster, Options(attention_backend="reference"))
    assert any(e.layout.dynamic for e in result.ranked)
    for e in result.ranked:
        topo = e.layout.topology
        assert topo.config is e.layout.config and topo.world_size == cluster.world_size
        assert topo == e.layout.config.resolve(cluster.world_size)
        assert (e.layout.tp, e.layout.cp, e.layout.pp, e.layout.dp) == (
            topo.tp, topo.cp, topo.pp, topo.dp)
        assert e.detail["dp_cp_size"] == topo.dp_cp
        assert e.layout.label == label(e.layout.config, e.layout.vp)
    assert result.rejected and all(isinstance(c, CPConfig) for c, _ in result.rejected)
    for config, _ in result.rejected:
        with pytest.raises(CPConfigError):
            config.resolve(cluster.world_size)
