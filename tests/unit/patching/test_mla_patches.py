"""What each MLA-family patch fixes, on megatron-core's own code, in one process (no ranks).

* ``cpu-yarn-rope-device`` (0.16.1, 0.19.2): YaRN's RoPE builds without CUDA (upstream asks
  ``torch.cuda.current_device()`` in its constructor and for every table) and gives the table
  its CPU initialization gives;
* ``mtp-collection-groups`` (0.19.2): where megatron has no global groups (Bridge's
  decentralized path), the number of MTP layers follows the ``pp_rank`` megatron passes, and
  ``mtp_on_this_rank`` / ``process_mtp_loss``'s logging group come from the model's collection
  in context (``model_groups``, which ``GPTModel._postprocess`` enters); upstream fails on
  megatron's uninitialized global groups;
* ``mla-tp-group`` (0.16.1, 0.19.2): MLA's q / kv gathers take the module's TP group (upstream
  passes none: megatron's global group, None on the decentralized path);
* ``mtp-dynamic-cp-group``'s per-token MTP counts (0.19.2, :func:`with_cp_token_counts`): the
  per-token MTP normalization counts the tokens of the whole CP group instead of this rank's
  share;
* all of them are named patches of ``ALL_PATCHES`` with their fork diffs.

Bridge's loop with all of them: ``tests/unit/bridge/test_bridge_family_mla.py``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_hcp.patching import ALL_PATCHES, PatchError, apply, by_name, revert
from megatron_hcp.patching.forkpatch import SERIES, series_for
from megatron_hcp.patching.integration import with_cp_token_counts
from megatron_hcp.patching.mla import (
    MLA_CPU_RUNTIME_PATCHES,
    MLA_DECENTRALIZED_PATCHES,
    apply_mla_decentralized,
    model_groups,
)
from megatron_hcp.patching.registry import is_applied, megatron_core_version

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks CPU-only behaviour")

INSTALLED = megatron_core_version()
needs_0192 = pytest.mark.skipif(INSTALLED != "0.19.2", reason="mtp-collection-groups and the "
                                "CP token counts are written for megatron-core 0.19.2")
ALL = MLA_CPU_RUNTIME_PATCHES + MLA_DECENTRALIZED_PATCHES
# the CPU runtime's view for plain RoPE, whose constructor YaRN's calls
ROPE = tuple(by_name(["cpu-rope-device"]))


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
    revert(ROPE + ALL)
    yield
    revert(ROPE + ALL)


def test_the_mla_patches_are_named_patches_with_their_fork_diffs():
    names = [p.name for p in ALL]
    assert names == ["cpu-yarn-rope-device", "mtp-collection-groups", "mla-tp-group"]
    assert all(p in ALL_PATCHES for p in ALL) and set(names) <= set(SERIES)
    assert {v: [n for n in series_for(v) if n in names] for v in ("0.16.1", "0.19.2")} == {
        "0.16.1": ["cpu-yarn-rope-device", "mla-tp-group"], "0.19.2": names}


# ------------------------------------------------------------------ YaRN
def _yarn(**kwargs):
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        YarnRotaryEmbedding,
    )

    return YarnRotaryEmbedding(8, scaling_factor=4.0, original_max_position_embeddings=32,
                               mscale=1.0, mscale_all_dim=0.0, **kwargs)


def test_yarn_builds_on_the_cpu_with_its_cpu_initializations_table(clean):
    apply(ROPE)  # the CPU runtime's plain RoPE: not enough for YaRN
    with pytest.raises((RuntimeError, AssertionError)):  # no CUDA driver / CUDA build
        _yarn()  # as MLA builds it (no use_cpu_initialization)
    with pytest.raises((RuntimeError, AssertionError)):
        _yarn(use_cpu_initialization=True)(64)  # the table moves its frequencies to CUDA
    assert apply(MLA_CPU_RUNTIME_PATCHES) == ["cpu-yarn-rope-device"]
    rope = _yarn()
    emb, mscale = rope(64)
    assert rope.inv_freq_extra.device.type == "cpu" and emb.device.type == "cpu"
    assert emb.shape == (64, 1, 1, 8) and mscale > 1.0  # YaRN's concentration factor
    reference, reference_mscale = _yarn(use_cpu_initialization=True)(64)
    torch.testing.assert_close(emb, reference, rtol=0, atol=0)
    assert mscale == reference_mscale
    revert(MLA_CPU_RUNTIME_PATCHES)
    with pytest.raises((RuntimeError, AssertionError)):
        _yarn()


# ------------------------------------------------------------------ MTP's groups
def test_mtp_groups_are_written_for_0192_only(clean):
    patch = MLA_DECENTRALIZED_PATCHES[0]
    assert patch.name == "mtp-collection-groups" and patch.versions == ("0.19.2",)
    assert patch.status("0.16.1") == "not written for this version"
    with pytest.raises(PatchError, match="not 0.17.1"):
        apply(MLA_DECENTRALIZED_PATCHES, version="0.17.1")
    assert apply_mla_decentralized() == (
        ["mtp-collection-groups", "mla-tp-group"] if INSTALLED == "0.19.2" else ["mla-tp-group"])
    assert apply_mla_decentralized() == []  # idempotent


def _config(**fields):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=4, hidden_size=8, num_attention_heads=1,
                             mtp_num_layers=1, use_cpu_initialization=True,
                             pipeline_dtype=torch.float32, **fields)


@needs_0192
def test_mtp_layers_to_build_follow_the_pp_rank_megatron_passes(clean):
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer import multi_token_prediction as mtp

    config = _config(pipeline_model_parallel_size=2)
    with pytest.raises(AssertionError, match="pipeline_model parallel group is not initialized"):
        mtp.get_mtp_num_layers_to_build(config, pp_rank=1)  # upstream ignores pp_rank
    apply(MLA_DECENTRALIZED_PATCHES)
    assert [mtp.get_mtp_num_layers_to_build(config, pp_rank=rank) for rank in (0, 1)] == [0, 1]
    assert gpt_layer_specs.get_mtp_num_layers_to_build is mtp.get_mtp_num_layers_to_build
    virtual = _config(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
    assert [mtp.get_mtp_num_layers_to_build(virtual, vp_stage=stage, pp_rank=1)
            for stage in (0, 1)] == [0, 1]
    with pytest.raises(AssertionError, match="not initialized"):
        mtp.get_mtp_num_layers_to_build(config)  # no pp_rank: upstream's answer


def _model_groups(pp_rank: int, pp_size: int = 2) -> SimpleNamespace:
    return SimpleNamespace(pp=Group(pp_size, pp_rank), dp_cp=Group(4, 0))


@needs_0192
def test_mtp_reads_the_models_groups_where_megatron_has_none(clean):
    from megatron.core import parallel_state
    from megatron.core.transformer import multi_token_prediction as mtp

    def on_this_rank(vp_stage=None):
        return mtp.mtp_on_this_rank(None, 1, ignore_virtual=False, vp_stage=vp_stage)

    last = _model_groups(1)
    with model_groups(last), pytest.raises(AssertionError, match="not initialized"):
        on_this_rank()  # upstream reads megatron's global pipeline group
    apply(MLA_DECENTRALIZED_PATCHES)
    with model_groups(last):
        assert on_this_rank()
        assert mtp.parallel_state.get_data_parallel_group(with_context_parallel=True) is (
            last.dp_cp)
    with model_groups(_model_groups(0)):
        assert not on_this_rank()
    with model_groups(last, vp_size=2):
        assert [on_this_rank(stage) for stage in (0, 1)] == [False, True]
    with pytest.raises(AssertionError, match="not initialized"):
        on_this_rank()  # no model in context: megatron's global groups, as upstream
    revert(MLA_DECENTRALIZED_PATCHES)
    assert mtp.parallel_state is parallel_state


@needs_0192
def test_gpt_postprocess_runs_with_its_models_groups(clean):
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer import multi_token_prediction as mtp

    from megatron_hcp.patching.mla import _make_postprocess

    apply(MLA_DECENTRALIZED_PATCHES)
    assert is_applied(MLA_DECENTRALIZED_PATCHES[0])
    assert GPTModel._postprocess.__name__ == "_postprocess"
    model = SimpleNamespace(pg_collection=_model_groups(1),
                            config=SimpleNamespace(virtual_pipeline_model_parallel_size=None))
    postprocess = _make_postprocess(
        lambda self, hidden: mtp.parallel_state.get_data_parallel_group(True))
    assert postprocess(model, None) is model.pg_collection.dp_cp
    with pytest.raises(AssertionError, match="not initialized"):
        mtp.parallel_state.get_data_parallel_group(True)  # only inside the model's call


def test_mla_gathers_over_its_own_tp_group(clean, monkeypatch):
    from megatron.core.tensor_parallel import mappings
    from megatron.core.transformer import multi_latent_attention as mla

    # as on the decentralized path: torch.distributed up, megatron's MPU not (the group given
    # passes through; None stays None)
    monkeypatch.setattr(mappings, "get_tensor_model_parallel_group_if_none",
                        lambda group, *args, **kwargs: group)
    x = torch.randn(3, 1, 4)

    def qkv(self, hidden_states):  # stands for upstream's: gathers without a group
        return mla.gather_from_tensor_model_parallel_region(
            mla.scatter_to_sequence_parallel_region(hidden_states))

    module = SimpleNamespace(pg_collection=SimpleNamespace(tp=Group(1, 0)))
    with pytest.raises(AssertionError, match="group should not be None"):
        qkv(module, x)  # megatron's global TP group: None without the MPU
    (patch,) = [p for p in MLA_DECENTRALIZED_PATCHES if p.name == "mla-tp-group"]
    apply([patch])
    assert is_applied(patch)
    from megatron_hcp.patching.mla import _make_qkv_with_own_tp_group

    assert torch.equal(_make_qkv_with_own_tp_group(qkv)(module, x), x)  # its group: 1 rank
    with pytest.raises(AssertionError, match="group should not be None"):
        qkv(module, x)  # outside the module's call: megatron's, as upstream


# ------------------------------------------------------------------ MTP's token counts
def _mtp_loss_grad(process_mtp_loss, cp_group) -> torch.Tensor:
    """The gradient one MTP layer's per-token losses get (this rank: 4 tokens, none lost to
    the roll; the roll and the logits are stand-ins)."""
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

    hidden = torch.ones(8, 1, 1, requires_grad=True)  # [main; MTP] x 4 tokens
    config = SimpleNamespace(mtp_num_layers=1, mtp_loss_scaling_factor=0.1,
                             calculate_per_token_loss=True, mtp_detach_heads=False)
    out = process_mtp_loss(
        hidden_states=hidden, labels=torch.zeros(1, 4, dtype=torch.long),
        loss_mask=torch.ones(1, 4), output_layer=lambda value, **kwargs: (value, None),
        output_weight=None, runtime_gather_output=True, is_training=False,
        compute_language_model_loss=lambda labels, logits: logits.squeeze(-1).transpose(0, 1),
        config=config, cp_group=cp_group)
    MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    (out.sum() * 0).backward()
    return hidden.grad[4:, 0, 0]


MTP_CP = tuple(by_name(["mtp-dynamic-cp-group"]))


@pytest.fixture
def no_mtp_cp():
    revert(MTP_CP)
    yield
    revert(MTP_CP)


@needs_0192
@pytest.mark.parametrize("form", ["function", "patch"])
def test_cp_token_counts_weigh_mtp_tokens_by_the_cp_groups_counts(monkeypatch, no_mtp_cp, form):
    """The other CP rank holds 4 tokens and loses one to the roll: upstream weighs this rank's
    tokens by its own 4/4, the counts of the group give 8/7 (CP=1's weight); ``patch``: the
    counts as ``mtp-dynamic-cp-group`` applies them to megatron's ``process_mtp_loss``."""
    import torch.distributed as dist
    from megatron.core.transformer import multi_token_prediction as mtp

    from megatron_hcp.group_release import PATCHED_ORIGINAL

    upstream = mtp.process_mtp_loss
    while getattr(upstream, PATCHED_ORIGINAL, None) is not None:
        upstream = getattr(upstream, PATCHED_ORIGINAL)
    if form == "function":
        fixed = with_cp_token_counts(upstream)
    else:
        apply(MTP_CP)
        fixed = mtp.process_mtp_loss  # no packed_seq_params: the static CP group it is given
        assert getattr(fixed, PATCHED_ORIGINAL) is upstream
    monkeypatch.setattr(mtp, "roll_tensor",
                        lambda tensor, **kwargs: (tensor, tensor.sum()))
    reduced = []

    def all_reduce(counts, group=None):
        reduced.append(group)
        counts += torch.tensor([4.0, 3.0])

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    two = Group(2, 1)
    torch.testing.assert_close(_mtp_loss_grad(upstream, two), torch.full((4,), 0.1))
    assert reduced == []
    torch.testing.assert_close(_mtp_loss_grad(fixed, two), torch.full((4,), 0.1 * 8 / 7))
    assert reduced == [two]
    torch.testing.assert_close(_mtp_loss_grad(fixed, Group(1, 0)), torch.full((4,), 0.1))
    assert reduced == [two]  # no CP: upstream's counts, nothing reduced


def test_cp_token_counts_refuse_another_function():
    def process_mtp_loss(hidden_states):
        return hidden_states

    with pytest.raises(PatchError, match="per-token normalization .* must occur once"):
        with_cp_token_counts(process_mtp_loss)


@needs_0192
def test_cp_token_counts_leave_a_function_that_has_them_as_it_is(tmp_path):
    """megatron-core patched with the fork diff already counts over the CP group: the runtime
    patch adds no second all-reduce."""
    import importlib.util
    import inspect

    from megatron.core.transformer import multi_token_prediction as mtp

    from megatron_hcp.group_release import PATCHED_ORIGINAL
    from megatron_hcp.patching.integration import CP_TOKEN_COUNTS, PER_TOKEN_COUNTS

    upstream = mtp.process_mtp_loss
    while getattr(upstream, PATCHED_ORIGINAL, None) is not None:
        upstream = getattr(upstream, PATCHED_ORIGINAL)
    forked = tmp_path / "forked_mtp.py"
    forked.write_text("from __future__ import annotations\n\n\n" + inspect.getsource(
        upstream).replace(PER_TOKEN_COUNTS, CP_TOKEN_COUNTS))
    spec = importlib.util.spec_from_file_location("forked_mtp", forked)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert with_cp_token_counts(module.process_mtp_loss) is module.process_mtp_loss
