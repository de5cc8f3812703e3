"""Dynamic CP at runtime on 8 gloo ranks: groups, data path and megatron training equivalence."""

from __future__ import annotations

import pytest
import torch

WORLD = 8
RTOL = 1e-5


# ---------------------------------------------------------------- groups
def dynamic_groups_case(tp: int, cp: int, min_size: int, decentralized: bool):
    """Members/sizes of this rank's dynamic groups vs the layout; what destroy leaves."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from torch.distributed import distributed_c10d as c10d

    from megatron_hcp.config import CPConfig
    from megatron_hcp.parallel_state.collection import create_pg_collection, destroy_pg_collection
    from megatron_hcp.parallel_state.dynamic import dynamic_cp_groups_of
    from megatron_hcp.parallel_state.layout import ParallelLayout, dynamic_cp_blocks
    from megatron_hcp.parallel_state.mpu import (
        destroy_model_parallel,
        dynamic_cp_groups,
        initialize_model_parallel,
    )

    before = len(c10d._world.pg_map)
    config = CPConfig(context_parallel_size=cp, tensor_model_parallel_size=tp,
                      data_parallel_size=WORLD // (tp * cp), dynamic_context_parallel=True,
                      min_dynamic_context_parallel_size=min_size, max_seqlen_per_dp_cp_rank=64)
    typed = None
    if decentralized:
        from dataclasses import fields

        pgc = create_pg_collection(config)
        groups = dynamic_cp_groups_of(pgc)
        # a typed attribute of the returned collection, not a field megatron iterates
        typed = (pgc.dynamic_cp is groups, "dynamic_cp" in {f.name for f in fields(pgc)},
                 pgc.topology == config.resolve())
    else:
        initialize_model_parallel(config, create_gloo_process_groups=False)
        groups = dynamic_cp_groups()
    rank = dist.get_rank()
    layout = ParallelLayout(world_size=WORLD, tp=tp, cp=cp, pp=1)
    mine = layout.group_of("dp_cp", rank)
    want = {size: next(b for b in blocks if rank in b)
            for size, blocks in dynamic_cp_blocks(mine, min_size).items()}
    got = {size: (None if g is None else dist.get_process_group_ranks(g))
           for size, g in groups.by_size.items()}
    table = None if decentralized else {k: (None if g is None else dist.get_process_group_ranks(g))
                                        for k, g in ps._HYBRID_DP_CP_GROUPS.items()}
    try:
        groups.group(min_size // 2) if min_size > 1 else None
        below = "accepted"
    except ValueError as err:
        below = str(err)
    if decentralized:
        destroy_pg_collection(pgc)
        typed = (*typed, pgc.dynamic_cp is None)
    else:
        destroy_model_parallel()
    after = len(c10d._world.pg_map)
    left = dict(ps._HYBRID_DP_CP_GROUPS)
    return {"want": want, "got": got, "table": table, "below": below,
            "leaked": after - before, "left": left, "dp_cp": groups.dp_cp_ranks, "typed": typed}


@pytest.mark.parametrize("tp, cp, min_size", [(1, 1, 1), (1, 2, 1), (1, 4, 2), (2, 4, 1),
                                              (2, 2, 2)])
@pytest.mark.parametrize("decentralized", [False, True])
@pytest.mark.multirank
def test_dynamic_groups_match_layout_and_leave_nothing(world, tp, cp, min_size, decentralized):
    for rank, r in enumerate(world.run(dynamic_groups_case, tp, cp, min_size, decentralized)):
        want = {size: (None if size == 1 else block) for size, block in r["want"].items()}
        assert r["got"] == want, (rank, r)
        assert min(r["got"]) == min_size
        if not decentralized:  # megatron's own table: every size but DPxCP
            n = len(r["dp_cp"])
            assert r["table"] == {k: v for k, v in want.items() if k != n}
        if min_size > 1:
            assert "min_dynamic_context_parallel_size=" in r["below"]
        assert r["leaked"] == 0 and r["left"] == {}, (rank, r)
        assert r["typed"] == ((True, False, True, True) if decentralized else None)


def dynamic_hcp_groups_case(cp: int, hcp: list[int], min_size: int, decentralized: bool):
    """This rank's dynamic hierarchical levels per size vs the pure layout function."""
    import torch.distributed as dist

    from megatron_hcp.config import CPConfig
    from megatron_hcp.parallel_state.collection import create_pg_collection, destroy_pg_collection
    from megatron_hcp.parallel_state.dynamic import dynamic_cp_groups_of
    from megatron_hcp.parallel_state.layout import (
        ParallelLayout,
        dynamic_cp_blocks,
        dynamic_hcp_levels,
    )
    from megatron_hcp.parallel_state.mpu import (
        destroy_model_parallel,
        dynamic_cp_groups,
        initialize_model_parallel,
    )

    config = CPConfig(context_parallel_size=cp, data_parallel_size=WORLD // cp,
                      cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes=hcp,
                      dynamic_context_parallel=True, min_dynamic_context_parallel_size=min_size,
                      max_seqlen_per_dp_cp_rank=64)
    if decentralized:
        pgc = create_pg_collection(config)
        groups = dynamic_cp_groups_of(pgc)
    else:
        initialize_model_parallel(config, create_gloo_process_groups=False)
        groups = dynamic_cp_groups()
    rank = dist.get_rank()
    mine = ParallelLayout(world_size=WORLD, tp=1, cp=cp, pp=1).group_of("dp_cp", rank)
    got, want = {}, {}
    for size, blocks in dynamic_cp_blocks(mine, min_size).items():
        block = next(b for b in blocks if rank in b)
        levels = dynamic_hcp_levels(block, hcp[0])
        want[size] = None if levels is None else [
            next(g for g in level if rank in g) for level in levels]
        have = groups.levels(size)
        got[size] = None if have is None else [dist.get_process_group_ranks(g) for g in have]
    if decentralized:
        destroy_pg_collection(pgc)
    else:
        destroy_model_parallel()
    return got, want


