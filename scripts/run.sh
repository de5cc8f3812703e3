#!/usr/bin/env bash
# The main job: the default functional recipe gpt3_mcore_tp2_pp1_cp4_dcp (TP2 x CP4 with dynamic
# CP on packed variable-length data) trained on 8 local gloo ranks, compared with its golden
# values and with the same run without CP. Extra arguments go to `megatron-hcp functional run`.
# MEGATRON_HCP_STACK=py311 (default) or py312 picks the stack (see scripts/setup_env.sh).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$("$root/scripts/setup_env.sh" | tail -n 1)"
export PYTHONWARNINGS="${PYTHONWARNINGS:-ignore}"
exec "$venv/bin/megatron-hcp" functional run gpt3_mcore_tp2_pp1_cp4_dcp "$@"
