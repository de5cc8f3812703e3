"""A functional recipe: megatron's ``model_config.yaml`` layout mapped to a validated run.

``MODEL_ARGS`` holds megatron command-line flags. Every flag is mapped onto the project's
:class:`~megatron_hcp.config.CPConfig` (validated, so bad CP flags get the config errors) and
:class:`~megatron_hcp.training.trainer.TinyGPTSpec`; a flag this CPU harness does not know is
an error that names it (nothing is ignored silently). Values are read by the project's one
strict parser (:func:`megatron_hcp.config.parse_value`): ``2.7`` is not an integer and ``true``
is not 1.

A recipe is trusted like code: its ``ENV_VARS`` reach the ranks' environment as given, so only
run recipes you would run as scripts. Variables that make the dynamic loader or the interpreter
load other code (``LD_*``, ``DYLD_*``, ``PYTHONPATH``, ``PYTHONSTARTUP``, ...) are refused
unless the caller names them in ``allow_env`` (``functional run --allow-env NAME``).
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import (
    FIELD_KINDS,
    MAX_SEQ_LENGTH,
    CPConfig,
    CPConfigError,
    Violation,
    fields_read_by,
    parse_float,
    parse_value,
)
from ..config.errors import closest
from ..files.bounded_read import InputFileError, read_yaml
from ..files.data import data_dir
from ..training.data import CORPORA
from ..training.trainer import TinyGPTSpec, VarLen
from .allowances import Allowed
from .bridge_recipe import BridgeRecipe, load_bridge_recipe
from .preflight import rank_environment_problems

__all__ = ["LOADER_ENV_VARS", "RECIPE_KEYS", "Recipe", "RECIPES_DIR", "TEST_TYPES",
           "list_recipes", "load_recipe"]

RECIPES_DIR = data_dir("recipes")
PLATFORM = "cpu_gloo"
ENVIRONMENT = "dev"

TEST_TYPES = ("regular", "ckpt-resume")
# the top-level keys of model_config.yaml (any other, e.g. a misspelt MODEL_ARG, is refused:
# it would otherwise train the default model)
RECIPE_KEYS = ("ENV_VARS", "NPROC", "TEST_TYPE", "MODEL_ARGS", "BRIDGE")
# environment variables that load other code into the ranks (refused unless allowed): the
# interpreter's paths and start-up file, its breakpoint hook and warning filters (a filter's
# category is imported by name), the shell's start-up files, glibc's conversion modules, and
# the libraries OpenMP, CUDA and NCCL load by name
LOADER_ENV_VARS = ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONEXECUTABLE",
                   "PYTHONUSERBASE", "PYTHONPLATLIBDIR", "PYTHONBREAKPOINT", "PYTHONWARNINGS",
                   "BASH_ENV", "ENV", "GCONV_PATH", "OMP_TOOL_LIBRARIES",
                   "CUDA_INJECTION64_PATH", "NCCL_NET_PLUGIN", "NCCL_TUNER_PLUGIN",
                   "NCCL_PROFILER_PLUGIN")
_LOADER_PREFIXES = ("LD_", "DYLD_")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

# flag -> (field, parse_value kind): a CPConfig field (CP, parallel sizes and the model shape the
# CP rules read; its kind is CPConfig's own), a TinyGPTSpec field, or None (accepted, fixed or
# handled below). Each flag maps to one field, once.
_FLOAT, _BOOL = "float", "bool"
_SPEC_FLAGS: dict[str, tuple[str | None, str]] = {
    "--hidden-size": ("hidden_size", "width"),
    "--micro-batch-size": ("micro_batch_size", "sequences"),
    "--global-batch-size": ("global_batch_size", "sequences"),
    "--train-iters": ("steps", "steps"),
    "--lr": ("lr", _FLOAT),
    "--seed": ("seed", "posint"),
    "--vocab-size": ("vocab_size", "vocab"),
    "--virtual-pipeline-model-parallel-size": ("virtual_pipeline_model_parallel_size", "layers"),
    "--sequence-parallel": ("sequence_parallel", _BOOL),
    "--group-query-attention": (None, _BOOL),
    "--max-position-embeddings": (None, "seqlen"),  # GPTModel's max_sequence_length
    "--tokenizer-type": (None, "str"),
    "--untie-embeddings-and-output-weights": (None, _BOOL),
    "--position-embedding-type": (None, "str"),
    "--mock-data": (None, _BOOL),
    "--use-decentralized-pg": (None, _BOOL),
    # variable-length mock data (upstream: lognormal, min 128 / max 2048 / mean 512 / sigma 1.2)
    "--mock-variable-seq-lengths": (None, _BOOL),
    "--mock-min-seqlen": (None, "seqlen"),
    "--mock-max-seqlen": (None, "seqlen"),
    "--mock-mean-seqlen": (None, _FLOAT),
    "--mock-seqlen-sigma": (None, _FLOAT),
    "--mock-samples-per-micro-batch": (None, "sequences"),
    "--mock-corpus": (None, "str"),  # motif (default) or markov: a corpus the model learns
}
# the ranges of the float flags (inclusive maximum, exclusive 0): a learning rate above 1 moves
# every weight by more than its initial scale each Adam step; a lognormal sigma above 4 puts
# the 99th percentile over 10^4 x the median, where clipping to min/max decides every length
_FLOAT_RANGES: dict[str, float] = {"--lr": 1.0, "--mock-mean-seqlen": float(MAX_SEQ_LENGTH),
                                   "--mock-seqlen-sigma": 4.0}
_CP_RECIPE_FIELDS = fields_read_by("recipe")  # the one field table (config.values.FIELDS)
_FLAGS: dict[str, tuple[str | None, str]] = {
    **{f"--{name.replace('_', '-')}": (name, FIELD_KINDS[name]) for name in _CP_RECIPE_FIELDS},
    **_SPEC_FLAGS,
}
# flags with the one value this harness runs (any other is refused)
_FIXED = {"--tokenizer-type": "NullTokenizer", "--position-embedding-type": "rope",
          "--mock-data": True}
_VARLEN_FLAGS = ("--mock-min-seqlen", "--mock-max-seqlen", "--mock-mean-seqlen",
                 "--mock-seqlen-sigma", "--mock-samples-per-micro-batch", "--mock-corpus")
_DYNAMIC_FLAGS = ("--min-dynamic-context-parallel-size", "--max-seqlen-per-dp-cp-rank")


def _combinations(values: dict[str, Any]) -> list[Violation]:
    """Flags that would be accepted and then do nothing in this combination: refused."""
    out = []
    varlen = values.get("--mock-variable-seq-lengths") is True
    for flag in _VARLEN_FLAGS:
        if flag in values and not varlen:
            out.append(Violation(flag, values[flag], "only applies to variable-length mock data",
                                 "add --mock-variable-seq-lengths: true, or remove the flag"))
    if varlen and values.get("--micro-batch-size", 1) != 1:
        out.append(Violation(
            "--micro-batch-size", values["--micro-batch-size"],
            "with variable-length data a micro-batch is one packed sequence of "
            "--mock-samples-per-micro-batch samples", "set --micro-batch-size: 1 and "
            "--mock-samples-per-micro-batch: N"))
    dynamic = values.get("--dynamic-context-parallel") is True or values.get(
        "--hybrid-context-parallel") is True
    for flag in _DYNAMIC_FLAGS:
        if flag in values and values[flag] is not None and not dynamic:
            out.append(Violation(flag, values[flag], "only applies to dynamic context "
                                 "parallelism", "add --dynamic-context-parallel: true, or "
                                 "remove the flag"))
    gqa = values.get("--group-query-attention")
    if gqa is True and values.get("--num-query-groups") is None:
        out.append(Violation("--group-query-attention", True, "needs --num-query-groups "
                             "(megatron would use 1 query group)", "add --num-query-groups: N"))
    if gqa is not True and values.get("--num-query-groups") is not None:
        out.append(Violation(
            "--num-query-groups", values["--num-query-groups"],
            "takes effect only with --group-query-attention: true (megatron runs plain "
            "multi-head attention without it)", "add --group-query-attention: true, or remove "
            "--num-query-groups"))
    mean = values.get("--mock-mean-seqlen")
    low, high = values.get("--mock-min-seqlen", 16), values.get("--mock-max-seqlen", 256)
    if varlen and low > high:
        out.append(Violation("--mock-min-seqlen", low, f"must be <= --mock-max-seqlen ({high})",
                             "swap or correct the two lengths"))
    elif varlen and mean is not None and not low <= mean <= high:
        out.append(Violation("--mock-mean-seqlen", mean, f"must lie between --mock-min-seqlen "
                             f"({low}) and --mock-max-seqlen ({high})", "set it in that range"))
    limit = values.get("--max-position-embeddings")
    longest = (values.get("--mock-max-seqlen", 256) if varlen
               else values.get("--seq-length"))
    if limit is not None and longest is not None and limit < longest:
        out.append(Violation("--max-position-embeddings", limit,
                             f"must be >= the longest sequence ({longest} tokens)",
                             f"set it to at least {longest}"))
    return out


@dataclass
class Recipe:
    """One recipe directory, parsed and validated."""

    name: str
    path: Path
    env: dict[str, str]
    args: dict[str, Any]
    test_type: str
    spec: TinyGPTSpec
    decentralized: bool = False
    worker: str = "megatron_hcp.functional.worker"  # the module torchrun starts per rank
    allowed: Allowed = Allowed()  # what the caller allowed (handed to every rank)

    @property
    def config(self) -> CPConfig:
        """The recipe's CP setup (held by its spec)."""
        return self.spec.config

    @property
    def steps(self) -> int:
        return self.spec.steps

    def cache_key(self, steps: int) -> str:
        """Equal for recipes whose runs of ``steps`` steps are the same run."""
        return repr((self.config, dataclasses.replace(self.spec, steps=steps),
                     self.decentralized, self.nproc))

    def worker_args(self, work_dir: str) -> list[str]:
        return self.allowed.worker_flags()

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
        if varlen is not None and self.config.per_token_loss():
            # one sample per micro-batch: enough micro-batches for VPP (a per-token loss does
            # not depend on how samples are packed; a loss per micro-batch does, so then the
            # packing is kept)
            varlen = dataclasses.replace(varlen, samples_per_micro_batch=1)
        spec = dataclasses.replace(self.spec, config=config, varlen=varlen)
        return dataclasses.replace(self, name=self.name + "@cp1", spec=spec)


