"""What the gpt-oss patches fix, on megatron-core's own code, in one process (no ranks).

* ``row-parallel-tp1-output`` (0.16.1, 0.19.2): an expert MLP with biases (gpt-oss's experts) on
  the local spec with TP=1 trains. Upstream's ``RowParallelLinear`` passes its output through
  the TP all-reduce Function, which returns a one-rank group's input as is (autograd: a view
  created in a custom Function), and ``MLP.forward`` adds the expert's bias to that output in
  place: RuntimeError at the first forward. With the patch the output and the gradients are
  the MLP's own math.
* ``yarn-rope-model-cp-group`` (0.16.1, 0.19.2): a GPT model's YaRN RoPE table is cut for the
  model's own CP group. ``GPTModel`` builds YaRN without ``cp_group`` (plain RoPE gets
  ``pg_collection.cp``), so the table falls back to megatron's global CP group - none on the
  decentralized path, where every CP rank got the whole sequence's table.

Bridge's loop with both: ``tests/unit/bridge/test_bridge_family_gpt_oss.py``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_hcp.patching import (
    ALL_PATCHES,
    DECENTRALIZED_PATCHES,
    LOCAL_SPEC_PATCHES,
    apply,
    by_name,
    revert,
)
from megatron_hcp.patching.forkpatch import SERIES, series_for
from megatron_hcp.patching.registry import is_applied

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks CPU-only behaviour")

NAMES = ("row-parallel-tp1-output", "yarn-rope-model-cp-group")
# the CPU runtime YaRN's table needs (its device, plain RoPE's, the CP cut without pinned memory)
ROPE = ("cpu-rope-device", "cpu-yarn-rope-device", "cpu-rope-cp-index")


class Group:
    """A process group as the code under test reads it (size and rank)."""

    def __init__(self, size: int = 1, rank: int = 0):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


@pytest.fixture
def clean():
    revert(by_name([*NAMES, *ROPE]))
    yield
    revert(by_name([*NAMES, *ROPE]))


@pytest.fixture
def given_groups(monkeypatch):
    """As on the decentralized path: torch.distributed up, megatron's MPU not (the group a
    module is given passes through; megatron answers None without torch.distributed)."""
    from megatron.core.tensor_parallel import layers, mappings
    from megatron.core.transformer import mlp

    for module in (layers, mappings, mlp):
        monkeypatch.setattr(module, "get_tensor_model_parallel_group_if_none",
                            lambda group, *args, **kwargs: group)


def test_the_gpt_oss_patches_are_named_patches_with_their_fork_diffs():
    patches = by_name(list(NAMES))
    assert all(p in ALL_PATCHES and p.versions == ("0.16.1", "0.19.2") for p in patches)
    assert set(NAMES) <= set(SERIES)
    assert all(set(NAMES) <= set(series_for(v)) for v in ("0.16.1", "0.19.2"))
    # Bridge's hook applies both (megatron_hcp.bridge.hook._core_patches)
    assert "yarn-rope-model-cp-group" in DECENTRALIZED_PATCHES
    assert "row-parallel-tp1-output" in LOCAL_SPEC_PATCHES


# ------------------------------------------------------------------ expert biases, TP=1
def _expert_mlp():
    """A gpt-oss-like expert: megatron's local MLP (column- then row-parallel linear) with
    biases, over a TP group of one rank."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1,
                               ffn_hidden_size=16, add_bias_linear=True,
                               bias_activation_fusion=False, gradient_accumulation_fusion=False,
                               use_cpu_initialization=True)
    torch.manual_seed(0)
    mlp = MLP(config, MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                    linear_fc2=RowParallelLinear),
              is_expert=True, ffn_hidden_size=16, tp_group=Group())
    with torch.no_grad():
        for p in mlp.parameters():
            p.normal_()
    return mlp


def _reference(mlp, x, scale):
    """The expert's math: fc2(act(fc1(x) + b1) * scale) + b2 * scale."""
    fc1, fc2 = mlp.linear_fc1, mlp.linear_fc2
    hidden = mlp.config.activation_func(x @ fc1.weight.t() + fc1.bias) * scale[:, None]
    return hidden @ fc2.weight.t() + fc2.bias * scale[:, None]


