"""Megatron-Bridge's model recipes from a local Hugging Face config: no download.

Bridge's model recipe functions (``megatron.bridge.recipes.*``, e.g.
``qwen3_30b_a3b_pretrain_8gpu_h100_bf16_config``) take no model path: each builds its provider
with ``AutoBridge.from_hf_pretrained("<Hub id>", revision=...)`` and names the Hub id as its
tokenizer, so calling one downloads the model's config (and, at training time, its tokenizer).
:func:`recipe_from_hf_config` runs such a function as it is, with the model's architecture read
from a local directory (``config.json``, as ``save_pretrained`` writes it) or a
``transformers.PretrainedConfig``:

* while the recipe runs, ``AutoBridge.from_hf_pretrained`` and ``transformers.AutoConfig.
  from_pretrained`` asked for a Hub id (anything that is not an existing local path) answer
  with the local config (``AutoBridge.from_hf_config``: Bridge's own provider of that
  architecture, no weights - recipes build with ``load_weights=False``), and the Hub is offline
  (``huggingface_hub``'s offline mode): any other read of the Hub fails instead of downloading;
* afterwards, a tokenizer the recipe named by a Hub id it asked for becomes the local
  directory's when that directory has tokenizer files, else Bridge's ``NullTokenizer`` over the
  config's vocabulary (enough for mock data; give a tokenizer for real data).

Everything else is the recipe's: parallelism, MoE dispatcher, precision, optimizer, data. The
result is Bridge's ``ConfigContainer``; change what the run needs (sizes, overrides) as with any
recipe. The replaced functions are class attributes, so the recipe call holds them for the whole
process: do not build two recipes at once from threads of one process.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ..config import CPConfigError, Violation

__all__ = ["TOKENIZER_FILES", "load_hf_config", "recipe_from_hf_config"]

logger = logging.getLogger("megatron_hcp")

# files whose presence makes a directory a Hugging Face tokenizer (any one of them)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_hf_config(hf_config: Any, *, trust_remote_code: bool = False) -> Any:
    """The ``transformers.PretrainedConfig`` of ``hf_config``: a config object as it is, or a
    local directory's ``config.json`` (read with ``local_files_only``: never the Hub)."""
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(hf_config, PretrainedConfig):
        return hf_config
    if not isinstance(hf_config, (str, os.PathLike)):
        raise CPConfigError([Violation(
            "hf_config", hf_config, "must be a transformers.PretrainedConfig or a local "
            "directory holding config.json", "pass e.g. the directory save_pretrained wrote")])
    path = Path(hf_config)
    if not (path / "config.json").is_file():
        raise CPConfigError([Violation(
            "hf_config", str(hf_config), "is not a local directory with a config.json (a Hub "
            "id would be downloaded, which this function exists to avoid)",
            "pass the directory of a local Hugging Face model or config (config.json in it)")])
    return AutoConfig.from_pretrained(str(path), local_files_only=True,
                                      trust_remote_code=trust_remote_code)


def _recipe(recipe: Callable[..., Any] | str) -> Callable[..., Any]:
    """A recipe function, or ``package.module:function`` naming one."""
    if callable(recipe):
        return recipe
    module, _, name = str(recipe).rpartition(":")
    cause: Exception | None = None
    try:
        function = getattr(importlib.import_module(module), name) if module else None
    except (ImportError, AttributeError, ValueError) as err:
        function, cause = None, err
    if not callable(function):
        # the import's own error is named: a module that exists but failed to import (a
        # missing dependency) reads differently from a misspelt name
        why = f" ({type(cause).__name__}: {cause})" if cause is not None else ""
        raise CPConfigError([Violation(
            "recipe", recipe,
            "must be a recipe function or package.module:function naming one" + why,
            "e.g. megatron.bridge.recipes.qwen.h100.qwen3_moe:"
            "qwen3_30b_a3b_pretrain_8gpu_h100_bf16_config")]) from cause
    return function


def _is_hub_id(path: Any) -> bool:
    return isinstance(path, (str, os.PathLike)) and not Path(path).exists()


