"""Decentralized process groups (HyperCommGrid) with hcp filled in equal the MPU path."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist

WORLD = 8
# fields whose rank order matters (positions in the group); every other field is compared as a
# set of members. Every field the installed ProcessGroupCollection declares is compared.
FIELDS_ORDERED = {"tp", "cp", "pp", "dp", "ep", "expt_tp", "expt_dp", "gtp_remat",
                  "expt_gtp_remat"}


def _config(tp, cp, pp, hcp, world=WORLD):
    from megatron_hcp.config import CPConfig

    return CPConfig(
        tensor_model_parallel_size=tp, context_parallel_size=cp, pipeline_model_parallel_size=pp,
        data_parallel_size=world // (tp * cp * pp),
        cp_comm_type="a2a+p2p" if hcp else "p2p", hierarchical_context_parallel_sizes=hcp,
    )


def _members(group):
    return dist.get_process_group_ranks(group) if group is not None else None


def _hooked_collection(tp, cp, pp, hcp, save_grid=False):
    """Through megatron_hcp's hook around Bridge's _create_pg_collection (the installed Bridge
    on the Python 3.12 leg, the stand-in on 3.11: see _bridge.py)."""
    from types import SimpleNamespace

    from megatron_hcp.bridge.hook import install

    from ..bridge import _bridge

    mods = _bridge.load()
    install()
    cfg = SimpleNamespace(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp,
        cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes=hcp,
        expert_model_parallel_size=1, expert_tensor_parallel_size=None)
    try:
        pgc = mods["initialize"]._create_pg_collection(cfg, 1, save_grid=save_grid)
        return (pgc, getattr(cfg, "grid", None)) if save_grid else pgc
    finally:
        _bridge.release()


def compare_with_mpu(tp, cp, pp, hcp, via_bridge_hook=False):
    from megatron.core import parallel_state as ps

    from megatron_hcp.parallel_state.collection import create_pg_collection, destroy_pg_collection
    from megatron_hcp.parallel_state.mpu import (
        destroy_model_parallel,
        initialize_model_parallel,
        mpu_groups_by_field,
    )
    from megatron_hcp.patching import apply, by_name

    apply(by_name(["pg-collection-repr"]))  # upstream __repr__ raises on the hcp list
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    log = logging.getLogger("megatron_hcp")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        ours = (_hooked_collection(tp, cp, pp, hcp) if via_bridge_hook
                else create_pg_collection(_config(tp, cp, pp, hcp)))
    finally:
        log.removeHandler(handler)
    initialize_model_parallel(_config(tp, cp, pp, hcp), create_gloo_process_groups=False)
    try:
        mpu = mpu_groups_by_field()
        diffs = []
        assert len(mpu) >= 20, sorted(mpu)  # 0.16.1 declares 20 fields, 0.19.2 27
        for name in sorted(set(mpu) - {"hcp"}):
            a, b = _members(getattr(ours, name)), _members(mpu[name])
            if name not in FIELDS_ORDERED and a is not None and b is not None:
                a, b = sorted(a), sorted(b)
            if a != b:
                diffs.append((name, a, b))
        if hcp:
            theirs = ps.get_hierarchical_context_parallel_groups()
            for level in range(2):
                a, b = _members(ours.hcp[level]), _members(theirs[level])
                if a != b:
                    diffs.append((f"hcp{level}", a, b))
                x = torch.tensor([dist.get_rank()])
                dist.all_reduce(x, group=ours.hcp[level])
                if int(x) != sum(b):
                    diffs.append((f"hcp{level} all_reduce", int(x), sum(b)))
        else:
            assert ours.hcp is None
        return diffs, records, repr(ours)
    finally:
        destroy_model_parallel()
        destroy_pg_collection(ours)


CASES = [
    (2, 4, 1, [2, 2]),
    (1, 8, 1, [4, 2]),
    (1, 8, 1, [2, 4]),
    (1, 4, 1, [2, 2]),  # DP2
    (1, 4, 2, [2, 2]),  # PP2
    (2, 2, 2, None),  # flat CP: hcp stays None
]


@pytest.mark.parametrize("tp, cp, pp, hcp", CASES)
@pytest.mark.multirank
def test_every_field_equals_the_mpu_path(world, tp, cp, pp, hcp):
    results = world.run(compare_with_mpu, tp, cp, pp, hcp)
    for rank, (diffs, _, _) in enumerate(results):
        assert not diffs, (rank, diffs)
    lines = results[0][1]
    assert any(line.startswith("CONTEXT_PARALLEL_GROUP created") for line in lines)
    assert any(line.startswith("HIERARCHICAL_CONTEXT_PARALLEL_GROUPS created") for line in lines) \
        == bool(hcp)
    assert all(not r[1] for r in results[1:])  # logged on the grid's first rank only
    assert ("hcp([" in results[0][2]) == bool(hcp)


@pytest.mark.parametrize("tp, cp, pp, hcp", [c for c in CASES if c[3]])
@pytest.mark.multirank
def test_bridge_hook_collection_equals_the_mpu_path(world, tp, cp, pp, hcp):
    """Bridge's _create_pg_collection, hooked, returns the same groups as the MPU path."""
    results = world.run(compare_with_mpu, tp, cp, pp, hcp, True)
    for rank, (diffs, _, _) in enumerate(results):
        assert not diffs, (rank, diffs)
    assert any(line.startswith("HIERARCHICAL_CONTEXT_PARALLEL_GROUPS created")
               for line in results[0][1])


