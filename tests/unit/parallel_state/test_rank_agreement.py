"""Real 4-rank gloo runs: ranks given different configurations fail on every rank with the
differing fields and ranks named (MPU, decentralized and dynamic-CP paths) instead of hanging
until the distributed timeout; a rank that never arrives is named within a bounded time."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed as dist

from megatron_hcp.config import CPConfig
from megatron_hcp.parallel_state.agreement import agree

pytestmark = pytest.mark.multirank  # starts ranks or processes (tests/conftest.py)

WORLD = 4
SHORT = timedelta(seconds=20)  # only reached if a rank is missing


def _catch(fn, *args, **kwargs) -> tuple[str, str]:
    try:
        fn(*args, **kwargs)
    except Exception as err:  # the test compares what every rank raised
        return type(err).__name__, str(err)
    return "ok", ""


def _hcp_config(rank: int) -> CPConfig:
    sizes = [4, 1] if rank == 3 else [2, 2]
    return CPConfig(context_parallel_size=4, cp_comm_type="a2a+p2p",
                    hierarchical_context_parallel_sizes=sizes)


def mpu_with_one_different_rank(kind: str):
    from megatron_hcp.parallel_state.mpu import destroy_model_parallel, initialize_model_parallel

    rank = dist.get_rank()
    if kind == "hcp":
        config = _hcp_config(rank)
    else:  # dynamic CP on rank 0 only
        config = CPConfig(context_parallel_size=2, data_parallel_size=2,
                          dynamic_context_parallel=rank == 0, max_seqlen_per_dp_cp_rank=64)
    result = _catch(initialize_model_parallel, config, create_gloo_process_groups=False,
                    agreement_timeout=SHORT)
    if result[0] == "ok":
        destroy_model_parallel()
    return result


def decentralized_with_one_different_rank():
    from megatron_hcp.parallel_state.collection import create_pg_collection, destroy_pg_collection

    try:
        pgc = create_pg_collection(_hcp_config(dist.get_rank()), agreement_timeout=SHORT)
    except Exception as err:
        return type(err).__name__, str(err)
    destroy_pg_collection(pgc)
    return "ok", ""


def dynamic_groups_with_one_different_rank():
    from megatron_hcp.parallel_state.dynamic import create_dynamic_cp_groups

    min_size = 2 if dist.get_rank() == 1 else 1
    return _catch(create_dynamic_cp_groups, [[0, 1, 2, 3]], None, min_size,
                  agreement_timeout=SHORT)


def rank_3_never_arrives():
    if dist.get_rank() == 3:
        return "absent", ""
    return _catch(agree, {"x": 1}, what="test configuration", tag="test-missing",
                  timeout=timedelta(seconds=2))


def rank_3_arrives_late():
    """Rank 3 calls agree only after ranks 0-2 have given up (signalled through the store)."""
    import time

    store = dist.distributed_c10d._get_default_store()
    if dist.get_rank() == 3:
        while store.add("test-late/gave-up", 0) < 3:
            time.sleep(0.05)
    result = _catch(agree, {"x": 1}, what="test configuration", tag="test-late",
                    timeout=timedelta(seconds=1))
    if dist.get_rank() != 3:
        store.add("test-late/gave-up", 1)
    return result


def same_config_everywhere():
    from megatron_hcp.parallel_state.mpu import destroy_model_parallel, initialize_model_parallel

    layout = initialize_model_parallel(_hcp_config(0), create_gloo_process_groups=False)
    destroy_model_parallel()
    return layout.hcp[0]


def _same_error_everywhere(results, kind="ConfigDisagreementError"):
    assert {r[0] for r in results} == {kind}, results
    assert len({r[1] for r in results}) == 1, "every rank must raise the same error"
    return results[0][1]


def test_mpu_path_names_the_differing_field_and_rank(world):
    message = _same_error_everywhere(world.run(mpu_with_one_different_rank, "hcp", timeout_s=60))
    assert "rank(s) 3 differ from rank 0" in message
    assert "hierarchical_context_parallel_sizes: [2, 2] on rank(s) 0, 1, 2; [4, 1] on rank(s) 3" \
        in message


def test_dynamic_cp_on_one_rank_only_is_named(world):
    message = _same_error_everywhere(
        world.run(mpu_with_one_different_rank, "dynamic", timeout_s=60))
    assert "dynamic_context_parallel: true on rank(s) 0; false on rank(s) 1, 2, 3" in message


def test_decentralized_path_names_the_differing_field_and_rank(world):
    message = _same_error_everywhere(
        world.run(decentralized_with_one_different_rank, timeout_s=60))
    assert "rank(s) 3 differ" in message and "hierarchical_context_parallel_sizes" in message


def test_dynamic_cp_groups_agree_before_creation(world):
    message = _same_error_everywhere(
        world.run(dynamic_groups_with_one_different_rank, timeout_s=60))
    assert "min_dynamic_context_parallel_size: 1 on rank(s) 0, 2, 3; 2 on rank(s) 1" in message


def test_a_missing_rank_is_named_within_the_timeout(world):
    results = world.run(rank_3_never_arrives, timeout_s=60)
    assert results[3][0] == "absent"
    message = _same_error_everywhere(results[:3], "MissingRanksError")
    assert "rank(s) 3 of 4 did not reach the test configuration agreement" in message


def test_a_rank_arriving_after_the_others_gave_up_does_not_go_on_alone(world):
    results = world.run(rank_3_arrives_late, timeout_s=60)
    _same_error_everywhere(results[:3], "MissingRanksError")
    assert results[3][0] == "MissingRanksError"
    assert "after the other ranks gave up waiting for rank(s) 3" in results[3][1]


def test_equal_configurations_still_build_the_groups(world):
    assert world.run(same_config_everywhere, timeout_s=60) == [[[0, 1], [2, 3]]] * WORLD
