"""The error of a provider spec megatron-hcp cannot give its CP attention or build as it is."""

from __future__ import annotations

__all__ = ["SpecError"]


class SpecError(ValueError):
    """The provider's spec has a core attention megatron-hcp's CP attention cannot stand in for,
    or a Transformer Engine module with no local twin where TE is absent."""