def _provider(mods, pgc, monkeypatch_like):
    """Bridge's GPTModelProvider for TP2 x CP4 a2a+p2p [2, 2] whose model is two TE attention
    modules (recording stand-ins: TE cannot run here)."""
    import torch.nn as nn

    from ..bridge import _bridge
    from ..bridge import _bridge_standin as standin

    def build():
        return nn.Sequential(_bridge.RecordingTEAttention(1), _bridge.RecordingTEAttention(2))

    if not _bridge.REAL:
        return standin.GPTModelProvider(cp_comm_type="a2a+p2p", context_parallel_size=4,
                                        _pg_collection=pgc, build=build)
    from megatron.core.transformer import ModuleSpec

    from megatron_hcp.patching.cpu_runtime import CpuDeviceTorch

    gp = mods["gpt_provider"]
    # the TE full-layer model cannot be built without CUDA: the model class returns the two
    # recording modules; Bridge's provide (config, flags, its rebinding loop) runs as shipped,
    # with a CPU view of torch (torch.cuda.Stream() has no device here)
    monkeypatch_like(gp, "MCoreGPTModel", lambda *args, **kwargs: build())
    monkeypatch_like(gp, "torch", CpuDeviceTorch(gp.torch))
    provider = gp.GPTModelProvider(
        num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=4,
        tensor_model_parallel_size=2, context_parallel_size=4, cp_comm_type="a2a+p2p",
        hierarchical_context_parallel_sizes=[2, 2], vocab_size=128, seq_length=64,
        use_transformer_engine_full_layer_spec=True,
        transformer_layer_spec=ModuleSpec(module=nn.Identity))
    provider._pg_collection = pgc
    return provider


def hooked_save_grid():
    """save_grid=True with HCP through the hook: the one grid (with its hcp view) on the config
    where megatron-core has grid views; a named refusal where it does not."""
    from megatron_hcp.config import CPConfigError
    from megatron_hcp.parallel_state.collection import destroy_pg_collection, grid_views_available

    try:
        pgc, grid = _hooked_collection(2, 4, 1, [2, 2], save_grid=True)
    except CPConfigError as err:
        return {"views": grid_views_available(), "error": str(err)}
    try:
        return {"views": grid_views_available(), "grid": type(grid).__name__,
                "hcp": [_members(g) for g in pgc.hcp],
                "view": [grid.get_rank_enum([d], view="hcp") for d in ("a2a", "p2p")]}
    finally:
        destroy_pg_collection(pgc)


@pytest.mark.multirank
def test_save_grid_with_hcp(world):
    from megatron_hcp.parallel_state.layout import ParallelLayout

    layout = ParallelLayout(world_size=WORLD, tp=2, cp=4, pp=1, hierarchical_sizes=(2, 2))
    for rank, r in enumerate(world.run(hooked_save_grid)):
        if not r["views"]:  # megatron-core 0.16
            assert "save_grid" in r["error"] and "register_view" in r["error"], r
            continue
        assert r["grid"] == "HyperCommGrid"
        assert [sorted(v) for v in r["view"]] == [sorted(level) for level in layout.hcp]
        assert r["hcp"] == layout.hcp_of(rank), rank