def _convert(flag: str, raw: Any, kind: str) -> Any:
    if kind.lstrip("?") == _BOOL and raw in (None, ""):
        return True  # a bare switch (``--mock-data:``)
    value = parse_value(raw, kind, flag, text=False)  # YAML values are typed
    if flag in _FLOAT_RANGES:
        return parse_float(value, flag, above=0.0, maximum=_FLOAT_RANGES[flag])
    return value


def _check_env(env: Any, allow_env: Iterable[str]) -> dict[str, str]:
    if not isinstance(env, dict):
        raise CPConfigError([Violation("ENV_VARS", env, "must be a mapping NAME: value",
                                       "write ENV_VARS: {NAME: value} or ENV_VARS: {}")])
    allowed = set(allow_env)
    out, problems = {}, []
    for name, value in env.items():
        if not isinstance(name, str) or not _ENV_NAME.fullmatch(name):
            problems.append(Violation("ENV_VARS", name, "is not an environment variable name",
                                      "use letters, digits and _"))
        elif isinstance(value, (dict, list)) or value is None:
            problems.append(Violation(f"ENV_VARS.{name}", value, "must be a single value",
                                      "give a string or a number"))
        elif (name in LOADER_ENV_VARS or name.startswith(_LOADER_PREFIXES)) and (
                name not in allowed):
            problems.append(Violation(
                f"ENV_VARS.{name}", value, "makes the ranks load other code (a recipe is "
                "trusted like code, but loader variables are refused by default)",
                f"remove it, or allow it explicitly: functional run --allow-env {name}"))
        else:
            out[name] = str(value).lower() if isinstance(value, bool) else str(value)
    problems += rank_environment_problems(out, "ENV_VARS")
    if problems:
        raise CPConfigError(problems)
    return out


