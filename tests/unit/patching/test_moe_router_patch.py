"""``moe-router-dynamic-cp-group``: a MoE router's load-balancing and z-losses of a dynamic-CP
micro-batch over the micro-batch's own group, checked on megatron's own ``TransformerLayer``
(its local MoE spec) against one rank holding the whole micro-batch; its rules on megatron's
``TransformerConfig`` (which router work reduces over the router's TP x CP group, what dynamic CP
refuses of it). Through Bridge's loop: test_bridge_family_dynamic_cp.py."""

from __future__ import annotations

import types

import pytest

from megatron_hcp.patching import by_name
from megatron_hcp.patching.moe_router import dynamic_cp_router_problems, router_group_uses

WORLD = 4


def router_per_micro_batch(patched: bool | None) -> dict:
    """One rank of 4: a MoE layer (megatron's TransformerLayer, its local MoE spec: router with
    aux and z-losses, all-gather dispatcher, no attention) runs micro-batch A split over ranks
    {0, 1} and B over {2, 3} as dynamic-CP micro-batches within one static TP x CP group of all
    4; the reference runs the rank's whole micro-batch alone. Returns the largest relative
    deviation of the router weight's gradient (summed over the micro-batch's ranks) and of the
    logged load-balancing and z-losses, and whether the tracker reduces over the static group
    again after the forward."""
    import torch
    import torch.distributed as dist
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import (
        TransformerLayer,
        TransformerLayerSubmodules,
    )

    from megatron_hcp.patching import apply, apply_cpu_runtime, by_name, revert

    patch = by_name(["moe-router-dynamic-cp-group"]) if patched is not None else []
    if patched is not None:  # None: megatron as imported (a patched fork), nothing applied
        apply_cpu_runtime(training=True)
        (apply if patched else revert)(patch)
    rank = dist.get_rank()
    world = dist.new_group([0, 1, 2, 3])
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pair = pairs[rank // 2]
    one = dist.new_group([rank], use_local_synchronization=True)
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1,
                               num_moe_experts=4, moe_router_topk=2, moe_aux_loss_coeff=0.1,
                               moe_z_loss_coeff=0.1, moe_token_dispatcher_type="allgather",
                               add_bias_linear=False, use_cpu_initialization=True,
                               context_parallel_size=4, hidden_dropout=0.0,
                               attention_dropout=0.0)
    mlp = get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False).submodules.mlp

    def layer(cp):
        groups = ProcessGroupCollection(tp=one, cp=cp, tp_cp=cp, tp_dp_cp=cp, dp=one, pp=one,
                                        ep=one, expt_tp=one, tp_ep=one, expt_dp=one)
        return TransformerLayer(config, TransformerLayerSubmodules(
            mlp=mlp, mlp_bda=get_bias_dropout_add), layer_number=1, pg_collection=groups)

    torch.manual_seed(0)
    split, whole = layer(world), layer(one)
    whole.load_state_dict(split.state_dict())
    data = torch.Generator().manual_seed(100 + rank // 2)  # micro-batch A or B
    x = torch.randn(8, 1, 8, generator=data)
    weight = torch.randn(8, 1, 8, generator=data)
    part = slice(4 * (rank % 2), 4 * (rank % 2) + 4)

    def run(module, tokens, weights, params):
        _clear_tracker()
        out, _ = module(hidden_states=tokens, attention_mask=None, packed_seq_params=params)
        (out * weights).sum().backward()
        return module.mlp.router.weight.grad.clone(), _tracked()

    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=torch.tensor([0, 8]),
                             cu_seqlens_kv=torch.tensor([0, 8]), local_cp_size=2,
                             cp_group=pair)
    grad, metrics = run(split, x[part].clone(), weight[part], params)
    dist.all_reduce(grad, group=pair)
    for name, (value, _) in metrics.items():  # the z-loss is logged per rank as a mean
        dist.all_reduce(value, group=pair, op=dist.ReduceOp.AVG if "z_loss" in name
                        else dist.ReduceOp.SUM)
    ref_grad, ref_metrics = run(whole, x.clone(), weight, None)
    revert(patch)
    out = {"grad": _relative(grad, ref_grad),
           "reduce_groups": sorted({"static" if group is world else
                                    "pair" if group is pair else str(group)
                                    for _, group in metrics.values()})}
    out.update({name: _relative(value, ref_metrics[name][0])
                for name, (value, _) in metrics.items()})
    for group in (world, *pairs):
        dist.destroy_process_group(group)
    return out


def _tracked() -> dict:
    """megatron's MoE metrics of this process: name -> (values, the group they reduce over when
    logged) (0.19.2's tracker object; 0.16.1's layer-wise dict)."""
    try:
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
    except ImportError:
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        return {name: (entry["values"].clone(), entry.get("reduce_group"))
                for name, entry in get_moe_layer_wise_logging_tracker().items()}
    return {name: (entry.values.clone(), entry.reduce_group)
            for name, entry in get_moe_metrics_tracker()._metrics.items()}


