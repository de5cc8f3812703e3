"""A stand-in for the four Megatron-Bridge functions megatron_hcp's hook wraps.

Megatron-Bridge cannot be installed here (it needs Python 3.12 and Transformer Engine; see the
README). This package has Bridge's exact signatures and reproduces the behaviour the hook
exists for, as read in Bridge's source (v0.6.0 / main 067f987):

* ``training/initialize.py`` ``_create_pg_collection``: NotImplementedError for
  hierarchical_context_parallel_sizes (other configs: Bridge builds NCCL grids; here a marker);
* ``models/gpt_provider.py`` ``GPTModelProvider.provide`` (TE full-layer spec, CP > 1): every
  child with ``set_context_parallel_group`` gets the *flat* CP group, three arguments;
* ``training/eval_context_parallel_rebinding.py`` ``install_pg_collection``: rebinds
  ``pg_collection`` and hands TE the flat ``target.cp`` with ``module.cp_comm_type``;
* ``training/model_load_save.py`` ``load_megatron_model``: CP/TP/PP forced to 1,
  hierarchical_context_parallel_sizes cleared, then non-None ``mp_overrides`` applied.

It is the thing the hook wraps, not the hook: tests exercise the real hook against it.
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import torch.distributed as dist

from ._bridge import RecordingTEAttention  # noqa: F401  (the TE stand-in both Bridges drive)

NAMES = ("megatron.bridge", "megatron.bridge.package_info", "megatron.bridge.training",
         "megatron.bridge.models",
         "megatron.bridge.training.initialize", "megatron.bridge.models.gpt_provider",
         "megatron.bridge.training.eval_context_parallel_rebinding",
         "megatron.bridge.training.model_load_save", "megatron.bridge.diffusion_pipeline")


VERSION = "0.6.2"  # the release whose code this stand-in mirrors


class _UnavailableMeta(type):
    """Like Bridge's import placeholders (utils/import_utils.py): any attribute raises."""

    def __getattr__(cls, name):
        raise RuntimeError(f"{cls.__name__} could not be imported")


class FP8GlobalStateManager(metaclass=_UnavailableMeta):
    pass


def _create_pg_collection(model_config, num_distributed_optimizer_instances,
                          get_embedding_ranks=None, get_position_embedding_ranks=None,
                          world_size=None, rank_offset=None, save_grid=False):
    if getattr(model_config, "hierarchical_context_parallel_sizes", None) is not None:
        raise NotImplementedError(
            "Decentralized process groups (use_decentralized_pg=True) do not support "
            "hierarchical_context_parallel_sizes.")
    return ("bridge", world_size, rank_offset, save_grid)


class GPTModelProvider(SimpleNamespace):
    _pg_collection = None

    def provide(self, pre_process=None, post_process=None, vp_stage=None):
        model = self.build()
        if self._pg_collection.cp.size() > 1:
            cp_stream = object()
            for index, child in enumerate(model.modules()):
                if index == 0:
                    continue
                if hasattr(child, "set_context_parallel_group"):
                    cp_group = self._pg_collection.cp
                    ranks = dist.get_process_group_ranks(cp_group)
                    child.set_context_parallel_group(cp_group, ranks, cp_stream)
        return model


def install_pg_collection(model, target):
    for module in model.modules():
        if hasattr(module, "pg_collection"):
            module.pg_collection = target
        if hasattr(module, "set_context_parallel_group"):
            module.set_context_parallel_group(
                target.cp, dist.get_process_group_ranks(target.cp), type(module).cp_stream,
                module.cp_comm_type)


def load_model_config(checkpoint_path):
    """Here: the checkpoint's model config is a JSON file ``config.json``."""
    fields = json.loads((Path(checkpoint_path) / "config.json").read_text())
    return SimpleNamespace(**fields), None


def build_and_load_model(checkpoint_path, model_cfg, model_type=None, mlm_args=None,
                         return_state_dict=False, use_cpu_init=False,
                         skip_temp_dist_context=None):
    return model_cfg  # the stand-in "model": the config it would be built from


def load_megatron_model(checkpoint_path, model_type=None, return_state_dict=False,
                        use_cpu_init=False, skip_temp_dist_context=None, mp_overrides=None):
    model_cfg, mlm_args = load_model_config(checkpoint_path)
    model_cfg.tensor_model_parallel_size = 1
    model_cfg.pipeline_model_parallel_size = 1
    model_cfg.context_parallel_size = 1
    model_cfg.hierarchical_context_parallel_sizes = None
    if mp_overrides:
        for key, value in mp_overrides.items():
            if hasattr(model_cfg, key) and value is not None:
                setattr(model_cfg, key, value)
    return build_and_load_model(checkpoint_path, model_cfg, model_type, mlm_args,
                                return_state_dict, use_cpu_init, skip_temp_dist_context)


def install_standin(create_pg_collection=_create_pg_collection) -> dict:
    """Put the stand-in into ``sys.modules``; returns the modules by short name."""
    mods = {name: types.ModuleType(name) for name in NAMES}
    for name in ("megatron.bridge", "megatron.bridge.training", "megatron.bridge.models"):
        mods[name].__path__ = []
    mods["megatron.bridge.package_info"].__version__ = VERSION
    mods["megatron.bridge.training.initialize"]._create_pg_collection = create_pg_collection
    mods["megatron.bridge.training.initialize"].FP8GlobalStateManager = FP8GlobalStateManager
    mods["megatron.bridge.models.gpt_provider"].GPTModelProvider = GPTModelProvider
    mods["megatron.bridge.training.eval_context_parallel_rebinding"].install_pg_collection = (
        install_pg_collection)
    mls = mods["megatron.bridge.training.model_load_save"]
    mls.__dict__.update(json=json, Path=Path, SimpleNamespace=SimpleNamespace)
    for fn in (load_model_config, build_and_load_model, load_megatron_model):
        # module globals of model_load_save, as in Bridge (helpers are looked up there)
        setattr(mls, fn.__name__, types.FunctionType(fn.__code__, mls.__dict__, fn.__name__,
                                                     fn.__defaults__))
    # a module that imported load_megatron_model by value (like Bridge's diffusion pipelines)
    mods["megatron.bridge.diffusion_pipeline"]._load_megatron_model = mls.load_megatron_model
    sys.modules.update(mods)
    return {name.rsplit(".", 1)[-1]: m for name, m in mods.items()}


def remove_standin() -> None:
    from megatron_hcp.bridge.hook import uninstall

    uninstall()
    for name in NAMES:
        sys.modules.pop(name, None)