@contextlib.contextmanager
def _answered_locally(config: Any, asked: list[str]) -> Iterator[None]:
    """``AutoBridge.from_hf_pretrained`` / ``AutoConfig.from_pretrained`` of a Hub id answered
    with ``config`` (the ids recorded in ``asked``), the Hub offline, for this block."""
    import huggingface_hub.constants as hub
    from megatron.bridge import AutoBridge
    from transformers import AutoConfig

    bridge_load = AutoBridge.__dict__["from_hf_pretrained"]
    config_load = AutoConfig.__dict__["from_pretrained"]

    def from_hf_pretrained(cls, path, *args, **kwargs):
        if not _is_hub_id(path):
            return bridge_load.__func__(cls, path, *args, **kwargs)
        asked.append(str(path))
        return cls.from_hf_config(copy.deepcopy(config))

    def from_pretrained(cls, path, *args, **kwargs):
        if not _is_hub_id(path):
            return config_load.__func__(cls, path, *args, **kwargs)
        asked.append(str(path))
        return copy.deepcopy(config)

    offline = hub.HF_HUB_OFFLINE
    AutoBridge.from_hf_pretrained = classmethod(from_hf_pretrained)
    AutoConfig.from_pretrained = classmethod(from_pretrained)
    hub.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        hub.HF_HUB_OFFLINE = offline
        AutoConfig.from_pretrained = config_load
        AutoBridge.from_hf_pretrained = bridge_load


def _local_tokenizer(cfg: Any, config: Any, source: Any, asked: list[str]) -> None:
    """The recipe's tokenizer named by a Hub id it asked for: the local directory's tokenizer
    where it has one, else Bridge's ``NullTokenizer`` over the config's vocabulary."""
    tokenizer = getattr(cfg, "tokenizer", None)
    if tokenizer is None or str(getattr(tokenizer, "tokenizer_model", None)) not in asked:
        return
    directory = Path(source) if isinstance(source, (str, os.PathLike)) else None
    kwargs = dict(getattr(tokenizer, "hf_tokenizer_kwargs", None) or {})
    kwargs.pop("revision", None)  # a Hub revision means nothing for a local directory
    tokenizer.hf_tokenizer_kwargs = kwargs
    if directory is not None and any((directory / f).is_file() for f in TOKENIZER_FILES):
        tokenizer.tokenizer_model = str(directory)
        return
    logger.info("recipe_from_hf_config: %s has no tokenizer files; the recipe's tokenizer %s "
                "becomes Bridge's NullTokenizer over %d ids", directory or "the config",
                tokenizer.tokenizer_model, config.vocab_size)
    tokenizer.tokenizer_type = "NullTokenizer"
    tokenizer.tokenizer_model = None
    tokenizer.vocab_size = config.vocab_size
    tokenizer.use_tokenizer_vocab_size = False


def recipe_from_hf_config(recipe: Callable[..., Any] | str, hf_config: Any, /, *,
                          trust_remote_code: bool = False, **recipe_kwargs: Any) -> Any:
    """Bridge's ``ConfigContainer`` of the model recipe function ``recipe`` (or
    ``package.module:function``) called with ``recipe_kwargs``, its model read from
    ``hf_config`` (a local directory with ``config.json``, or a ``PretrainedConfig``) instead of
    the Hub (module docstring). Raises ``CPConfigError`` for a ``hf_config`` that is neither,
    or a recipe that asks for no Hugging Face model (it has nothing to answer locally)."""
    config = load_hf_config(hf_config, trust_remote_code=trust_remote_code)
    function = _recipe(recipe)
    asked: list[str] = []
    with _answered_locally(config, asked):
        cfg = function(**recipe_kwargs)
    if not asked:
        raise CPConfigError([Violation(
            "recipe", getattr(function, "__qualname__", recipe), "asked for no Hugging Face "
            "model (AutoBridge.from_hf_pretrained / AutoConfig.from_pretrained of a Hub id): "
            "its model does not come from a config", "call the recipe function directly")])
    _local_tokenizer(cfg, config, hf_config, asked)
    return cfg
