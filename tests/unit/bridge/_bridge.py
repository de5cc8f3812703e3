"""The Megatron-Bridge that the hook tests run against, on each supported stack.

* Python 3.12 leg: the **installed Megatron-Bridge 0.6.2**, Bridge's own code. Two things it needs
  cannot exist without CUDA and are replaced by the smallest shims, named as such:
  - :func:`te_import_shim`: megatron-hcp's *import-only* ``transformer_engine`` (and
    ``nvidia_resiliency_ext``) stand-ins (:mod:`megatron_hcp.bridge.import_shims`: Bridge imports
    TE unconditionally and TE cannot be built without CUDA), installed after megatron-core is
    imported, so megatron keeps ``HAVE_TE=False``;
  - :func:`build_recorder`: ``model_load_save.build_and_load_model`` (builds a TE model and loads
    its weights) returns the config it would build from, so a test can read what Bridge's own
    ``load_megatron_model`` decided.
* Python 3.11 leg: Bridge 0.4+ needs Python 3.12, so :mod:`._bridge_standin` (Bridge's
  signatures and the behaviour the hook exists for) takes its place.
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any

import torch
import yaml

REAL = sys.version_info >= (3, 12)
# the overrides of the layout the families are proven in (CP4 a2a+p2p [2,2]) and of Bridge's
# decentralized process-group path
HCP = ["model.context_parallel_size=4", "model.cp_comm_type=a2a+p2p",
       "model.hierarchical_context_parallel_sizes=[2,2]"]
DECENTRALIZED = ["dist.use_decentralized_pg=true", "dist.use_gloo_process_groups=false"]
WHICH = "the installed Megatron-Bridge 0.6.2" if REAL else "the stand-in of _bridge_standin"
# a Bridge module that imported load_megatron_model by value (like Bridge's diffusion pipelines,
# which need diffusers to import)
BY_VALUE = "megatron.bridge._megatron_hcp_test_by_value_importer"


class RecordingTEAttention(torch.nn.Module):
    """A stand-in for TE's DotProductAttention (TE cannot run here): records every
    ``set_context_parallel_group`` call, as TE would receive it."""

    cp_stream = object()  # class-wide, as in TE (no CUDA stream on CPU)

    def __init__(self, layer_number: int = 1):
        super().__init__()
        self.layer_number = layer_number
        self.cp_comm_type = "p2p"
        self.calls: list = []

    def set_context_parallel_group(self, cp_group, cp_global_ranks, cp_stream,
                                   cp_comm_type="p2p"):
        self.cp_comm_type = cp_comm_type
        self.calls.append((cp_group, cp_global_ranks, cp_comm_type))


def te_import_shim() -> None:
    """``transformer_engine`` for imports only (megatron-hcp's stand-in, also used by its
    Bridge runtime): any attribute chain resolves to a placeholder."""
    from megatron_hcp.bridge import import_shims

    import_shims.install()


def load() -> dict[str, Any]:
    """Bridge's modules by short name: initialize, gpt_provider, model_load_save,
    eval_context_parallel_rebinding, and the by-value importer."""
    if not REAL:
        from . import _bridge_standin as standin

        mods = standin.install_standin()
        mods["by_value"] = mods.pop("diffusion_pipeline")
        return mods
    import megatron.core  # noqa: F401  (before the shim: megatron keeps HAVE_TE=False)
    import megatron.core.extensions.transformer_engine  # noqa: F401

    te_import_shim()
    from megatron.bridge.models import gpt_provider
    from megatron.bridge.training import eval_context_parallel_rebinding, initialize
    from megatron.bridge.training import model_load_save as mls

    by_value = sys.modules.get(BY_VALUE)
    if by_value is None:
        by_value = sys.modules[BY_VALUE] = types.ModuleType(BY_VALUE)
    by_value._load_megatron_model = mls.load_megatron_model
    return {"initialize": initialize, "gpt_provider": gpt_provider, "model_load_save": mls,
            "eval_context_parallel_rebinding": eval_context_parallel_rebinding,
            "by_value": by_value}


def release() -> None:
    """Undo the hook, remove the stand-in modules (py311) and the import-only TE shim (py312:
    Bridge's modules keep what they imported; :func:`load` puts the shim back)."""
    from megatron_hcp.bridge.hook import uninstall

    uninstall()
    if not REAL:
        from . import _bridge_standin as standin

        standin.remove_standin()
        return
    from megatron_hcp.bridge import import_shims

    import_shims.remove()


def provider_class(mods: dict[str, Any]) -> type:
    return mods["gpt_provider"].GPTModelProvider


def write_checkpoint(path: Path, **model: Any) -> Path:
    """A checkpoint directory whose saved model config Bridge's load_model_config reads."""
    if REAL:
        (path / "run_config.yaml").write_text(yaml.safe_dump({"model": {
            "_target_": "megatron.bridge.models.gpt_provider.GPTModelProvider",
            "hidden_size": 64, **model}}))
    else:
        (path / "config.json").write_text(json.dumps(model))
    return path


def build_recorder(mods: dict[str, Any], monkeypatch) -> None:
    """The model build at the end of load_megatron_model returns the config it was given."""
    if REAL:
        monkeypatch.setattr(mods["model_load_save"], "build_and_load_model",
                            lambda path, cfg, *args, **kwargs: cfg)
