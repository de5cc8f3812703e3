#!/usr/bin/env bash
# The whole test suite: lint, then pytest (multi-rank tests run as real gloo processes).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup_env.sh"
cd "$root"
.venv/bin/ruff check megatron_hcp tests benchmarks
exec .venv/bin/python -m pytest -q -n 2 --dist loadfile "$@"
