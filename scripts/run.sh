#!/usr/bin/env bash
# The main job: build hierarchical CP groups (TP2 x CP4, a2a+p2p [2,2]) on 8 local gloo ranks
# through megatron-core's initialize_model_parallel and verify them with collectives.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup_env.sh"
exec "$root/.venv/bin/megatron-hcp" verify-groups --world-size 8 --tp 2 --cp 4 --hcp 2,2 "$@"
