"""The Megatron-Bridge hook (the decentralized collection it builds lives in
:mod:`megatron_hcp.parallel_state.collection`)."""

from .hook import (
    BridgeHookError,
    BridgeNotInstalledError,
    cp_config_from_model_config,
    cp_config_from_overrides,
    install,
    installed,
    uninstall,
)
from .spec import layer_spec, use_cp_attention

__all__ = [
    "BridgeHookError",
    "BridgeNotInstalledError",
    "cp_config_from_model_config",
    "cp_config_from_overrides",
    "install",
    "installed",
    "layer_spec",
    "uninstall",
    "use_cp_attention",
]
