"""Runtime patches: version gate, atomic apply, exact revert, and what each CPU patch fixes."""

from __future__ import annotations

import pytest
import torch

from megatron_hcp.cli import main as cli_main
from megatron_hcp.patching import (
    ALL_PATCHES,
    CPU_RUNTIME_PATCHES,
    Patch,
    PatchError,
    apply,
    by_name,
    is_applied,
    revert,
)
from megatron_hcp.patching.registry import Target, _raw, megatron_core_version

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks CPU-only behaviour")

INSTALLED = megatron_core_version()
HERE = [p for p in ALL_PATCHES if p.needed() and not p.missing_requirement()]
FIXED_HERE = {p.name for p in ALL_PATCHES if p.fixed_upstream()}
# written for this release, but what they change is not in it (megatron/training from 0.19)
ABSENT_HERE = {p.name for p in ALL_PATCHES if p.supports() and not p.targets_for()}
# not written for this release (the releases a patch names are the only ones it applies to)
NOT_WRITTEN_HERE = {p.name for p in ALL_PATCHES if not p.supports() and not p.fixed_upstream()}


@pytest.fixture
def clean():
    revert(ALL_PATCHES)
    yield
    revert(ALL_PATCHES)


def snapshot(patches):
    out = []
    for patch in patches:
        for target in patch.targets_for():
            owner, attr = target.owner_and_attr()
            out.append(_raw(owner, attr))
    return out


def test_every_patch_applies_and_reverts_to_the_identical_original(clean):
    assert {p.name for p in ALL_PATCHES} - {p.name for p in HERE} == {
        "te-attention-hcp", "mamba-dynamic-cp-group", *FIXED_HERE,  # TE / triton + mamba_ssm
        *ABSENT_HERE, *NOT_WRITTEN_HERE}
    assert ABSENT_HERE == ({"moe-router-gating-without-te"} if INSTALLED == "0.19.2"
                           else {"cpu-ddp-wrap", "moe-metrics-collection-dp"})
    assert NOT_WRITTEN_HERE == (set() if INSTALLED == "0.19.2" else {"mtp-collection-groups"})
    # the MLA family's patches (megatron_hcp.patching.mla) are named patches like the others
    assert {"cpu-yarn-rope-device", "mla-tp-group"} <= {p.name for p in HERE}
    assert ("mtp-collection-groups" in {p.name for p in HERE}) == (INSTALLED == "0.19.2")
    assert FIXED_HERE == ({"cross-entropy-model-tp-group", "pg-collection-repr",
                           "chained-optimizer-count-zeros-tp-group", "mla-without-te"}
                          if INSTALLED == "0.19.2" else set())
    before = snapshot(HERE)
    assert apply(HERE) == [p.name for p in HERE]
    assert all(is_applied(p) for p in HERE)
    assert apply(HERE) == []  # idempotent
    assert snapshot(HERE) != before
    assert revert(HERE) == [p.name for p in reversed(HERE)]
    after = snapshot(HERE)
    assert all(a is b for a, b in zip(before, after))
    assert not any(is_applied(p) for p in HERE)


@pytest.mark.skipif(bool(by_name(["te-attention-hcp"])[0].missing_requirement() is None),
                    reason="Transformer Engine is installed")
def test_te_patch_refused_clearly_without_te(clean):
    with pytest.raises(PatchError, match="needs Transformer Engine, which is not installed"):
        apply(by_name(["te-attention-hcp"]))


@pytest.mark.parametrize("patch", ALL_PATCHES, ids=lambda p: p.name)
def test_refused_on_other_versions_without_changing_anything(clean, patch):
    written = f"written for megatron-core {', '.join(patch.versions)}, not 0.17.1"
    if patch.fixed_upstream("0.17.1"):  # fixed by then (mla-without-te): skipped, not refused
        before = snapshot([patch])
        assert apply([patch], version="0.17.1") == []
        assert all(a is b for a, b in zip(before, snapshot([patch])))
        return
    if patch.missing_requirement() or not patch.needed():  # the version gate comes first
        with pytest.raises(PatchError, match=written):
            apply([patch], version="0.17.1")
        return
    before = snapshot([patch])
    with pytest.raises(PatchError, match=written):
        apply([patch], version="0.17.1")
    assert all(a is b for a, b in zip(before, snapshot([patch])))
    assert patch.upstream and patch.summary


