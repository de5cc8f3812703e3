"""Recipes as the GPU suite runs them: the shipped ones on as many GPUs as they have ranks, and
a one-rank form of a shipped recipe for a machine with one GPU."""

from __future__ import annotations

from pathlib import Path

import yaml

from megatron_hcp.functional.harness import RECIPES_DIR, recipe_dir
from megatron_hcp.functional.recipe import load_recipe

__all__ = ["ONE_RANK_SOURCE", "one_rank_recipe", "shipped_recipes"]

ONE_RANK_SOURCE = "gpt3_mcore_tp1_pp1_cp4_p2p"
_PARALLEL_FLAGS = ("--context-parallel-size", "--cp-comm-type", "--tensor-model-parallel-size",
                   "--pipeline-model-parallel-size", "--hierarchical-context-parallel-sizes")


def shipped_recipes() -> dict[str, int]:
    """Every shipped recipe and the ranks (GPUs) it runs on."""
    return {path.name: load_recipe(path).nproc
            for path in sorted(RECIPES_DIR.iterdir()) if (path / "model_config.yaml").is_file()}


def one_rank_recipe(out_dir: Path, source: str = ONE_RANK_SOURCE) -> Path:
    """``source``'s model, data and steps on one rank (no TP/PP/CP), written to ``out_dir``
    (``model_config.yaml``); returns the directory."""
    doc = yaml.safe_load((recipe_dir(source) / "model_config.yaml").read_text(encoding="utf-8"))
    args = {k: v for k, v in doc["MODEL_ARGS"].items() if k not in _PARALLEL_FLAGS}
    doc = {**doc, "NPROC": 1, "TEST_TYPE": "regular", "MODEL_ARGS": args}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "model_config.yaml").write_text(yaml.safe_dump(doc, sort_keys=False),
                                               encoding="utf-8")
    return out_dir