@pytest.mark.parametrize("cp, hcp, min_size, decentralized", [
    (4, [2, 2], 1, False), (8, [4, 2], 2, True), (4, [2, 2], 4, False)])
@pytest.mark.multirank
def test_dynamic_hierarchical_levels_match_the_layout(world, cp, hcp, min_size, decentralized):
    for rank, (got, want) in enumerate(world.run(dynamic_hcp_groups_case, cp, hcp, min_size,
                                                 decentralized)):
        assert got == want, (rank, got, want)
        assert any(v is not None for v in want.values())


# ---------------------------------------------------------------- training
VARLEN = dict(min_len=8, max_len=160, mean=40, sigma=1.0, samples_per_micro_batch=2)


def uneven_replicas_case(counts: list[int]):
    """DP replicas load different numbers of samples (packed rows hold different numbers of
    sequences): every rank's packed micro-batches are the packing of the plan's samples, and
    the plan places every sample of every replica once (TP2 x CP2 x DP2, dynamic CP)."""
    from megatron.core import parallel_state as ps

    from megatron_hcp.config import CPConfig
    from megatron_hcp.dynamic_cp.packing import pack_thd
    from megatron_hcp.dynamic_cp.runtime import DynamicCPDataPath
    from megatron_hcp.parallel_state.mpu import (
        destroy_model_parallel,
        dynamic_cp_groups,
        initialize_model_parallel,
    )

    def sample(i: int) -> torch.Tensor:
        n = 6 + 5 * i
        return torch.stack([torch.arange(n) + 100 * i, torch.arange(n) + 1 + 100 * i,
                            torch.ones(n, dtype=torch.int64)])

    config = CPConfig(context_parallel_size=2, tensor_model_parallel_size=2,
                      data_parallel_size=2, dynamic_context_parallel=True,
                      max_seqlen_per_dp_cp_rank=16)
    initialize_model_parallel(config, create_gloo_process_groups=False)
    try:
        groups = dynamic_cp_groups()
        path = DynamicCPDataPath(groups, dp_group=ps.get_data_parallel_group(),
                                 cp_group=ps.get_context_parallel_group(),
                                 tp_group=ps.get_tensor_model_parallel_group(),
                                 max_seqlen_per_dp_cp_rank=16, hardware=None)
        replica = ps.get_data_parallel_rank()
        first = sum(counts[:replica])
        plan, micro = path.step(range(first, first + counts[replica]), sample)
        same = []
        for mb, got in zip(plan.micro_batches, micro):
            group = next((g for g in mb.groups if groups.position in g.ranks), None)
            if group is None:
                same.append(got.loss_mask.sum().item() == 0)  # an idle rank's dummy
                continue
            want = pack_thd([sample(i) for i in group.samples], len(group.ranks),
                            groups.position - group.ranks[0])
            same.append(torch.equal(got.tokens, want.tokens)
                        and torch.equal(got.labels, want.labels))
        placed = sorted(i for mb in plan.micro_batches for g in mb.groups for i in g.samples)
        return all(same), placed
    finally:
        destroy_model_parallel()


