"""What each MoE patch fixes, on megatron-core's own classes, in one process (no ranks).

* ``cpu-moe-router-device``: the router's weight, bias and expert-bias buffers stay on the CPU
  (upstream moves them to ``torch.cuda.current_device()``);
* ``moe-router-gating-without-te`` (0.16.1): the router's gating without Transformer Engine
  (upstream raises ``NameError: te_general_gemm``), equal to upstream's torch branch;
* ``cpu-moe-alltoall-dispatcher``: the dispatcher builds without a CUDA stream, and its split
  sizes become NumPy arrays as on a GPU (tensors are refused by ``all_to_all_single``);
* ``moe-metrics-collection-dp`` (0.19.2): the MoE metrics' average over a process-group
  collection without ``dp_cp_gtp_remat`` (Bridge's decentralized one) uses the collection's
  ``dp_cp`` instead of failing on megatron's uninitialized global group.

Bridge's training loop with all of them is ``tests/unit/bridge/test_bridge_families_moe.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_hcp.patching import apply, by_name, revert
from megatron_hcp.patching.registry import megatron_core_version

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks CPU-only behaviour")

INSTALLED = megatron_core_version()
MOE = ("cpu-moe-router-device", "moe-router-gating-without-te", "cpu-moe-alltoall-dispatcher",
       "moe-metrics-collection-dp")


class Group:
    """A process group as the MoE modules' constructors read it (size and rank)."""

    def __init__(self, size: int = 1, rank: int = 0):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


@pytest.fixture
def clean():
    revert(by_name(list(MOE)))
    yield
    revert(by_name(list(MOE)))


def _config(**fields):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1,
                             num_moe_experts=4, moe_router_topk=2, add_bias_linear=False,
                             use_cpu_initialization=True, **fields)


def _collection():
    from megatron.core.process_groups_config import ProcessGroupCollection

    return ProcessGroupCollection(tp=Group(), cp=Group(), tp_cp=Group(), tp_dp_cp=Group(),
                                  ep=Group(), expt_tp=Group(), tp_ep=Group())


def _router(**fields):
    from megatron.core.transformer.moe.router import TopKRouter

    return TopKRouter(_config(**fields), pg_collection=_collection())


def test_the_router_stays_on_the_cpu_and_routes_like_upstreams_torch_branch(clean):
    with pytest.raises((RuntimeError, AssertionError)):  # no CUDA driver / CUDA build
        _router(moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid")
    apply(by_name(["cpu-moe-router-device", "moe-router-gating-without-te"]))
    router = _router(moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid")
    assert router.expert_bias.device.type == "cpu"
    x = torch.randn(3, 2, 8, requires_grad=True)
    logits = router.gating(x)
    assert router.weight.device.type == "cpu" and logits.shape == (3, 2, 4)
    torch.testing.assert_close(logits, x @ router.weight.t(), rtol=0, atol=0)
    logits.sum().backward()
    torch.testing.assert_close(router.weight.grad, x.detach().reshape(-1, 8).sum(0).expand(4, 8))


@pytest.mark.skipif(INSTALLED != "0.16.1", reason="0.19.2 defines te_general_gemm = None")
def test_without_te_0161_gating_raises_nameerror_and_the_patch_takes_the_torch_branch(clean):
    apply(by_name(["cpu-moe-router-device"]))
    router = _router()
    with pytest.raises(NameError, match="te_general_gemm"):
        router.gating(torch.randn(2, 8))
    apply(by_name(["moe-router-gating-without-te"]))
    x = torch.randn(2, 8, dtype=torch.float64)
    out = router.gating(x.float())
    assert out.dtype == torch.float32
    router.config.moe_router_dtype = "fp64"
    assert router.gating(x.float()).dtype == torch.float64


def test_the_gating_patch_has_nothing_to_change_where_upstream_has_the_fallback():
    patch = by_name(["moe-router-gating-without-te"])[0]
    assert patch.needed("0.16.1") and not patch.needed("0.19.2")
    assert patch.status("0.19.2") == "nothing to change in this version (its code is not there)"


def test_the_alltoall_dispatcher_builds_and_its_split_sizes_are_numpy_as_on_a_gpu(clean):
    from megatron.core.transformer.moe import token_dispatcher

    def dispatcher():
        return token_dispatcher.MoEAlltoAllTokenDispatcher(
            4, [0, 1, 2, 3], _config(moe_token_dispatcher_type="alltoall"),
            pg_collection=_collection())

    token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = None
    with pytest.raises((RuntimeError, AssertionError)):  # torch.cuda.Stream() without CUDA
        dispatcher()
    splits = torch.tensor([3, 5])
    assert token_dispatcher.maybe_move_tensor_to_cpu(splits, as_numpy=True) is splits
    apply(by_name(["cpu-moe-alltoall-dispatcher"]))
    try:
        assert dispatcher().num_experts == 4
        moved = token_dispatcher.maybe_move_tensor_to_cpu(splits, as_numpy=True)
        assert isinstance(moved, np.ndarray) and moved.tolist() == [3, 5]
        splits[0] = 7  # a copy, as upstream's device-to-host copy is
        assert moved.tolist() == [3, 5]
        counts = torch.tensor([1, 2])
        assert token_dispatcher.maybe_move_tensor_to_cpu(counts) is counts  # not asked: as is
    finally:
        token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = None


@pytest.mark.skipif(INSTALLED != "0.19.2", reason="0.16.1's MoE logging reduces over "
                    "pg_collection.dp (the patch has nothing to change there)")
def test_moe_metrics_average_over_the_collections_own_group(clean):
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.moe_logging import MoEMetricsTracker

    from megatron_hcp.patching.integration import _with_dp_cp_gtp_remat

    if parallel_state.model_parallel_is_initialized():
        pytest.skip("megatron's global groups exist in this process")
    dp_cp = Group(2)
    collection = ProcessGroupCollection(pp=Group(), dp=Group(), dp_cp=dp_cp)  # Bridge's: no
    # dp_cp_gtp_remat
    with pytest.raises(AssertionError, match="data parallel group .*GTP_remat.* is not "
                       "initialized"):
        MoEMetricsTracker()._sync_metrics([], collection)
    apply(by_name(["moe-metrics-collection-dp"]))
    MoEMetricsTracker()._sync_metrics([], collection)  # no metric yet: nothing to reduce
    completed = _with_dp_cp_gtp_remat(collection)
    assert completed.dp_cp_gtp_remat is dp_cp and completed.pp is collection.pp
    assert getattr(collection, "dp_cp_gtp_remat", None) is None  # the caller's is unchanged
    full = ProcessGroupCollection(pp=Group(), dp_cp=dp_cp, dp_cp_gtp_remat=Group(4))
    assert _with_dp_cp_gtp_remat(full) is full  # a collection with the group keeps it