def test_an_expert_mlp_with_biases_trains_over_one_tp_rank(clean, given_groups):
    mlp = _expert_mlp()
    x = torch.randn(5, 8)
    scale = torch.rand(5)
    with pytest.raises(RuntimeError, match="is a view and is being modified inplace"):
        mlp(x, per_token_scale=scale)  # upstream: the bias added in place (mlp.py)
    apply(by_name(["row-parallel-tp1-output"]))
    x.requires_grad_(True)
    out, bias = mlp(x, per_token_scale=scale)
    assert bias is None  # the expert's bias is in its output
    want = _reference(mlp, x, scale)
    torch.testing.assert_close(out, want)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, [x, *mlp.parameters()], grad)
    torch.testing.assert_close(got, torch.autograd.grad(want, [x, *mlp.parameters()], grad))


def test_the_tp1_output_is_the_input_and_larger_groups_keep_upstreams_reduce(
        clean, given_groups, monkeypatch):
    from megatron.core.tensor_parallel import layers, mappings

    upstream = layers.reduce_from_tensor_model_parallel_region
    apply(by_name(["row-parallel-tp1-output"]))
    reduce = layers.reduce_from_tensor_model_parallel_region
    assert reduce is not upstream and is_applied(by_name(["row-parallel-tp1-output"])[0])
    assert mappings.reduce_from_tensor_model_parallel_region is upstream  # layers.py's only
    y = torch.randn(3, requires_grad=True) * 2
    assert reduce(y, group=Group()) is y  # upstream: a view of y made by its Function
    calls = []
    monkeypatch.setattr(mappings._ReduceFromModelParallelRegion, "apply",
                        lambda input_, group: calls.append(group) or input_)
    two = Group(2)
    assert reduce(y, group=two) is y and calls == [two]  # upstream's all-reduce
    revert(by_name(["row-parallel-tp1-output"]))
    assert layers.reduce_from_tensor_model_parallel_region is upstream


# ------------------------------------------------------------------ YaRN's CP group
def _yarn():
    """YaRN's RoPE as ``GPTModel`` builds it: no ``cp_group`` (megatron's global CP group,
    None without megatron's groups: the decentralized path)."""
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        YarnRotaryEmbedding,
    )

    return YarnRotaryEmbedding(8, scaling_factor=4.0, original_max_position_embeddings=32,
                               mscale=1.0, mscale_all_dim=0.0, use_cpu_initialization=True)


def _table_of(model):
    """What ``GPTModel._preprocess`` asks of the model's YaRN (a 64-token sequence, no packed
    parameters: ``cp_group=None``)."""
    return model.rotary_pos_emb(64, packed_seq=False, cp_group=None)[0]


def test_a_gpt_models_yarn_table_is_cut_for_the_models_cp_group(clean):
    from megatron.core.models.gpt.gpt_model import GPTModel

    from megatron_hcp.patching.integration import _make_preprocess

    apply(by_name(list(ROPE)))
    cp = Group(2, 1)
    model = SimpleNamespace(position_embedding_type="yarn", rotary_pos_emb=_yarn(),
                            pg_collection=SimpleNamespace(cp=cp))
    whole = _table_of(model)
    assert whole.shape[0] == 64  # upstream: every CP rank gets the whole sequence's table
    apply(by_name(["yarn-rope-model-cp-group"]))
    assert GPTModel._preprocess.__name__ == "_preprocess"
    preprocess = _make_preprocess(_table_of)
    cut = preprocess(model)
    assert model.rotary_pos_emb.cp_group is cp
    # CP rank 1 of 2 holds chunks 1 and 2 of 4 (megatron's load-balanced layout)
    torch.testing.assert_close(cut, torch.cat([whole[16:32], whole[32:48]]), rtol=0, atol=0)
    torch.testing.assert_close(preprocess(model), cut, rtol=0, atol=0)  # once set, kept
    # plain RoPE is built with the model's group; a model without CP keeps its table
    for kind, group in (("rope", cp), ("yarn", None)):
        other = SimpleNamespace(position_embedding_type=kind, rotary_pos_emb=_yarn(),
                                pg_collection=SimpleNamespace(cp=group))
        fallback = other.rotary_pos_emb.cp_group
        assert preprocess(other).shape[0] == 64 and other.rotary_pos_emb.cp_group is fallback