@pytest.mark.multirank
def test_replicas_with_different_sample_counts(world):
    counts = [3, 5]
    for same, placed in world.run(uneven_replicas_case, counts):
        assert same, "a rank's packed micro-batch differs from the plan's samples"
        assert placed == list(range(sum(counts)))


def train(tp: int, cp: int, pp: int, dynamic: bool, vpp: int | None = None, *,
          decentralized: bool = False, lengths: list[int] | None = None, cap: int = 96,
          batch: int = 8, steps: int = 2, min_size: int = 1, patches: bool = True,
          extra_config: dict | None = None, hcp: list[int] | None = None):
    from megatron_hcp.config import CPConfig
    from megatron_hcp.parallel_state.collection import create_pg_collection, destroy_pg_collection
    from megatron_hcp.parallel_state.mpu import destroy_model_parallel, initialize_model_parallel
    from megatron_hcp.patching import (
        DECENTRALIZED_PATCHES,
        apply,
        apply_cpu_runtime,
        apply_dynamic_cp,
        by_name,
        revert,
    )
    from megatron_hcp.training.trainer import TinyGPTSpec, VarLen, train_tiny_gpt

    apply_cpu_runtime()
    if patches:
        apply_dynamic_cp()
    config = CPConfig(context_parallel_size=cp, tensor_model_parallel_size=tp,
                      pipeline_model_parallel_size=pp, data_parallel_size=WORLD // (tp * cp * pp),
                      dynamic_context_parallel=dynamic, min_dynamic_context_parallel_size=min_size,
                      max_seqlen_per_dp_cp_rank=cap if dynamic else None,
                      cp_comm_type="a2a+p2p" if hcp else None,
                      hierarchical_context_parallel_sizes=hcp)
    spec = TinyGPTSpec.of(
        cp_comm_type="a2a+p2p" if hcp else None, hierarchical_context_parallel_sizes=hcp,
        num_layers=4, num_attention_heads=4, num_query_groups=2, steps=steps,
        tensor_model_parallel_size=tp, context_parallel_size=cp,
        pipeline_model_parallel_size=pp, global_batch_size=batch,
        varlen=VarLen(**VARLEN, lengths=lengths), dynamic_context_parallel=dynamic,
        max_seqlen_per_dp_cp_rank=cap if dynamic else None,
        min_dynamic_context_parallel_size=min_size,
        virtual_pipeline_model_parallel_size=vpp, extra_config=extra_config or {})
    if decentralized:
        ce = by_name(list(DECENTRALIZED_PATCHES))
        apply(ce)
        pgc = create_pg_collection(config)
        try:
            return train_tiny_gpt(spec, pg_collection=pgc)
        finally:
            destroy_pg_collection(pgc)
            revert(ce)
    kwargs = {"virtual_pipeline_model_parallel_size": vpp} if vpp else {}
    initialize_model_parallel(config, create_gloo_process_groups=False, **kwargs)
    try:
        return train_tiny_gpt(spec)
    finally:
        destroy_model_parallel()


def assert_same(runs, reference, grad_rtol: float = RTOL):
    for rank, run in enumerate(runs):
        for key, rtol in (("loss", RTOL), ("grad_norm", grad_rtol)):
            got, want = torch.tensor(run[key]), torch.tensor(reference[key])
            rel = ((got - want).abs() / want.abs()).max().item()
            assert rel <= rtol, (rank, key, run[key], reference[key])


@pytest.fixture(scope="module")
def no_cp(world):
    runs = world.run(train, 1, 1, 1, False)
    assert all(r["loss"] == runs[0]["loss"] for r in runs)
    assert runs[0]["loss"][0] != runs[0]["loss"][1]  # it trains
    return runs[0]


CASES = [
    # (tp, cp, pp, vpp, decentralized)
    (1, 4, 1, None, False),   # DP2 x CP4
    (2, 4, 1, None, False),   # TP2 x CP4, DPxCP = 4
    (1, 2, 2, None, False),   # PP2, DP2 x CP2
    (1, 2, 2, 2, False),      # PP2 x VPP2
    (1, 4, 1, None, True),    # decentralized collection
]


