"""A functional recipe: megatron's ``model_config.yaml`` layout mapped to a validated run.

``MODEL_ARGS`` holds megatron command-line flags. Every flag is mapped onto the project's
:class:`~megatron_hcp.config.CPConfig` (validated, so bad CP flags get the config errors) and
:class:`~megatron_hcp.training.trainer.TinyGPTSpec`; a flag this CPU harness does not know is
an error that names it (nothing is ignored silently).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ..config import CPConfig, CPConfigError, Violation
from ..data import data_dir
from ..training.trainer import TinyGPTSpec, VarLen

__all__ = ["Recipe", "RECIPES_DIR", "list_recipes", "load_recipe"]

RECIPES_DIR = data_dir("recipes")
PLATFORM = "cpu_gloo"
ENVIRONMENT = "dev"

# flag -> (TinyGPTSpec field or None, CPConfig field or None, converter)
_INT, _FLOAT, _BOOL = int, float, "bool"
_FLAGS: dict[str, tuple[str | None, str | None, Any]] = {
    "--num-layers": ("num_layers", "num_layers", _INT),
    "--hidden-size": ("hidden_size", None, _INT),
    "--num-attention-heads": ("num_attention_heads", "num_attention_heads", _INT),
    "--num-query-groups": ("num_query_groups", "num_query_groups", _INT),
    "--group-query-attention": (None, None, _BOOL),
    "--seq-length": ("seq_length", "seq_length", _INT),
    "--max-position-embeddings": (None, None, _INT),
    "--micro-batch-size": ("micro_batch_size", None, _INT),
    "--global-batch-size": ("global_batch_size", None, _INT),
    "--train-iters": ("steps", None, _INT),
    "--lr": ("lr", None, _FLOAT),
    "--seed": ("seed", None, _INT),
    "--vocab-size": ("vocab_size", None, _INT),
    "--tokenizer-type": (None, None, str),
    "--tensor-model-parallel-size": ("tensor_model_parallel_size",
                                     "tensor_model_parallel_size", _INT),
    "--pipeline-model-parallel-size": ("pipeline_model_parallel_size",
                                       "pipeline_model_parallel_size", _INT),
    "--virtual-pipeline-model-parallel-size": ("virtual_pipeline_model_parallel_size", None,
                                               _INT),
    "--context-parallel-size": ("context_parallel_size", "context_parallel_size", _INT),
    "--cp-comm-type": ("cp_comm_type", "cp_comm_type", str),
    "--hierarchical-context-parallel-sizes": ("hierarchical_context_parallel_sizes",
                                              "hierarchical_context_parallel_sizes", "ints"),
    "--dynamic-context-parallel": ("dynamic_context_parallel", "dynamic_context_parallel",
                                   _BOOL),
    "--hybrid-context-parallel": ("dynamic_context_parallel", "hybrid_context_parallel", _BOOL),
    "--min-dynamic-context-parallel-size": ("min_dynamic_context_parallel_size",
                                            "min_dynamic_context_parallel_size", _INT),
    "--max-seqlen-per-dp-cp-rank": ("max_seqlen_per_dp_cp_rank", "max_seqlen_per_dp_cp_rank",
                                    _INT),
    "--calculate-per-token-loss": (None, "calculate_per_token_loss", _BOOL),
    "--untie-embeddings-and-output-weights": (None, None, _BOOL),
    "--position-embedding-type": (None, None, str),
    "--mock-data": (None, None, _BOOL),
    "--use-decentralized-pg": (None, None, _BOOL),
    # variable-length mock data (upstream: lognormal, min 128 / max 2048 / mean 512 / sigma 1.2)
    "--mock-variable-seq-lengths": (None, None, _BOOL),
    "--mock-min-seqlen": (None, None, _INT),
    "--mock-max-seqlen": (None, None, _INT),
    "--mock-mean-seqlen": (None, None, _FLOAT),
    "--mock-seqlen-sigma": (None, None, _FLOAT),
    "--mock-samples-per-micro-batch": (None, None, _INT),
}
_FIXED = {"--tokenizer-type": "NullTokenizer", "--position-embedding-type": "rope"}


@dataclass
class Recipe:
    """One recipe directory, parsed and validated."""

    name: str
    path: Path
    env: dict[str, str]
    args: dict[str, Any]
    test_type: str
    config: CPConfig
    spec: TinyGPTSpec
    decentralized: bool = False

    @property
    def nproc(self) -> int:
        return self.config.world_size

    def golden_path(self, environment: str = ENVIRONMENT, platform: str = PLATFORM) -> Path:
        return self.path / f"golden_values_{environment}_{platform}.json"

    def with_cp1(self) -> Recipe:
        """The same model and data without CP (CP ranks become DP ranks; dynamic CP off)."""
        cp = self.config.context_parallel_size
        config = dataclasses.replace(
            self.config, context_parallel_size=1, cp_comm_type=None,
            hierarchical_context_parallel_sizes=None, dynamic_context_parallel=False,
            hybrid_context_parallel=False, max_seqlen_per_dp_cp_rank=None,
            data_parallel_size=self.config.data_parallel_size * cp)
        varlen = self.spec.varlen
        if varlen is not None:  # one sample per micro-batch: enough micro-batches for VPP
            varlen = dataclasses.replace(varlen, samples_per_micro_batch=1)
        spec = dataclasses.replace(
            self.spec, context_parallel_size=1, cp_comm_type="p2p",
            hierarchical_context_parallel_sizes=None, dynamic_context_parallel=False,
            max_seqlen_per_dp_cp_rank=None, varlen=varlen)
        return dataclasses.replace(self, name=self.name + "@cp1", config=config, spec=spec)


def _convert(flag: str, raw: Any, kind: Any) -> Any:
    if kind == _BOOL:
        if raw in (True, None, "", "true", "True"):
            return True
        if raw in (False, "false", "False"):
            return False
        raise CPConfigError([Violation(flag, raw, "is a switch", f"write {flag}: true")])
    if kind == "ints":
        parts = raw if isinstance(raw, list) else str(raw).replace(",", " ").split()
        return [int(p) for p in parts]
    try:
        return kind(raw)
    except (TypeError, ValueError):
        raise CPConfigError([Violation(flag, raw, f"must be {kind.__name__}",
                                       f"give {flag} a {kind.__name__} value")]) from None


def load_recipe(path: str | os.PathLike) -> Recipe:
    """Parse ``<path>/model_config.yaml`` (``yaml.safe_load``) into a validated recipe."""
    root = Path(path)
    with open(root / "model_config.yaml", encoding="utf-8") as fh:
        doc = yaml.safe_load(fh) or {}
    args = dict(doc.get("MODEL_ARGS") or {})
    unknown = [f for f in args if f not in _FLAGS]
    if unknown:
        raise CPConfigError([Violation(f, args[f], "is not a flag this CPU harness maps",
                                       f"use one of {', '.join(sorted(_FLAGS))}")
                             for f in unknown])
    values = {f: _convert(f, raw, _FLAGS[f][2]) for f, raw in args.items()}
    bad = [Violation(f, values[f], f"must be {want} on {PLATFORM}", f"set {f} {want}")
           for f, want in _FIXED.items() if f in values and values[f] != want]
    if bad:
        raise CPConfigError(bad)
    spec_kwargs: dict[str, Any] = {}
    cfg_kwargs: dict[str, Any] = {}
    for flag, value in values.items():
        spec_field, cfg_field, _ = _FLAGS[flag]
        if spec_field:
            spec_kwargs[spec_field] = value
        if cfg_field:
            cfg_kwargs[cfg_field] = value
    if values.get("--untie-embeddings-and-output-weights") is not True:
        spec_kwargs["share_embeddings_and_output_weights"] = True
    if values.get("--mock-variable-seq-lengths"):
        spec_kwargs["varlen"] = VarLen(
            min_len=values.get("--mock-min-seqlen", 16),
            max_len=values.get("--mock-max-seqlen", 256),
            mean=values.get("--mock-mean-seqlen", 64.0),
            sigma=values.get("--mock-seqlen-sigma", 1.2),
            samples_per_micro_batch=values.get("--mock-samples-per-micro-batch", 1))
    spec = TinyGPTSpec(**spec_kwargs)
    model = spec.tensor_model_parallel_size * spec.pipeline_model_parallel_size
    env = {str(k): str(v) for k, v in (doc.get("ENV_VARS") or {}).items()}
    world = int(doc.get("NPROC", 0))
    if world <= 0:
        raise CPConfigError([Violation("NPROC", None, "the recipe must say how many ranks run it",
                                       "add NPROC: <ranks> to model_config.yaml")])
    cp = spec.context_parallel_size
    cfg_kwargs["data_parallel_size"] = world // (model * cp) if world % (model * cp) == 0 else 0
    config = CPConfig(**cfg_kwargs)
    config.validate()
    return Recipe(name=root.name, path=root, env=env, args=args,
                  test_type=str(doc.get("TEST_TYPE", "regular")), config=config, spec=spec,
                  decentralized=bool(values.get("--use-decentralized-pg")))


def list_recipes(root: str | os.PathLike = RECIPES_DIR) -> list[str]:
    """Names of the recipe directories under ``root``."""
    base = Path(root)
    return sorted(p.name for p in base.iterdir() if (p / "model_config.yaml").is_file())