def bridge_rebinding():
    """Bridge's provide / install_pg_collection hand TE the flat group; the hook restores hcp."""
    from megatron_hcp.bridge.hook import install, uninstall
    from megatron_hcp.parallel_state.collection import destroy_pg_collection

    from ..bridge import _bridge

    pgc = _hooked_collection(2, 4, 1, [2, 2])
    want = ([_members(g) for g in pgc.hcp], _members(pgc.cp), "a2a+p2p")

    def seen(model):
        out = []
        for m in model.modules():
            if isinstance(m, _bridge.RecordingTEAttention):
                group, ranks, comm = m.calls[-1]
                members = ([_members(g) for g in group] if isinstance(group, list)
                           else _members(group))
                out.append((members, ranks, comm))
        return out

    mods = _bridge.load()
    undo = []

    def monkeypatch_like(owner, name, value):
        undo.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    if _bridge.REAL:  # megatron's TE attention class, which Bridge isinstance-checks (no TE)
        from megatron.core.extensions import transformer_engine as te_ext

        monkeypatch_like(te_ext, "TEDotProductAttention", _bridge.RecordingTEAttention)
    try:
        provider = _provider(mods, pgc, monkeypatch_like)
        plain = seen(provider.provide())  # Bridge alone: flat group, TE's default comm type
        install()
        model = provider.provide()
        hooked = seen(model)
        mods["eval_context_parallel_rebinding"].install_pg_collection(model, pgc)
        rebound = seen(model)
        uninstall()
        mods["eval_context_parallel_rebinding"].install_pg_collection(model, pgc)
        rebound_plain = seen(model)
    finally:
        for owner, name, value in reversed(undo):
            setattr(owner, name, value)
        _bridge.release()
        destroy_pg_collection(pgc)
    return want, plain, hooked, rebound, rebound_plain


@pytest.mark.multirank
def test_bridge_hook_gives_te_the_hierarchical_groups_back(world):
    for want, plain, hooked, rebound, rebound_plain in world.run(bridge_rebinding):
        flat = (want[1], want[1], "p2p")
        assert plain == [flat, flat]
        assert hooked == [want, want]
        assert rebound == [want, want]
        assert rebound_plain == [(want[1], want[1], "a2a+p2p")] * 2  # flat group: wrong for TE


def two_grids():
    """Two 4-rank grids over one 8-rank world (rank_offset 0 and 4)."""
    from megatron_hcp.parallel_state.collection import create_pg_collection, destroy_pg_collection
    from megatron_hcp.parallel_state.layout import ParallelLayout

    built = []
    for offset in (0, 4):
        pgc = create_pg_collection(_config(1, 4, 1, [2, 2], world=4), world_size=4,
                                   rank_offset=offset)
        built.append(pgc)
        if offset <= dist.get_rank() < offset + 4:
            mine = (pgc, offset)
    pgc, offset = mine
    layout = ParallelLayout(world_size=4, cp=4, hierarchical_sizes=(2, 2), rank_offset=offset)
    rank = dist.get_rank()
    x = torch.tensor([rank])
    dist.all_reduce(x, group=pgc.hcp[1])  # the groups work, not only their member lists
    ok = ([_members(g) for g in pgc.hcp] == layout.hcp_of(rank)
          and _members(pgc.cp) == layout.group_of("cp", rank)
          and int(x) == sum(layout.hcp_of(rank)[1]))
    for collection in built:
        destroy_pg_collection(collection)
    return ok


@pytest.mark.multirank
def test_rank_offsets_several_grids_one_world(world):
    assert world.run(two_grids) == [True] * WORLD