@pytest.mark.parametrize("tp, cp, pp, vpp, decentralized", CASES)
@pytest.mark.multirank
def test_dynamic_cp_trains_like_static_cp_and_no_cp(world, no_cp, tp, cp, pp, vpp,
                                                    decentralized):
    dynamic = world.run(train, tp, cp, pp, True, vpp, decentralized=decentralized)
    assert_same(dynamic, no_cp)
    # the plan really used dynamic groups of more than one size
    sizes = {s for run in dynamic for step in run["local_cp_sizes"] for s in step}
    assert len(sizes) > 1, sizes
    if vpp is None and not decentralized:
        assert_same(world.run(train, tp, cp, pp, False), no_cp)  # static CP, same data


@pytest.mark.parametrize("tp, cp, pp, hcp, decentralized", [
    (1, 4, 1, [2, 2], False),  # DP2 x CP4: dynamic groups up to 8 = a2a 2 x p2p 4
    (1, 8, 1, [2, 4], False),  # CP8 [2, 4]
    # decentralized collection; a2a level 4 over 2 KV heads: each KV head replicated twice
    (1, 8, 1, [4, 2], True),
    (2, 4, 1, [2, 2], False),  # TP2 x DPxCP 4
    (1, 2, 2, [2, 1], False),  # PP2 x DPxCP 4
])
@pytest.mark.multirank
def test_dynamic_hierarchical_cp_trains_like_no_cp(world, tp, cp, pp, hcp, decentralized):
    """Each micro-batch runs on its own levels: a2a inside min(c, a) contiguous ranks, a ring
    across them; groups of at most ``a`` ranks are pure a2a."""
    lengths = [200, 40, 44, 36, 30, 50, 20, 24]  # 200 tokens need the whole DPxCP group
    runs = world.run(train, tp, cp, pp, True, decentralized=decentralized, hcp=hcp,
                     lengths=lengths, cap=48 if tp * pp == 1 else 64)
    assert_same(runs, world.run(train, 1, 1, 1, False, lengths=lengths)[0])
    used = {(s, tuple(lv) if lv else None) for run in runs
            for step_s, step_l in zip(run["local_cp_sizes"], run["cp_levels"])
            for s, lv in zip(step_s, step_l)}
    a = hcp[0]
    assert any(lv == (a, s // a) for s, lv in used if s and s > a), used  # hierarchical
    assert all(lv is None for s, lv in used if not s or s <= a), used  # flat at most a


@pytest.mark.multirank
def test_micro_batch_mixing_hierarchical_a2a_and_single_ranks(world):
    """One micro-batch: a 4-rank group on levels a2a 2 x p2p 2, a 2-rank pure a2a group and
    single ranks, side by side on DPxCP 8; equal to no CP."""
    lengths = [150, 80, 40, 44, 36, 30, 20, 24]  # cap 48: 150 needs 4 ranks, 80 needs 2
    runs = world.run(train, 1, 4, 1, True, hcp=[2, 2], lengths=lengths, cap=48, steps=2)
    first = [(run["local_cp_sizes"][0], run["cp_levels"][0]) for run in runs]
    mixed = [j for j in range(len(first[0][0]))
             if {(sizes[j], tuple(levels[j]) if levels[j] else None) for sizes, levels in first}
             >= {(4, (2, 2)), (2, None), (1, None)}]
    assert mixed, first
    assert_same(runs, world.run(train, 1, 1, 1, False, lengths=lengths, steps=2)[0])


@pytest.mark.multirank
def test_vpp_when_every_micro_batch_is_in_warm_up(world):
    """PP2 x VPP2 with as many micro-batches as stages: stage 0 never reaches 1F1B (upstream's
    blocking shape exchange deadlocks here)."""
    lengths = [256, 27, 34, 16, 68, 28, 52, 32]  # plan: 2 micro-batches ([4], [1, 1, 1, 1])
    runs = world.run(train, 1, 2, 2, True, 2, lengths=lengths, cap=128, steps=1)
    assert runs[0]["micro_batches"] == [2]
    assert_same(runs, world.run(train, 1, 1, 1, False, lengths=lengths, steps=1)[0])


@pytest.mark.multirank
def test_micro_batch_with_local_cp_sizes_1_and_4(world):
    """One long sequence over 4 ranks while 4 short ones run alone (local CP size 1)."""
    lengths = [200, 40, 44, 36, 30, 50, 20, 24]  # cap 96: 200 runs on 4 ranks, the rest on 1
    kwargs = dict(lengths=lengths, cap=96, steps=2)
    runs = world.run(train, 1, 8, 1, True, **kwargs)
    first = [run["local_cp_sizes"][0] for run in runs]
    mixed = [j for j in range(len(first[0])) if {r[j] for r in first} >= {1, 4}]
    assert mixed, first
    want = world.run(train, 1, 1, 1, False, lengths=lengths)[0]
    assert_same(runs, want)


@pytest.mark.multirank
def test_multi_token_prediction_follows_the_dynamic_group(world):
    """An MTP layer rolls tokens and labels across CP ranks: over the micro-batch's group.

    Lengths are multiples of 16 so that no sequence is padded: upstream's packed roll
    (``_roll_tensor_packed_seq``) cuts by ``cu_seqlens_q`` and ignores the padding, so padded
    sequences differ from no-CP already with static CP (measured 2026-11-22 at 87da1c5 on a 2-core
    x86_64 CPU VM; not patched here).

    megatron-core 0.19's ``process_mtp_loss`` weights the MTP loss by each rank's own
    ``original_num_tokens / num_tokens`` (local counts) under per-token loss, so the MTP part of the
    gradient of any CP run differed slightly from no-CP there (measured on these inputs, 2026-11-22
    at 0b91e1d on a 2-core x86_64 CPU VM: static CP4 1.7e-4, this dynamic run 1.7e-5 relative grad
    norm); ``mtp-dynamic-cp-group`` counts them over the micro-batch's CP group, and this run keeps
    1e-5 in both (a roll over a wrong group, or no roll, changes the labels and is far outside it;
    without the patch 0.19 deadlocks).
    """
    mtp = {"mtp_num_layers": 1}
    lengths = [32, 48, 16, 176, 32, 48, 16, 64]
    want = world.run(train, 1, 1, 1, False, extra_config=mtp, lengths=lengths)[0]
    plain = world.run(train, 1, 1, 1, False, lengths=lengths)[0]
    assert want["loss"] != plain["loss"]  # MTP changes the loss
    for hcp in (None, [2, 2]):  # flat dynamic groups, then each on its a2a x p2p levels
        runs = world.run(train, 1, 4, 1, True, extra_config=mtp, lengths=lengths, hcp=hcp,
                         cap=48 if hcp else 96)
        assert len({s for run in runs for step in run["local_cp_sizes"] for s in step}) > 1
        if hcp:
            assert any(lv for run in runs for step in run["cp_levels"] for lv in step)
        assert_same(runs, want)


@pytest.mark.multirank
def test_dynamic_cp_without_its_patches_is_refused(world):
    err = world.run(refused_without_patches)
    assert all("attention-dynamic-cp-rope" in e for e in err), err


def refused_without_patches():
    from megatron_hcp.patching import DYNAMIC_CP_PATCHES, by_name, revert

    revert(by_name(list(DYNAMIC_CP_PATCHES)))
    try:
        train(1, 4, 1, True, steps=1, patches=False)
    except Exception as err:  # noqa: BLE001 - the message is the result
        return str(err)
    return "accepted"


def test_dynamic_groups_are_typed_on_the_returned_collection_only():
    """megatron's own ProcessGroupCollection gets no attribute set; megatron-hcp's collection
    carries ``dynamic_cp`` and ``topology`` outside the dataclass fields megatron iterates."""
    from dataclasses import fields

    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_hcp.config import CPConfig
    from megatron_hcp.parallel_state.dynamic import DynamicCPGroups, dynamic_cp_groups_of
    from megatron_hcp.parallel_state.pg_collection import (
        HCPProcessGroupCollection,
        attach_dynamic_cp_groups,
    )

    plain = ProcessGroupCollection(tp=None, cp=None)
    groups = DynamicCPGroups([0, 1], {1: None, 2: None})
    with pytest.raises(TypeError, match="HCPProcessGroupCollection.of"):
        attach_dynamic_cp_groups(plain, groups)
    assert dynamic_cp_groups_of(plain) is None and "dynamic_cp" not in vars(plain)
    topology = CPConfig(context_parallel_size=2).resolve()
    ours = HCPProcessGroupCollection.of(plain, dynamic_cp=groups, topology=topology)
    assert isinstance(ours, ProcessGroupCollection) and ours.topology is topology
    assert dynamic_cp_groups_of(ours) is groups and "dynamic_cp(sizes [1, 2])" in repr(ours)
    assert {f.name for f in fields(ours)} == {f.name for f in fields(ProcessGroupCollection)}
    assert {k: v for k, v in vars(ours).items() if k in ("tp", "cp")} == {"tp": None, "cp": None}
    attach_dynamic_cp_groups(ours, None)  # the old name still clears it
    assert dynamic_cp_groups_of(ours) is None
