"""Functional recipes: megatron-style ``model_config.yaml`` + golden values, run on CPU/gloo."""
