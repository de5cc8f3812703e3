"""CPConfig: every rule, with the error it must give; an independent oracle via hypothesis."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_hcp.cli import main as cli_main
from megatron_hcp.config import CP_PARTITION_MODES as config_modes
from megatron_hcp.config import CPConfig, CPConfigError

BAD = [
    # (kwargs, parameter named, fragment of the rule)
    (dict(context_parallel_size=4, cp_comm_type="a2a+p2p"),
     "hierarchical_context_parallel_sizes", "needs the sizes of its two levels"),
    (dict(context_parallel_size=4, cp_comm_type="a2a+p2p",
          hierarchical_context_parallel_sizes=[2, 3]),
     "hierarchical_context_parallel_sizes", "must equal context_parallel_size=4"),
    (dict(context_parallel_size=8, cp_comm_type="a2a+p2p",
          hierarchical_context_parallel_sizes=[2, 2, 2]),
     "hierarchical_context_parallel_sizes", "exactly two levels"),
    (dict(context_parallel_size=4, cp_comm_type="a2a+p2p",
          hierarchical_context_parallel_sizes=[4, 0]),
     "hierarchical_context_parallel_sizes", "every level must be >= 1"),
    (dict(context_parallel_size=4, cp_comm_type="p2p",
          hierarchical_context_parallel_sizes=[2, 2]),
     "hierarchical_context_parallel_sizes", "only take effect with cp_comm_type a2a+p2p"),
    (dict(context_parallel_size=4, seq_length=100), "seq_length", "divisible by 2*context"),
    (dict(context_parallel_size=4, cp_comm_type="a2a", num_attention_heads=6),
     "num_attention_heads", "local query heads"),
    (dict(context_parallel_size=4, cp_comm_type="a2a", num_attention_heads=8,
          num_query_groups=2, cp_attention_backend="te", te_version="2.0"),
     "num_query_groups", "must be divisible by it"),
    (dict(context_parallel_size=4, cp_comm_type="a2a", num_attention_heads=12,
          num_query_groups=3),
     "num_query_groups", "or divide it"),
    (dict(context_parallel_size=8, cp_comm_type="a2a+p2p",
          hierarchical_context_parallel_sizes=[4, 2], num_attention_heads=8,
          num_query_groups=8, tensor_model_parallel_size=4),
     "num_attention_heads", "2 local query heads"),
    (dict(context_parallel_size=4, cp_comm_type="a2a+p2p",
          hierarchical_context_parallel_sizes=[2, 2], te_version="1.11.0",
          cp_attention_backend="te"),
     "te_version", ">= 1.12"),
    (dict(context_parallel_size=4, cp_comm_type="a2a+p2p",
          hierarchical_context_parallel_sizes=[2, 2], cp_attention_backend="te"),
     "te_version", ">= 1.12"),
    (dict(context_parallel_size=4, data_parallel_size=2, cp_comm_type="a2a+p2p",
          hierarchical_context_parallel_sizes=[2, 2], dynamic_context_parallel=True,
          max_seqlen_per_dp_cp_rank=512, cp_attention_backend="te", te_version="2.18.0"),
     "te_version", "THD only from 2.20"),
    (dict(cp_comm_type=["p2p", "a2a"], num_layers=3), "cp_comm_type", "num_layers=3 entries"),
    (dict(cp_comm_type=["p2p", "a2a"]), "cp_comm_type", "needs num_layers"),
    (dict(cp_comm_type="ring"), "cp_comm_type", "unknown comm type"),
    (dict(context_parallel_size=0), "context_parallel_size", "integer >= 1"),
    (dict(num_attention_heads=6, tensor_model_parallel_size=4),
     "num_attention_heads", "divisible by tensor_model_parallel_size"),
    (dict(num_attention_heads=8, num_query_groups=3), "num_query_groups", "must divide"),
    (dict(dynamic_context_parallel=True, context_parallel_size=2, data_parallel_size=2,
          min_dynamic_context_parallel_size=3, max_seqlen_per_dp_cp_rank=1024),
     "min_dynamic_context_parallel_size", "power of two"),
    (dict(dynamic_context_parallel=True, context_parallel_size=2, data_parallel_size=2,
          min_dynamic_context_parallel_size=8, max_seqlen_per_dp_cp_rank=1024),
     "min_dynamic_context_parallel_size", "<= data_parallel_size*context_parallel_size=4"),
    (dict(dynamic_context_parallel=True, context_parallel_size=1, data_parallel_size=3,
          max_seqlen_per_dp_cp_rank=1024),
     "data_parallel_size", "power of two >= 2"),
    (dict(dynamic_context_parallel=True, context_parallel_size=2, data_parallel_size=3,
          max_seqlen_per_dp_cp_rank=1024),
     "data_parallel_size", "power of two >= 2"),
    (dict(dynamic_context_parallel=True, context_parallel_size=2, data_parallel_size=2,
          max_seqlen_per_dp_cp_rank=1024, calculate_per_token_loss=False),
     "calculate_per_token_loss", "per-token loss"),
    (dict(dynamic_context_parallel=True, context_parallel_size=2, data_parallel_size=2,
          max_seqlen_per_dp_cp_rank=1024, cuda_graph_impl="local"),
     "cuda_graph_impl", "CUDA graphs"),
    (dict(dynamic_context_parallel=True, context_parallel_size=2, data_parallel_size=2,
          max_seqlen_per_dp_cp_rank=1024, enable_cuda_graph=True),
     "cuda_graph_impl", "CUDA graphs"),
    (dict(dynamic_context_parallel=True, context_parallel_size=2, data_parallel_size=2,
          max_seqlen_per_dp_cp_rank=1024, use_megatron_fsdp=True),
     "use_megatron_fsdp", "FSDP"),
    (dict(dynamic_context_parallel=True, context_parallel_size=4, data_parallel_size=2,
          max_seqlen_per_dp_cp_rank=1024, cp_comm_type="a2a+p2p",
          hierarchical_context_parallel_sizes=[1, 4]),
     "hierarchical_context_parallel_sizes[0]", "plain ring"),
    (dict(dynamic_context_parallel=True, context_parallel_size=6, data_parallel_size=1,
          max_seqlen_per_dp_cp_rank=1024, cp_comm_type="a2a+p2p",
          hierarchical_context_parallel_sizes=[3, 2]),
     "hierarchical_context_parallel_sizes[0]", "power of two"),
    (dict(hybrid_context_parallel=True, context_parallel_size=2, data_parallel_size=2),
     "max_seqlen_per_dp_cp_rank", "positive token cap"),
    (dict(dynamic_context_parallel=True, context_parallel_size=2, data_parallel_size=2),
     "max_seqlen_per_dp_cp_rank", "positive token cap"),
    (dict(dynamic_context_parallel=True, context_parallel_size=2, data_parallel_size=2,
          max_seqlen_per_dp_cp_rank=0),
     "max_seqlen_per_dp_cp_rank", "positive token cap"),
]


@pytest.mark.parametrize("kwargs, parameter, fragment", BAD)
def test_bad_config_error_names_parameter_value_rule_fix(kwargs, parameter, fragment):
    with pytest.raises(CPConfigError) as info:
        CPConfig(**kwargs).validate()
    hits = [v for v in info.value.violations if v.parameter == parameter and fragment in v.rule]
    assert hits, info.value.violations
    v = hits[0]
    assert v.fix and f"{parameter}=" in str(info.value) and "Fix:" in str(info.value)


def test_all_violations_reported_at_once():
    with pytest.raises(CPConfigError) as info:
        CPConfig(context_parallel_size=4, seq_length=10, cp_comm_type="a2a",
                 num_attention_heads=6).validate()
    # 6 MHA heads: neither Q nor KV heads split over 4 a2a ranks
    assert {v.parameter for v in info.value.violations} == {
        "seq_length", "num_attention_heads", "num_query_groups"}


def test_advice_for_valid_configs():
    advice = CPConfig(context_parallel_size=4, cp_comm_type="a2a+p2p",
                      hierarchical_context_parallel_sizes=[1, 4]).validate()
    assert any("behaves as pure p2p" in a for a in advice)
    advice = CPConfig(context_parallel_size=4, cp_comm_type="a2a+p2p",
                      hierarchical_context_parallel_sizes=[2, 2], num_attention_heads=16,
                      num_query_groups=8, tensor_model_parallel_size=2).validate()
    assert any("pure a2a" in a for a in advice)
    assert CPConfig(context_parallel_size=16, cp_comm_type="a2a+p2p",
                    hierarchical_context_parallel_sizes=[8, 2], num_attention_heads=32,
                    num_query_groups=8, seq_length=131072).validate() == []


def test_kv_replication_only_with_reference_backend():
    cfg = dict(context_parallel_size=4, cp_comm_type="a2a", num_attention_heads=8,
               num_query_groups=2)
    CPConfig(**cfg).validate()  # reference backend replicates 2 KV heads to 4
    with pytest.raises(CPConfigError):
        CPConfig(**cfg, te_version="2.8").validate()


def test_window_and_softmax_offset_rules_per_backend():
    te, ref = dict(te_version="2.8"), dict(cp_attention_backend="reference")
    base = dict(context_parallel_size=4, window_size=[128, 0])
    for comm in ("p2p", "a2a+p2p"):
        hcp = dict(hierarchical_context_parallel_sizes=[2, 2]) if comm == "a2a+p2p" else {}
        with pytest.raises(CPConfigError) as info:
            CPConfig(**base, cp_comm_type=comm, **hcp, **te).validate()
        (v,) = info.value.violations
        assert v.parameter == "window_size" and comm in v.rule and "backend te" in v.rule
        assert "cp_attention_backend=reference" in v.fix
        CPConfig(**base, cp_comm_type=comm, **hcp, **ref).validate()  # the ring skips blocks
    for comm in ("a2a", "all_gather"):
        CPConfig(**base, cp_comm_type=comm, **te).validate()
    CPConfig(context_parallel_size=4, window_size=[-1, -1], **te).validate()  # no window
    with pytest.raises(CPConfigError, match="window_size"):
        CPConfig(context_parallel_size=4, window_size=[128]).validate()
    # softmax offsets: TE only with a2a; the reference backend with every comm type
    CPConfig(context_parallel_size=4, cp_comm_type="a2a", softmax_type="learnable",
             **te).validate()
    with pytest.raises(CPConfigError) as info:
        CPConfig(context_parallel_size=4, cp_comm_type="p2p", softmax_type="off-by-one",
                 **te).validate()
    assert "only with a2a (backend te" in str(info.value)
    for comm in ("p2p", "all_gather", "a2a"):
        CPConfig(context_parallel_size=4, cp_comm_type=comm, softmax_type="off-by-one",
                 **ref).validate()
    CPConfig(context_parallel_size=4, cp_comm_type="a2a+p2p", softmax_type="learnable",
             hierarchical_context_parallel_sizes=[2, 2], **ref).validate()
    with pytest.raises(CPConfigError, match="softmax_type"):
        CPConfig(softmax_type="sink").validate()
    assert cli_main(["check-config", "context_parallel_size=4", "window_size=[128,0]",
                     "te_version=2.8"]) == 2  # p2p by default


def test_cp_partition_mode_rules():
    """Both layouts; the seq_length rule of each; TE refuses the contiguous layout by name;
    the contiguous layout's causal imbalance is said, not hidden; the flag and key=value."""
    from megatron_hcp.sharding import CP_PARTITION_MODES

    assert CP_PARTITION_MODES == config_modes  # config may not import sharding: kept equal
    assert CPConfig().cp_partition_mode == "zigzag"
    CPConfig(context_parallel_size=4, seq_length=12, cp_partition_mode="contiguous",
             window_size=[4, 0]).validate()
    with pytest.raises(CPConfigError) as info:
        CPConfig(context_parallel_size=4, seq_length=12).validate()
    assert "divisible by 2*context_parallel_size=8" in str(info.value)
    with pytest.raises(CPConfigError) as info:
        CPConfig(context_parallel_size=4, seq_length=10, cp_partition_mode="contiguous").validate()
    (v,) = info.value.violations
    assert v.parameter == "seq_length" and "context_parallel_size=4 (the contiguous" in v.rule
    assert "e.g. 12" in v.fix
    with pytest.raises(CPConfigError) as info:
        CPConfig(context_parallel_size=2, cp_partition_mode="striped").validate()
    (v,) = info.value.violations
    assert (v.parameter, v.value) == ("cp_partition_mode", "striped")
    assert "must be one of zigzag, contiguous" in v.rule
    for cp, dynamic in ((2, False), (1, True)):
        with pytest.raises(CPConfigError) as info:
            CPConfig(context_parallel_size=cp, data_parallel_size=2, te_version="2.20",
                     cp_partition_mode="contiguous", dynamic_context_parallel=dynamic,
                     max_seqlen_per_dp_cp_rank=64).validate()
        (v,) = info.value.violations
        assert v.parameter == "cp_partition_mode" and "Transformer Engine" in v.rule
        assert "cp_attention_backend=reference" in v.fix
    CPConfig(context_parallel_size=1, te_version="2.8", cp_partition_mode="contiguous").validate()
    advice = CPConfig(context_parallel_size=4, cp_partition_mode="contiguous").validate()
    assert any("7/4 = 1.75x the mean attention work" in a for a in advice), advice
    assert not CPConfig(context_parallel_size=4, cp_partition_mode="contiguous",
                        window_size=[64, 0]).validate()
    flags = CPConfig.from_args(["--context-parallel-size", "2", "--cp-partition-mode",
                                "contiguous"])
    assert flags.cp_partition_mode == "contiguous"
    assert CPConfig.from_pairs(["cp_partition_mode=contiguous"]).cp_partition_mode == "contiguous"
    with pytest.raises(CPConfigError, match="cp_partition_mode"):
        CPConfig(cp_partition_mode=2).validate()


