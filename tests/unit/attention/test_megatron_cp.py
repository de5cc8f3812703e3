"""Real megatron-core GPT models trained with CP on 4 gloo ranks equal the CP=1 run."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_hcp.harness.local_world import RankError
from megatron_hcp.parallel_state.groups import destroy_groups

WORLD = 4
RTOL = 1e-5


def train(tp, cp, pp, comm, hcp, steps=3, tied=False, sp=False, extra=None, mode="zigzag"):
    """One rank: MPU groups through megatron_hcp, then megatron's schedule/DDP/optimizer;
    ``mode``: the CP partition layout (``cp_partition_mode``)."""
    from megatron_hcp.config import CPConfig
    from megatron_hcp.parallel_state.mpu import destroy_model_parallel, initialize_model_parallel
    from megatron_hcp.patching import apply, apply_cpu_runtime, by_name, revert
    from megatron_hcp.training.trainer import TinyGPTSpec, train_tiny_gpt

    apply_cpu_runtime()
    rope = by_name(["rope-cp-partition-mode"])
    if mode != "zigzag":
        apply(rope)
    initialize_model_parallel(
        CPConfig(context_parallel_size=cp, tensor_model_parallel_size=tp,
                 pipeline_model_parallel_size=pp, data_parallel_size=WORLD // (tp * cp * pp),
                 cp_comm_type=comm, hierarchical_context_parallel_sizes=hcp,
                 num_attention_heads=4, num_query_groups=2, seq_length=64,
                 cp_partition_mode=mode),
        create_gloo_process_groups=False,
    )
    try:
        return train_tiny_gpt(TinyGPTSpec.of(
            num_layers=4, num_attention_heads=4, num_query_groups=2, steps=steps,
            tensor_model_parallel_size=tp, context_parallel_size=cp,
            pipeline_model_parallel_size=pp, cp_comm_type=comm,
            hierarchical_context_parallel_sizes=hcp, share_embeddings_and_output_weights=tied,
            sequence_parallel=sp, extra_config=extra or {}, cp_partition_mode=mode))
    finally:
        destroy_model_parallel()
        revert(rope)


@pytest.fixture(scope="module")
def baseline(world):
    runs = world.run(train, 1, 1, 1, "p2p", None)
    assert all((r["loss"], r["grad_norm"]) == (runs[0]["loss"], runs[0]["grad_norm"])
               for r in runs)
    return runs[0]


CASES = [
    # (tp, cp, pp, comm, hcp[, sequence_parallel])
    (1, 2, 1, "p2p", None),
    (1, 2, 1, "all_gather", None),
    (1, 2, 1, "a2a", None),
    (1, 2, 1, "a2a+p2p", [2, 1]),
    (1, 4, 1, "p2p", None),
    (1, 4, 1, "all_gather", None),
    (1, 4, 1, "a2a", None),
    (1, 4, 1, "a2a+p2p", [2, 2]),
    (2, 2, 1, "p2p", None),
    (2, 2, 1, "a2a", None),
    (2, 1, 1, "p2p", None, True),
    (2, 2, 1, "p2p", None, True),
    (2, 2, 1, "a2a+p2p", [2, 1], True),
    (1, 2, 2, "p2p", None),
    (1, 2, 2, "a2a+p2p", [2, 1]),
]


@pytest.mark.multirank
@pytest.mark.parametrize("tp, cp, pp, comm, hcp, sp", [(*c, False)[:6] for c in CASES])
def test_cp_training_equals_cp1(world, baseline, tp, cp, pp, comm, hcp, sp):
    """TP/CP/PP layouts, with and without sequence parallelism (norms of the local spec become
    SequenceParallelTorchNorm), train like one rank."""
    runs = world.run(train, tp, cp, pp, comm, hcp, sp=sp)
    for rank, run in enumerate(runs):
        for key in ("loss", "grad_norm"):
            got, want = torch.tensor(run[key]), torch.tensor(baseline[key])
            rel = ((got - want).abs() / want.abs()).max().item()
            assert rel <= RTOL, (rank, key, run[key], baseline[key])
    # the model really trains (the check would be empty on a frozen model)
    assert baseline["loss"][0] != baseline["loss"][-1]


def assert_runs_equal(runs, want):
    for rank, run in enumerate(runs):
        for key in ("loss", "grad_norm"):
            got, ref = torch.tensor(run[key]), torch.tensor(want[key])
            assert ((got - ref).abs() / ref.abs()).max() <= RTOL, (rank, key, run, want)


@pytest.mark.parametrize("extra, layouts", [
    ({"window_size": (5, 0)}, [(1, 4, 1, "p2p", None), (1, 4, 1, "a2a+p2p", [2, 2])]),
    ({"softmax_type": "learnable"}, [(1, 4, 1, "p2p", None), (2, 2, 1, "all_gather", None),
                                     (1, 4, 1, "a2a+p2p", [2, 2])]),
    ({"softmax_type": "off-by-one"}, [(1, 2, 2, "a2a", None)]),
    # megatron's multi-latent attention on the local spec: q/k head dim 16 + 8 (RoPE part),
    # v head dim 8 (mla-without-te lets it build without TE on megatron-core 0.16.1). TP is
    # left out: MLA with TP2 differs from TP1 by up to 8e-5 (grad norm) without any CP too
    ({"multi_latent_attention": True, "q_lora_rank": None, "kv_lora_rank": 32,
      "qk_head_dim": 16, "qk_pos_emb_head_dim": 8, "v_head_dim": 8, "rope_type": "rope",
      "normalization": "RMSNorm"},
     [(1, 4, 1, "p2p", None), (1, 4, 1, "a2a+p2p", [2, 2]), (1, 2, 2, "all_gather", None)]),
])
@pytest.mark.multirank
def test_attention_features_train_like_cp1(world, extra, layouts):
    """Sliding window, softmax offsets (megatron's config fields, read by the reference
    attention) and MLA's head dims (v's differs from q/k's) with CP, TP, PP and HCP train like
    one rank; the feature changes the run."""
    want = world.run(train, 1, 1, 1, "p2p", None, extra=extra)[0]
    assert want["loss"] != world.run(train, 1, 1, 1, "p2p", None)[0]["loss"]
    for tp, cp, pp, comm, hcp in layouts:
        assert_runs_equal(world.run(train, tp, cp, pp, comm, hcp, extra=extra), want)


CONTIGUOUS = [(1, 4, 1, "p2p", None), (1, 4, 1, "all_gather", None), (1, 4, 1, "a2a", None),
              (1, 4, 1, "a2a+p2p", [2, 2]), (2, 2, 1, "p2p", None), (1, 2, 2, "a2a+p2p", [2, 1])]


@pytest.mark.multirank
@pytest.mark.parametrize("extra", [None, {"window_size": (5, 0)}])
def test_contiguous_layout_trains_like_cp1(world, baseline, extra):
    """cp_partition_mode='contiguous' (slice r of the sequence, RoPE by its positions: the
    rope-cp-partition-mode patch) trains like one rank with every comm type, TP, PP and HCP,
    causal and with a sliding window (whose ring stops at the window's reach)."""
    want = baseline if extra is None else world.run(train, 1, 1, 1, "p2p", None, extra=extra)[0]
    for tp, cp, pp, comm, hcp in CONTIGUOUS if extra is None else CONTIGUOUS[:1] + CONTIGUOUS[3:4]:
        assert_runs_equal(world.run(train, tp, cp, pp, comm, hcp, extra=extra,
                                    mode="contiguous"), want)


def train_contiguous_without_its_rope_patch():
    from megatron_hcp.config import CPConfig
    from megatron_hcp.parallel_state.mpu import destroy_model_parallel, initialize_model_parallel
    from megatron_hcp.patching import PatchError, apply_cpu_runtime
    from megatron_hcp.training.trainer import TinyGPTSpec, train_tiny_gpt

    apply_cpu_runtime()
    initialize_model_parallel(CPConfig(context_parallel_size=4, seq_length=64,
                                       cp_partition_mode="contiguous"),
                              create_gloo_process_groups=False)
    try:
        train_tiny_gpt(TinyGPTSpec.of(context_parallel_size=4, steps=1,
                                      cp_partition_mode="contiguous"))
    except PatchError as err:
        return str(err)
    finally:
        destroy_model_parallel()
    return None


@pytest.mark.multirank
def test_contiguous_layout_needs_its_rope_patch(world):
    """Without rope-cp-partition-mode RoPE would rotate a slice by zigzag positions: the
    trainer refuses, naming the patch, before any step."""
    messages = world.run(train_contiguous_without_its_rope_patch)
    assert all(m is not None and "rope-cp-partition-mode" in m for m in messages), messages


@pytest.mark.multirank
def test_tied_embeddings_across_pipeline_stages(world):
    """PP=2 ties the output layer to the embedding through an all-reduce (cpu-tied-embedding-sync
    makes it run on CPU); the tied model trains exactly like PP=1 with one shared weight."""
    want = world.run(train, 1, 1, 1, "p2p", None, 3, True)[0]
    assert want != world.run(train, 1, 1, 1, "p2p", None, 3, False)[0]  # tying matters
    for run in world.run(train, 1, 2, 2, "p2p", None, 3, True):
        for key in ("loss", "grad_norm"):
            got, ref = torch.tensor(run[key]), torch.tensor(want[key])
            assert ((got - ref).abs() / ref.abs()).max() <= RTOL, (key, run, want)


# ---------------------------------------------------------------- silent CP-off guard
def upstream_failure_without_hierarchical_groups():
    """megatron initialized with CP=4 but no hierarchical groups, model asks for a2a+p2p."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_hcp.attention.groups import SilentCPOffError
    from megatron_hcp.attention.module import ReferenceCPAttention
    from megatron_hcp.patching import apply_cpu_runtime

    apply_cpu_runtime()
    ps.initialize_model_parallel(context_parallel_size=4, create_gloo_process_groups=False)
    try:
        config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4,
                                   context_parallel_size=4, cp_comm_type="a2a+p2p",
                                   hierarchical_context_parallel_sizes=[2, 2],
                                   attention_dropout=0.0, use_cpu_initialization=True)
        assert ps.get_hierarchical_context_parallel_groups(check_initialized=False) is None
        try:
            ReferenceCPAttention(config, 1, AttnMaskType.causal, "self",
                                 cp_comm_type="a2a+p2p")
        except SilentCPOffError as err:
            return str(err)
        return None
    finally:
        ps.destroy_model_parallel()


@pytest.mark.multirank
def test_silent_cp_off_guard_fires(world):
    for message in world.run(upstream_failure_without_hierarchical_groups):
        assert message is not None
        assert "pg_collection.hcp is None" in message and "CP off" in message


def make_test_groups():
    """All four ranks, this rank's contiguous pair and its strided pair (like [a2a, p2p])."""
    full = dist.new_group(list(range(WORLD)))
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    stride = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    return full, pairs[dist.get_rank() // 2], stride[dist.get_rank() % 2], [full, *pairs, *stride]


def resolution_cases():
    from types import SimpleNamespace

    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_hcp.attention.groups import SilentCPOffError, resolve_cp_groups

    full, mine, other, created = make_test_groups()
    pgc = SimpleNamespace(cp=full, hcp=[mine, other])
    out = {}
    g = resolve_cp_groups(4, "a2a+p2p", pgc)
    out["hcp"] = (g.group == [mine, other], g.flat_group is full, g.size)
    g = resolve_cp_groups(4, "p2p", pgc)
    out["flat"] = (g.group is full, g.size)
    g = resolve_cp_groups(4, "p2p", pgc, PackedSeqParams(cp_group=mine, local_cp_size=2))
    out["dynamic"] = (g.group is mine, g.size, g.dynamic)
    g = resolve_cp_groups(4, "p2p", pgc, PackedSeqParams(local_cp_size=1))
    out["dynamic_off"] = (g.enabled, g.dynamic)
    # dynamic hierarchical CP: a group that fits the a2a level is pure a2a; a larger one brings
    # its [a2a, p2p] levels
    g = resolve_cp_groups(4, "a2a+p2p", pgc, PackedSeqParams(cp_group=mine, local_cp_size=2))
    out["dynamic_a2a"] = (g.comm_type, g.group is mine, g.size)
    params = PackedSeqParams(cp_group=full, local_cp_size=4)
    params.hierarchical_cp_groups = [mine, other]
    g = resolve_cp_groups(4, "a2a+p2p", pgc, params)
    out["dynamic_hcp"] = (g.comm_type, g.group == [mine, other], g.flat_group is full, g.size)
    bad_levels = PackedSeqParams(cp_group=mine, local_cp_size=2)
    bad_levels.hierarchical_cp_groups = [mine, other]
    errors = []
    for args in [(4, "p2p", SimpleNamespace(cp=None)),
                 (4, "p2p", SimpleNamespace(cp=mine)),
                 (4, "a2a+p2p", SimpleNamespace(cp=full, hcp=None)),
                 (4, "p2p", pgc, PackedSeqParams(local_cp_size=2)),
                 (4, "p2p", pgc, PackedSeqParams(cp_group=mine, local_cp_size=4)),
                 (4, "a2a+p2p", pgc, bad_levels)]:
        try:
            resolve_cp_groups(*args)
            errors.append(None)
        except SilentCPOffError as err:
            errors.append(str(err))
    out["errors"] = errors
    destroy_groups(created)
    return out


@pytest.mark.multirank
def test_cp_group_resolution(world):
    result = world.run(resolution_cases)[0]
    assert result["hcp"] == (True, True, 4)
    assert result["flat"] == (True, 4)
    assert result["dynamic"] == (True, 2, True)
    assert result["dynamic_off"] == (False, True)
    assert result["dynamic_a2a"] == ("a2a", True, 2)
    assert result["dynamic_hcp"] == ("a2a+p2p", True, True, 4)
    fragments = ["pg_collection.cp is missing", "has 2 ranks but context_parallel_size=4",
                 "pg_collection.hcp is None", "cp_group is None", "its cp_group has 2 ranks",
                 "hierarchical_cp_groups span [2, 2] ranks but the micro-batch's group has 2"]
    for fragment, message in zip(fragments, result["errors"]):
        assert message is not None and fragment in message, (fragment, message)


# ---------------------------------------------------------------- TE wrapper contract
class RecordingTE:
    """Stand-in for TE's DotProductAttention *base*: records what our wrappers hand to TE.

    This checks the wrappers' contract (arguments, order, restore); it does not run TE.
    """

    cp_stream = None

    def __init__(self, config, layer_number, attn_mask_type, attention_type,
                 attention_dropout=None, softmax_scale=None, cp_comm_type="p2p",
                 pg_collection=None):
        self.built_with_cp = config.context_parallel_size
        self.calls = []

    def set_context_parallel_group(self, cp_group, cp_global_ranks, cp_stream, cp_comm_type):
        self.calls.append((cp_group, cp_global_ranks, cp_stream, cp_comm_type))

    def forward(self, query, key, value, attention_mask, attn_mask_type, attention_bias=None,
                packed_seq_params=None):
        return self.calls[-1], packed_seq_params


def te_contract():
    from types import SimpleNamespace

    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_hcp.attention.te import make_te_forward, make_te_init

    full, mine, other, created = make_test_groups()
    cls = type("Wrapped", (RecordingTE,), {"__init__": make_te_init(RecordingTE.__init__),
                                            "forward": make_te_forward(RecordingTE.forward)})
    pgc = SimpleNamespace(tp=None, cp=full, hcp=[mine, other])
    cls.cp_stream = "stream"  # a real TE run creates torch.cuda.Stream() lazily here
    config = SimpleNamespace(context_parallel_size=4)
    module = cls(config, 1, None, "self", cp_comm_type="a2a+p2p", pg_collection=pgc)
    assert module.built_with_cp == 1 and module.config is config
    group, ranks, stream, comm = module.calls[-1]
    assert group == [mine, other] and ranks == [0, 1, 2, 3] and stream == "stream"
    assert comm == "a2a+p2p"
    module = cls(config, 1, None, "self", cp_comm_type="p2p", pg_collection=pgc)
    params = PackedSeqParams(qkv_format="thd", cp_group=mine, local_cp_size=2)
    (seen, handed) = module.forward(None, None, None, None, None, packed_seq_params=params)
    assert seen[0] is mine and seen[1] == dist.get_process_group_ranks(mine)
    assert handed.cp_group is None and handed.local_cp_size is None  # TE won't switch again
    assert params.cp_group is mine  # the caller's params are untouched
    assert module.calls[-1][0] is full  # restored after forward
    off = module.forward(None, None, None, None, None,
                         packed_seq_params=PackedSeqParams(qkv_format="thd", local_cp_size=1))[0]
    assert off == (None, None, None, "p2p")
    lazy = type("Lazy", (RecordingTE,), {"__init__": make_te_init(RecordingTE.__init__)})
    lazy(SimpleNamespace(context_parallel_size=1), 1, None, "self", pg_collection=pgc)
    assert lazy.cp_stream is None  # no stream without CP
    destroy_groups(created)
    return True


def te_thd_gate(version):
    """TE before 2.20 asserts on a2a+p2p with THD: the wrapper refuses first, by name."""
    from types import SimpleNamespace
    from unittest import mock

    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_hcp.attention import te as te_mod

    full, mine, other, created = make_test_groups()
    cls = type("Gated", (RecordingTE,), {"__init__": te_mod.make_te_init(RecordingTE.__init__),
                                          "forward": te_mod.make_te_forward(RecordingTE.forward)})
    cls.cp_stream = "stream"
    pgc = SimpleNamespace(tp=None, cp=full, hcp=[mine, other])
    module = cls(SimpleNamespace(context_parallel_size=4), 1, None, "self",
                 cp_comm_type="a2a+p2p", pg_collection=pgc)
    thd, bshd = PackedSeqParams(qkv_format="thd"), PackedSeqParams(qkv_format="bshd")
    dynamic = PackedSeqParams(qkv_format="thd", cp_group=full, local_cp_size=4)
    dynamic.hierarchical_cp_groups = [mine, other]  # as dynamic_cp.packing sets it
    results = []
    with mock.patch.object(te_mod, "installed_te_version", return_value=version):
        for params in (thd, bshd, dynamic):
            calls = len(module.calls)
            try:
                module.forward(None, None, None, None, None, packed_seq_params=params)
                results.append("ran")
            except te_mod.TEUnavailableError as err:
                assert "a2a+p2p" in str(err) and "2.20" in str(err) and version in str(err)
                assert len(module.calls) == calls  # refused before TE got new groups
                results.append("refused")
    destroy_groups(created)
    return results


@pytest.mark.multirank
def test_te_refuses_hierarchical_thd_before_2_20(world):
    old, new = world.run(te_thd_gate, "2.18.0"), world.run(te_thd_gate, "2.20.0")
    # static hcp with THD, with bshd, and a dynamic micro-batch on its hierarchical levels
    assert old == [["refused", "ran", "refused"]] * WORLD, old
    assert new == [["ran", "ran", "ran"]] * WORLD, new


@pytest.mark.multirank
def test_te_wrappers_hand_te_the_resolved_groups_and_restore(world):
    assert world.run(te_contract) == [True] * WORLD


@pytest.mark.multirank
def test_failures_are_reported_from_ranks(world):
    with pytest.raises(RankError):
        world.run(train, 1, 3, 1, "p2p", None)  # 3 does not divide the world


def stale_globals_after_destroy():
    from megatron.core import parallel_state as ps

    from megatron_hcp.parallel_state.mpu import forget_stale_groups
    from megatron_hcp.patching import apply, by_name, revert

    patch = by_name(["destroy-forgets-stale-groups"])
    revert(patch)
    left = []
    for patched in (False, True):
        if patched:
            apply(patch)
        ps.initialize_model_parallel(context_parallel_size=2, pipeline_model_parallel_size=2,
                                     hierarchical_context_parallel_sizes=[2, 1])
        ps.destroy_model_parallel()
        left.append(sorted(n for n in dir(ps) if n.startswith("_") and n.isupper()
                           and getattr(ps, n) not in (None, {}, [])))
    revert(patch)
    forget_stale_groups(ps)
    return left


@pytest.mark.multirank
def test_destroy_forgets_every_group_and_rank_list(world):
    from megatron_hcp.parallel_state.mpu import STALE_AFTER_DESTROY

    for upstream, patched in world.run(stale_globals_after_destroy):
        # upstream 0.16.1 keeps destroyed groups and rank lists; the patched destroy keeps none
        assert "_HIERARCHICAL_CONTEXT_PARALLEL_GROUPS" in upstream
        assert "_PIPELINE_GLOBAL_RANKS" in upstream
        assert set(upstream) <= set(STALE_AFTER_DESTROY)
        assert patched == []


def dynamic_group_forward(patched: bool):
    """GPT forward on packed thd data: a dynamic CP group of 2 (static CP=4) vs no CP."""
    import torch
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_hcp.attention.reference import get_local_chunk, pad_thd
    from megatron_hcp.config import CPConfig
    from megatron_hcp.parallel_state.mpu import destroy_model_parallel, initialize_model_parallel
    from megatron_hcp.patching import apply, apply_cpu_runtime, by_name, revert
    from megatron_hcp.training.trainer import TinyGPTSpec, deterministic_init

    apply_cpu_runtime()
    patch = by_name(["attention-dynamic-cp-rope"])
    (apply if patched else revert)(patch)
    initialize_model_parallel(CPConfig(context_parallel_size=4), create_gloo_process_groups=False)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    try:
        from megatron.core.models.gpt.gpt_model import GPTModel

        from megatron_hcp.attention.module import gpt_layer_spec
        from megatron_hcp.training.trainer import _transformer_config

        spec = TinyGPTSpec.of(context_parallel_size=4, num_query_groups=2)
        model = GPTModel(config=_transformer_config(spec), transformer_layer_spec=gpt_layer_spec(),
                         vocab_size=spec.vocab_size, max_sequence_length=128,
                         position_embedding_type="rope")
        deterministic_init(model, 7, 0, 1)
        rank = dist.get_rank()
        group = pairs[rank // 2]
        gen = torch.Generator().manual_seed(11 + rank // 2)  # each pair its own micro-batch
        cu = torch.tensor([0, 30, 51], dtype=torch.int32)
        tokens, cu_pad = pad_thd(torch.randint(0, 128, (51,), generator=gen), cu, 4)
        full = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                               cu_seqlens_q_padded=cu_pad, cu_seqlens_kv_padded=cu_pad,
                               max_seqlen_q=int((cu_pad[1:] - cu_pad[:-1]).max()),
                               max_seqlen_kv=int((cu_pad[1:] - cu_pad[:-1]).max()),
                               local_cp_size=1)
        labels = tokens.roll(-1)
        try:
            ref = model(tokens[None], None, None, labels=labels[None], packed_seq_params=full)[0]
        except RuntimeError as err:  # upstream: RoPE cut by the static CP=4 group
            return f"error: {err}"
        dyn = PackedSeqParams(**{**full.__dict__, "local_cp_size": 2, "cp_group": group})
        local = get_local_chunk(tokens, 2, group.rank(), "thd", cu_pad)
        out = model(local[None], None, None,
                    labels=get_local_chunk(labels, 2, group.rank(), "thd", cu_pad)[None],
                    packed_seq_params=dyn)[0]
        want = get_local_chunk(ref, 2, group.rank(), "thd", cu_pad)
        valid = get_local_chunk(torch.arange(len(tokens)) < 0, 2, group.rank(), "thd", cu_pad)
        for i in range(2):  # real tokens only (padding carries no loss)
            start, n = int(cu_pad[i]), int(cu[i + 1] - cu[i])
            valid |= get_local_chunk((torch.arange(len(tokens)) >= start)
                                     & (torch.arange(len(tokens)) < start + n), 2,
                                     group.rank(), "thd", cu_pad)
        assert model.decoder.layers[0].self_attention.pg_collection.cp.size() == 4  # restored
        return (out[valid] - want[valid]).abs().max().item()
    finally:
        revert(patch)
        destroy_groups(pairs)
        destroy_model_parallel()


@pytest.mark.multirank
def test_rope_follows_the_dynamic_cp_group(world):
    # with the patch, the dynamic group of 2 reproduces the no-CP forward exactly
    assert max(world.run(dynamic_group_forward, True)) < 1e-5
    # megatron 0.16.1 alone slices RoPE by the static CP=4 group: it fails or is wrong
    for result in world.run(dynamic_group_forward, False):
        assert (isinstance(result, str) and "split_with_sizes" in result) or result > 1e-3


# ---------------------------------------------------------------- config fields (one process)
def test_reference_attention_reads_window_size_and_softmax_offsets():
    from types import SimpleNamespace

    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_hcp.attention.module import ReferenceCPAttention
    from megatron_hcp.attention.reference import full_attention

    def build(**fields):
        cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4,
                                attention_dropout=0.0, use_cpu_initialization=True, **fields)
        return ReferenceCPAttention(cfg, 1, AttnMaskType.causal, "self",
                                    pg_collection=SimpleNamespace(cp=None, hcp=None))

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(16, 2, 4, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    out = build(window_size=(3, 0))(q, k, v, None)  # [s, b, h*d]
    ref = full_attention(q, k, v, qkv_format="sbhd", window_size=(3, 0))
    assert (out - ref.reshape(16, 2, 32)).abs().max() <= 1e-10
    assert (out - full_attention(q, k, v, qkv_format="sbhd").reshape(16, 2, 32)).abs().max() > 1e-3
    # off-by-one: a zero logit per head in every softmax, in one process against the oracle
    sink = build(softmax_type="off-by-one")
    assert sink.softmax_offset.shape == (4,) and not sink.softmax_offset.any()
    ref = full_attention(q, k, v, qkv_format="sbhd", softmax_offset=torch.zeros(4))
    assert (sink(q, k, v, None) - ref.reshape(16, 2, 32)).abs().max() <= 1e-10
    assert isinstance(build(softmax_type="learnable").softmax_offset, torch.nn.Parameter)
    with pytest.raises(ValueError, match="softmax_type='sinks'"):
        build(softmax_type="sinks")