def _shown(key: Any) -> str:
    """A key as an error names it: as written where it is plain printable ASCII, else escaped
    (a terminal may not print it)."""
    return key if isinstance(key, str) and key.isascii() and key.isprintable() else ascii(key)


def _read_yaml(path: Path) -> dict:
    try:
        doc = read_yaml(path, "recipe")
    except InputFileError as err:
        raise CPConfigError([Violation(str(path), None, err.rule, err.fix)]) from None
    doc = {} if doc is None else doc
    if not isinstance(doc, dict):
        raise CPConfigError([Violation(str(path), type(doc).__name__, "must be a YAML mapping",
                                       "use the keys ENV_VARS, NPROC, TEST_TYPE, MODEL_ARGS")])
    return doc


def load_recipe(path: str | os.PathLike, *, allow_env: Iterable[str] = (),
                allow_recipe_modules: Iterable[str] = ()) -> Recipe | BridgeRecipe:
    """Parse ``<path>/model_config.yaml`` (``yaml.safe_load``) into a validated recipe: a
    ``MODEL_ARGS`` recipe (the project's trainer) or a ``BRIDGE`` recipe (Megatron-Bridge's own
    loop, :mod:`.bridge_recipe`).

    ``allow_env`` names loader variables (:data:`LOADER_ENV_VARS`, ``LD_*``, ``DYLD_*``) the
    recipe's ``ENV_VARS`` may set; ``allow_recipe_modules`` modules a ``BRIDGE.recipe`` may
    name a function of, beyond Bridge's and the project's recipe modules
    (:data:`~.bridge_recipe.RECIPE_MODULES`).
    """
    allowed = Allowed.of(allow_env, allow_recipe_modules)
    root = Path(path)
    doc = _read_yaml(root / "model_config.yaml")
    unknown_keys = [key for key in doc if key not in RECIPE_KEYS]
    if unknown_keys:
        raise CPConfigError([Violation(_shown(key), doc[key], "is not a key of model_config.yaml",
                                       closest(key, RECIPE_KEYS)) for key in unknown_keys])
    env = _check_env(doc.get("ENV_VARS") or {}, allowed.env)
    if "NPROC" not in doc:
        raise CPConfigError([Violation("NPROC", None, "the recipe must say how many ranks run it",
                                       "add NPROC: <ranks> to model_config.yaml")])
    world = parse_value(doc["NPROC"], "size", "NPROC", text=False)
    test_type = parse_value(doc.get("TEST_TYPE", "regular"), "str", "TEST_TYPE")
    if test_type not in TEST_TYPES:
        raise CPConfigError([Violation("TEST_TYPE", test_type, "unknown test type",
                                       f"use one of {', '.join(TEST_TYPES)}")])
    if "BRIDGE" in doc:
        if "MODEL_ARGS" in doc:
            raise CPConfigError([Violation("MODEL_ARGS", "...", "a recipe is either MODEL_ARGS "
                                           "(the project's trainer) or BRIDGE (Bridge's loop)",
                                           "keep one of the two sections")])
        return load_bridge_recipe(root, doc, env, test_type, world, allowed)
    model_args = doc.get("MODEL_ARGS") or {}
    if not isinstance(model_args, dict):
        raise CPConfigError([Violation("MODEL_ARGS", model_args, "must be a mapping of flags",
                                       "write MODEL_ARGS: {--flag: value}")])
    args = dict(model_args)
    unknown = [f for f in args if f not in _FLAGS]
    if unknown:
        raise CPConfigError([Violation(_shown(f), args[f], "is not a flag this CPU harness maps",
                                       closest(f, sorted(_FLAGS))) for f in unknown])
    values, problems = {}, []
    for flag, raw in args.items():
        try:
            values[flag] = _convert(flag, raw, _FLAGS[flag][1])
        except CPConfigError as err:
            problems.extend(err.violations)
    problems += [Violation(f, values[f], f"must be {want} on {PLATFORM} (this harness runs "
                           "only that)", f"set {f} {want}")
                 for f, want in _FIXED.items() if f in values and values[f] != want]
    problems += _combinations(values)
    if problems:
        raise CPConfigError(problems)
    spec_kwargs: dict[str, Any] = {}
    cfg_kwargs: dict[str, Any] = {}
    for flag, value in values.items():
        name = _FLAGS[flag][0]
        if name in _CP_RECIPE_FIELDS:
            cfg_kwargs[name] = value
        elif name is not None:
            spec_kwargs[name] = value
    if "--max-position-embeddings" in values:
        spec_kwargs["max_position_embeddings"] = values["--max-position-embeddings"]
    if values.get("--untie-embeddings-and-output-weights") is not True:
        spec_kwargs["share_embeddings_and_output_weights"] = True
    corpus = values.get("--mock-corpus", "motif")
    if corpus not in CORPORA or (
            "--mock-corpus" in values and not values.get("--mock-variable-seq-lengths")):
        raise CPConfigError([Violation(
            "--mock-corpus", corpus,
            f"must be one of {', '.join(CORPORA)}, with --mock-variable-seq-lengths: true",
            "e.g. --mock-corpus: markov next to --mock-variable-seq-lengths: true")])
    if values.get("--mock-variable-seq-lengths"):
        spec_kwargs["varlen"] = VarLen(
            corpus=corpus,
            min_len=values.get("--mock-min-seqlen", 16),
            max_len=values.get("--mock-max-seqlen", 256),
            mean=values.get("--mock-mean-seqlen", 64.0),
            sigma=values.get("--mock-seqlen-sigma", 1.2),
            samples_per_micro_batch=values.get("--mock-samples-per-micro-batch", 1))
    model = (cfg_kwargs.get("tensor_model_parallel_size", 1)
             * cfg_kwargs.get("pipeline_model_parallel_size", 1)
             * cfg_kwargs.get("context_parallel_size", 1))
    cfg_kwargs["data_parallel_size"] = world // model if world % model == 0 else 0
    config = CPConfig(**cfg_kwargs)
    config.validate()
    spec = TinyGPTSpec(config=config, **spec_kwargs)
    return Recipe(name=root.name, path=root, env=env, args=args, test_type=test_type,
                  spec=spec, decentralized=bool(values.get("--use-decentralized-pg")),
                  allowed=allowed)


def list_recipes(root: str | os.PathLike = RECIPES_DIR) -> list[str]:
    """Names of the recipe directories under ``root``."""
    base = Path(root)
    return sorted(p.name for p in base.iterdir() if (p / "model_config.yaml").is_file())