# ---------------------------------------------------------------- independent oracle
def oracle_is_valid(c: dict) -> bool:
    """The rules of the foundation issue, restated from scratch."""
    cp, tp = c["context_parallel_size"], c["tensor_model_parallel_size"]
    types = c["cp_comm_type"] if isinstance(c["cp_comm_type"], list) else [c["cp_comm_type"]]
    hcp = c["hierarchical_context_parallel_sizes"]
    te = c["te_version"] is not None
    if isinstance(c["cp_comm_type"], list) and len(types) != c["num_layers"]:
        return False
    uses_h = "a2a+p2p" in types
    if uses_h and (hcp is None or len(hcp) != 2):
        return False
    if hcp is not None and (min(hcp) < 1 or math.prod(hcp) != cp or not uses_h):
        return False
    contiguous = c["cp_partition_mode"] == "contiguous"
    if cp > 1 and c["seq_length"] % (cp if contiguous else 2 * cp):
        return False
    if contiguous and te and (cp > 1 or c["dynamic_context_parallel"]):
        return False  # no TE release attends over per-sequence contiguous slices
    h, g = c["num_attention_heads"], c["num_query_groups"]
    if h % tp or g % tp or h % g:
        return False
    for size, on in ((cp, "a2a" in types), (hcp[0] if hcp else 1, uses_h)):
        if not on or size == 1:
            continue
        if (h // tp) % size:
            return False
        kv = g // tp
        if kv % size and (te or size % kv):
            return False
    if te and uses_h and c["te_version"] < "1.12":
        return False
    if c["dynamic_context_parallel"]:
        n = cp * c["data_parallel_size"]
        m = c["min_dynamic_context_parallel_size"]
        if m & (m - 1) or m > n or n < 2 or n & (n - 1) or c["max_seqlen_per_dp_cp_rank"] <= 0:
            return False
        if uses_h:  # dynamic hierarchical CP: an a2a level that tiles aligned blocks
            a = hcp[0]
            if len(types) > 1 or a < 2 or a & (a - 1) or a > n:
                return False
            release = tuple(int(x) for x in c["te_version"].split(".")) if te else ()
            if te and release < (2, 20):  # TE refuses a2a+p2p with THD before 2.20
                return False
    return True


comm = st.sampled_from(["p2p", "all_gather", "a2a", "a2a+p2p"])


@st.composite
def configs(draw):
    num_layers = draw(st.integers(1, 3))
    per_layer = draw(st.booleans())
    return dict(
        context_parallel_size=draw(st.sampled_from([1, 2, 3, 4, 8])),
        cp_comm_type=draw(st.lists(comm, min_size=1, max_size=3)) if per_layer else draw(comm),
        hierarchical_context_parallel_sizes=draw(
            st.none() | st.lists(st.integers(0, 4), min_size=1, max_size=3)
        ),
        tensor_model_parallel_size=draw(st.sampled_from([1, 2, 4])),
        data_parallel_size=draw(st.integers(1, 4)),
        num_attention_heads=draw(st.sampled_from([1, 2, 4, 6, 8, 12, 16, 32])),
        num_query_groups=draw(st.sampled_from([1, 2, 3, 4, 8])),
        num_layers=num_layers,
        seq_length=draw(st.sampled_from([64, 96, 100, 128, 4096])),
        dynamic_context_parallel=draw(st.booleans()),
        min_dynamic_context_parallel_size=draw(st.sampled_from([1, 2, 3, 4, 16])),
        max_seqlen_per_dp_cp_rank=draw(st.sampled_from([0, 512])),
        te_version=draw(st.sampled_from([None, "1.11", "1.12", "2.8", "2.20"])),
        cp_partition_mode=draw(st.sampled_from(["zigzag", "contiguous"])),
    )


@settings(max_examples=1500, deadline=None)
@given(c=configs())
def test_no_invalid_accepted_no_valid_rejected(c):
    try:
        CPConfig(**c).validate()
        accepted = True
    except CPConfigError:
        accepted = False
    assert accepted == oracle_is_valid(c), c


# ---------------------------------------------------------------- CLI
def test_cli_check_config_valid(capsys):
    code = cli_main(["check-config", "context_parallel_size=4", "cp_comm_type=a2a+p2p",
                     "hierarchical_context_parallel_sizes=[2,2]", "num_attention_heads=16",
                     "num_query_groups=8", "tensor_model_parallel_size=2", "seq_length=4096"])
    out = capsys.readouterr().out
    assert code == 0 and "valid" in out and "advice:" in out and "pure a2a" in out


def test_cli_check_config_invalid_lists_every_rule(capsys):
    code = cli_main(["check-config", "context_parallel_size=4", "cp_comm_type=a2a+p2p",
                     "hierarchical_context_parallel_sizes=[2,3]", "seq_length=100"])
    err = capsys.readouterr().err
    assert code == 2
    assert "hierarchical_context_parallel_sizes=[2, 3]" in err and "seq_length=100" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("args", [["bogus_key=1"], ["novalue"], ["context_parallel_size=x"],
                                  ["cp_comm_type=[p2p,"]])
def test_cli_check_config_garbage_exits_2(args, capsys):
    assert cli_main(["check-config", *args]) == 2
    assert "Traceback" not in capsys.readouterr().err


def test_hybrid_context_parallel_is_a_deprecated_alias_of_dynamic_cp():
    config = CPConfig(hybrid_context_parallel=True, context_parallel_size=2, data_parallel_size=2,
                      max_seqlen_per_dp_cp_rank=512)
    assert config.dynamic_context_parallel and config.dynamic
    advice = config.validate()
    assert any("hybrid_context_parallel" in a and "deprecated" in a for a in advice)
    assert not any("deprecated" in a for a in CPConfig(
        dynamic_context_parallel=True, context_parallel_size=2, data_parallel_size=2,
        max_seqlen_per_dp_cp_rank=512).validate())


def test_dynamic_hierarchical_cp_is_accepted_with_its_levels_explained():
    config = CPConfig(dynamic_context_parallel=True, context_parallel_size=4,
                      data_parallel_size=2, max_seqlen_per_dp_cp_rank=1024,
                      cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes=[2, 2],
                      num_attention_heads=8, num_query_groups=2)
    advice = config.validate()
    assert any("1: no CP; 2: pure a2a over 2; 4: a2a 2 x p2p 2; 8: a2a 2 x p2p 4" in a
               for a in advice), advice
    assert [config.dynamic_levels(c) for c in (1, 2, 4, 8)] == [(1, 1), (2, 1), (2, 2), (2, 4)]
    # one rule and one convention for every user: a flat ring without hierarchical CP
    from megatron_hcp.config import describe_levels, dynamic_levels
    from megatron_hcp.dynamic_cp.projection import dynamic_levels as projection_levels

    assert projection_levels is dynamic_levels
    flat = CPConfig(context_parallel_size=4, dynamic_context_parallel=True,
                    max_seqlen_per_dp_cp_rank=64)
    assert flat.dynamic_levels(8) == dynamic_levels(8, None) == (1, 8)
    assert [describe_levels(c, 2) for c in (1, 2, 8)] == ["no CP", "pure a2a over 2",
                                                          "a2a 2 x p2p 4"]
    assert describe_levels(8, None) == "p2p 8"
