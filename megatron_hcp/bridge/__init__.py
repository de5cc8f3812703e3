"""Decentralized process groups with hierarchical CP, and the Megatron-Bridge hook."""

from .collection import create_pg_collection, destroy_pg_collection
from .hook import (
    BridgeHookError,
    BridgeNotInstalledError,
    cp_config_from_model_config,
    cp_config_from_overrides,
    install,
    installed,
    uninstall,
)

__all__ = [
    "BridgeHookError",
    "BridgeNotInstalledError",
    "cp_config_from_model_config",
    "cp_config_from_overrides",
    "create_pg_collection",
    "destroy_pg_collection",
    "install",
    "installed",
    "uninstall",
]
