"""A functional recipe trained by Megatron-Bridge's own loop: ``model_config.yaml`` with ``BRIDGE``.

```yaml
ENV_VARS: {}
NPROC: 4
TEST_TYPE: ckpt-resume            # or regular
BRIDGE:
  recipe: tiny_llama_sft_config   # a recipe function: a name in megatron_hcp.bridge.recipes
                                  #   (e.g. tiny_family_pretrain_config, recipe_args
                                  #   {family: qwen3_moe}), or module:function (any Bridge
                                  #   recipe function)
  recipe_args: {seq_length: 128}  # its keyword arguments (plain values)
  config: bridge.yaml             # optional: a Bridge ConfigContainer YAML merged on top
  entry: finetune                 # pretrain | finetune
  overrides:                      # Bridge's section.key=value (Hydra syntax), applied last
    - model.context_parallel_size=4
    - model.hybrid_context_parallel=true
    - model.max_seqlen_per_dp_cp_rank=32
    - train.train_iters=6
```

The overrides go through Bridge's own ``process_config_with_overrides``, except the dynamic-CP
names of megatron-core's development branch (``model.dynamic_context_parallel``,
``model.min_dynamic_context_parallel_size``) and its CP layout (``model.cp_partition_mode``)
where the model config has no such field: Bridge
would drop them with a warning (and train static CP), so they are set on the provider here,
where megatron-hcp reads them. The CP fields of the overrides make the recipe's
:class:`~megatron_hcp.config.CPConfig` (checked when the recipe loads, also without Bridge);
the whole configuration is validated again by ``bridge-cp-setup`` inside Bridge's loop.
``entry: finetune`` starts from a pretrained checkpoint: unless the recipe names one, the worker
first pre-trains the same model one step with CP=1 and fine-tunes from that.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import FIELD_KINDS, CPConfig, CPConfigError, Violation, parse_value
from ..config.errors import closest
from .allowances import Allowed

__all__ = ["BRIDGE_WORKER", "RECIPE_MODULES", "BridgeRecipe", "bridge_available",
           "build_bridge_config", "check_recipe_function", "load_bridge_recipe"]

BRIDGE_WORKER = "megatron_hcp.functional.bridge_worker"
ENTRIES = ("pretrain", "finetune")
# megatron-core development-branch names of dynamic CP (no fields on 0.19's model config)
DEV_DYNAMIC_FIELDS = ("dynamic_context_parallel", "min_dynamic_context_parallel_size")
# ... and every development-branch name a 0.19 model config has no field for (set on the
# provider; cp_partition_mode is upstream's TransformerConfig field for the CP layout)
DEV_FIELDS = (*DEV_DYNAMIC_FIELDS, "cp_partition_mode")
_CP_FIELDS = frozenset(CPConfig.field_names()) - {"data_parallel_size"}
# where a BRIDGE.recipe function may come from without --allow-recipe-module: the project's
# recipes (its tiny models; Bridge's family recipes made tiny CPU runs) and Bridge's (a module
# and its submodules); every rank calls the function
RECIPE_MODULES = ("megatron_hcp.bridge.recipes", "megatron_hcp.bridge.family_recipes",
                  "megatron.bridge.recipes")
_DEFAULT_MODULE = RECIPE_MODULES[0]
_DOTTED = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


def bridge_available() -> str | None:
    """Why Bridge recipes cannot run here (None: they can)."""
    if importlib.util.find_spec("megatron.bridge") is None:
        return ("needs Megatron-Bridge, which is not installed (Bridge 0.4+ needs Python 3.12: "
                "MEGATRON_HCP_STACK=py312)")
    return None


@dataclass
class BridgeRecipe:
    """One Bridge recipe directory, parsed; the CP fields of its overrides checked."""

    name: str
    path: Path
    env: dict[str, str]
    test_type: str
    nproc: int
    entry: str
    recipe: str
    recipe_args: dict[str, Any]
    config_file: Path | None
    overrides: tuple[str, ...]
    config: CPConfig
    steps: int
    args: dict[str, Any] = field(default_factory=dict)
    worker: str = BRIDGE_WORKER
    allowed: Allowed = Allowed()  # what the caller allowed (handed to every rank)

    def golden_path(self, environment: str = "dev", platform: str = "cpu_gloo") -> Path:
        return self.path / f"golden_values_{environment}_{platform}.json"

    def worker_args(self, work_dir: str) -> list[str]:
        return ["--work-dir", work_dir, *self.allowed.worker_flags()]

    def cache_key(self, steps: int) -> str:
        return repr((self.recipe, sorted(self.recipe_args.items()), self.config_file,
                     self.overrides, self.entry, steps, self.nproc))

    def with_cp1(self) -> BridgeRecipe:
        """The same model and data without CP (CP ranks become data-parallel ranks)."""
        off = ["model.context_parallel_size=1", "model.cp_comm_type=null",
               "model.hierarchical_context_parallel_sizes=null",
               "model.hybrid_context_parallel=false", "model.max_seqlen_per_dp_cp_rank=null"]
        off += [f"model.{f}=false" if f == "dynamic_context_parallel" else f"model.{f}=1"
                for f in DEV_DYNAMIC_FIELDS if any(_key(o) == f"model.{f}"
                                                   for o in self.overrides)]
        config = dataclasses.replace(
            self.config, context_parallel_size=1, cp_comm_type=None,
            hierarchical_context_parallel_sizes=None, dynamic_context_parallel=False,
            hybrid_context_parallel=False, max_seqlen_per_dp_cp_rank=None,
            min_dynamic_context_parallel_size=1,
            data_parallel_size=self.config.data_parallel_size
            * self.config.context_parallel_size)
        return dataclasses.replace(self, name=self.name + "@cp1",
                                   overrides=(*self.overrides, *off), config=config)

    # ------------------------------------------------------------------ in Bridge's process
    def build(self, *, steps: int | None = None, work_dir: str | None = None,
              platform: str = "cpu_gloo") -> Any:
        """Bridge's ``ConfigContainer`` of this recipe (imports Bridge); ``work_dir`` holds
        generated data; ``platform`` picks the distributed backend."""
        return build_bridge_config(self.recipe, self.recipe_args, self.overrides,
                                   config_file=self.config_file, steps=steps,
                                   work_dir=work_dir, platform=platform,
                                   allowed_modules=self.allowed.recipe_modules)


def build_bridge_config(recipe: str, recipe_args: dict[str, Any], overrides: Iterable[str],
                        *, config_file: Path | None = None, steps: int | None = None,
                        work_dir: str | None = None, platform: str = "cpu_gloo",
                        allowed_modules: Iterable[str] = ()) -> Any:
    """Bridge's ``ConfigContainer``: the recipe function (``recipe_args``; ``data_dir`` under
    ``work_dir`` where it takes one), the distributed backend of ``platform`` (gloo on
    ``cpu_gloo``, NCCL on ``gpu_nccl``), then ``config_file`` and ``overrides`` through Bridge's
    own ``process_config_with_overrides`` - except the development-branch dynamic-CP names the
    model config has no field for, which are set on the provider (module docstring). The
    recipe function must come from :data:`RECIPE_MODULES` or ``allowed_modules``."""
    from megatron.bridge.training.utils.omegaconf_utils import process_config_with_overrides

    from .launch import BACKENDS

    function = _recipe_function(recipe, allowed_modules)
    kwargs = dict(recipe_args)
    if "data_dir" in _parameters(function) and "data_dir" not in kwargs:
        kwargs["data_dir"] = os.path.join(work_dir or ".", "data")
    cfg = function(**kwargs)
    cfg.dist.distributed_backend = BACKENDS[platform]
    overrides = list(overrides)
    ours = [o for o in overrides if _key(o).removeprefix("model.") in DEV_FIELDS
            and not hasattr(cfg.model, _key(o).removeprefix("model."))]
    theirs = [o for o in overrides if o not in ours]
    process_config_with_overrides(cfg, config_filepath=str(config_file) if config_file else None,
                                  cli_overrides=theirs or None)
    for item in ours:  # set where megatron-hcp reads them (Bridge would drop them)
        name = _key(item).removeprefix("model.")
        setattr(cfg.model, name, parse_value(item.partition("=")[2], FIELD_KINDS[name],
                                             f"model.{name}"))
    if steps is not None:
        cfg.train.train_iters = steps
    return cfg


def _key(override: str) -> str:
    return override.partition("=")[0].strip().lstrip("+~")


def _parameters(function: Any) -> set[str]:
    import inspect

    return set(inspect.signature(function).parameters)


def _within(module: str, roots: Iterable[str]) -> bool:
    return any(module == root or module.startswith(root + ".") for root in roots)


def check_recipe_function(spec: Any, allowed_modules: Iterable[str] = ()) -> tuple[str, str]:
    """``(module, name)`` of ``BRIDGE.recipe`` (``name``: in the project's recipes, or
    ``module:function``), refused unless the module is one of :data:`RECIPE_MODULES` (or a
    submodule) or named in ``allowed_modules`` and the name is a public identifier. Reads the
    text only: nothing is imported, so a recipe is refused before any rank starts."""
    spec = parse_value(spec, "str", "BRIDGE.recipe")
    module, _, name = spec.rpartition(":")
    module = module or _DEFAULT_MODULE
    allowed = tuple(allowed_modules)
    if not _DOTTED.fullmatch(module) or not name.isidentifier() or name.startswith("_"):
        raise CPConfigError([Violation("BRIDGE.recipe", spec, "must be a recipe function: "
                                       "name or package.module:function (public names)",
                                       "e.g. megatron.bridge.recipes.llama.llama3:"
                                       "llama32_1b_pretrain_config")])
    if not _within(module, RECIPE_MODULES) and module not in allowed:
        raise CPConfigError([Violation(
            "BRIDGE.recipe", spec, f"names a function of {module}, outside the recipe modules "
            f"({', '.join(m + '.*' for m in RECIPE_MODULES)}); every rank would call it",
            f"use a recipe function of those modules, or allow the module explicitly: "
            f"functional run --allow-recipe-module {module}")])
    return module, name


def _recipe_function(spec: str, allowed_modules: Iterable[str] = ()) -> Any:
    """The recipe function ``spec`` names (:func:`check_recipe_function`): a function defined
    in its module (not one the module imported from elsewhere)."""
    module, name = check_recipe_function(spec, allowed_modules)
    try:
        function = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        raise CPConfigError([Violation("BRIDGE.recipe", spec, f"names no recipe function ({err})",
                                       "give a name in megatron_hcp.bridge.recipes or "
                                       "module:function")]) from None
    home = getattr(function, "__module__", None) or ""
    if not inspect.isfunction(function) or not (
            _within(home, RECIPE_MODULES) or home in tuple(allowed_modules)):
        raise CPConfigError([Violation(
            "BRIDGE.recipe", spec, f"is not a function defined in a recipe module (it is "
            f"{type(function).__name__} from {home or 'nowhere'})",
            "name the recipe function where it is defined")])
    return function


def _overrides_config(overrides: Iterable[str], nproc: int) -> tuple[CPConfig, int | None]:
    """The CPConfig the CP fields of ``overrides`` describe on ``nproc`` ranks, and
    ``train.train_iters`` when given."""
    values: dict[str, Any] = {}
    steps = None
    problems: list[Violation] = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip().lstrip("+~")
        section, _, name = key.partition(".")
        if not sep or not name:
            problems.append(Violation("BRIDGE.overrides", item, "overrides are section.key=value",
                                      "write e.g. model.context_parallel_size=4"))
            continue
        try:
            if section == "model" and name in _CP_FIELDS:
                if name == "window_size":  # Bridge's scalar form, as its providers hold it
                    from ..bridge.config import window_override

                    raw = window_override(raw)
                values[name] = parse_value(raw, FIELD_KINDS[name], key)
            elif key == "train.train_iters":
                steps = parse_value(raw, "posint", key)
        except CPConfigError as err:
            problems.extend(err.violations)
    if problems:
        raise CPConfigError(problems)
    model = (values.get("tensor_model_parallel_size", 1)
             * values.get("pipeline_model_parallel_size", 1)
             * values.get("context_parallel_size", 1))
    if nproc % model:
        raise CPConfigError([Violation(
            "NPROC", nproc, f"tensor*pipeline*context_parallel_size = {model} must divide it",
            "change NPROC or the parallel sizes")])
    config = CPConfig(data_parallel_size=nproc // model, **values)
    config.validate()
    return config, steps


def load_bridge_recipe(root: Path, doc: dict[str, Any], env: dict[str, str], test_type: str,
                       nproc: int, allowed: Allowed | None = None) -> BridgeRecipe:
    """A :class:`BridgeRecipe` from a parsed ``model_config.yaml`` (its ``BRIDGE`` section)."""
    section = doc.get("BRIDGE")
    if not isinstance(section, dict):
        raise CPConfigError([Violation("BRIDGE", section, "must be a mapping",
                                       "write BRIDGE: {recipe: ..., overrides: [...]}")])
    known = {"recipe", "recipe_args", "config", "entry", "overrides"}
    unknown = sorted(set(section) - known)
    if unknown:
        raise CPConfigError([Violation(f"BRIDGE.{k}", section[k], "is not a key of BRIDGE",
                                       closest(k, sorted(known))) for k in unknown])
    recipe = parse_value(section.get("recipe"), "str", "BRIDGE.recipe")
    allowed = allowed or Allowed()
    check_recipe_function(recipe, allowed.recipe_modules)
    entry = parse_value(section.get("entry", "pretrain"), "str", "BRIDGE.entry")
    if entry not in ENTRIES:
        raise CPConfigError([Violation("BRIDGE.entry", entry, "is not a Bridge entry point",
                                       f"use one of {', '.join(ENTRIES)}")])
    args = section.get("recipe_args") or {}
    overrides = section.get("overrides") or []
    if not isinstance(args, dict) or not all(isinstance(k, str) for k in args):
        raise CPConfigError([Violation("BRIDGE.recipe_args", args, "must be a mapping",
                                       "write recipe_args: {name: value}")])
    if not isinstance(overrides, list) or not all(isinstance(o, str) for o in overrides):
        raise CPConfigError([Violation("BRIDGE.overrides", overrides,
                                       "must be a list of section.key=value strings",
                                       "write overrides: [model.context_parallel_size=4]")])
    config_file = None
    if section.get("config") is not None:
        config_file = (root / parse_value(section["config"], "str", "BRIDGE.config")).resolve()
        if not config_file.is_relative_to(root.resolve()) or not config_file.is_file():
            raise CPConfigError([Violation("BRIDGE.config", section["config"],
                                           "must name a file inside the recipe directory",
                                           "put the Bridge config YAML next to model_config.yaml")])
    config, steps = _overrides_config(overrides, nproc)
    if steps is None:
        steps = args.get("train_iters")
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
            raise CPConfigError([Violation("BRIDGE.overrides", None,
                                           "the recipe must say how many steps it trains",
                                           "add train.train_iters=N to the overrides")])
    return BridgeRecipe(name=root.name, path=root, env=env, test_type=test_type, nproc=nproc,
                        entry=entry, recipe=recipe, recipe_args=dict(args),
                        config_file=config_file, overrides=tuple(overrides), config=config,
                        steps=steps, args={"BRIDGE": section}, allowed=allowed)