def _clear_tracker() -> None:
    try:
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
    except ImportError:
        from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

        clear_aux_losses_tracker()
        return
    get_moe_metrics_tracker().clear()


def _relative(value, reference) -> float:
    return float((value - reference).abs().max() / reference.abs().max())


# ------------------------------------------------------------------------------ the tests
@pytest.mark.multirank
def test_a_micro_batchs_router_losses_equal_one_rank_holding_it(world):
    """Micro-batch A over ranks {0, 1} and B over {2, 3}, one static group of all 4: the router
    weight's gradient (aux and z-loss included) summed over the micro-batch's ranks and the
    logged load-balancing loss equal those of one rank running the whole micro-batch, and the
    tracker reduces over the static group again when the step is logged."""
    for result in world.run(router_per_micro_batch, True, timeout_s=300):
        assert result["grad"] <= 1e-6, result
        assert result["load_balancing_loss"] <= 1e-6 and result["z_loss"] <= 1e-6, result
        assert result["reduce_groups"] in (["static"], ["None", "static"]), result


@pytest.mark.multirank
def test_upstream_sums_the_router_counts_over_other_micro_batches(world):
    """Without the patch the token counts are summed over the static group (A's and B's) and
    the z-loss divided by its size: the gradient and the logged load-balancing loss are off."""
    for result in world.run(router_per_micro_batch, False, timeout_s=300):
        assert result["grad"] > 1e-2 and result["load_balancing_loss"] > 1e-2, result


def _config(**fields):
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = {"num_layers": 2, "hidden_size": 16, "num_attention_heads": 2,
            "num_moe_experts": 4, "moe_router_topk": 2, "moe_aux_loss_coeff": 1e-3,
            "add_bias_linear": False}
    return TransformerConfig(**{**base, **fields})


@pytest.mark.pure
@pytest.mark.parametrize("fields, uses", [
    ({}, ["aux_loss"]),
    ({"moe_aux_loss_coeff": 0.0}, []),
    ({"moe_aux_loss_coeff": 0.0, "moe_z_loss_coeff": 1e-3}, ["z_loss"]),
    ({"moe_router_load_balancing_type": "seq_aux_loss", "moe_z_loss_coeff": 1e-3},
     ["seq_aux_loss", "z_loss"]),
    ({"moe_router_load_balancing_type": ["aux_loss", "seq_aux_loss"],
      "moe_aux_loss_coeff": [0.0, 1e-4]}, ["seq_aux_loss"]),
    ({"moe_router_load_balancing_type": "none"}, []),
    ({"num_moe_experts": None, "moe_router_topk": 2}, []),
])
def test_what_a_router_computes_over_its_group(fields, uses):
    assert router_group_uses(_config(**fields)) == uses


@pytest.mark.pure
@pytest.mark.parametrize("kinds, uses", [
    ("quantile_balancing", ["quantile_balancing"]),
    (["aux_loss", "quantile_balancing"], ["quantile_balancing"]),
])
def test_quantile_balancing_gathers_over_the_group_in_either_form(kinds, uses):
    """0.19.2's quantile balancing gathers logits over the group, named alone or in a list
    (megatron's config takes both forms; the coefficients here are 0)."""
    config = types.SimpleNamespace(num_moe_experts=4, moe_router_load_balancing_type=kinds,
                                   moe_aux_loss_coeff=[0.0, 0.0] if isinstance(kinds, list)
                                   else 0.0, moe_z_loss_coeff=None)
    assert router_group_uses(config) == uses


@pytest.mark.pure
def test_a_router_without_group_work_is_never_refused():
    config = _config(moe_aux_loss_coeff=0.0, tensor_model_parallel_size=2,
                     sequence_parallel=True)
    assert dynamic_cp_router_problems(config) == []
    assert dynamic_cp_router_problems(_config()) == []


@pytest.mark.pure
@pytest.mark.parametrize("fields, name, words", [
    ({"tensor_model_parallel_size": 2, "sequence_parallel": True},
     "model.tensor_model_parallel_size", "TP x the micro-batch's CP group"),
    ({"moe_router_load_balancing_type": "global_aux_loss"},
     "model.moe_router_load_balancing_type", "every rank holds as many tokens"),
    ({"recompute_granularity": "selective", "recompute_modules": ["moe"]},
     "model.recompute_modules", "runs the router again in backward"),
])
def test_what_dynamic_cp_refuses_of_a_router_names_the_field_and_the_fix(fields, name, words):
    problems = dynamic_cp_router_problems(_config(**fields))
    assert [p.parameter for p in problems] == [name]
    text = str(problems[0])
    assert words in text and "Fix: " in text, text


@pytest.mark.pure
def test_the_patch_is_one_named_version_gated_patch_on_the_transformer_layer():
    (patch,) = by_name(["moe-router-dynamic-cp-group"])
    assert patch.versions == ("0.16.1", "0.19.2")
    assert [t.qualname for t in patch.targets] == ["TransformerLayer.forward"]
