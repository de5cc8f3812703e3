#!/usr/bin/env bash
# The main job: the default functional recipe gpt3_mcore_tp2_pp1_cp4_dcp (TP2 x CP4 with dynamic
# CP on packed variable-length data) trained on 8 local gloo ranks, compared with its golden
# values and with the same run without CP. Extra arguments go to `megatron-hcp functional run`.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup_env.sh"
export PYTHONWARNINGS="${PYTHONWARNINGS:-ignore}"
exec "$root/.venv/bin/megatron-hcp" functional run gpt3_mcore_tp2_pp1_cp4_dcp "$@"
