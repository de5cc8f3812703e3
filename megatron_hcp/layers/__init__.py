"""Model layers megatron-core's local spec lacks, for both clients (the project's trainer and
Megatron-Bridge's loop)."""