@pytest.mark.parametrize("patch", [p for p in ALL_PATCHES if p.fixed_in], ids=lambda p: p.name)
def test_fixed_upstream_is_skipped_and_says_so(clean, patch):
    assert patch.status(patch.fixed_in) == f"fixed upstream in {patch.fixed_in}"
    assert patch.status("0.19.2") == f"fixed upstream in {patch.fixed_in}"
    assert patch.status("0.16.1") == "written for this version"
    assert not patch.needed("0.19.2") and patch.needed("0.16.1")
    if INSTALLED == "0.19.2":
        before = snapshot([patch])
        assert apply([patch]) == []  # nothing to do: upstream has the fix
        assert all(a is b for a, b in zip(before, snapshot([patch])))


def test_versions_that_are_no_versions_are_refused(clean):
    with pytest.raises(PatchError, match="'banana9' is not a release version"):
        apply(HERE[:1], version="banana9")


def test_apply_is_all_or_nothing(clean):
    broken = Patch("broken", "missing target", "nowhere", (INSTALLED,),
                   (Target("megatron.core.utils", "does_not_exist", lambda o: o),))
    before = snapshot(CPU_RUNTIME_PATCHES)
    with pytest.raises(PatchError, match="does_not_exist does not exist"):
        apply([*CPU_RUNTIME_PATCHES, broken])
    assert all(a is b for a, b in zip(before, snapshot(CPU_RUNTIME_PATCHES)))


def test_unknown_patch_name():
    with pytest.raises(PatchError, match="unknown patch"):
        by_name(["nope"])


def test_causal_mask_needs_the_patch(clean):
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils

    with pytest.raises((AssertionError, RuntimeError)):
        utils.get_default_causal_mask(4)
    apply(by_name(["cpu-attention-masks"]))
    mask = fused_softmax.get_default_causal_mask(4)  # imported by value there
    assert mask.device.type == "cpu" and mask.tolist()[0] == [False, True, True, True]


def test_global_memory_buffer_on_cpu(clean):
    from megatron.core.utils import GlobalMemoryBuffer

    with pytest.raises((AssertionError, RuntimeError)):
        GlobalMemoryBuffer().get_tensor((2, 3), torch.float32, "x")
    apply(by_name(["cpu-global-memory-buffer"]))
    t = GlobalMemoryBuffer().get_tensor((2, 3), torch.float32, "x")
    assert t.shape == (2, 3) and t.device.type == "cpu"


class FakeGroup:
    def __init__(self, size, rank):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


def test_rope_cp_slicing_on_cpu_matches_load_balanced_chunks(clean):
    from megatron.core.models.common.embeddings import rope_utils, rotary_pos_embedding

    emb = torch.arange(16.0).view(16, 1, 1, 1)
    with pytest.raises(RuntimeError):
        rope_utils.get_pos_emb_on_this_cp_rank(emb, 0, FakeGroup(4, 1))
    apply(by_name(["cpu-rope-cp-index"]))
    for fn in (rope_utils.get_pos_emb_on_this_cp_rank,
               rotary_pos_embedding.get_pos_emb_on_this_cp_rank):
        out = fn(emb, 0, FakeGroup(4, 1))
        assert out.view(-1).tolist() == [2.0, 3.0, 12.0, 13.0]


def test_rng_tracker_forks_cpu_streams(clean):
    from megatron.core.tensor_parallel import random as mrandom

    apply(by_name(["cpu-rng-tracker"]))
    mrandom.initialize_rng_tracker(force_reset=True)
    tracker = mrandom.get_cuda_rng_tracker()
    torch.manual_seed(0)
    tracker.add("model-parallel-rng", 123)
    outside = torch.get_rng_state()
    with tracker.fork():
        a = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), outside)  # default stream restored
    with tracker.fork():
        b = torch.rand(3)
    assert not torch.equal(a, b)  # the forked stream advanced
    mrandom.initialize_rng_tracker(force_reset=True)


