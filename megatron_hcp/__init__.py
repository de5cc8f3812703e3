"""megatron-hcp: hierarchical and dynamic context parallelism for megatron-core.

Importing this package never imports Transformer Engine, apex or Megatron-Bridge.
"""

__version__ = "0.1.0"
