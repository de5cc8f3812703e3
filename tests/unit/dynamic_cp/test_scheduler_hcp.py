"""Dynamic hierarchical CP in the scheduler: two link classes, the a2a level, the CLI."""

from __future__ import annotations

import json

import numpy as np
import pytest

from megatron_hcp.cli import main as cli_main
from megatron_hcp.dynamic_cp.projection import Cluster, Hardware, plan_seconds
from megatron_hcp.dynamic_cp.scheduler import schedule
from megatron_hcp.dynamic_cp.workload import GPTWorkload, ScheduleError

W = GPTWorkload(num_layers=4, hidden_size=1024, num_attention_heads=16, num_query_groups=4)
GQA = GPTWorkload(num_layers=4, hidden_size=4096, ffn_hidden_size=14336, gated_mlp=True,
                  num_attention_heads=32, num_query_groups=8)


def _lengths(seed, count, median, sigma, lo, hi):
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(np.log(median), sigma, count), lo, hi).astype(int).tolist()


@pytest.mark.parametrize("hcp", [None, 4])
def test_ranking_changes_with_the_link_numbers(hcp):
    """Fast IB: spreading over nodes is cheap; slow IB: the scheduler keeps groups on a node.
    Each plan is the faster one on the links it was ranked with."""
    lengths = _lengths(0, 24, 2048, 1.0, 256, 16384)
    fast = Cluster(gpus_per_node=4, inter_bytes_per_second=450e9, inter_latency_seconds=5e-6)
    slow = Cluster(gpus_per_node=4, inter_bytes_per_second=5e9, inter_latency_seconds=50e-6)
    on_fast = schedule(lengths, 16, 2048, workload=W, hardware=fast, hcp_a2a_size=hcp)
    on_slow = schedule(lengths, 16, 2048, workload=W, hardware=slow, hcp_a2a_size=hcp)
    assert on_fast != on_slow
    assert plan_seconds(on_fast, lengths, W, fast, hcp) < plan_seconds(on_slow, lengths, W,
                                                                       fast, hcp)
    assert plan_seconds(on_slow, lengths, W, slow, hcp) < plan_seconds(on_fast, lengths, W,
                                                                       slow, hcp)


def test_dynamic_hcp_projects_faster_than_flat_dynamic_cp_on_long_tails():
    lengths = _lengths(1, 64, 8192, 1.5, 512, 262144)
    cluster = Cluster(gpus_per_node=8)
    flat = schedule(lengths, 64, 16384, workload=GQA, hardware=cluster)
    hcp = schedule(lengths, 64, 16384, workload=GQA, hardware=cluster, hcp_a2a_size=8)
    assert plan_seconds(hcp, lengths, GQA, cluster, 8) < plan_seconds(flat, lengths, GQA,
                                                                      cluster)


def test_flat_single_link_ranking_is_unchanged():
    """hardware=Hardware without hcp_a2a_size: the same plan as before (one link, flat ring)."""
    lengths = _lengths(2, 64, 512, 1.2, 128, 2048)
    hw = Hardware(bytes_per_second=25e9, latency_seconds=15e-6)
    a = schedule(lengths, 16, 512, workload=W, hardware=hw)
    b = schedule(lengths, 16, 512, workload=W, hardware=hw, hcp_a2a_size=None)
    assert a == b