def test_pg_collection_repr_with_hcp_list(clean):
    from megatron.core.process_groups_config import ProcessGroupCollection

    pgc = ProcessGroupCollection(cp=FakeGroup(4, 0), hcp=[FakeGroup(2, 0), FakeGroup(2, 0)])
    if by_name(["pg-collection-repr"])[0].needed():
        with pytest.raises(AttributeError):
            repr(pgc)
    apply(by_name(["pg-collection-repr"]))  # a no-op where upstream fixed it (0.18.0+)
    assert "cp(4)" in repr(pgc) and "hcp([2, 2])" in repr(pgc)


def test_cli_patch_list(clean, capsys):
    apply(by_name(["pg-collection-repr"]))
    assert cli_main(["patch", "list", "-v"]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.strip().startswith("pg-collection-repr"))
    assert out.splitlines()[0] == f"megatron-core {INSTALLED}"
    if INSTALLED == "0.16.1":
        assert line.split()[3:5] == ["yes", "yes"]  # needed, applied
    else:
        assert line.split()[3:5] == ["no", "n/a"]
        assert f"megatron-core {INSTALLED}: fixed upstream in 0.18.0" in out
    assert "upstream: megatron/core/process_groups_config.py" in out
    assert all(p.name in out for p in ALL_PATCHES)
    mla = {ln.split()[0]: ln.split()[1:5] for ln in out.splitlines()
           if ln.strip().startswith(("cpu-yarn-rope-device", "mtp-collection-groups",
                                     "mla-tp-group"))}
    assert mla == {
        "cpu-yarn-rope-device": ["cpu-runtime", "0.16.1,0.19.2", "yes", "no"],
        "mtp-collection-groups": ["integration", "0.19.2",
                                  *(["yes", "no"] if INSTALLED == "0.19.2" else ["no", "n/a"])],
        "mla-tp-group": ["integration", "0.16.1,0.19.2", "yes", "no"]}
    # the Megatron-Bridge hook's patches are listed with their own package's releases
    from megatron_hcp.bridge.hook import BRIDGE_PATCHES

    bridge = out[out.index("\nmegatron-bridge "):]
    assert all(p.name in bridge for p in BRIDGE_PATCHES)
    assert "written for megatron-bridge 0.4.0, 0.4.1, 0.4.2, 0.5.0, 0.5.1, 0.6.0, 0.6.2" in bridge


def test_mamba_context_for_a_dynamic_group_is_built_with_this_versions_arguments():
    """mamba-dynamic-cp-group builds one MambaContextParallel per dynamic group from the static
    one; its constructor changed between releases (0.16.1 ``conv1d_cp1``; 0.19.2
    ``conv1d_weight_cp1``, ``conv1d_bias_cp1``, ``conv1d_padding``). The mixer itself needs
    CUDA kernels (not run here); the per-group construction runs on the real class."""
    import inspect

    from megatron.core.ssm.mamba_context_parallel import MambaContextParallel

    from megatron_hcp.patching.integration import NoCPGroup, mamba_cp_for_group

    names = [n for n in inspect.signature(MambaContextParallel.__init__).parameters
             if n not in ("self", "cp_group")]
    values = {n: torch.zeros(1) for n in names}
    values.update(d_inner_local_tp=8, nheads_local_tp=4, ngroups_local_tp=1, d_state=4,
                  D_has_hdim=False)
    if "conv1d_padding" in values:
        values["conv1d_padding"] = 3
    static = MambaContextParallel(cp_group=NoCPGroup(), **values)
    other = mamba_cp_for_group(static, None)
    assert type(other) is MambaContextParallel and other is not static
    assert all(getattr(other, n) is getattr(static, n) for n in names)
    assert other.cp_group.size() == 1 and other.nheads_local_tpcp == 4