def train(path, cp, hcp):
    from megatron.core import parallel_state as ps

    from megatron_hcp.parallel_state.collection import create_pg_collection, destroy_pg_collection
    from megatron_hcp.parallel_state.mpu import destroy_model_parallel, initialize_model_parallel
    from megatron_hcp.patching import DECENTRALIZED_PATCHES, apply, apply_cpu_runtime, by_name
    from megatron_hcp.training.trainer import TinyGPTSpec, train_tiny_gpt

    apply_cpu_runtime()
    # 0.16.1's unfused LM loss and ChainedOptimizer.count_zeros read the MPU TP group; the
    # decentralized path needs these patches
    apply(by_name(list(DECENTRALIZED_PATCHES)))
    spec = TinyGPTSpec.of(context_parallel_size=cp, cp_comm_type="a2a+p2p" if hcp else "p2p",
                       hierarchical_context_parallel_sizes=hcp, micro_batch_size=1,
                       num_query_groups=2)
    config = _config(1, cp, 1, hcp)
    if path == "decentralized":
        pgc = create_pg_collection(config)
        assert not ps.model_parallel_is_initialized()  # no MPU globals at all
        try:
            return train_tiny_gpt(spec, pg_collection=pgc)
        finally:
            destroy_pg_collection(pgc)
    initialize_model_parallel(config, create_gloo_process_groups=False)
    try:
        return train_tiny_gpt(spec)
    finally:
        destroy_model_parallel()


@pytest.mark.multirank
def test_decentralized_a2a_p2p_trains_like_mpu_and_cp1(world):
    runs = {
        "decentralized": world.run(train, "decentralized", 4, [2, 2]),
        "mpu": world.run(train, "mpu", 4, [2, 2]),
        "cp1": world.run(train, "mpu", 1, None),
    }
    want = runs["cp1"][0]
    assert want["loss"][0] != want["loss"][-1]
    for name, per_rank in runs.items():
        for run in per_rank:
            for key in ("loss", "grad_norm"):
                got, ref = torch.tensor(run[key]), torch.tensor(want[key])
                assert ((got - ref).abs() / ref.abs()).max() <= 1e-5, (name, key, run, want)


def disagreeing_layout():
    from megatron_hcp.parallel_state.collection import LayoutDisagreementError, _check

    try:
        _check("cp", [[0, 2, 1, 3]], [[0, 1, 2, 3]], ordered=True)
    except LayoutDisagreementError as err:
        return str(err)


def test_disagreement_is_an_error():
    assert "differs from the MPU layout" in disagreeing_layout()


def cross_entropy_equals_megatron():
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy as theirs

    from megatron_hcp.parallel_state.mpu import destroy_model_parallel, initialize_model_parallel
    from megatron_hcp.patching.cross_entropy import vocab_parallel_cross_entropy as ours

    initialize_model_parallel(_config(2, 1, 1, None), create_gloo_process_groups=False)
    try:
        tp = ps.get_tensor_model_parallel_group()
        gen = torch.Generator().manual_seed(5)
        full = torch.randn(6, 2, 16, generator=gen, dtype=torch.float64).float()
        target = torch.randint(0, 16, (6, 2), generator=gen)
        local = full.chunk(2, dim=-1)[tp.rank()]
        a, b = local.clone().requires_grad_(), local.clone().requires_grad_()
        la, lb = ours(a, target, tp), theirs(b, target)
        grad = torch.rand(6, 2, generator=gen)
        la.backward(grad)
        lb.backward(grad)
        return (la - lb).abs().max().item(), (a.grad - b.grad).abs().max().item()
    finally:
        destroy_model_parallel()


@pytest.mark.multirank
def test_cross_entropy_equals_megatron(world):
    for loss_err, grad_err in world.run(cross_entropy_equals_megatron):
        assert loss_err < 1e-6 and grad_err < 1e-6


def thread_count_over_cycles():
    import os

    from megatron_hcp.parallel_state.collection import create_pg_collection, destroy_pg_collection
    from megatron_hcp.parallel_state.mpu import destroy_model_parallel, initialize_model_parallel

    def threads():
        with open(f"/proc/{os.getpid()}/status") as status:
            return int(next(ln for ln in status if ln.startswith("Threads")).split()[1])

    counts = []
    for _ in range(3):
        destroy_pg_collection(create_pg_collection(_config(2, 4, 1, [2, 2])))
        initialize_model_parallel(_config(2, 4, 1, [2, 2]), create_gloo_process_groups=True)
        destroy_model_parallel()
        counts.append(threads())
    return counts


@pytest.mark.multirank
def test_destroy_frees_process_groups(world):
    # gloo keeps threads per group: without destroying them every cycle adds ~100 threads
    for counts in world.run(thread_count_over_cycles):
        assert counts[-1] - counts[0] <= 4, counts
