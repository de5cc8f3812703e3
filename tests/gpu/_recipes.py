"""Recipes as the GPU suite runs them: the shipped ones on as many GPUs as they have ranks, and
the one-rank form of every recipe family for a machine with one GPU.

A one-rank form keeps a recipe's model, data, loss and training path and drops what needs more
ranks: TP, PP and VPP, CP and dynamic CP (a dynamic-CP recipe keeps its packed variable-length
THD data), sequence parallelism, expert parallelism. Recipes whose one-rank forms are the same
run form one family (the p2p / a2a / all_gather recipes are one model on one rank).
Megatron-Bridge recipes keep Bridge's own loop (``pretrain`` / ``finetune``) and its data.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from megatron_hcp.files.bounded_read import read_yaml
from megatron_hcp.functional.harness import RECIPES_DIR, recipe_dir
from megatron_hcp.functional.recipe import list_recipes, load_recipe

__all__ = ["GOLDEN_DIR", "ONE_RANK_SOURCE", "one_rank_families", "one_rank_golden",
           "one_rank_recipe", "shipped_recipes"]

ONE_RANK_SOURCE = "gpt3_mcore_tp1_pp1_cp4_p2p"
GOLDEN_DIR = Path(__file__).resolve().parent / "golden"  # gpu_nccl values of the one-rank forms
_PARALLEL_FLAGS = ("--context-parallel-size", "--cp-comm-type", "--tensor-model-parallel-size",
                   "--pipeline-model-parallel-size", "--hierarchical-context-parallel-sizes",
                   "--virtual-pipeline-model-parallel-size", "--sequence-parallel",
                   "--dynamic-context-parallel", "--hybrid-context-parallel",
                   "--min-dynamic-context-parallel-size", "--max-seqlen-per-dp-cp-rank")
_PARALLEL_OVERRIDES = ("model.tensor_model_parallel_size", "model.sequence_parallel",
                       "model.pipeline_model_parallel_size",
                       "model.virtual_pipeline_model_parallel_size",
                       "model.context_parallel_size", "model.cp_comm_type",
                       "model.hierarchical_context_parallel_sizes",
                       "model.hybrid_context_parallel", "model.dynamic_context_parallel",
                       "model.min_dynamic_context_parallel_size",
                       "model.max_seqlen_per_dp_cp_rank", "model.variable_seq_lengths",
                       "model.moe_token_dispatcher_type", "model.expert_model_parallel_size")


def shipped_recipes() -> dict[str, int]:
    """Every shipped recipe and the ranks (GPUs) it runs on."""
    return {path.name: load_recipe(path).nproc
            for path in sorted(RECIPES_DIR.iterdir()) if (path / "model_config.yaml").is_file()}


def _one_rank_doc(source: str) -> dict:
    doc = read_yaml(recipe_dir(source) / "model_config.yaml", "recipe")
    doc = {**doc, "NPROC": 1, "TEST_TYPE": "regular"}
    if "BRIDGE" in doc:
        bridge = dict(doc["BRIDGE"])
        bridge["overrides"] = [o for o in bridge.get("overrides", [])
                               if o.partition("=")[0].strip() not in _PARALLEL_OVERRIDES]
        doc["BRIDGE"] = bridge
    else:
        doc["MODEL_ARGS"] = {k: v for k, v in doc["MODEL_ARGS"].items()
                             if k not in _PARALLEL_FLAGS}
    return doc


def one_rank_recipe(out_dir: Path, source: str = ONE_RANK_SOURCE) -> Path:
    """``source``'s one-rank form written to ``out_dir`` (``model_config.yaml``); returns the
    directory."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "model_config.yaml").write_text(
        yaml.safe_dump(_one_rank_doc(source), sort_keys=False), encoding="utf-8")
    return out_dir


def one_rank_families() -> dict[str, list[str]]:
    """The shipped recipes grouped by their one-rank form: the first recipe of each family
    (sorted by name) -> every recipe of it."""
    families: dict[str, list[str]] = {}
    key_of: dict[str, str] = {}
    for name in list_recipes():
        key = json.dumps(_one_rank_doc(name), sort_keys=True, default=str)
        if key not in key_of:
            key_of[key] = name
            families[name] = []
        families[key_of[key]].append(name)
    return families


def one_rank_golden(source: str) -> Path:
    """Where the gpu_nccl golden values of ``source``'s one-rank form live."""
    return GOLDEN_DIR / f"{source}@1rank_gpu_nccl.json"
