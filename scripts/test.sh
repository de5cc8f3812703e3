#!/usr/bin/env bash
# The whole test suite of one stack: lint, then pytest (multi-rank tests run as real gloo
# processes). tests/gpu (marker gpu, needs CUDA GPUs) is deselected by pyproject's addopts;
# ./scripts/gpu_check.sh runs it on a GPU node. Skipped tests print their reason (-rs).
# MEGATRON_HCP_STACK=py311 (default: Python 3.11 + megatron-core 0.16.1) or py312 (Python 3.12 +
# megatron-core 0.19.2 + Megatron-Bridge 0.6.2); see scripts/setup_env.sh.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$("$root/scripts/setup_env.sh" | tail -n 1)"
cd "$root"
"$venv/bin/ruff" check megatron_hcp tests benchmarks
# one test worker: the multi-rank tests are gloo worlds of 4-8 processes whose ranks poll while
# they wait, so two such worlds at once on a 2-core machine slow each other far more than 2x
# (test_megatron_cp.py: 112 s alone, its MLA test 11 s alone and 67-276 s beside another
# world) and time out; py311's whole suite took 18:44 with one worker (2026-11-27)
exec "$venv/bin/python" -m pytest -q -n 1 --dist loadfile "$@"
