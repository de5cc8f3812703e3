"""Dynamic CP: workload model (scheduler and runtime follow, see the issues)."""