@pytest.mark.parametrize("kwargs, fragment", [
    ({"hcp_a2a_size": 4}, "hcp_a2a_size=4 needs hardware=Cluster"),
    ({"hcp_a2a_size": 4, "hardware": Hardware()}, "hcp_a2a_size=4 needs hardware=Cluster"),
    ({"hcp_a2a_size": 3, "hardware": Cluster()}, "hcp_a2a_size=3 must be a power of two"),
    ({"hcp_a2a_size": 1, "hardware": Cluster()}, "hcp_a2a_size=1 must be a power of two >= 2"),
    ({"hcp_a2a_size": 16, "hardware": Cluster()}, "<= dp_cp=8"),
    ({"hcp_a2a_size": 2.0, "hardware": Cluster()}, "hcp_a2a_size"),
    ({"hcp_a2a_size": 8, "hardware": Cluster(),
      "workload": GPTWorkload(hidden_size=768, num_attention_heads=12)}, "12 query heads"),
    ({"hardware": Cluster(gpus_per_node=0)}, "hardware.gpus_per_node=0"),
    ({"hardware": Cluster(inter_bytes_per_second=0.0)}, "hardware.inter_bytes_per_second=0.0"),
    ({"hardware": Cluster(intra_latency_seconds=-1.0)}, "hardware.intra_latency_seconds=-1.0"),
    ({"hardware": "nvlink"}, "hardware='nvlink'"),
])
def test_bad_pricing_parameters_are_named(kwargs, fragment):
    with pytest.raises(ScheduleError, match=fragment) as err:
        schedule([100, 200, 300], 8, 512, **kwargs)
    assert "; " in str(err.value) or "must" in str(err.value)


def _schedule_cli(tmp_path, capsys, *extra):
    lengths = tmp_path / "lengths.json"
    lengths.write_text(json.dumps([200000, 150000, 60000, 30000, 20000, 9000, 8000, 4000,
                                   3000, 2000, 1000, 900]))
    code = cli_main(["schedule", "--dp-cp", "32", "--max-seqlen-per-rank", "16384",
                     "--layers", "4", "--hidden", "4096", "--heads", "32", "--kv-heads", "8",
                     "--lengths", str(lengths), *extra])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_prints_the_levels_of_every_group(tmp_path, capsys):
    code, out, err = _schedule_cli(
        tmp_path, capsys, "--gpus-per-node", "8", "--intra-gbps", "450", "--inter-gbps", "50",
        "--hierarchical-context-parallel-sizes", "4", "8")
    assert code == 0, err
    assert "2 link classes: 8 GPUs per node" in out and "a2a level 4" in out
    groups = [line.strip() for line in out.splitlines() if line.strip().startswith("group of")]
    assert groups
    for line in groups:  # e.g. "group of 16 (ranks 0-15) = a2a 4 x p2p 4: samples [...]"
        c = int(line.split()[2])
        levels = line.split(" = ")[1].split(":")[0]
        if c == 1:
            assert levels == "no CP"
        elif c <= 4:  # the words of check-config's advice (config.describe_levels)
            assert levels == f"pure a2a over {c}"
        else:
            assert levels == f"a2a 4 x p2p {c // 4}"
    assert any(" x p2p " in line for line in groups)
    assert "projected step" in out
    # --json carries the levels too
    code, out, _ = _schedule_cli(tmp_path, capsys, "--hcp", "4", "8", "--json")
    plan = json.loads(out)
    for mb in plan["micro_batches"]:
        for g in mb["groups"]:
            c = len(g["ranks"])
            assert g["a2a"] * g["p2p"] == c and g["a2a"] == min(c, 4)


def test_cli_flat_groups_and_bad_hcp(tmp_path, capsys):
    code, out, _ = _schedule_cli(tmp_path, capsys, "--inter-gbps", "25")
    assert code == 0
    assert all(line.split(" = ")[1].split(":")[0] in ("no CP", f"p2p {line.split()[2]}")
               for line in out.splitlines() if line.strip().startswith("group of"))
    for extra, fragment in [
        (("--hcp", "3", "2"), "hierarchical_context_parallel_sizes"),
        (("--hcp", "4", "2", "--link-gbps", "100"), "--link-gbps"),
        (("--inter-gbps", "50", "--link-gbps", "100"), "--link-gbps"),
        (("--hcp", "64", "1"), "hierarchical_context_parallel_sizes"),
        (("--gpus-per-node", "0"), "--gpus-per-node"),
        (("--hcp", "4", "2", "--cost", "seq_squared"), "--cost"),
    ]:
        code, _, err = _schedule_cli(tmp_path, capsys, *extra)
        assert code == 2 and fragment in err and len(err.strip().splitlines()) == 1, (extra,
                                                                                      err)
